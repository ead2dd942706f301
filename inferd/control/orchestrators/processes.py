"""Replicas as processes of this machine (``replica_backend: local``): a replica backend
(:mod:`inferd.control.backends`: child processes, or replica cores on the server's own
loop) starts each one, and a :class:`~inferd.control.supervisor.Supervisor` keeps it
alive. Nothing outlives the controller: its replicas drain and stop with it.

A deployment's ``resources.gpu`` is placed here: each replica on one device of that type
(:mod:`inferd.control.gpu_place`: beside the replicas already on each GPU), or not
started at all when none has room, recorded once as a ``capacity`` scaling event
(``VersionSet.gpu_short``). Replicas on devices the deployment no longer allows are
replaced: new ones start, the old ones drain once the new ones are ready.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from inferd import devices
from inferd.config import Settings
from inferd.control import gpu_place, gpu_plan
from inferd.control.autoscaler import Decision
from inferd.control.backends import ReplicaBackend
from inferd.control.orchestrators import Context
from inferd.control.specs import replica_spec
from inferd.control.state import VersionSet
from inferd.control.supervisor import Supervisor
from inferd.errors import InvalidInput
from inferd.shapes.replica import ReplicaState

logger = logging.getLogger(__name__)


class Processes:
    machine_bound = True

    def __init__(self, settings: Settings, backend: ReplicaBackend, context: Context) -> None:
        self.settings = settings
        self.backend = backend
        self.context = context
        self._ids = itertools.count(1)

    async def start(self) -> None:
        pass  # nothing outlived the last controller

    def scale(self, vset: VersionSet, *, shrink: bool = True) -> None:
        """Start or stop replicas until ``desired`` run; extra ones drain (not-ready and
        newest first) and only then leave the set. Replicas placed on other GPUs than
        the deployment's (its ``resources.gpu`` changed) are replaced: new ones start,
        and the old ones drain once the new ones are all ready (all that fit, when the
        GPUs hold fewer than desired)."""
        own = _own(vset, live=True)
        wanted_here = self._wanted_here(vset)
        if not shrink:
            for _ in range(wanted_here - len(own)):
                self._start_replica(vset)
            return
        live = [r for r in own if _placed_within(r.spec.gpus, vset.gpus)]
        misplaced = [r for r in own if not _placed_within(r.spec.gpus, vset.gpus)]
        for _ in range(wanted_here - len(live)):
            if not self._start_replica(vset):
                break  # no GPU takes another: recorded as a capacity event
        # Short of GPU room, the ones that fit are all there will be (and misplaced ones
        # may hold the room the rest need).
        wanted = wanted_here if vset.gpu_short is None else len(live)
        if misplaced and sum(r.state is ReplicaState.READY for r in live) >= wanted:
            for replica in misplaced:
                self.context.spawn(self._scale_down(vset, replica))
        extra = len(live) - wanted_here
        if extra > 0:
            victims = sorted(live, key=lambda r: (r.state is ReplicaState.READY, -live.index(r)))
            for replica in victims[:extra]:
                self.context.spawn(self._scale_down(vset, replica))

    def running(self, model: str, version: str) -> int:
        return 0  # its replicas are all in their version's set

    def gpus(self, vset: VersionSet) -> list[int]:
        """The devices of the deployment's GPU type; none (CPU) for a deployment recorded
        before this machine lost them (new ones are refused at deploy time)."""
        assert vset.gpu_type is not None
        try:
            return devices.place(vset.gpu_type)
        except InvalidInput as exc:
            logger.error("%s: %s", vset.name, exc.message)
            return []

    def gpu_room(self, vset: VersionSet) -> tuple[int, str] | None:
        """How many replicas of ``vset`` its GPUs hold (its live ones and what more fit),
        and the limit's wording; None when it asks for no GPU."""
        if not vset.gpus:
            return None
        need = _gpu_need(vset)
        more = gpu_place.room(
            need, [g for g in devices.local_gpus() if g.index in vset.gpus], self._gpu_replicas()
        )
        return len(vset.live()) + more, f"GPU memory: {need.memory_gb:.1f} GB per replica"

    def sync(self) -> None:
        pass  # its supervisors report every change as it happens

    def keep_only(self, running: set[tuple[str, str]]) -> None:
        pass  # nothing of a version outlives the controller that ran it

    def retire(self, model: str, version: str) -> None:
        pass  # the controller stops its supervisors

    async def close(self) -> None:
        """Every replica it started drains and stops."""
        models = self.context.models.values()
        replicas = [r for m in models for v in m.versions.values() for r in _own(v)]
        await asyncio.gather(*(r.stop() for r in replicas))
        await self.backend.close()

    def _wanted_here(self, vset: VersionSet) -> int:
        """Replicas to run on this host: the desired count less the ones that joined from
        other hosts and serve (none with ``cluster.local_replicas`` off)."""
        if not self.settings.cluster.local_replicas:
            return 0
        joined = [r for r in vset.replicas if not isinstance(r, Supervisor)]
        return max(0, vset.desired - sum(r.ready for r in joined))

    def _start_replica(self, vset: VersionSet) -> bool:
        """Start one more replica of ``vset``; False when no GPU of its deployment's type
        has room for it, or while replicas rejoin (nothing starts)."""
        if not self.context.may_start():
            return False
        gpus = vset.gpus
        if vset.gpus:  # one device per replica, placed beside the others
            where = gpu_place.choose(
                _gpu_need(vset),
                [g for g in devices.local_gpus() if g.index in vset.gpus],
                self._gpu_replicas(),
            )
            if where.device is None:
                self._short_of_gpus(vset, where.why)
                return False
            gpus = [where.device]
        vset.gpu_short = None
        rid = f"{vset.record.model_name}-{vset.record.version}-{next(self._ids)}"
        replica = Supervisor(
            replica_spec(self.settings, vset, rid, gpus),
            self.backend,
            self.context.on_change,
            load_timeout_s=self.settings.load_timeout_s,
            backoff_max_s=self.settings.restart_backoff_max_s,
            clock=self.context.clock,
        )
        vset.replicas.append(replica)
        replica.start()
        return True

    async def _scale_down(self, vset: VersionSet, replica: Supervisor) -> None:
        logger.info("scaling down %s: stopping %s", vset.record.version, replica.id)
        await replica.stop()
        if replica in vset.replicas:
            vset.replicas.remove(replica)
        self.context.publish()

    def _gpu_replicas(self) -> dict[int, list[gpu_plan.Replica]]:
        """The replicas on each GPU now (stopping ones too: they hold memory until gone)."""
        placed: dict[int, list[gpu_plan.Replica]] = {}
        for model in self.context.models.values():
            for vset in model.versions.values():
                if not vset.gpus:
                    continue
                need = _gpu_need(vset)
                for i, replica in enumerate(vset.replicas):
                    for device in replica.spec.gpus or []:
                        placed.setdefault(device, []).append(need.replica(i))
        return placed

    def _short_of_gpus(self, vset: VersionSet, why: str) -> None:
        """Recorded once while the reason stays the same, as a capacity scaling event."""
        if vset.gpu_short == why:
            return
        vset.gpu_short = why
        live = len(vset.live())
        logger.warning("%s: not starting a replica on a GPU: %s", vset.name, why)
        decision = Decision(self.context.clock.monotonic(), live, live, "capacity", why, {})
        self.context.capacity(vset.record.model_name, vset.record.version, decision)


def _own(vset: VersionSet, live: bool = False) -> list[Supervisor]:
    """The replicas of ``vset`` this orchestrator started (``live``: not being stopped)."""
    return [r for r in vset.replicas if isinstance(r, Supervisor) and not (live and r.stopping)]


def _placed_within(gpus: list[int] | None, allowed: list[int] | None) -> bool:
    """Whether a replica started on ``gpus`` runs where its deployment now allows."""
    if allowed is None or not allowed:
        return gpus == allowed
    return bool(gpus) and set(gpus or ()) <= set(allowed)


def _gpu_need(vset: VersionSet) -> gpu_place.GpuNeed:
    record = vset.record
    return gpu_place.need_of(record.model_name, record.metadata, record.size_bytes)
