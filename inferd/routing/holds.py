"""Requests held, not refused, while what they need is on its way.

A version with no ready replica but one coming (a crash restart, a first load, a
version scaled to zero that the controller is asked to start) holds its requests until
the table that shows one ready, within their deadline, ``hold_timeout_s``, and
``hold_max_requests`` held at once per gateway process (like Knative's activator); a
replica whose loads keep failing is not waited for. A model or version the registry
knows but no table lists yet is waited for the same way (:meth:`Holds.arriving`)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from inferd.errors import ModelNotReady
from inferd.serving.client import ReplicaClient
from inferd.shapes.control import ModelRoute, ReplicaRoute, RoutingTable
from inferd.telemetry.log_rows import COUNTERS

if TYPE_CHECKING:
    from inferd.routing.server_link import ServerLink
    from inferd.routing.targets import Target

logger = logging.getLogger(__name__)
T = TypeVar("T")
COLD_START: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "inferd_cold_start", default=None
)
"""Set (``time.perf_counter()``) when the current request waited for a version scaled to
zero to start: the data plane reports how long it waited (``x-inferd-cold-start-ms``)."""


def coming_back(replica: ReplicaRoute) -> bool:
    """A replica that should be ready soon: a first start, or a restart of one that
    served (not one whose loads keep failing)."""
    if replica.state in ("starting", "loading"):
        return replica.restarts == 0 or replica.ever_ready
    return replica.state == "failed" and replica.ever_ready


class Tables(Protocol):
    """What holds read of the router: its table, its replicas' connections, the next
    table."""

    server: ServerLink

    @property
    def table(self) -> RoutingTable: ...

    def connected(self, model: str, version: str) -> Sequence[ReplicaClient]: ...

    def client(self, replica_id: str) -> ReplicaClient | None: ...

    async def next_table(self, timeout_s: float) -> None: ...

    async def wait_for(
        self, check: Callable[[RoutingTable], T | None], timeout_s: float
    ) -> T | None: ...

    def target(self, model: str, version: str | None = None, user: str | None = None) -> Target: ...


class Holds:
    """A gateway process's held requests, and what they wait for."""

    def __init__(self, tables: Tables, timeout_s: float = 0.0, max_requests: int = 0) -> None:
        self.tables = tables
        self.hold_timeout_s = timeout_s
        self.hold_max_requests = max_requests
        self.holding = 0
        """Requests waiting now for a replica that is coming."""
        self._asked: dict[tuple[str, str], float] = {}
        self.deployed: Callable[[str, str | None], bool] | None = None
        """Asks the registry whether a version is deployed, or (version None) whether a
        model is registered (set by the gateway): what the table does not list yet is
        waited for when it is (see :meth:`arriving`)."""
        self._not_deployed: dict[tuple[str, str | None], float] = {}

    async def arriving(
        self, model: str, version: str | None, until: float, missing: Exception
    ) -> Target:
        """The target of a request for what the table does not list (``target`` raised
        ``missing``): a pinned ``version`` whose deployment was just written, or (no
        version) a model just registered — the registry knows it, the controller has not
        published it yet, and another gateway process may already have said it serves.
        It is waited for, like a replica that is starting: until a table lists it (then
        the request is held for its replica as usual) or ``until``
        (``time.perf_counter()``, within ``hold_timeout_s``): 503 with Retry-After,
        never 404. Anything else: ``missing`` (404) at once; "not there" answers are kept
        a second, so unknown names cost one registry read a second, not one per
        request."""
        key = (model, version)
        now = time.monotonic()
        if self.deployed is None or self.hold_timeout_s <= 0:
            raise missing
        if self._not_deployed.get(key, 0.0) > now:
            raise missing
        try:
            known = await asyncio.to_thread(self.deployed, model, version)
        except Exception:  # the registry unreachable: answer as before it was asked
            logger.warning("cannot ask the registry about %s:%s", model, version, exc_info=True)
            known = False
        if not known:
            if len(self._not_deployed) > 10_000:
                self._not_deployed.clear()
            self._not_deployed[key] = now + 1.0
            raise missing
        until = min(until, time.perf_counter() + self.hold_timeout_s)

        def listed(table: RoutingTable) -> bool | None:
            route = table.models.get(model)
            if route is None or (version is not None and version not in route.versions):
                return None
            return True

        if await self.tables.wait_for(listed, until - time.perf_counter()):
            return self.tables.target(model, version)
        if version is None:
            raise ModelNotReady(
                f"model {model!r} is registered but not started yet", retry_after_s=2, model=model
            )
        raise ModelNotReady(
            f"version {version!r} of model {model!r} is deployed but not started yet",
            retry_after_s=2,
            model=model,
            version=version,
        )

    def coming_version(self, route: ModelRoute) -> str | None:
        """With no version ready: the one a request should wait for (the largest share of
        the traffic, else any) when it has a replica coming or can start one; else None."""
        if self.hold_timeout_s <= 0:
            return None
        coming = [
            v
            for v, vroute in route.versions.items()
            if vroute.scale_from_zero or any(map(coming_back, vroute.replicas))
        ]
        if not coming:
            return None
        return max(coming, key=lambda v: route.traffic.get(v, 0))

    def coming(self, target: Target, gone: Collection[ReplicaClient] = ()) -> bool:
        """Whether ``target`` has a replica coming (``gone``: replicas that just failed
        the request, as good as closed even before their connection says so)."""
        route = self.tables.table.models.get(target.model)
        vroute = route.versions.get(target.version) if route and route.loaded else None
        if vroute is None:
            return False
        connected = self.tables.connected(target.model, target.version)
        if vroute.scale_from_zero and all(c.closed or c in gone for c in connected):
            # scaled to zero, on its way up, or just unloaded under a memory budget (its
            # table may still say ready): the controller starts one
            self._ask_for(target)
            return True
        for replica in vroute.replicas:
            if coming_back(replica):
                return True
            # Its connection dropped before the controller saw it die: it will restart.
            client = self.tables.client(replica.id)
            if replica.state == "ready" and (client is None or client.closed or client in gone):
                return True
        return False

    def until(self, target: Target, deadline: float, gone: Collection[ReplicaClient] = ()) -> float:
        """When a request finding no ready replica stops waiting for one (counted as held
        when one is coming)."""
        if self.coming(target, gone):
            COUNTERS["held"] += 1
        return min(deadline, time.perf_counter() + self.hold_timeout_s)

    def _ask_for(self, target: Target) -> None:
        """Ask the controller for a replica of a version scaled to zero (once a second
        per version, whatever the number of requests held)."""
        key = (target.model, target.version)
        now = time.monotonic()
        if now - self._asked.get(key, -1.0) >= 1.0:
            self._asked[key] = now
            self.tables.server.send_demand(target.model, target.version)
        if COLD_START.get() is None:
            COLD_START.set(time.perf_counter())

    async def hold(
        self, target: Target, until: float, gone: Collection[ReplicaClient] = ()
    ) -> bool:
        """Wait for the next table while ``target`` has a replica coming, until ``until``
        (``time.perf_counter()``); False when the request must not wait (nothing is
        coming, too many are held, no time is left)."""
        left = until - time.perf_counter()
        if left <= 0 or self.holding >= self.hold_max_requests:
            return False
        if not self.coming(target, gone):
            return False
        self.holding += 1
        try:
            with contextlib.suppress(TimeoutError):
                await self.tables.next_table(left)
        finally:
            self.holding -= 1
        return True

    def not_ready(self, target: Target, gone: Collection[ReplicaClient] = ()) -> ModelNotReady:
        if self.coming(target, gone):
            COUNTERS["held_expired"] += 1
            why = "a replica is starting but was not ready within the request's deadline"
        else:
            why = "no ready replica"
        return ModelNotReady(
            f"{why} for {target.model}:{target.version}",
            model=target.model,
            version=target.version,
        )
