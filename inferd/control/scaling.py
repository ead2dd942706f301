"""Autoscaled versions, looked at every ``autoscale_interval_s``: what their replicas
counted (each replica's own status: compute seconds, rows waiting, its latency sketch),
differenced since the previous look, becomes the :class:`~inferd.control.autoscaler.Signals`
of the version's :class:`~inferd.control.autoscaler.Autoscaler`; a decision changes the
version's desired replica count, and is kept as a scaling event (registry, logs,
``/metrics``).

Capacity: a version scales up only as far as the machine holds replicas of its
measured size: its free memory (less ``autoscale_memory_headroom`` of the machine) in
replicas of the largest RSS of the version's running ones, and, for CPU-bound replicas
(half a core or more), its idle cores (over the last look) in replicas of the most CPU
one of them used (local replicas: their ``/proc/<pid>/stat``). Beyond, the autoscaler
records a ``capacity`` event naming the limit instead of starting replicas that would
not fit.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferd.clock import Clock
from inferd.control.autoscaler import Decision, Signals
from inferd.control.state import ModelState, VersionSet
from inferd.serving.client import status_of
from inferd.shapes.replica import ReplicaState
from inferd.telemetry.metrics import Sketch

logger = logging.getLogger(__name__)

Key = tuple[str, int]  # replica id, pid: a restarted replica counts afresh


@dataclass(frozen=True, slots=True)
class Look:
    """One replica's cumulative figures at one moment."""

    t: float
    compute_s: float
    queued: int
    rss_bytes: int
    latency: Sketch
    cpu_s: float | None = None
    """CPU seconds its process used so far (None: not a local process)."""


Looker = Callable[[list[tuple[str, int, str]], float], Awaitable[dict[Key, Look]]]


async def look(replicas: list[tuple[str, int, str]], t: float) -> dict[Key, Look]:
    """The figures of ``(replica id, pid, address)``; replicas that do not answer within
    a second are left out (starting, draining: the next look asks again)."""

    async def one(rid: str, address: str) -> Look | None:
        status = await status_of(address, rid, timeout_s=1.0)
        if status is None:
            return None
        stats, metrics = status.stats, status.metrics
        # predict: time in the replica; generation: time to first token
        sketch = metrics.get("latency_sketch") or metrics.get("ttft_sketch")
        if sketch is None:
            return None  # an older replica: not measurable
        return Look(
            t,
            # generation: occupancy-weighted step time, and requests waiting for a slot
            float(stats.computed_s),
            int(stats.queued),
            int(stats.rss_bytes or 0),
            Sketch.of(sketch),
            cpu_seconds(status.pid),
        )

    found = await asyncio.gather(*(one(rid, address) for rid, _, address in replicas))
    return {(rid, pid): f for (rid, pid, _), f in zip(replicas, found, strict=True) if f}


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float | None:
    """User + system CPU seconds of a local process so far (None: not readable here)."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)


def machine_cpu(proc: Path = Path("/proc")) -> tuple[float, float] | None:
    """(idle, total) CPU seconds of the whole machine so far, from ``/proc/stat``."""
    try:
        first = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return idle / _TICKS, sum(values) / _TICKS


CPU_BOUND_CORES = 0.5
"""A replica using at least this much CPU is CPU-bound: the idle cores cap its count."""


def cpu_room(
    current: int,
    per_replica_cores: float,
    idle_share: float | None,
    cores: int,
) -> int | None:
    """How many replicas the idle cores allow (``current`` plus what fits in them);
    None when unknown, or when a replica is not CPU-bound (under half a core: it mostly
    waits on something else, an accelerator or I/O, and more of them still help)."""
    if idle_share is None or per_replica_cores < CPU_BOUND_CORES:
        return None
    return current + int(max(0.0, idle_share * cores) // per_replica_cores)


def signals(before: dict[Key, Look], now: dict[Key, Look], t: float, ready: int) -> Signals:
    """The version's signals between two looks (a replica new since counts from now)."""
    busy, shares, queued, requests = Sketch(), [], 0, 0
    for key, current in now.items():
        queued += current.queued
        previous = before.get(key)
        if previous is None or current.t <= previous.t:
            continue
        shares.append((current.compute_s - previous.compute_s) / (current.t - previous.t))
        answered = current.latency.minus(previous.latency)
        requests += answered.count
        busy.add(answered)
    utilisation = sum(shares) / len(shares) if shares else 0.0
    p99 = busy.quantile(0.99)
    return Signals(t, ready, utilisation, queued, requests, None if p99 is None else p99 * 1000)


def memory_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the machine can still give (``MemAvailable``); None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_total(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def room_for(current: int, footprint: int, available: int | None, keep_free: int) -> int | None:
    """How many replicas of ``footprint`` bytes the version can have (``current`` plus
    what fits in ``available`` beyond ``keep_free``); None when unknown."""
    if available is None or footprint <= 0:
        return None
    return current + max(0, (available - keep_free) // footprint)


COLD_START_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


@dataclass
class ColdStarts:
    """A histogram of one version's cold starts (seconds)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(COLD_START_BUCKETS_S) + 1))
    total_s: float = 0.0
    bounds: tuple[float, ...] = COLD_START_BUCKETS_S

    def observe(self, seconds: float) -> None:
        index = next(
            (i for i, bound in enumerate(COLD_START_BUCKETS_S) if seconds <= bound),
            len(COLD_START_BUCKETS_S),
        )
        self.counts[index] += 1
        self.total_s += seconds

    def cumulative(self) -> list[float]:
        out, running = [], 0
        for n in self.counts:
            running += n
            out.append(float(running))
        return out


class Scaling:
    """The autoscaled versions' looks and decisions, for the controller."""

    def __init__(
        self,
        record: Callable[[str, str, Decision], Awaitable[None]],
        memory_headroom: float,
        looker: Looker = look,
        machine_bound: bool = True,
    ) -> None:
        self.record = record
        self.memory_headroom = memory_headroom
        self.machine_bound = machine_bound
        """Replicas run on this machine: its memory and idle cores bound scale-ups. False
        (Kubernetes): the cluster's scheduler (and its autoscaler) decides what fits."""
        self.looker = looker
        self._looks: dict[tuple[str, str], dict[Key, Look]] = {}
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        """(model, version, reason) -> decisions taken, for ``/metrics``."""
        self._cold: dict[tuple[str, str], float] = {}  # started from zero at (clock)
        self._machine: tuple[float, float] | None = machine_cpu()
        self._idle_share: float | None = None
        self.cold_starts: dict[tuple[str, str], ColdStarts] = {}
        """Times from a demand at zero replicas to a ready replica, for ``/metrics``."""

    async def look_at(
        self, vset: VersionSet, now: float, gpu_room: tuple[int, str] | None = None
    ) -> Decision | None:
        """Look at one autoscaled version; the decision it led to, if any (the caller
        applies it: ``vset.desired`` is already the new count). ``gpu_room``: how many
        replicas its GPUs hold, and why, for a version on GPUs."""
        scaler = vset.autoscaler
        if scaler is None:
            return None
        key = (vset.record.model_name, vset.record.version)
        ready = [r for r in vset.live() if r.state is ReplicaState.READY]
        current = await self.looker([(r.id, r.pid, r.address) for r in ready], now)
        before = self._looks.get(key, {})
        self._looks[key] = current
        if not before and ready:
            return None  # the first look: nothing to difference yet
        room, limit = self._room(len(vset.live()), before, current, gpu_room)
        events_before = len(scaler.events)
        decision = scaler.observe(signals(before, current, now, len(ready)), room, limit)
        if len(scaler.events) > events_before and decision is None:  # a capacity refusal
            await self.keep(key, scaler.events[-1])
        if decision is not None:
            vset.desired = decision.desired
            await self.keep(key, decision)
        return decision

    async def look_at_all(
        self,
        models: dict[str, ModelState],
        clock: Clock,
        gpu_room: Callable[[VersionSet], tuple[int, str] | None],
        apply: Callable[[VersionSet], Awaitable[None]],
    ) -> bool:
        """One pass: look at every autoscaled version of a loaded model and ``apply`` each
        decision at once (before the next version is looked at); whether any was taken."""
        self.machine_look()
        changed = False
        for model in list(models.values()):
            for vset in list(model.versions.values()):
                if vset.autoscaler is None or vset.retiring or not model.loaded:
                    continue
                if await self.look_at(vset, clock.monotonic(), gpu_room(vset)) is not None:
                    await apply(vset)
                    changed = True
        return changed

    def machine_look(self) -> None:
        """Once per pass: the machine's idle share of its cores since the last pass."""
        sample = machine_cpu()
        if sample is not None and self._machine is not None:
            idle, total = (a - b for a, b in zip(sample, self._machine, strict=True))
            self._idle_share = idle / total if total > 0 else None
        self._machine = sample

    def _room(
        self,
        live: int,
        before: dict[Key, Look],
        now: dict[Key, Look],
        gpu_room: tuple[int, str] | None = None,
    ) -> tuple[int | None, str]:
        """The most replicas the machine holds for this version, and what limits it."""
        if not self.machine_bound:
            return gpu_room or (None, "")
        footprint = max((f.rss_bytes for f in now.values()), default=0)
        total = memory_total() or 0
        by_memory = room_for(live, footprint, memory_available(), int(total * self.memory_headroom))
        per_replica = 0.0
        for key, look_now in now.items():
            earlier = before.get(key)
            if earlier is None or look_now.cpu_s is None or earlier.cpu_s is None:
                continue
            if look_now.t > earlier.t:
                used = (look_now.cpu_s - earlier.cpu_s) / (look_now.t - earlier.t)
                per_replica = max(per_replica, used)
        by_cores = cpu_room(live, per_replica, self._idle_share, os.cpu_count() or 1)
        limits = [
            (n, why)
            for n, why in (
                (by_memory, f"memory: {footprint / 2**20:.0f} MiB per replica"),
                (
                    by_cores,
                    f"cores: {per_replica:.2f} cores per replica, {self._idle_share or 0:.0%} idle",
                ),
                gpu_room or (None, ""),
            )
            if n is not None
        ]
        if not limits:
            return None, ""
        return min(limits)

    async def demand(self, vset: VersionSet, now: float) -> Decision | None:
        """A request waits for a version scaled to zero."""
        if vset.autoscaler is None:
            return None
        decision = vset.autoscaler.demand(now)
        if decision is not None:
            key = (vset.record.model_name, vset.record.version)
            vset.desired = decision.desired
            self._cold[key] = now
            await self.keep(key, decision)
        return decision

    def started_cold(self, key: tuple[str, str], now: float) -> None:
        """A version with no replica gets one for a waiting request (its cold start ends
        when it is :meth:`ready`)."""
        self._cold[key] = now

    def ready(self, model: str, version: str, now: float) -> float | None:
        """A replica of ``model:version`` became ready: the cold start it ended (seconds),
        if it was started from zero."""
        began = self._cold.pop((model, version), None)
        if began is None:
            return None
        self.cold_starts.setdefault((model, version), ColdStarts()).observe(now - began)
        logger.info("%s:%s started from zero in %.2fs", model, version, now - began)
        return now - began

    def forget(self, model: str, version: str) -> None:
        self._looks.pop((model, version), None)

    async def keep(self, key: tuple[str, str], decision: Decision) -> None:
        """Count a decision for ``/metrics``, log and record it (also the ``capacity``
        events an orchestrator decides: no GPU has room for another replica)."""
        model, version = key
        self.decisions[(model, version, decision.reason)] += 1
        logger.info(
            "autoscaling %s:%s %d -> %d (%s): %s",
            model, version, decision.replicas, decision.desired, decision.reason, decision.detail,
        )  # fmt: skip
        try:
            await self.record(model, version, decision)
        except Exception:  # the decision stands; only its record is missing
            logger.exception("could not record the scaling event of %s:%s", model, version)
