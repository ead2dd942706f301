"""Replica backends: where replicas run.

The process orchestrator (:mod:`inferd.control.orchestrators.processes`) decides *what*
runs (a :class:`~inferd.shapes.replica_spec.ReplicaSpec` per replica); a backend decides
*where* and *how*: it starts a replica from its spec, tells when it is ready to serve
(or why it is not), when it is gone and why, and stops it (draining it first, or at
once). The orchestrator and the supervisor (:mod:`inferd.control.supervisor`) see only
these two interfaces; a backend whose processes a supervisor can keep alive elsewhere
is a new module here and a line in :func:`create`, nothing more. Where something else
keeps replicas alive (Kubernetes), per-replica supervision does not fit: that is an
orchestrator of its own (:mod:`inferd.control.orchestrators`).

The contract a backend keeps:

- ``start`` returns once the replica was *asked* to start (a process spawned, a pod
  created); loading the model takes as long as it takes, so readiness is
  ``handle.wait_ready``. The handle's ``address`` is where gateways reach it
  (``unix:/path`` or ``tcp:host:port``), fixed for the handle's life.
- ``wait_ready(timeout_s)`` returns ``None`` once the replica answers ready, or the
  reason it will not be (it failed to load, it is gone, the timeout passed). It does
  not stop the replica; the supervisor does.
- ``wait_gone`` returns the reason once the replica is gone (exited with a code,
  killed, evicted); ``gone`` says so without waiting.
- ``stop(handle, drain=True)`` makes it finish what it accepted, then go (the backend's
  grace period, then it is forced); ``drain=False`` stops it at once. It returns once
  the replica is gone, and is a no-op for one that already is.
- ``close`` releases what the backend holds besides its replicas (the fork server),
  once they are stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from inferd.shapes.replica_spec import ReplicaSpec


class ReplicaHandle(Protocol):
    """One incarnation of a replica (a restart is a new handle)."""

    @property
    def replica_id(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def pid(self) -> int:
        """Its process id on this machine (for process metrics); 0 when it runs elsewhere."""
        ...

    @property
    def incarnation(self) -> int:
        """Distinguishes restarts of the same replica id (counters start again)."""
        ...

    @property
    def gone(self) -> bool: ...

    async def wait_ready(self, timeout_s: float) -> str | None: ...

    async def wait_gone(self) -> str: ...


class ReplicaBackend(Protocol):
    name: str

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle: ...

    async def stop(self, handle: ReplicaHandle, *, drain: bool = True) -> None: ...

    async def close(self) -> None: ...


BACKENDS = ("local", "inprocess")
"""What `create` makes; `shared` (small versions in shared processes) wraps `local`
when `models.versions_per_process` is above 1 (`orchestrators._processes`)."""


def create(kind: str, run_dir: Path, grace_s: float, fork_server: bool = False) -> ReplicaBackend:
    """The backend a server's settings name (``local``: processes here, forked from the
    fork server with ``fork_server``)."""
    if kind == "local":
        from inferd.control.backends.local import LocalBackend

        return LocalBackend(run_dir, grace_s, fork_server)
    if kind == "inprocess":
        from inferd.control.backends.inprocess import InProcessBackend

        return InProcessBackend(grace_s)
    raise ValueError(f"unknown replica backend {kind!r}; available: {list(BACKENDS)}")
