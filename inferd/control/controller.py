"""The controller: makes the running replicas match the registry.

Desired state (for now): every registered model that is *loaded* (the registry's
desired state, see the model repository API) serves its most recently registered
version with ``replicas`` processes; an unloaded model runs none, and stays in the
routing table with no serving version. Reconciliation is level-triggered: each pass
compares desired with actual and acts, so a missed event is repaired by the next pass.
Passes run one at a time: periodically, and when a gateway asks (after a load/unload).

Version updates are zero-downtime: the new version's replicas start beside the old
ones; traffic switches only when all of them are ready (loaded and warmed up); then the
old replicas drain and stop. A replica that dies is restarted with exponential backoff;
its death is published at once so gateways stop routing to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferd.config import Settings
from inferd.control.backend import LocalBackend
from inferd.registry import ModelRecord, Registry, VersionRecord
from inferd.routing.table import ModelRoute, ReplicaRoute, RoutingTable, VersionRoute
from inferd.serving.client import ReplicaClient
from inferd.serving.spec import ReplicaSpec

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    id: str
    spec: ReplicaSpec
    state: str = "starting"
    pid: int = 0
    restarts: int = 0
    message: str = ""
    stopping: bool = False
    process: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = None
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    """Cuts short a restart backoff, so a crash-looping replica stops at once."""

    def route(self) -> ReplicaRoute:
        return ReplicaRoute(
            self.id, self.spec.address, self.state, self.pid, self.restarts, self.message
        )


@dataclass
class VersionSet:
    record: VersionRecord
    desired: int
    replicas: list[Replica] = field(default_factory=list)
    retiring: bool = False
    """Its replicas are being stopped; the set goes away once they are."""

    def all_ready(self) -> bool:
        ready = sum(r.state == "ready" for r in self.replicas)
        return ready >= self.desired


@dataclass
class ModelState:
    name: str
    serving: str | None = None
    versions: dict[str, VersionSet] = field(default_factory=dict)
    loaded: bool = True
    """Desired state, as of the last pass."""


class Controller:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        run_dir: Path,
        on_change: Callable[[RoutingTable], None],
        backend: LocalBackend | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.run_dir = run_dir
        self.on_change = on_change
        self.backend = backend or LocalBackend(settings.shutdown_grace_s)
        self.models: dict[str, ModelState] = {}
        self._generation = itertools.count(1)
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._pass = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        await self.reconcile()
        self._task = asyncio.get_running_loop().create_task(self._reconcile_forever())

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reconcile_interval_s)
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
            records = await asyncio.to_thread(self.registry.list_models)
            for record in records:
                if record.versions:
                    self._reconcile_model(record)
            self.publish()

    def _reconcile_model(self, record: ModelRecord) -> None:
        model = self.models.setdefault(record.name, ModelState(record.name))
        model.loaded = record.loaded
        if not record.loaded:
            self._unload(model)
            return
        target = record.versions[-1]
        vset = model.versions.get(target.version)
        if vset is not None and vset.retiring:
            return  # an unload is still stopping it; _retire asks for a new pass
        if vset is None:
            desired = int((target.batching or {}).get("replicas") or self.settings.replicas)
            vset = model.versions[target.version] = VersionSet(target, desired)
            logger.info("deploying %s:%s with %d replica(s)", record.name, target.version, desired)
        live = [r for r in vset.replicas if not r.stopping]
        for _ in range(vset.desired - len(live)):
            self._start_replica(vset)
        self._switch_when_ready(model)

    def _unload(self, model: ModelState) -> None:
        """Stop serving at once, then drain and stop every replica of the model."""
        if model.serving is not None:
            logger.info("%s unloaded; stopping its replicas", model.name)
            model.serving = None
            self.publish()
        for version, vset in model.versions.items():
            if not vset.retiring:
                self._retire_soon(model, version)

    def _switch_when_ready(self, model: ModelState) -> None:
        """Send traffic to the newest version once all its replicas are ready."""
        if not model.loaded or not model.versions:
            return
        newest = max(model.versions.values(), key=lambda v: v.record.created_at)
        if newest.retiring or model.serving == newest.record.version or not newest.all_ready():
            return
        previous, model.serving = model.serving, newest.record.version
        logger.info("%s now serves version %s", model.name, model.serving)
        self.publish()
        if previous is not None:
            self._retire_soon(model, previous)

    def _retire_soon(self, model: ModelState, version: str) -> None:
        model.versions[version].retiring = True  # at once: the next pass must not retire twice
        task = asyncio.get_running_loop().create_task(self._retire(model, version))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _start_replica(self, vset: VersionSet) -> None:
        n = next(self._ids)
        rid = f"{vset.record.model_name}-{vset.record.version}-{n}"
        batching = self.settings.batching.model_dump()
        batching.update({k: v for k, v in (vset.record.batching or {}).items() if k in batching})
        spec = ReplicaSpec(
            replica_id=rid,
            model=vset.record.model_name,
            version=vset.record.version,
            framework=vset.record.framework,
            artifact_dir=str(vset.record.artifact_path),
            address=f"unix:{self.run_dir / f'r{n}.sock'}",
            batching=batching,
            signature=vset.record.signature.to_dict(),
            metadata=vset.record.metadata,
            threads=self.settings.replica_threads,
            log_level=self.settings.log_level,
            log_json=self.settings.log_json,
            llm={**self.settings.llm.model_dump(), **_adapters(vset.record)},
        )
        replica = Replica(rid, spec)
        vset.replicas.append(replica)
        replica.task = asyncio.get_running_loop().create_task(self._supervise(replica))

    async def _supervise(self, replica: Replica) -> None:
        backoff = 0.5
        while not replica.stopping:
            replica.state, replica.message = "loading", ""
            replica.process = process = await self.backend.start(replica.spec)
            replica.pid = process.pid
            self.publish()
            if await self._wait_ready(replica, process):
                replica.state = "ready"
                backoff = 0.5
                self.publish()
                self._switch_when_ready(self.models[replica.spec.model])
            code = await process.wait()
            if replica.stopping:
                break
            replica.state = "failed"
            replica.restarts += 1
            replica.message = replica.message or f"exited with code {code}"
            logger.error("replica %s %s; restarting in %.1fs", replica.id, replica.message, backoff)
            self.publish()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(replica.stop_requested.wait(), backoff)
            backoff = min(backoff * 2, self.settings.restart_backoff_max_s)
        replica.state = "stopped"
        self.publish()

    async def _wait_ready(self, replica: Replica, process: asyncio.subprocess.Process) -> bool:
        """Poll the replica's status until ready; kill it past the load timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.load_timeout_s
        client = ReplicaClient(replica.spec.address, replica.id)
        try:
            while process.returncode is None and loop.time() < deadline:
                try:
                    if client.closed:
                        await client.connect()
                    status = await client.status()
                except Exception:  # not listening yet, or just died
                    await asyncio.sleep(0.05)
                    continue
                if status.state == "ready":
                    return True
                if status.state == "failed":
                    replica.message = status.message
                await asyncio.sleep(0.05)
            if process.returncode is None:
                replica.message = f"not ready after {self.settings.load_timeout_s:.0f}s"
                process.kill()
            return False
        finally:
            client.close()

    async def _retire(self, model: ModelState, version: str) -> None:
        vset = model.versions.get(version)
        if vset is None:
            return
        # Gateways got the new table before this; give in-flight requests time to land.
        await asyncio.sleep(0.2)
        await asyncio.gather(*(self._stop_replica(r) for r in vset.replicas))
        model.versions.pop(version, None)
        logger.info("%s:%s retired", model.name, version)
        self.publish()
        if model.loaded and model.serving is None and not self._stopping:
            # Loaded again while this version was stopping: start it afresh now.
            await self.reconcile()

    async def _stop_replica(self, replica: Replica) -> None:
        replica.stopping = True
        replica.stop_requested.set()
        replica.state = "draining"
        self.publish()
        if replica.process is not None:
            await self.backend.stop(replica.process)
        if replica.task is not None:
            await asyncio.gather(replica.task, return_exceptions=True)

    def publish(self) -> None:
        models = {}
        for name, state in self.models.items():
            versions = {
                v: VersionRoute(
                    v,
                    s.record.framework,
                    s.record.signature.to_dict(),
                    [r.route() for r in s.replicas],
                    s.desired,
                    sorted(_adapters(s.record).get("adapters", {})),
                )
                for v, s in state.versions.items()
            }
            models[name] = ModelRoute(name, state.serving, versions, state.loaded)
        self.on_change(RoutingTable(next(self._generation), models))

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        replicas = [
            r for m in self.models.values() for v in m.versions.values() for r in v.replicas
        ]
        await asyncio.gather(*(self._stop_replica(r) for r in replicas))


def _adapters(record: VersionRecord) -> dict[str, dict[str, str]]:
    """LoRA adapters registered with a base model version (name -> folder inside the
    version's artifact folder) load with its replicas."""
    adapters = record.metadata.get("adapters")
    return {"adapters": adapters} if isinstance(adapters, dict) else {}
