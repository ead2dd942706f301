"""The controller: makes the running replicas match the registry.

Desired state: every registered model that is *loaded* (the registry's desired state,
see the model repository API) serves its most recently registered version with
``replicas`` replicas; an unloaded model runs none, and stays in the routing table with
no serving version. Reconciliation is level-triggered: each pass compares desired with
actual and acts, so a missed event is repaired by the next pass. Passes run one at a
time: periodically, and when a gateway asks (after a load/unload).

A model with deployments (``registry.deployments``) runs exactly its deployed versions,
each with its replica count, and publishes their traffic split; gateways send a version
its share only while it has ready replicas, so a new version takes traffic once it is
loaded and warm, and a removed (draining) one stops taking it before its replicas stop.
Its serving (default) version is the ready one with the largest share. What a
deployment's strategy does next (switch, analyse, finish) is its rollout policy's call
(:mod:`inferd.control.rollouts`); the controller runs the step.

Version updates are zero-downtime: the new version's replicas start beside the old
ones; traffic switches only when all of them are ready (loaded and warmed up); then the
old replicas drain and stop.

Where replicas run is the backend's business (:mod:`inferd.control.backends`); keeping
each one alive (readiness, restarts with backoff, crash counts) is its supervisor's
(:mod:`inferd.control.supervisor`). A replica's death is published at once so gateways
stop routing to it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from inferd import devices, transport
from inferd.clock import SYSTEM, Clock
from inferd.config import BatchingConfig, Settings
from inferd.control import backends, gpu_place
from inferd.control.analyst import CanaryAnalyst
from inferd.control.autoscaler import Autoscaler, Decision
from inferd.control.backends import ReplicaBackend
from inferd.control.backends.kubernetes import KubernetesBackend, PodSeen
from inferd.control.gpu_plan import Replica
from inferd.control.joined import JoinedReplica, ReportedReplica
from inferd.control.pods import PodReplica
from inferd.control.rollouts import Step, policy
from inferd.control.routes import adapters, routing_table
from inferd.control.scaling import Scaling
from inferd.control.state import ModelState, VersionSet
from inferd.control.supervisor import ReplicaState, Supervisor
from inferd.errors import InvalidInput
from inferd.registry import ModelRecord, Registry, VersionRecord
from inferd.registry.deployments import DeploymentRecord
from inferd.registry.rollout import DeploymentStatus
from inferd.registry.rollout_progress import RolloutProgress
from inferd.routing.table import Join, RoutingTable
from inferd.serving.spec import ReplicaSpec

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
        fleet: KubernetesBackend | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.on_change = on_change
        self.backend = backend or backends.create("local", run_dir, settings.shutdown_grace_s)
        if fleet is None and settings.replica_backend == "kubernetes":
            fleet = KubernetesBackend(settings)
        self.fleet = fleet
        """Kubernetes keeps the replicas (a Deployment per version): the controller only
        says how many, and routes to the pods it reports; None: the backend's replicas."""
        self.clock = clock
        self.analyst = CanaryAnalyst(registry.rollouts, clock)
        self.models: dict[str, ModelState] = {}
        self._generation = itertools.count(1)
        self.epoch = secrets.token_hex(8)
        """This controller's tables (gateways take a new epoch's from generation 1)."""
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._pass = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._steps: set[tuple[str, str, Step]] = set()
        """Rollout steps running now (model, version, step): each runs once at a time."""
        self._stopping = False
        self.scaling = Scaling(
            self._record_scaling, settings.autoscale_memory_headroom, machine_bound=fleet is None
        )
        self._autoscale_task: asyncio.Task[None] | None = None
        self._joined_task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()
        """Set after the first reconcile pass (joins wait for it)."""
        self._rejoin_until = 0.0
        """Until then nothing starts here and no table goes out (``_rejoining``)."""

    async def start(self) -> None:
        window = self.settings.cluster.rejoin_window_s
        if self.settings.cluster.control_listen and window > 0:
            # Replicas on other hosts that served the last controller join again first:
            # a table without them would turn gateways away from them meanwhile.
            self._rejoin_until = self.clock.monotonic() + window
            self._spawn(self._after_rejoin_window(window))
        if self.fleet is not None:
            await self.fleet.start(self._on_pod)
        await self.reconcile()
        if self.fleet is not None:
            running = {(m.name, v) for m in self.models.values() for v in m.versions}
            self.fleet.keep_only(running)
        self.started.set()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._reconcile_forever())
        self._autoscale_task = loop.create_task(self._autoscale_forever())
        self._joined_task = loop.create_task(self._watch_joined_forever())

    async def _after_rejoin_window(self, window: float) -> None:
        await self.clock.sleep(window)
        logger.info("rejoin window over: starting and routing")
        await self.reconcile()

    def _rejoining(self) -> bool:
        return self.clock.monotonic() < self._rejoin_until

    async def _autoscale_forever(self) -> None:
        while True:
            await self.clock.sleep(self.settings.autoscale_interval_s)
            try:
                await self.autoscale()
            except Exception:
                logger.exception("autoscaling pass failed")

    async def autoscale(self) -> None:
        """Look at every autoscaled version; apply what its autoscaler decides."""
        self.scaling.machine_look()
        changed = False
        for model in list(self.models.values()):
            for vset in list(model.versions.values()):
                if vset.autoscaler is None or vset.retiring or not model.loaded:
                    continue
                decision = await self.scaling.look_at(
                    vset, self.clock.monotonic(), self.gpu_room(vset)
                )
                if decision is not None:
                    async with self._pass:
                        if not vset.retiring:
                            self._scale(vset)
                    changed = True
        if changed:
            self.publish()

    async def demand(self, model: str, version: str) -> None:
        """A gateway holds a request for ``model:version``: a version scaled to zero gets
        a replica at once."""
        state = self.models.get(model)
        if state is None or not state.loaded:
            return
        vset = state.versions.get(version)
        if vset is None or vset.retiring:
            return
        if await self.scaling.demand(vset, self.clock.monotonic()) is not None:
            async with self._pass:
                if not vset.retiring:
                    self._scale(vset)
            self.publish()

    async def _record_scaling(self, model: str, version: str, decision: Decision) -> None:
        await asyncio.to_thread(
            self.registry.deployments.record_scaling, model, version, decision.to_dict()
        )

    async def _reconcile_forever(self) -> None:
        while True:
            await self.clock.sleep(self.settings.reconcile_interval_s)
            try:
                await self.reconcile()
            except Exception:
                logger.exception(
                    "reconcile failed; retrying in %.1fs", self.settings.reconcile_interval_s
                )

    async def reconcile(self) -> None:
        """One pass. Passes are serialised: each acts on the registry as it read it, so
        an older read can never undo a newer one (a load right after an unload)."""
        async with self._pass:
            if self._stopping:
                return
            records, deployments = await asyncio.to_thread(self._read_registry)
            for record in records:
                if record.versions:
                    self._reconcile_model(record, deployments.get(record.name, []))
            if self.fleet is not None:
                for pod in self.fleet.pods():
                    self._on_pod(pod)  # pods of versions that run from this pass on
            self.publish()
            await self._write_statuses()

    def _read_registry(self) -> tuple[list[ModelRecord], dict[str, list[DeploymentRecord]]]:
        deployments: dict[str, list[DeploymentRecord]] = {}
        for row in self.registry.deployments.list_all():
            deployments.setdefault(row.model_name, []).append(row)
        return self.registry.list_models(), deployments

    def _reconcile_model(self, record: ModelRecord, deployments: list[DeploymentRecord]) -> None:
        model = self.models.setdefault(record.name, ModelState(record.name))
        model.loaded = record.loaded
        if not record.loaded or not deployments:
            model.traffic, model.mirrors, model.canaries = {}, {}, set()
            self.analyst.keep_only(model.name, set())
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
            desired = int((target.batching or {}).get("replicas") or self.settings.replicas)
            vset = model.versions[target.version] = VersionSet(target, desired)
            logger.info("deploying %s with %d replica(s)", vset.name, desired)
        self._orchestrate(vset)
        for _ in range(self._wanted_here(vset) - len(vset.own(live=True))):
            self._start_replica(vset)
        self._switch_when_ready(model)

    def _reconcile_deployments(
        self, model: ModelState, record: ModelRecord, rows: list[DeploymentRecord]
    ) -> None:
        """Run exactly the deployed versions with their replica counts; drain the rest."""
        registered = {v.version: v for v in record.versions}
        active = [r for r in rows if not r.status.gone]
        model.traffic = {r.version: r.traffic_pct for r in active if policy(r).takes_traffic}
        model.mirrors = {r.version: m for r in active if (m := policy(r).mirror(r)) is not None}
        model.canaries = {r.version for r in active if policy(r).holds_back(r)}
        self.analyst.keep_only(model.name, model.canaries)
        wanted = {r.version for r in active}
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
            vset = _deployed(
                model, row, registered[row.version], self.settings.replicas,
                self.clock.monotonic(), self._pods_of(model.name, row.version), self.fleet is None,
            )  # fmt: skip
            self._scale(vset)
            step = policy(row).next_step(row, vset, now)
            if step is not None:
                self._once(model, row, step)
        self._pick_serving(model)

    # -- rollout steps --------------------------------------------------------------------

    def _once(self, model: ModelState, row: DeploymentRecord, step: Step) -> None:
        """Run a rollout step in the background unless the same one is still running;
        a step that changed the registry asks for a new pass."""
        key = (model.name, row.version, step)
        if key in self._steps:
            return
        self._steps.add(key)

        async def run() -> None:
            try:
                if await _run_step(self.registry.rollouts, self.analyst, model, row, step):
                    self._spawn(self.reconcile())
            except Exception:
                logger.exception("%s of %s:%s failed; the next pass retries", step, *key[:2])
            finally:
                self._steps.discard(key)

        self._spawn(run())

    # -- replicas -------------------------------------------------------------------------

    def _scale(self, vset: VersionSet) -> None:
        """Start or stop replicas until ``desired`` run; extra ones drain (not-ready and
        newest first) and only then leave the set. Replicas placed on other GPUs than
        the deployment's (its ``resources.gpu`` changed) are replaced: new ones start,
        and the old ones drain once the new ones are all ready (all that fit, when the
        GPUs hold fewer than desired)."""
        self._orchestrate(vset)
        own = vset.own(live=True)
        live = [r for r in own if _placed_within(r.spec.gpus, vset.gpus)]
        misplaced = [r for r in own if not _placed_within(r.spec.gpus, vset.gpus)]
        wanted_here = self._wanted_here(vset)
        for _ in range(wanted_here - len(live)):
            if not self._start_replica(vset):
                break  # no GPU takes another: recorded as a capacity event
        # Short of GPU room, the ones that fit are all there will be (and misplaced ones
        # may hold the room the rest need).
        wanted = wanted_here if vset.gpu_short is None else len(live)
        if misplaced and sum(r.state is ReplicaState.READY for r in live) >= wanted:
            for replica in misplaced:
                self._spawn(self._scale_down(vset, replica))
        extra = len(live) - wanted_here
        if extra > 0:
            victims = sorted(live, key=lambda r: (r.state is ReplicaState.READY, -live.index(r)))
            for replica in victims[:extra]:
                self._spawn(self._scale_down(vset, replica))

    def _wanted_here(self, vset: VersionSet) -> int:
        """Replicas to run on this host: the desired count less the joined ones that
        serve (none with ``cluster.local_replicas`` off, nor on Kubernetes)."""
        if not self.settings.cluster.local_replicas or self.fleet is not None:
            return 0
        return max(0, vset.desired - sum(r.ready for r in vset.joined()))

    def _orchestrate(self, vset: VersionSet) -> None:
        """On Kubernetes: the version's Deployment runs ``desired`` pods of its spec."""
        if self.fleet is not None and not vset.retiring:
            # Pods fetch the files from the S3 store: no folder of this host in their spec.
            spec = msgspec.structs.replace(
                _replica_spec(self.settings, vset, "", None), artifact_dir=""
            )
            self.fleet.want(spec, vset.desired, vset.gpu_type)

    def _pods_of(self, model: str, version: str) -> int:
        """Replica pods of ``model:version`` Kubernetes runs now (0 off Kubernetes)."""
        if self.fleet is None:
            return 0
        pods = self.fleet.pods()
        return sum(p.model == model and p.version == version and not p.deleting for p in pods)

    def _on_pod(self, pod: PodSeen) -> None:
        """The API says something new of a replica pod: its replica in its version's set
        (pods of versions that do not run here are left to the backend, which deletes
        their Deployments)."""
        state = self.models.get(pod.model)
        vset = state.versions.get(pod.version) if state is not None else None
        if vset is None:
            return
        replica = next(
            (r for r in vset.replicas if isinstance(r, PodReplica) and r.id == pod.name), None
        )
        if replica is None:
            if pod.deleted:
                return
            spec = _replica_spec(self.settings, vset, pod.name, None)
            port = self.settings.kubernetes.replica_port
            replica = PodReplica(spec, port, self._on_replica_change)
            replica.stopping = vset.retiring
            vset.replicas.append(replica)
        replica.update(pod)
        if pod.deleted and replica in vset.replicas:
            vset.replicas.remove(replica)
            self.publish()

    async def _scale_down(self, vset: VersionSet, replica: Supervisor) -> None:
        logger.info("scaling down %s: stopping %s", vset.record.version, replica.id)
        await replica.stop()
        if replica in vset.replicas:
            vset.replicas.remove(replica)
        self.publish()

    def _start_replica(self, vset: VersionSet) -> bool:
        """Start one more replica of ``vset``; False when no GPU of its deployment's type
        has room for it, or in the rejoin window (nothing started)."""
        if self._rejoining():
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
            _replica_spec(self.settings, vset, rid, gpus),
            self.backend,
            self._on_replica_change,
            load_timeout_s=self.settings.load_timeout_s,
            backoff_max_s=self.settings.restart_backoff_max_s,
            clock=self.clock,
        )
        vset.replicas.append(replica)
        replica.start()
        return True

    def _gpu_replicas(self) -> dict[int, list[Replica]]:
        """The replicas on each GPU now (stopping ones too: they hold memory until gone)."""
        placed: dict[int, list[Replica]] = {}
        for model in self.models.values():
            for vset in model.versions.values():
                if not vset.gpus:
                    continue
                need = _gpu_need(vset)
                for i, replica in enumerate(vset.replicas):
                    for device in replica.spec.gpus or []:
                        placed.setdefault(device, []).append(need.replica(i))
        return placed

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

    def _short_of_gpus(self, vset: VersionSet, why: str) -> None:
        """Recorded once while the reason stays the same, as a capacity scaling event."""
        if vset.gpu_short == why:
            return
        vset.gpu_short = why
        live = len(vset.live())
        logger.warning("%s: not starting a replica on a GPU: %s", vset.name, why)
        decision = Decision(self.clock.monotonic(), live, live, "capacity", why, {})
        model, version = vset.record.model_name, vset.record.version
        self.scaling.decisions[(model, version, "capacity")] += 1
        self._spawn(self._record_scaling(model, version, decision))

    def _on_replica_change(self, replica: Supervisor | ReportedReplica) -> None:
        """One table for the change and what it decides: a replica ready and the version
        it makes the serving one arrive together (a table listing a ready replica with
        no serving version would fail the unpinned requests held for it)."""
        if replica.state is ReplicaState.READY:
            self.scaling.ready(replica.spec.model, replica.spec.version, self.clock.monotonic())
            if self._switch_when_ready(self.models[replica.spec.model]):
                return
        self.publish()

    # -- which version serves -------------------------------------------------------------

    def _pick_serving(self, model: ModelState) -> bool:
        """Deployments: the serving version is the ready one with the largest share (the
        older on a tie: the established one is the stable one, and what failed requests
        fall back to), never a canary in progress while another version is ready; a
        version at 0 % still serves while nothing else is ready. True: it changed (and
        a table was published)."""
        ready = [
            v
            for v, s in model.versions.items()
            if not s.retiring and s.ready_count() > 0 and (v in model.traffic)
        ]
        order = list(model.traffic)  # newest first: the older version wins a tie
        best = max(
            ready,
            key=lambda v: (v not in model.canaries, model.traffic[v], order.index(v)),
            default=None,
        )
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

    # -- retiring -------------------------------------------------------------------------

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
        if self.fleet is not None:
            self.fleet.remove(model.name, version)  # Kubernetes drains and deletes its pods
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

    # -- publishing -----------------------------------------------------------------------

    async def _write_statuses(self) -> None:
        """Record each deployed version's state (deploying/active/failed) when it changed."""
        for change in _status_changes(self.models):
            await asyncio.to_thread(self.registry.rollouts.set_status, *change)

    def publish(self) -> None:
        if self._rejoining():
            return  # gateways keep the last controller's table meanwhile
        self.on_change(routing_table(next(self._generation), self.models, self.epoch))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        self._stopping = True
        for task in (self._task, self._autoscale_task, self._joined_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        replicas = [r for m in self.models.values() for v in m.versions.values() for r in v.own()]
        # Joined replicas keep serving: their gateways do not need this controller, and
        # they join the next one (a restart, the other controller taking over); so do
        # replica pods (the next controller finds them through the API).
        await asyncio.gather(*(r.stop() for r in replicas))
        if self.fleet is not None:
            await self.fleet.close()

    # -- replicas that join from other hosts ------------------------------------------------

    async def join(self, request: Join, writer: asyncio.StreamWriter) -> JoinedReplica | str:
        """A replica on another host asks to serve ``model:version``: its place in the
        version's set, or why not."""
        await self.started.wait()  # the registry read once: what is deployed is known
        state = self.models.get(request.model)
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
            _replica_spec(self.settings, vset, rid, None), address=request.address
        )
        replica = JoinedReplica(spec, host, writer, self._on_replica_change)
        vset.replicas.append(replica)
        self._spawn(self._forget_when_gone(vset, replica))
        logger.info("%s joined from %s at %s", rid, host, request.address)
        self.publish()
        return replica

    async def _forget_when_gone(self, vset: VersionSet, replica: JoinedReplica) -> None:
        await replica.gone.wait()
        if replica in vset.replicas:
            vset.replicas.remove(replica)
        self.publish()
        if not self._stopping:
            self._spawn(self.reconcile())  # replicas started here may fill the gap

    async def _watch_joined_forever(self) -> None:
        """Joined replicas whose beats stopped (a host that died or was cut off) leave
        routing within ``cluster.replica_timeout_s``."""
        timeout = self.settings.cluster.replica_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            now = time.monotonic()
            for model in list(self.models.values()):
                for vset in list(model.versions.values()):
                    for replica in vset.joined():
                        silent = now - replica.last_beat
                        if silent > timeout:
                            replica.lost(f"no beat for {silent:.1f}s")


async def _run_step(
    rollouts: RolloutProgress,
    analyst: CanaryAnalyst,
    model: ModelState,
    row: DeploymentRecord,
    step: Step,
) -> bool:
    """Run a rollout step; whether it changed the registry."""
    if step is Step.SWITCH:
        change = await asyncio.to_thread(rollouts.switch_blue_green, model.name, row.version)
        if change is not None:
            logger.info(
                "%s: all replicas of %s ready; switched all traffic to it", model.name, row.version
            )
        return change is not None
    if step is Step.FINISH:
        removed = await asyncio.to_thread(rollouts.finish_rollout, model.name, row.version)
        if removed:
            logger.info("%s: keep window over; removing %s", model.name, ", ".join(removed))
        return True
    assert row.canary is not None
    return await analyst.analyse(model, row.version, row.canary)


def _deployed(
    model: ModelState,
    row: DeploymentRecord,
    record: VersionRecord,
    default_replicas: int,
    now: float,
    running: int = 0,
    gpus_here: bool = True,
) -> VersionSet:
    """The running set of a deployed version, created or brought up to date; an
    autoscaled one runs what its autoscaler wants (starting from the fixed count)."""
    desired = row.replicas or int((record.batching or {}).get("replicas") or default_replicas)
    vset = model.versions.get(row.version)
    if vset is None:
        vset = VersionSet(record, desired, batching=row.batching, status=row.status)
        model.versions[row.version] = vset
        logger.info("deploying %s with %d replica(s)", vset.name, desired)
    if row.autoscaling is None:
        vset.autoscaler = None
    elif vset.autoscaler is None:
        # A controller taking over an autoscaled version goes on from what runs.
        vset.autoscaler = Autoscaler(row.autoscaling, len(vset.live()) or running or desired, now)
    else:
        vset.autoscaler.retune(row.autoscaling)
    if vset.autoscaler is not None:
        desired = vset.autoscaler.desired
    vset.desired, vset.fallback = desired, row.fallback
    vset.status = row.status  # what the registry says now: _status_changes compares
    if row.gpu_type != vset.gpu_type:
        vset.gpu_type = row.gpu_type
        # On Kubernetes the scheduler places pods on GPU nodes: no device here is chosen.
        vset.gpus = _gpus(vset) if row.gpu_type is not None and gpus_here else None
    return vset


def _status_changes(models: dict[str, ModelState]) -> list[tuple[str, str, DeploymentStatus]]:
    """The deployed versions whose state differs from what their deployment row says
    (read this pass; now recorded as written)."""
    changes = []
    for model in models.values():
        if not model.traffic:
            continue
        for version, vset in model.versions.items():
            state = vset.state()
            deployed = version in model.traffic or version in model.mirrors
            if deployed and not vset.retiring and state != vset.status:
                vset.status = state
                changes.append((model.name, version, state))
    return changes


def _placed_within(gpus: list[int] | None, allowed: list[int] | None) -> bool:
    """Whether a replica started on ``gpus`` runs where its deployment now allows."""
    if allowed is None or not allowed:
        return gpus == allowed
    return bool(gpus) and set(gpus or ()) <= set(allowed)


def _gpu_need(vset: VersionSet) -> gpu_place.GpuNeed:
    record = vset.record
    return gpu_place.need_of(record.model_name, record.metadata, record.size_bytes)


def _replica_spec(
    settings: Settings, vset: VersionSet, replica_id: str, gpus: list[int] | None
) -> ReplicaSpec:
    """What a replica of ``vset`` is told to serve: the server's batching settings under
    the version's, under the deployment's; the backend picks its address."""
    batching = settings.batching.model_dump()
    for overrides in (vset.record.batching, vset.batching):
        batching.update({k: v for k, v in (overrides or {}).items() if k in batching})
    return ReplicaSpec(
        replica_id=replica_id,
        model=vset.record.model_name,
        version=vset.record.version,
        framework=vset.record.framework,
        artifact_dir=str(vset.record.artifact_path),
        artifact_uri=vset.record.artifact_uri,
        sha256=vset.record.sha256,
        address="",
        batching=BatchingConfig.model_validate(batching),
        signature=vset.record.signature.to_dict(),
        metadata=vset.record.metadata,
        threads=settings.replica_threads,
        log_level=settings.log_level,
        log_json=settings.log_json,
        llm=settings.llm,
        adapters=adapters(vset.record),
        gpus=gpus,
    )


def _gpus(vset: VersionSet) -> list[int]:
    """The devices of the deployment's GPU type; none (CPU) for a deployment recorded
    before this machine lost them (new ones are refused at deploy time)."""
    assert vset.gpu_type is not None
    try:
        return devices.place(vset.gpu_type)
    except InvalidInput as exc:
        logger.error("%s: %s", vset.name, exc.message)
        return []
