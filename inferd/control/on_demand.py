"""Versions loaded on demand under a memory budget (``models.memory_budget_mb``).

With a budget, a version runs a replica only while it is used: every version that is
not pinned (``pinned: true`` in its metadata) and whose replica count nobody fixed (no
deployment's ``replicas`` nor ``autoscaling``) starts with none and is flagged
``scale_from_zero`` in the routing table, so a gateway holds a request for it and asks
for it (a ``Demand`` frame, as for a deployment scaled to zero). Before its replica
starts, :func:`evictions` makes room: the resident versions' measured memory (their
replicas' resident set) plus the newcomer's (as last measured, else the median of the
others) must fit; the least recently used unpinned versions with nothing in flight are
unloaded until it does. A request in flight is never cut: a busy version is passed
over (and so is one that became ready less than ``SETTLE_S`` ago: the requests held for
it reach it first), and an evicted replica drains what it accepted. What cannot be made
to fit (all that is resident is pinned or busy) loads anyway and is counted over
budget; the next load evicts again.

The policy, :func:`evictions`, is pure (figures in, decisions out). :class:`OnDemand`
measures the residents, applies the decisions through the controller's orchestrator
between its passes and records them as scaling events (``load``, ``evict``); the
controller hands it a held request's demand (:meth:`~OnDemand.load`), the gateways'
log rows (:meth:`~OnDemand.used`), replicas turning ready and its autoscaling pass
(:meth:`~OnDemand.trim`).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferd.control.autoscaler import Decision
from inferd.control.state import replica_count
from inferd.registry import VersionRecord
from inferd.serving.client import status_of

if TYPE_CHECKING:
    from inferd.control.orchestrators import Context, Orchestrator
    from inferd.control.replica import Replica
    from inferd.control.scaling import Scaling
    from inferd.control.state import VersionSet

Key = tuple[str, str]

DEFAULT_FOOTPRINT_BYTES = 128 * 1024**2
"""What a version never measured is taken to need when nothing was measured yet."""
SETTLE_S = 2.0
"""A version that just became ready is not evicted for this long: the requests held for
it reach it first (else two versions taking turns in one slot could each be unloaded
before serving what waited for them)."""


def pinned(record: VersionRecord) -> bool:
    """A version that is always loaded and never evicted (metadata ``pinned: true``)."""
    return record.metadata.get("pinned") is True


@dataclass(frozen=True, slots=True)
class Resident:
    """A version with replicas, as measured before a load."""

    key: Key
    bytes: int
    last_used: float
    pinned: bool
    busy: bool
    """Requests in flight (queued, computing or generating) on one of its replicas."""


def evictions(need_bytes: int, residents: list[Resident], budget_bytes: int) -> list[Key]:
    """The versions to unload, least recently used first, so that the residents left
    plus ``need_bytes`` fit ``budget_bytes``; never a pinned or a busy one (all it can
    when even that does not fit)."""
    total = sum(r.bytes for r in residents) + need_bytes
    out: list[Key] = []
    for r in sorted(residents, key=lambda r: r.last_used):
        if total <= budget_bytes:
            break
        if r.pinned or r.busy:
            continue
        out.append(r.key)
        total -= r.bytes
    return out


async def _resident_figures(replica: Replica) -> tuple[int, bool] | None:
    """A replica's own bytes (in a shared process, what its load added: the process's
    RSS is everyone's) and whether it has requests in flight; None: it did not answer
    within a second."""
    status = await status_of(replica.address, replica.id)
    if status is None:
        return None
    stats = status.stats
    inflight = sum(
        n or 0 for n in (stats.inflight, stats.queued_rows, stats.running, stats.waiting)
    )
    own = stats.model_bytes if stats.model_bytes is not None else stats.rss_bytes or 0
    return int(own), inflight > 0


class OnDemand:
    """The on-demand versions' loads and evictions, and what it keeps for them: their
    last use, their measured footprint, and counts for ``/metrics``. ``context``,
    ``orchestrator``, ``scaling`` and ``passes`` (the pass lock: a load or an eviction
    comes between two passes) are the controller's; ``default_replicas``: what a version
    loads with when it says none (``replicas``)."""

    def __init__(
        self,
        budget_bytes: int,
        context: Context,
        orchestrator: Orchestrator,
        scaling: Scaling,
        passes: asyncio.Lock,
        default_replicas: int,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._context = context
        self._orchestrator = orchestrator
        self._scaling = scaling
        self._passes = passes
        self._default_replicas = default_replicas
        self.last_used: dict[Key, float] = {}
        self.ready_at: dict[Key, float] = {}
        self.footprint: dict[Key, int] = {}
        """Resident bytes of a version's replica, as last measured (kept after it leaves)."""
        self.loads = 0
        self.evictions = 0
        self.over_budget = 0
        """Loads that went over the budget: nothing resident could be unloaded."""
        self.figures: Callable[[Replica], Awaitable[tuple[int, bool] | None]]
        self.figures = _resident_figures
        """How a ready replica is measured (a seam for tests: replicas with no socket)."""

    def used(self, rows: Any) -> None:
        """Requests answered (inference-log rows): their versions were just used."""
        now = self._context.clock.monotonic()
        for row in rows:
            if row.version is not None:
                self.last_used[(row.model_name, row.version)] = now

    def ready(self, key: Key) -> None:
        """A replica of ``key`` became ready: it counts as used now, and settles."""
        self.ready_at[key] = self.last_used[key] = self._context.clock.monotonic()

    def settling(self, key: Key, now: float) -> bool:
        return now - self.ready_at.get(key, -SETTLE_S) < SETTLE_S

    def estimate(self, key: Key) -> int:
        """Bytes ``key`` will take: as last measured, else the median of the others."""
        if key in self.footprint:
            return self.footprint[key]
        return (
            int(statistics.median(self.footprint.values()))
            if self.footprint
            else (DEFAULT_FOOTPRINT_BYTES)
        )

    async def load(self, vset: VersionSet) -> None:
        """A request waits for ``vset``: start its replicas, after unloading the least
        recently used versions it needs the room of (:func:`evictions`); nothing when it
        is loaded already."""
        if vset.desired > 0:
            return
        key = (vset.record.model_name, vset.record.version)
        residents = await self.residents()  # before the pass lock: it may wait
        async with self._passes:
            if vset.retiring or vset.desired > 0:
                return  # another request's demand loaded it meanwhile
            need = self.estimate(key)
            evicted = evictions(need, residents, self.budget_bytes)
            self._evict(evicted, f"room for {vset.name}")
            after = sum(r.bytes for r in residents if r.key not in evicted) + need
            detail = f"a request is waiting; {after / 2**20:.0f} of "
            detail += f"{self.budget_bytes / 2**20:.0f} MiB of the budget in use"
            if after > self.budget_bytes:
                self.over_budget += 1
                detail += " (over: what is resident is pinned or busy)"
            self.loads += 1
            now = self._context.clock.monotonic()
            self.last_used[key] = now
            self._set(vset, replica_count(vset.record, self._default_replicas), "load", detail)
            self._scaling.started_cold(key, now)
        self._context.publish()

    async def trim(self) -> bool:
        """Loads that went over the budget (all that was resident was busy or settling):
        unload the least recently used idle versions until it fits again. True: some
        went (a table is to be published)."""
        residents = await self.residents()
        if sum(r.bytes for r in residents) <= self.budget_bytes:
            return False
        async with self._passes:
            chosen = evictions(0, residents, self.budget_bytes)
            return self._evict(chosen, "over the budget after busy loads") > 0

    def _evict(self, keys: list[Key], why: str) -> int:
        """Unload the on-demand versions ``keys`` (those still loaded); how many."""
        done = 0
        for model, version in keys:
            state = self._context.models.get(model)
            vset = state.versions.get(version) if state is not None else None
            if vset is not None and vset.on_demand and vset.desired > 0 and not vset.retiring:
                self._set(vset, 0, "evict", why)
                done += 1
        self.evictions += done
        return done

    def _set(self, vset: VersionSet, desired: int, reason: str, detail: str) -> None:
        key = (vset.record.model_name, vset.record.version)
        now = self._context.clock.monotonic()
        decision = Decision(now, vset.desired, desired, reason, detail)
        vset.desired = desired
        self._orchestrator.scale(vset)
        self._context.spawn(self._scaling.keep(key, decision))

    async def residents(self) -> list[Resident]:
        """Every version with replicas, measured now (their replicas' memory and requests
        in flight, asked over the replica protocol; a replica still starting is busy, at
        its estimate). Measuring updates ``footprint``."""
        now = self._context.clock.monotonic()
        found = [
            self._measure((name, version), vset, now)
            for name, model in list(self._context.models.items())
            for version, vset in list(model.versions.items())
            if not vset.retiring and (vset.desired > 0 or vset.live())
        ]
        return list(await asyncio.gather(*found))

    async def _measure(self, key: Key, vset: VersionSet, now: float) -> Resident:
        live = vset.live()
        figures = await asyncio.gather(*(self.figures(r) for r in live if r.ready))
        measured = [f for f in figures if f is not None]
        busy = any(f[1] for f in measured) or len(measured) < max(vset.desired, len(live))
        if measured:
            self.footprint[key] = sum(f[0] for f in measured)
        return Resident(
            key,
            self.footprint.get(key) or self.estimate(key),
            self.last_used.get(key, 0.0),
            pinned=not vset.on_demand,
            busy=busy or self.settling(key, now),
        )
