"""How long a batch job should take, known when it is submitted.

A job's ``estimated_time`` is never null. Before a job runs it comes from the first of:

1. ``history``: the rate of the model's last finished batch job (500+ inputs);
2. ``replicas``: what the version's replicas measured themselves — compute seconds per
   row summed over their batches (predict), or finished generations per second of
   engine time (generation) — times the ready replicas;
3. ``probe``: one request run now at ``batch`` priority — rows of zeros shaped as the
   signature (predict), or the job's first input (generation) — timed;
4. ``default``: when nothing could be measured (no ready replica yet), 10 ms per input,
   saying why.

Once the job runs, its own progress replaces the estimate (``progress``). The job
document says which (``estimate.method``, ``estimate.basis``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import orjson

from inferd.config import Settings
from inferd.errors import InferdError
from inferd.priority import NAMED_PRIORITIES
from inferd.routing.dataplane import DataPlane
from inferd.routing.router import Router
from inferd.routing.targets import Target

PROBE_ROWS = 32
PROBE_TIMEOUT_S = 5.0
DEFAULT_ITEM_S = 0.01


@dataclass(frozen=True, slots=True)
class Estimate:
    seconds: float
    items_per_s: float
    method: str
    """history | replicas | probe | default (progress, once the job runs)"""
    basis: str
    """What it was computed from, in words."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        out["items_per_s"] = round(self.items_per_s, 3)
        return out


def _from_rate(items: int, rate: float, method: str, basis: str) -> Estimate:
    return Estimate(items / rate, rate, method, basis)


async def estimate_job(
    router: Router,
    plane: DataPlane,
    settings: Settings,
    target: Target,
    items: list[bytes],
    history_rate: float | None,
    generative: bool,
) -> Estimate:
    n = len(items)
    if history_rate:
        basis = f"the model's last batch job ran at {history_rate:.1f} inputs/s"
        return _from_rate(n, history_rate, "history", basis)
    clients = [c for c in router.clients_of(target.model, target.version) if not c.closed]
    replicas = max(1, len(clients))
    measured = await _measured_rate(clients, generative, n, settings)
    if measured is not None:
        rate, basis = measured
        return _from_rate(n, rate, "replicas", basis)
    try:
        rate, basis = await (
            _probe_generation(router, settings, target, items[0], replicas, n)
            if generative
            else _probe_predict(plane, target, replicas, n)
        )
    except (InferdError, TimeoutError, ValueError) as exc:
        why = getattr(exc, "message", None) or type(exc).__name__
        basis = f"nothing could be measured ({why}); assumed {DEFAULT_ITEM_S * 1000:.0f} ms"
        basis += " per input"
        return _from_rate(n, 1 / DEFAULT_ITEM_S, "default", basis)
    return _from_rate(n, rate, "probe", basis)


async def _measured_rate(
    clients: list[Any], generative: bool, items: int, settings: Settings
) -> tuple[float, str] | None:
    """Inputs per second from the replicas' own counters; None before they computed any."""
    statuses = []
    for status in await asyncio.gather(
        *(c.status(timeout_s=2.0) for c in clients), return_exceptions=True
    ):
        if not isinstance(status, BaseException) and status.state == "ready":
            statuses.append(status)
    if not statuses:
        return None
    if generative:
        done = sum(s.metrics.get("e2e_s", {}).get("count", 0) for s in statuses)
        busy = sum(s.metrics.get("step_s", {}).get("sum", 0.0) for s in statuses)
        if done < 1 or busy <= 0:
            return None
        rate = done / busy * len(statuses)
        return rate, (
            f"{len(statuses)} replica(s) finished {done} generations in {busy:.2f} s of engine time"
        )
    rows = sum(s.stats.rows or 0 for s in statuses)
    compute = sum(s.stats.compute_s or 0.0 for s in statuses)
    if rows < 1 or compute <= 0:
        return None
    rate = rows / compute * len(statuses)
    return rate, (
        f"{len(statuses)} replica(s) measured {compute / rows * 1000:.3f} ms of compute per "
        f"row over {rows} rows"
    )


async def _probe_predict(
    plane: DataPlane, target: Target, replicas: int, items: int
) -> tuple[float, str]:
    rows = min(PROBE_ROWS, items)
    columns = {}
    for spec in target.signature.inputs:
        shape = (rows, *(max(d, 1) for d in spec.shape[1:]))
        if spec.datatype == "BYTES":
            columns[spec.name] = np.full(shape, "probe", dtype=object)
        else:
            columns[spec.name] = np.zeros(shape, dtype=spec.numpy_dtype)
    started = time.perf_counter()
    probe = plane.request(
        "estimate-probe", started, PROBE_TIMEOUT_S, NAMED_PRIORITIES["batch"], pinned=True
    )
    await plane.infer(target, columns, rows, probe)
    elapsed = max(time.perf_counter() - started, 1e-6)
    rate = rows / elapsed * replicas
    return rate, f"a probe of {rows} rows took {elapsed * 1000:.1f} ms, on {replicas} replica(s)"


async def _probe_generation(
    router: Router, settings: Settings, target: Target, first: bytes, replicas: int, items: int
) -> tuple[float, str]:
    from inferd.routing.generation import GenerationStart, start_generation

    body = orjson.loads(first)
    if not isinstance(body, dict):
        raise ValueError("the first input is not an object")
    body = {**body, "stream": False, "priority": "batch"}
    started = time.perf_counter()

    async def run() -> None:
        start = GenerationStart(target.model, body, target.version, "estimate-probe")
        chunks, _, _, _ = await start_generation(router, settings, start)
        async with contextlib.aclosing(chunks):
            async for _ in chunks:
                pass

    await asyncio.wait_for(run(), PROBE_TIMEOUT_S)
    elapsed = max(time.perf_counter() - started, 1e-6)
    together = min(items, settings.llm.max_num_seqs * replicas)
    rate = together / elapsed
    return rate, (
        f"the first input generated in {elapsed:.2f} s; up to {together} run together on "
        f"{replicas} replica(s)"
    )
