"""Packing model replicas onto GPUs: the fewest GPUs that hold them all, with headroom,
and with latency-critical models kept away from heavy neighbours.

The design documents' practice problem: 30 models from 500 MB to 40 GB, 80 GB A100s,
latency SLAs. Rules a placement keeps:

- a GPU's replicas fit in its memory less ``headroom`` (CUDA context, fragmentation,
  activations the estimate missed);
- the replicas of one model are on different GPUs (a GPU failure takes one of them);
- on a GPU holding a latency-critical replica, the other models' heavy replicas
  (``heavy_gb`` and up) take at most ``critical_heavy_gb`` together: a 40 GB model's
  long batches would otherwise sit in front of a fraud model's 5 ms ones.

:func:`plan` is first-fit decreasing (largest replicas first, each on the fullest GPU it
fits on, critical ones preferring GPUs without heavy neighbours), then a local search
that tries to empty the least-used GPU by moving its replicas elsewhere.
:func:`lower_bound` is what no placement can beat (memory, per-model spread, replicas
too large to share a GPU); :func:`exact` finds the optimum of small cases by search, to
check the heuristic against.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

LATENCY_CLASSES = ("critical", "standard", "batch")


@dataclass(frozen=True, slots=True)
class ModelNeed:
    name: str
    memory_gb: float
    """GPU memory one replica needs (weights, KV cache or activations at its batch size)."""
    replicas: int = 1
    latency: str = "standard"
    """critical | standard | batch"""

    def __post_init__(self) -> None:
        if self.memory_gb <= 0 or self.replicas < 1:
            raise ValueError(f"{self.name}: memory_gb must be > 0 and replicas >= 1")
        if self.latency not in LATENCY_CLASSES:
            raise ValueError(f"{self.name}: latency must be one of {', '.join(LATENCY_CLASSES)}")


@dataclass(frozen=True, slots=True)
class GpuType:
    name: str
    memory_gb: float
    count: int


@dataclass(frozen=True, slots=True)
class Rules:
    headroom: float = 0.1
    """Share of each GPU's memory left free."""
    heavy_gb: float = 20.0
    critical_heavy_gb: float = 20.0
    """Most memory of heavy replicas of other models beside a latency-critical one."""
    spread: bool = True
    """A model's replicas on different GPUs (the local placement relaxes it when no
    other GPU takes one)."""


@dataclass(frozen=True, slots=True)
class Replica:
    model: str
    index: int
    memory_gb: float
    latency: str


@dataclass
class Gpu:
    type: GpuType
    index: int
    replicas: list[Replica] = field(default_factory=list)

    @property
    def used_gb(self) -> float:
        return sum(r.memory_gb for r in self.replicas)

    @property
    def name(self) -> str:
        return f"{self.type.name}#{self.index}"


@dataclass
class Plan:
    gpus: list[Gpu]
    """The GPUs used, each with its replicas."""
    unplaced: list[Replica]
    """Replicas no GPU of the inventory could take (the inventory is too small)."""
    lower_bound: int

    @property
    def used(self) -> int:
        return len(self.gpus)


def replicas_of(models: list[ModelNeed]) -> list[Replica]:
    return [Replica(m.name, i, m.memory_gb, m.latency) for m in models for i in range(m.replicas)]


def fits(gpu: Gpu, replica: Replica, rules: Rules) -> bool:
    """Whether ``replica`` may join ``gpu`` under the rules."""
    usable = gpu.type.memory_gb * (1 - rules.headroom)
    if gpu.used_gb + replica.memory_gb > usable + 1e-9:
        return False
    if rules.spread and any(r.model == replica.model for r in gpu.replicas):
        return False
    everyone = [*gpu.replicas, replica]
    if any(r.latency == "critical" for r in everyone):
        for critical in (r for r in everyone if r.latency == "critical"):
            heavy = sum(
                r.memory_gb
                for r in everyone
                if r.model != critical.model and r.memory_gb >= rules.heavy_gb
            )
            if heavy > rules.critical_heavy_gb + 1e-9:
                return False
    return True


def lower_bound(models: list[ModelNeed], inventory: list[GpuType], rules: Rules) -> int:
    """No placement uses fewer GPUs: enough memory (on the largest GPUs), one GPU per
    replica of the most replicated model, one each for replicas too large to share a GPU
    with any other replica, and, when the co-location rule applies, the GPUs the heavy
    replicas fill plus those each critical model's replicas need apart from them."""
    if not models or not inventory:
        return 0
    sizes = sorted(
        (t.memory_gb * (1 - rules.headroom) for t in inventory for _ in range(t.count)),
        reverse=True,
    )
    total = sum(m.memory_gb * m.replicas for m in models)
    running = list(itertools.accumulate(sizes))
    # the fewest of the largest GPUs whose memory holds it all (more than the inventory:
    # it cannot hold them)
    by_memory = next(
        (n for n, held in enumerate(running, 1) if held >= total - 1e-9), len(sizes) + 1
    )
    spread = max(m.replicas for m in models)
    # Replicas too heavy to sit beside a latency-critical one fill GPUs that the
    # critical replicas (each model's on distinct GPUs) cannot use.
    blocking = [
        m for m in models if m.memory_gb >= rules.heavy_gb and m.memory_gb > rules.critical_heavy_gb
    ]
    critical = [m for m in models if m.latency == "critical" and m not in blocking]
    apart = 0
    if blocking and critical:
        memory = sum(m.memory_gb * m.replicas for m in blocking)
        by_blocking = next(
            (n for n, held in enumerate(running, 1) if held >= memory - 1e-9), len(sizes) + 1
        )
        blocked = max(by_blocking, max(m.replicas for m in blocking))
        apart = blocked + max(m.replicas for m in critical)
    largest = sizes[0]
    smallest_replica = min(m.memory_gb for m in models)
    alone = sum(m.replicas for m in models if m.memory_gb + smallest_replica > largest)
    return max(by_memory, spread, alone, apart)


def plan(models: list[ModelNeed], inventory: list[GpuType], rules: Rules | None = None) -> Plan:
    """A placement using few GPUs (see the module docstring): the best of a few orders
    of first-fit decreasing, each consolidated."""
    rules = rules or Rules()
    replicas = replicas_of(models)
    orders = [
        # largest first
        sorted(replicas, key=lambda r: (-r.memory_gb, r.latency != "critical", r.model, r.index)),
        # latency-critical first, so they gather on GPUs of their own
        sorted(replicas, key=lambda r: (r.latency != "critical", -r.memory_gb, r.model, r.index)),
        # heavy first, then the critical ones, then the rest
        sorted(replicas, key=lambda r: (_group(r, rules), -r.memory_gb, r.model, r.index)),
    ]
    best: tuple[list[Gpu], list[Replica]] | None = None
    for order in orders:
        free = [
            Gpu(t, i) for t in sorted(inventory, key=lambda t: -t.memory_gb) for i in range(t.count)
        ]
        used: list[Gpu] = []
        unplaced = [r for r in order if not _place(r, used, free, rules)]
        _consolidate(used, free, rules)
        if best is None or (len(unplaced), len(used)) < (len(best[1]), len(best[0])):
            best = (used, unplaced)
    assert best is not None
    return Plan(best[0], best[1], lower_bound(models, inventory, rules))


def _group(replica: Replica, rules: Rules) -> int:
    if replica.memory_gb >= rules.heavy_gb:
        return 0
    return 1 if replica.latency == "critical" else 2


def best(replica: Replica, candidates: list[Gpu], rules: Rules) -> Gpu:
    """Of the GPUs ``replica`` fits on, the one it goes to: the fullest, a latency-critical
    replica preferring GPUs without heavy neighbours."""

    def score(g: Gpu) -> tuple[bool, float]:
        heavy_neighbour = replica.latency == "critical" and any(
            r.memory_gb >= rules.heavy_gb for r in g.replicas
        )
        return (heavy_neighbour, -(g.used_gb / g.type.memory_gb))

    return min(candidates, key=score)


def _place(replica: Replica, used: list[Gpu], free: list[Gpu], rules: Rules) -> bool:
    candidates = [g for g in used if fits(g, replica, rules)]
    if candidates:
        best(replica, candidates, rules).replicas.append(replica)
        return True
    for gpu in free:
        if fits(gpu, replica, rules):
            free.remove(gpu)
            gpu.replicas.append(replica)
            used.append(gpu)
            return True
    return False


def _consolidate(used: list[Gpu], free: list[Gpu], rules: Rules) -> None:
    """Empty the least-used GPUs where their replicas fit elsewhere; repeat while it helps."""
    improved = True
    while improved and len(used) > 1:
        improved = False
        for victim in sorted(used, key=lambda g: g.used_gb):
            others = [g for g in used if g is not victim]
            moves: list[tuple[Replica, Gpu]] = []
            trial = {id(g): list(g.replicas) for g in others}
            for replica in sorted(victim.replicas, key=lambda r: -r.memory_gb):
                target = next(
                    (g for g in sorted(others, key=lambda g: -g.used_gb)
                     if fits(Gpu(g.type, g.index, trial[id(g)]), replica, rules)),
                    None,
                )  # fmt: skip
                if target is None:
                    break
                trial[id(target)].append(replica)
                moves.append((replica, target))
            else:
                for replica, target in moves:
                    target.replicas.append(replica)
                victim.replicas.clear()
                used.remove(victim)
                free.append(victim)
                improved = True
                break


def exact(
    models: list[ModelNeed], inventory: list[GpuType], rules: Rules | None = None
) -> int | None:
    """The fewest GPUs any placement needs (None: none places everything), by trying
    every assignment with symmetry breaking. Small cases only (a dozen replicas)."""
    rules = rules or Rules()
    replicas = sorted(replicas_of(models), key=lambda r: -r.memory_gb)
    gpus = [
        Gpu(t, i) for t in sorted(inventory, key=lambda t: -t.memory_gb) for i in range(t.count)
    ]
    best = [math.inf]

    def search(i: int, opened: int) -> None:
        if opened >= best[0]:
            return
        if i == len(replicas):
            best[0] = opened
            return
        replica = replicas[i]
        seen_empty: set[str] = set()
        for gpu in gpus:
            empty = not gpu.replicas
            if empty:
                if gpu.type.name in seen_empty:
                    continue  # empty GPUs of one type are interchangeable
                seen_empty.add(gpu.type.name)
            if fits(gpu, replica, rules):
                gpu.replicas.append(replica)
                search(i + 1, opened + (1 if empty else 0))
                gpu.replicas.pop()

    search(0, 0)
    return None if best[0] == math.inf else int(best[0])


def parse_inventory(text: str) -> list[GpuType]:
    """``A100-80GB:80:16,L4:24:4`` (type:memory_gb:count, comma-separated)."""
    inventory = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, memory, count = [*part.split(":"), "", ""][:3]
        try:
            inventory.append(GpuType(name, float(memory), int(count or 1)))
        except ValueError:
            raise ValueError(f"GPU inventory {part!r}: expected type:memory_gb:count") from None
    return inventory


def rows(plan_: Plan) -> list[tuple[str, float, float, list[str]]]:
    """(GPU, used GB, memory GB, replicas) rows for printing."""
    return [
        (
            g.name,
            round(g.used_gb, 2),
            g.type.memory_gb,
            [f"{r.model}[{r.index}]" for r in g.replicas],
        )
        for g in plan_.gpus
    ]
