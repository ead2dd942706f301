"""A replica as the controller sees it, wherever it runs.

Three kinds fill a version's set today: a :class:`~inferd.control.supervisor.Supervisor`
keeping a process of this machine alive, a replica that joined from another host
(:class:`~inferd.control.joined.JoinedReplica`) and a Kubernetes pod
(:class:`~inferd.control.pods.PodReplica`). Routing tables, deployment status, canary
analysis, autoscaling, ``/metrics`` and the console read them only through
:class:`Replica`, so the next orchestrator's replicas are routed, counted, drained and
shown like these without a change anywhere else.

The last two are *reported*: started and restarted by something else, held here as what
was last said of them (:class:`ReportedReplica`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from inferd.shapes.control import ReplicaRoute
from inferd.shapes.replica import ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec


class Replica(Protocol):
    """One replica of a version, in its version's set."""

    spec: ReplicaSpec
    """What it serves; ``spec.gpus``: the devices of this machine it runs on, if any."""
    state: ReplicaState
    message: str
    """Why it is not ready (a failed load, an exit), for people and the API."""
    restarts: int
    """Times it went without being asked to (canary analysis fails a crashing canary)."""
    ever_ready: bool
    """It served once: a restart after a crash, not a load that keeps failing."""
    stopping: bool
    """It was asked to stop: out of routing, and no longer counted as running."""

    @property
    def id(self) -> str: ...

    @property
    def address(self) -> str:
        """Where gateways reach it (``unix:/path`` or ``tcp:host:port``; "" not yet)."""
        ...

    @property
    def pid(self) -> int:
        """Its process on this machine, for process metrics; 0 when it runs elsewhere."""
        ...

    @property
    def incarnation(self) -> int:
        """Distinguishes restarts of the same replica id (its counters start again)."""
        ...

    @property
    def placement(self) -> str:
        """Where it runs, for people: ``local``, ``host NAME``, ``pod``, …"""
        ...

    @property
    def ready(self) -> bool:
        """Ready and not stopping: it takes requests."""
        ...

    def route(self) -> ReplicaRoute: ...

    async def stop(self) -> None:
        """Out of routing at once; returns once it is gone (drained first)."""
        ...


def route_of(replica: Replica) -> ReplicaRoute:
    """What a routing table says of ``replica``."""
    return ReplicaRoute(
        replica.id,
        replica.address,
        replica.state,
        replica.pid,
        replica.restarts,
        replica.message,
        replica.ever_ready,
        replica.spec.gpus,
        replica.placement,
    )


class ReportedReplica:
    """A replica this controller did not start and never restarts: it holds what was
    last reported of it (by its beats, or by the Kubernetes API for a pod)."""

    pid = 0  # its process runs on another host
    incarnation = 0
    placement = "elsewhere"

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.state = ReplicaState.LOADING
        self.message = ""
        self.restarts = 0
        self.ever_ready = False
        self.stopping = False
        self.gone = asyncio.Event()

    @property
    def id(self) -> str:
        return self.spec.replica_id

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def ready(self) -> bool:
        return self.state is ReplicaState.READY and not self.stopping

    def route(self) -> ReplicaRoute:
        return route_of(self)

    async def stop(self, drain: bool = True, grace_s: float = 30.0) -> None:
        """Out of routing at once; returns once it is gone (or after ``grace_s``)."""
        raise NotImplementedError
