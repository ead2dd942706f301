"""Autoscaled versions, looked at every ``autoscale_interval_s``: what their replicas
counted (each replica's own status: compute seconds, rows waiting, its latency sketch),
differenced since the previous look, becomes the :class:`~inferd.control.autoscaler.Signals`
of the version's :class:`~inferd.control.autoscaler.Autoscaler`; a decision changes the
version's desired replica count, and is kept as a scaling event (registry, logs,
``/metrics``).

Capacity: a version scales up only as far as the machine's free memory holds replicas
of its measured size (the largest RSS of its running replicas), keeping
``autoscale_memory_headroom`` of the machine free; beyond, the autoscaler records a
``capacity`` event instead of starting replicas that would not fit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferd.control.autoscaler import Decision, Signals
from inferd.control.state import VersionSet
from inferd.control.supervisor import ReplicaState
from inferd.observability.metrics import Sketch
from inferd.serving.client import ReplicaClient

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


Looker = Callable[[list[tuple[str, int, str]], float], Awaitable[dict[Key, Look]]]


async def look(replicas: list[tuple[str, int, str]], t: float) -> dict[Key, Look]:
    """The figures of ``(replica id, pid, address)``; replicas that do not answer within
    a second are left out (starting, draining: the next look asks again)."""

    async def one(rid: str, address: str) -> Look | None:
        client = ReplicaClient(address, rid)
        try:
            await client.connect()
            status = await client.status(timeout_s=1.0)
        except Exception:  # not measurable now
            return None
        finally:
            client.close()
        stats, metrics = status.stats, status.metrics
        if "latency_sketch" not in metrics:
            return None  # text generation: its engine has its own figures
        return Look(
            t,
            float(stats.get("compute_s", 0.0)),
            int(stats.get("queued_rows", 0)),
            int(stats.get("rss_bytes", 0)),
            Sketch.of(metrics["latency_sketch"]),
        )

    found = await asyncio.gather(*(one(rid, address) for rid, _, address in replicas))
    return {(rid, pid): f for (rid, pid, _), f in zip(replicas, found, strict=True) if f}


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
    ) -> None:
        self.record = record
        self.memory_headroom = memory_headroom
        self.looker = looker
        self._looks: dict[tuple[str, str], dict[Key, Look]] = {}
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        """(model, version, reason) -> decisions taken, for ``/metrics``."""
        self._cold: dict[tuple[str, str], float] = {}  # started from zero at (clock)
        self.cold_starts: dict[tuple[str, str], ColdStarts] = {}
        """Times from a demand at zero replicas to a ready replica, for ``/metrics``."""

    async def look_at(self, vset: VersionSet, now: float) -> Decision | None:
        """Look at one autoscaled version; the decision it led to, if any (the caller
        applies it: ``vset.desired`` is already the new count)."""
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
        footprint = max((f.rss_bytes for f in current.values()), default=0)
        total = memory_total() or 0
        room = room_for(
            len(vset.live()), footprint, memory_available(), int(total * self.memory_headroom)
        )
        events_before = len(scaler.events)
        decision = scaler.observe(signals(before, current, now, len(ready)), room)
        if len(scaler.events) > events_before and decision is None:  # a capacity refusal
            await self._keep(key, scaler.events[-1])
        if decision is not None:
            vset.desired = decision.desired
            await self._keep(key, decision)
        return decision

    async def demand(self, vset: VersionSet, now: float) -> Decision | None:
        """A request waits for a version scaled to zero."""
        if vset.autoscaler is None:
            return None
        decision = vset.autoscaler.demand(now)
        if decision is not None:
            key = (vset.record.model_name, vset.record.version)
            vset.desired = decision.desired
            self._cold[key] = now
            await self._keep(key, decision)
        return decision

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

    async def _keep(self, key: tuple[str, str], decision: Decision) -> None:
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
