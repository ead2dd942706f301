"""Replicas that join from other hosts (``inferd replica --control HOST:PORT``).

A joined replica is a process the controller did not start: it dialled in over the
control channel (:class:`~inferd.routing.table.Join`), got its spec
(:class:`~inferd.routing.table.Joined`), and beats every second with its state. The
controller keeps it in its version's set beside the replicas it started, so it is
routed to, counted, drained and shown like one of them (:class:`JoinedReplica` has the
parts of :class:`~inferd.control.supervisor.Supervisor` they use). It is never
restarted from here: when its beats stop for ``cluster.replica_timeout_s`` or its
connection closes it leaves the set (and every routing table); its host brings it back
(a service manager), and it joins again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from inferd.control.supervisor import ReplicaState, route_of
from inferd.routing.table import DrainReplica, ReplicaRoute, encode_down
from inferd.serving.spec import ReplicaSpec

logger = logging.getLogger(__name__)

_STATES = {s.value: s for s in ReplicaState}


class ReportedReplica:
    """A replica this controller did not start and never restarts: it holds what was
    last reported of it (by its beats, or by the Kubernetes API for a pod), with the
    parts of :class:`~inferd.control.supervisor.Supervisor` that routing, status,
    scaling and draining use."""

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


class JoinedReplica(ReportedReplica):
    def __init__(
        self,
        spec: ReplicaSpec,
        host: str,
        writer: asyncio.StreamWriter,
        on_change: Callable[[JoinedReplica], None],
    ) -> None:
        super().__init__(spec)
        self.host = host
        self.placement = f"host {host}"
        self.writer = writer
        self.on_change = on_change
        self.last_beat = time.monotonic()

    def beat(self, state: str, message: str) -> None:
        self.last_beat = time.monotonic()
        new = _STATES.get(state, ReplicaState.LOADING)
        if self.stopping and new is not ReplicaState.STOPPED:
            new = ReplicaState.DRAINING
        if new is ReplicaState.READY:
            self.ever_ready = True
        if (new, message) != (self.state, self.message):
            self.state, self.message = new, message
            self.on_change(self)

    def lost(self, why: str) -> None:
        """Its connection closed or its beats stopped: out of routing at once."""
        if self.gone.is_set():
            return
        if not self.stopping:
            logger.warning("joined replica %s (%s) is gone: %s", self.id, self.host, why)
        self.message = why
        self.state = ReplicaState.STOPPED
        self.gone.set()
        self.on_change(self)
        if not self.writer.is_closing():
            self.writer.close()

    async def stop(self, drain: bool = True, grace_s: float = 30.0) -> None:
        """Ask it to drain and leave; returns once it left (or after ``grace_s``)."""
        self.stopping = True
        self.state = ReplicaState.DRAINING
        self.on_change(self)
        if not self.writer.is_closing():
            self.writer.write(encode_down(DrainReplica()))
        try:
            await asyncio.wait_for(self.gone.wait(), grace_s if drain else 1.0)
        except TimeoutError:
            self.lost("did not leave within its grace after a drain")
