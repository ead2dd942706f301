"""Which GPU a local replica runs on: one device per replica, chosen under the GPU
planner's rules (:mod:`inferd.control.gpu_plan`) among this machine's GPUs of the
deployment's ``resources.gpu`` type, beside the replicas already placed.

A replica's need is the version's metadata ``gpu_memory_gb`` when set (what ``inferd
plan gpus`` reads too), else an estimate from its artifact: weights as stored, times
1.2 for activations and the allocator's slack, plus 1 GB of CUDA context and
workspace. Its latency class is the metadata ``latency_class`` (critical, standard,
batch; standard when unset).

Placement is incremental (a running replica never moves) and follows the planner: of
the GPUs a replica fits on (memory less ``headroom``; beside a latency-critical replica
at most ``critical_heavy_gb`` of other models' heavy ones), the fullest, a critical
replica preferring GPUs without heavy neighbours; a model's replicas go to different
GPUs when they can, and share one only when no other GPU takes them (one GPU, two
replicas). A replica no GPU takes is not started: the controller records a
``capacity`` scaling event saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from inferd.control.gpu_plan import LATENCY_CLASSES, GpuType, Replica, Rules, best, fits
from inferd.control.gpu_plan import Gpu as PlanGpu
from inferd.devices import Gpu

CONTEXT_GB = 1.0
"""CUDA context and library workspaces of one process, beside the model."""
WEIGHTS_FACTOR = 1.2


@dataclass(frozen=True, slots=True)
class GpuNeed:
    model: str
    memory_gb: float
    latency: str = "standard"
    estimated: bool = False
    """True: from the artifact's size, not the version's ``gpu_memory_gb``."""

    def replica(self, index: int) -> Replica:
        return Replica(self.model, index, self.memory_gb, self.latency)


def need_of(model: str, metadata: dict[str, object] | None, size_bytes: int) -> GpuNeed:
    """What one replica of a version needs (see the module docstring)."""
    meta = metadata or {}
    latency = meta.get("latency_class")
    latency = latency if isinstance(latency, str) and latency in LATENCY_CLASSES else "standard"
    stated = meta.get("gpu_memory_gb")
    if isinstance(stated, int | float) and not isinstance(stated, bool) and stated > 0:
        return GpuNeed(model, float(stated), latency)
    estimate = size_bytes * WEIGHTS_FACTOR / 1e9 + CONTEXT_GB
    return GpuNeed(model, round(estimate, 2), latency, estimated=True)


@dataclass(frozen=True, slots=True)
class Placement:
    device: int | None
    """The GPU index (None: no GPU takes the replica)."""
    why: str = ""
    """Why none does, for the scaling event."""


def choose(
    need: GpuNeed,
    candidates: Iterable[Gpu],
    placed: dict[int, list[Replica]],
    rules: Rules | None = None,
) -> Placement:
    """The GPU for one more replica of ``need`` among ``candidates``, beside the
    replicas ``placed`` on each device index."""
    rules = rules or Rules()
    gpus = [
        PlanGpu(GpuType(g.name, _gb(g), 1), g.index, list(placed.get(g.index, [])))
        for g in candidates
    ]
    if not gpus:
        return Placement(None, "no GPU of the deployment's type on this machine")
    replica = need.replica(sum(r.model == need.model for rs in placed.values() for r in rs))
    for strict in (True, False):
        # A model's replicas on different GPUs first; sharing one only when no other fits.
        trial = rules if strict else dataclasses.replace(rules, spread=False)
        fitting = [g for g in gpus if fits(g, replica, trial)]
        if fitting:
            return Placement(best(replica, fitting, rules).index)
    usable = ", ".join(
        f"GPU {g.index} {g.type.memory_gb * (1 - rules.headroom) - g.used_gb:.1f} GB free"
        for g in gpus
    )
    source = "estimated from its artifact" if need.estimated else "gpu_memory_gb"
    return Placement(
        None,
        f"a replica needs {need.memory_gb:.1f} GB of GPU memory ({source}), "
        f"{rules.headroom:.0%} of each GPU kept free: {usable}",
    )


def room(
    need: GpuNeed,
    candidates: list[Gpu],
    placed: dict[int, list[Replica]],
    rules: Rules | None = None,
    most: int = 64,
) -> int:
    """How many more replicas of ``need`` the GPUs take (at most ``most``)."""
    trial = {i: list(rs) for i, rs in placed.items()}
    for count in range(most):
        where = choose(need, candidates, trial, rules)
        if where.device is None:
            return count
        assert where.device is not None
        trial.setdefault(where.device, []).append(need.replica(count))
    return most


def _gb(gpu: Gpu) -> float:
    """A GPU's memory in GB (1e9 bytes, as ``gpu_memory_gb``); unknown: no limit."""
    return gpu.memory_mib * 2**20 / 1e9 if gpu.memory_mib > 0 else float("inf")
