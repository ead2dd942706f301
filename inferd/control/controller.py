"""The controller: makes the running replicas match the registry.

Each pass (periodically, or when a gateway asks; one at a time) reads the registry and
acts, level-triggered: a missed event is repaired by the next. A loaded model without
deployments runs its newest version and switches to it once all its replicas are ready
(loaded and warm), then drains the old one: no downtime. A model with deployments runs
exactly its deployed versions and publishes their split: gateways send a version its
share only while it has ready replicas, and the ready one with the largest share serves
by default. A deployment's next step is its rollout policy's call
(:mod:`inferd.control.rollouts`). An unloaded model runs nothing.

Where replicas run is the orchestrator's business, chosen by ``replica_backend``
(:mod:`inferd.control.orchestrators`), and replicas that join from other hosts are the
joins' (:mod:`inferd.control.joined`): the controller sees only
:class:`~inferd.control.replica.Replica`, and publishes each change at once. Under a
memory budget, which versions are loaded is :class:`~inferd.control.on_demand.OnDemand`'s
call: the controller hands it the demands, log rows and autoscaling passes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from inferd.clock import SYSTEM, Clock, every
from inferd.config import Settings
from inferd.control.analyst import CanaryAnalyst
from inferd.control.backends import ReplicaBackend
from inferd.control.joined import Joins
from inferd.control.on_demand import OnDemand, pinned
from inferd.control.orchestrators import Context, orchestrator_for
from inferd.control.replica import Replica
from inferd.control.rollouts import Steps, policy, route
from inferd.control.routes import routing_table
from inferd.control.scaling import Scaling
from inferd.control.state import ModelState, VersionSet, deployed, replica_count, status_changes
from inferd.registry import ModelRecord, Registry
from inferd.registry.deployments import DeploymentRecord
from inferd.registry.rollout import DeploymentStatus
from inferd.shapes.control import RoutingTable
from inferd.shapes.graph import GRAPH_FRAMEWORK
from inferd.shapes.replica import ReplicaState

logger = logging.getLogger(__name__)

RETIRE_DELAY_S = 0.2
"""Gateways get the table without a retiring version first; in-flight requests land."""


class Controller:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        run_dir: Path,
        on_change: Callable[[RoutingTable], None],
        backend: ReplicaBackend | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        """``backend``: where a ``local`` orchestrator starts replicas (default: child
        processes, their sockets in ``run_dir``)."""
        self.settings = settings
        self.registry = registry
        self.on_change = on_change
        self.clock = clock
        self.analyst = CanaryAnalyst(registry.rollouts, clock)
        self.steps = Steps(registry.rollouts, self.analyst, self._spawn, self._reconcile_soon)
        self.models: dict[str, ModelState] = {}
        self._generation = itertools.count(1)
        self.epoch = secrets.token_hex(8)
        """This controller's tables (gateways take a new epoch's from generation 1)."""
        self._pass = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        context = Context(
            models=self.models, clock=clock, on_change=self._on_replica_change,
            publish=self.publish, spawn=self._spawn, reconcile_soon=self._reconcile_soon,
            may_start=lambda: not self.joins.rejoining(),
            capacity=lambda model, version, e: self._spawn(self.scaling.keep((model, version), e)),
        )  # fmt: skip
        self.joins = Joins(settings, context)
        self.orchestrator = orchestrator_for(settings, run_dir, context, backend)
        self.scaling = Scaling(
            lambda model, version, event: asyncio.to_thread(
                registry.deployments.record_scaling, model, version, event.to_dict()
            ),
            settings.autoscale_memory_headroom,
            machine_bound=self.orchestrator.machine_bound,
        )
        budget = settings.models.memory_budget_mb
        self.on_demand = None if budget is None else OnDemand(
            budget * 1024**2, context, self.orchestrator, self.scaling, self._pass,
            settings.replicas,
        )  # fmt: skip
        """Versions loaded on demand under ``models.memory_budget_mb`` (None: off)."""

    async def start(self) -> None:
        self.joins.open_window()
        await self.orchestrator.start()
        await self.reconcile()
        self.orchestrator.keep_only({(m.name, v) for m in self.models.values() for v in m.versions})
        self.joins.start()
        settings = self.settings
        self._tasks = [
            asyncio.create_task(every(self.clock, interval_s, run, what))
            for interval_s, run, what in (
                (settings.reconcile_interval_s, self.reconcile, "reconcile"),
                (settings.autoscale_interval_s, self.autoscale, "autoscaling pass"),
            )
        ]

    async def autoscale(self) -> None:
        """Look at every autoscaled version; apply what its autoscaler decides. Under a
        memory budget, unload what a load left over it once it can go."""
        room = self.orchestrator.gpu_room
        if await self.scaling.look_at_all(self.models, self.clock, room, self._scale):
            self.publish()
        if self.on_demand is not None and await self.on_demand.trim():
            self.publish()

    async def demand(self, model: str, version: str) -> None:
        """A gateway holds a request for ``model:version``: a version scaled to zero gets
        a replica at once (an on-demand one, once it has the room)."""
        state = self.models.get(model)
        vset = state.versions.get(version) if state is not None and state.loaded else None
        if vset is None or vset.retiring:
            return
        if vset.on_demand and self.on_demand is not None:
            await self.on_demand.load(vset)  # unless it is loaded already
        elif await self.scaling.demand(vset, self.clock.monotonic()) is not None:
            await self._scale(vset)
            self.publish()

    def used(self, rows: Any) -> None:
        """Requests were answered (the gateways' log rows): on-demand versions' last use,
        and inference graph versions' figures (for their canary analysis)."""
        if self.on_demand is not None:
            self.on_demand.used(rows)
        if self._graphs:
            self.analyst.graphs.observe(rows, self._is_graph)

    @property
    def _graphs(self) -> bool:
        """Is any inference graph version deployed?"""
        return any(v.replicaless for m in self.models.values() for v in m.versions.values())

    def _is_graph(self, model: str, version: str) -> bool:
        state = self.models.get(model)
        vset = None if state is None else state.versions.get(version)
        return vset is not None and vset.replicaless

    async def _scale(self, vset: VersionSet) -> None:
        """Apply a new ``desired`` between passes (none runs meanwhile)."""
        async with self._pass:
            if not vset.retiring:
                self.orchestrator.scale(vset)

    async def reconcile(self) -> None:
        """One pass. Passes are serialised: each acts on the registry as it read it, so
        an older read can never undo a newer one (a load right after an unload)."""
        async with self._pass:
            if self._stopping:
                return
            # Deployments first: the versions they name are in the models read next.
            deployments = await asyncio.to_thread(self.registry.deployments.by_model)
            for record in await asyncio.to_thread(self.registry.list_models):
                if record.versions:
                    self._reconcile_model(record, deployments.get(record.name, []))
            self.orchestrator.sync()
            self.publish()
            for change in status_changes(self.models):  # deploying/active/failed, if changed
                await asyncio.to_thread(self.registry.rollouts.set_status, *change)

    def _reconcile_soon(self) -> None:
        if not self._stopping:
            self._spawn(self.reconcile())

    def _reconcile_model(self, record: ModelRecord, deployments: list[DeploymentRecord]) -> None:
        model = self.models.setdefault(record.name, ModelState(record.name))
        model.loaded = record.loaded
        route(model, deployments if record.loaded else [])
        self.analyst.keep_only(model.name, model.canaries)
        if not record.loaded:
            self._unload(model)
        elif deployments:
            self._reconcile_deployments(model, record, deployments)
        else:
            self._reconcile_automatic(model, record)

    def _reconcile_automatic(self, model: ModelState, record: ModelRecord) -> None:
        """No deployments: run the newest version, and switch to it once it is ready."""
        target = record.versions[-1]
        vset = model.versions.get(target.version)
        if vset is not None and vset.retiring:
            return  # an unload is still stopping it; _retire asks for a new pass
        if vset is None:
            on_demand = self.on_demand is not None and not pinned(target)
            on_demand = on_demand and target.framework != GRAPH_FRAMEWORK
            desired = 0 if on_demand else replica_count(target, self.settings.replicas)
            vset = model.versions[target.version] = VersionSet(target, desired, on_demand=on_demand)
            logger.info("deploying %s with %d replica(s)", vset.name, desired)
        if not vset.replicaless:  # a graph: no orchestrator object of its own (no pods)
            self.orchestrator.scale(vset, shrink=False)
        self._switch_when_ready(model)

    def _reconcile_deployments(
        self, model: ModelState, record: ModelRecord, rows: list[DeploymentRecord]
    ) -> None:
        """Run exactly the deployed versions with their replica counts; drain the rest."""
        registered = {v.version: v for v in record.versions}
        wanted = {r.version for r in rows if not r.status.gone}
        for version, running in model.versions.items():
            if version not in wanted and not running.retiring:
                self._retire_soon(model, version, remove=True)
        now = self.clock.now()
        for row in rows:
            if row.status is DeploymentStatus.DRAINING and row.version not in model.versions:
                self._spawn(self._remove_deployment(model, row.version))  # nothing runs
            if row.status.gone or row.version not in registered:
                continue
            current = model.versions.get(row.version)
            if current is not None and current.retiring:
                continue  # still stopping from an unload or removal; a later pass restarts it
            vset = deployed(
                model, row, registered[row.version], self.settings.replicas,
                self.clock.monotonic(), self.orchestrator.running(model.name, row.version),
                self.orchestrator.gpus,
                self.on_demand is not None and not pinned(registered[row.version]),
            )  # fmt: skip
            if not vset.replicaless:
                self.orchestrator.scale(vset)
            step = policy(row).next_step(row, vset, now)
            if step is not None:
                self.steps.once(model, row, step)
        self._pick_serving(model)

    def _on_replica_change(self, replica: Replica) -> None:
        """One table for the change and what it decides: a replica ready and the version
        it makes the serving one arrive together (a table listing a ready replica with
        no serving version would fail the unpinned requests held for it)."""
        if replica.state is ReplicaState.READY:
            self.scaling.ready(replica.spec.model, replica.spec.version, self.clock.monotonic())
            if self.on_demand is not None:
                self.on_demand.ready((replica.spec.model, replica.spec.version))
            if self._switch_when_ready(self.models[replica.spec.model]):
                return
        self.publish()

    def _pick_serving(self, model: ModelState) -> bool:
        """Deployments: :meth:`~ModelState.best_deployed` serves by default. True: that
        changed the serving version (and a table was published)."""
        best = model.best_deployed()
        if best == model.serving:
            return False
        logger.info("%s now serves version %s by default", model.name, best)
        model.serving = best
        self.publish()
        return True

    def _switch_when_ready(self, model: ModelState) -> bool:
        """Send traffic to the newest version once all its replicas are ready. True: the
        serving version changed (and a table was published)."""
        if not model.loaded or not model.versions:
            return False
        if model.traffic:
            return self._pick_serving(model)
        newest = max(model.versions.values(), key=lambda v: v.record.created_at)
        if newest.retiring or model.serving == newest.record.version or not newest.all_ready():
            return False
        model.serving = newest.record.version
        logger.info("%s now serves version %s", model.name, model.serving)
        self.publish()
        # The one it replaced, and any that started but was overtaken before it served
        # (two versions pushed in quick succession).
        for version, vset in list(model.versions.items()):
            if version != model.serving and not vset.retiring:
                self._retire_soon(model, version)
        return True

    def _unload(self, model: ModelState) -> None:
        """Stop serving at once, then drain and stop every replica of the model."""
        if model.serving is not None:
            logger.info("%s unloaded; stopping its replicas", model.name)
            model.serving = None
            self.publish()
        for version, vset in model.versions.items():
            if not vset.retiring:
                self._retire_soon(model, version)

    def _retire_soon(self, model: ModelState, version: str, remove: bool = False) -> None:
        """Drain and stop a version's replicas in the background; ``remove``: then delete
        its (draining) deployment."""
        model.versions[version].retiring = True  # at once: the next pass must not retire twice
        self._spawn(self._retire(model, version, remove))

    async def _retire(self, model: ModelState, version: str, remove: bool = False) -> None:
        vset = model.versions.get(version)
        if vset is None:
            return
        await self.clock.sleep(RETIRE_DELAY_S)
        self.orchestrator.retire(model.name, version)
        await asyncio.gather(*(r.stop() for r in vset.replicas))
        model.versions.pop(version, None)
        logger.info("%s:%s retired", model.name, version)
        self.publish()
        if remove:
            await self._remove_deployment(model, version)
        if model.loaded and model.serving is None and not self._stopping:
            # Loaded again while this version was stopping: start it afresh now.
            await self.reconcile()

    async def _remove_deployment(self, model: ModelState, version: str) -> None:
        await asyncio.to_thread(self.registry.rollouts.remove, model.name, version)
        logger.info("%s:%s undeployed", model.name, version)

    def publish(self) -> None:
        if self.joins.rejoining():
            return  # gateways keep the last controller's table meanwhile
        self.on_change(routing_table(next(self._generation), self.models, self.epoch))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        """Stop passes, then what must not outlive this controller (the orchestrator's
        call: Kubernetes pods and joined replicas keep serving, for the next one)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.joins.stop()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.orchestrator.close()
