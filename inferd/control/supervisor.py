"""Keeps one replica alive on a backend.

A supervisor starts its replica, waits until it is ready (or gives up after
``load_timeout_s`` and stops it), and when the replica goes without being asked to,
counts a restart and starts a new one after a backoff: 0.5 s, doubling up to
``backoff_max_s``, back to 0.5 s once a replica became ready. ``stop`` drains it and
ends the loop at once, even in the middle of a backoff (a crash-looping replica stops
without waiting it out).

Every change of state is reported to ``on_change`` (the controller publishes the
routing table and reacts to a replica becoming ready), so gateways stop routing to a
replica the moment it is seen gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from inferd.clock import SYSTEM, Clock
from inferd.control.backends import ReplicaBackend, ReplicaHandle
from inferd.control.replica import route_of
from inferd.shapes.control import ReplicaRoute
from inferd.shapes.replica import ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5


class Supervisor:
    def __init__(
        self,
        spec: ReplicaSpec,
        backend: ReplicaBackend,
        on_change: Callable[[Supervisor], None],
        *,
        load_timeout_s: float,
        backoff_max_s: float,
        clock: Clock = SYSTEM,
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.on_change = on_change
        self.load_timeout_s = load_timeout_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.state = ReplicaState.STARTING
        self.restarts = 0
        self.ever_ready = False
        """It served once: a restart after a crash, not a load that keeps failing."""
        """Times it went without being asked to (crash accounting for canary analysis)."""
        self.message = ""
        """Why it is not ready (a failed load, an exit), for people and the API."""
        self.stopping = False
        self.handle: ReplicaHandle | None = None
        self._stop_requested = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.spec.replica_id

    @property
    def address(self) -> str:
        return self.handle.address if self.handle is not None else self.spec.address

    @property
    def pid(self) -> int:
        return self.handle.pid if self.handle is not None else 0

    @property
    def incarnation(self) -> int:
        return self.handle.incarnation if self.handle is not None else 0

    @property
    def ready(self) -> bool:
        return self.state is ReplicaState.READY and not self.stopping

    placement = "local"
    """Where it runs, for people: started by this controller on its own host."""

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, drain: bool = True) -> None:
        """Drain the replica (or stop it at once) and end supervision."""
        self.stopping = True
        self._stop_requested.set()
        self._set(ReplicaState.DRAINING)
        if self.handle is not None:
            await self.backend.stop(self.handle, drain=drain)
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def route(self) -> ReplicaRoute:
        return route_of(self)

    async def _run(self) -> None:
        backoff = FIRST_BACKOFF_S
        while not self.stopping:
            self.message = ""
            handle = await self._start()
            if handle is not None and self.stopping:
                # stopped while the backend started it (a fork server importing a
                # framework, a pod being created): ``stop`` found no handle to stop
                await self.backend.stop(handle, drain=False)
                break
            if handle is None:
                reason = self.message
            else:
                if await self._load(handle):
                    backoff = FIRST_BACKOFF_S
                reason = await handle.wait_gone()
            if self.stopping:
                break
            self.restarts += 1
            self.message = self.message or reason
            logger.error("replica %s %s; restarting in %.1fs", self.id, self.message, backoff)
            self._set(ReplicaState.FAILED)
            await self.clock.wait(self._stop_requested, backoff)
            backoff = min(backoff * 2, self.backoff_max_s)
        self._set(ReplicaState.STOPPED)

    async def _start(self) -> ReplicaHandle | None:
        self._set(ReplicaState.LOADING)
        try:
            self.handle = await self.backend.start(self.spec)
        except Exception as exc:  # the backend could not even ask for one
            logger.exception("starting replica %s failed", self.id)
            self.message = f"could not start: {type(exc).__name__}: {exc}"
            return None
        self.on_change(self)  # its address and pid are known now
        return self.handle

    async def _load(self, handle: ReplicaHandle) -> bool:
        """Wait until it serves; stop it when it cannot (it then counts as a crash)."""
        why = await handle.wait_ready(self.load_timeout_s)
        if why is None:
            self.ever_ready = True
            self._set(ReplicaState.READY)
            return True
        self.message = why
        if not handle.gone and not self.stopping:
            await self.backend.stop(handle, drain=False)
        return False

    def _set(self, state: ReplicaState) -> None:
        if self.stopping and state not in (ReplicaState.DRAINING, ReplicaState.STOPPED):
            return
        self.state = state
        self.on_change(self)
