"""Readiness over the replica protocol: any backend whose replicas the server can reach
(a Unix socket here, TCP elsewhere) asks them, the way gateways will talk to them."""

from __future__ import annotations

from collections.abc import Callable

from inferd.clock import SYSTEM, Clock
from inferd.serving.client import ReplicaClient
from inferd.shapes.replica_spec import ReplicaSpec

POLL_S = 0.05


async def wait_ready(
    address: str,
    replica_id: str,
    timeout_s: float,
    gone: Callable[[], bool],
    clock: Clock = SYSTEM,
) -> str | None:
    """Poll the replica's status until it reports ready (None), or why it will not: the
    message of a failed load, or of the timeout; "" when it went without saying why."""
    deadline = clock.monotonic() + timeout_s
    client = ReplicaClient(address, replica_id)
    message = ""
    try:
        while not gone() and clock.monotonic() < deadline:
            try:
                if client.closed:
                    await client.connect()
                status = await client.status()
            except Exception:  # not listening yet, or just died
                await clock.sleep(POLL_S)
                continue
            if status.state == "ready":
                return None
            if status.state == "failed":
                message = status.message
            await clock.sleep(POLL_S)
    finally:
        client.close()
    if gone():
        return message
    return f"not ready after {timeout_s:.0f}s"


class ProbedReplica:
    """What a handle knows from its spec, with readiness asked over the replica
    protocol; a backend's handle adds ``gone``, ``pid``, ``incarnation`` and
    ``wait_gone``."""

    spec: ReplicaSpec

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def gone(self) -> bool:
        raise NotImplementedError

    async def wait_ready(self, timeout_s: float) -> str | None:
        return await wait_ready(self.address, self.replica_id, timeout_s, lambda: self.gone)
