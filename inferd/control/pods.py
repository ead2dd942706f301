"""Replica pods, as the Kubernetes backend reports them.

A pod is started, restarted, moved and stopped by Kubernetes, never by the controller:
the controller only holds what the API last said of it (:class:`PodReplica`, a
:class:`~inferd.control.replica.Replica` that :mod:`inferd.control.orchestrators.kubernetes`
puts in its version's set), so gateways route to the pods whose readiness probe passes,
and stop the moment Kubernetes starts deleting one (its replica drains on SIGTERM). Its
container's restarts are the replica's crash count (canary analysis reads it); a crash
loop or an image that cannot be pulled shows as ``failed`` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from inferd.control.backends.kubernetes import PodSeen
from inferd.control.replica import ReportedReplica
from inferd.shapes.replica import ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)


class PodReplica(ReportedReplica):
    placement = "pod"

    def __init__(
        self, spec: ReplicaSpec, port: int, on_change: Callable[[PodReplica], None]
    ) -> None:
        super().__init__(spec)
        self.port = port
        self.on_change = on_change

    def update(self, pod: PodSeen) -> None:
        """What the API says of it now."""
        if pod.deleted:
            self.state, self.message = ReplicaState.STOPPED, self.message or "deleted"
            self.gone.set()
            self.on_change(self)
            return
        address = f"tcp:{pod.ip}:{self.port}" if pod.ip else ""
        moved = address != self.spec.address
        if moved:
            self.spec = msgspec.structs.replace(self.spec, address=address)
        if pod.restarts > self.restarts:
            logger.warning("replica pod %s restarted (%d so far)", self.id, pod.restarts)
        self.restarts = self.incarnation = pod.restarts
        if pod.deleting or self.stopping:
            state, message = ReplicaState.DRAINING, "stopping"
        elif pod.ready and address:
            state, message = ReplicaState.READY, ""
            self.ever_ready = True
        elif pod.failed:
            state, message = ReplicaState.FAILED, pod.problem
        else:
            state, message = ReplicaState.LOADING, pod.problem
        if (state, message) != (self.state, self.message) or moved:
            self.state, self.message = state, message
            self.on_change(self)

    async def stop(self, drain: bool = True, grace_s: float = 60.0) -> None:
        """Out of routing at once; returns once Kubernetes deleted it (the backend
        deletes or scales its Deployment), or after ``grace_s``."""
        self.stopping = True
        if self.state is not ReplicaState.STOPPED:
            self.state = ReplicaState.DRAINING
            self.on_change(self)
        try:
            await asyncio.wait_for(self.gone.wait(), grace_s)
        except TimeoutError:
            logger.warning("replica pod %s still there %.0fs after its stop", self.id, grace_s)
