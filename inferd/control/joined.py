"""Replicas that join from other hosts (``inferd replica --control HOST:PORT``).

A joined replica is a process the controller did not start: it dialled in over the
control channel (:class:`~inferd.shapes.control.Join`), got its spec
(:class:`~inferd.shapes.control.Joined`), and beats every second with its state. The
controller's :class:`Joins` keeps it in its version's set beside the replicas its
orchestrator runs, so it is routed to, counted, drained and shown like one of them
(:class:`JoinedReplica` is a :class:`~inferd.control.replica.Replica`); an orchestrator
that runs replicas here runs that many fewer while it serves. It is never restarted
from here: when its beats stop for ``cluster.replica_timeout_s`` or its connection
closes it leaves the set (and every routing table); its host brings it back (a service
manager), and it joins again.

Joined replicas outlive their controller: they keep serving the gateways they reach, and
join the next one (a restart, the other controller taking over). For
``cluster.rejoin_window_s`` after it starts, a controller listening for other hosts
waits for them: it starts nothing and publishes no table meanwhile (a table without
them would turn gateways away from them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import msgspec

from inferd import transport
from inferd.config import Settings
from inferd.control.orchestrators import Context
from inferd.control.replica import ReportedReplica
from inferd.control.specs import replica_spec
from inferd.control.state import VersionSet
from inferd.shapes.control import DrainReplica, Join, encode_down
from inferd.shapes.replica import ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)


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

    def beat(self, state: ReplicaState, message: str) -> None:
        self.last_beat = time.monotonic()
        new = state
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


class Joins:
    """The controller's joined replicas (see the module's docstring)."""

    def __init__(self, settings: Settings, context: Context) -> None:
        self.settings = settings
        self.context = context
        self.started = asyncio.Event()
        """Set after the controller's first pass (joins wait for it)."""
        self._ids = itertools.count(1)
        self._rejoin_until = 0.0
        self._task: asyncio.Task[None] | None = None

    def open_window(self) -> None:
        """Before the controller's first pass: replicas on other hosts that served the
        last controller join again first."""
        window = self.settings.cluster.rejoin_window_s
        if self.settings.cluster.control_listen and window > 0:
            self._rejoin_until = self.context.clock.monotonic() + window
            self.context.spawn(self._after_rejoin_window(window))

    def rejoining(self) -> bool:
        """In the rejoin window: nothing starts and no table goes out."""
        return self.context.clock.monotonic() < self._rejoin_until

    def start(self) -> None:
        """After the first pass: take joins, and watch their beats."""
        self.started.set()
        self._task = asyncio.get_running_loop().create_task(self._watch_forever())

    async def stop(self) -> None:
        """Stop watching; the joined replicas keep serving (they join the next one)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def join(self, request: Join, writer: asyncio.StreamWriter) -> JoinedReplica | str:
        """A replica on another host asks to serve ``model:version``: its place in the
        version's set, or why not."""
        await self.started.wait()  # the registry read once: what is deployed is known
        state = self.context.models.get(request.model)
        vset = state.versions.get(request.version) if state is not None else None
        if state is None or vset is None or vset.retiring or not state.loaded:
            return f"{request.model}:{request.version} is not deployed on this controller"
        if transport.split(request.address)[0] != "tcp":
            return f"a joining replica is reached over TCP (host:port), not {request.address!r}"
        record = vset.record
        host = request.host or "remote"
        rid = request.replica_id or f"{record.model_name}-{record.version}-{host}-{next(self._ids)}"
        for old in [r for r in vset.replicas if r.id == rid]:
            if isinstance(old, JoinedReplica):  # a rejoin before its old connection closed
                old.lost("joined again")
        spec = msgspec.structs.replace(
            replica_spec(self.settings, vset, rid, None), address=request.address
        )
        replica = JoinedReplica(spec, host, writer, self.context.on_change)
        vset.replicas.append(replica)
        self.context.spawn(self._forget_when_gone(vset, replica))
        logger.info("%s joined from %s at %s", rid, host, request.address)
        self.context.publish()
        return replica

    async def _after_rejoin_window(self, window: float) -> None:
        await self.context.clock.sleep(window)
        logger.info("rejoin window over: starting and routing")
        self.context.reconcile_soon()

    async def _forget_when_gone(self, vset: VersionSet, replica: JoinedReplica) -> None:
        await replica.gone.wait()
        if replica in vset.replicas:
            vset.replicas.remove(replica)
        self.context.publish()
        self.context.reconcile_soon()  # replicas started here may fill the gap

    async def _watch_forever(self) -> None:
        """Joined replicas whose beats stopped (a host that died or was cut off) leave
        routing within ``cluster.replica_timeout_s``."""
        timeout = self.settings.cluster.replica_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            now = time.monotonic()
            for model in list(self.context.models.values()):
                for vset in list(model.versions.values()):
                    for replica in [r for r in vset.replicas if isinstance(r, JoinedReplica)]:
                        silent = now - replica.last_beat
                        if silent > timeout:
                            replica.lost(f"no beat for {silent:.1f}s")
