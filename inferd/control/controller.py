"""The controller: makes the running replicas match the registry.

Desired state (for now): every registered model that is *loaded* (the registry's
desired state, see the model repository API) serves its most recently registered
version with ``replicas`` processes; an unloaded model runs none, and stays in the
routing table with no serving version. Reconciliation is level-triggered: each pass
compares desired with actual and acts, so a missed event is repaired by the next pass.
Passes run one at a time: periodically, and when a gateway asks (after a load/unload).

A model with deployments (``registry.deployments``) runs exactly its deployed versions,
each with its replica count, and publishes their traffic split; gateways send a version
its share only while it has ready replicas, so a new version takes traffic once it is
loaded and warm, and a removed (draining) one stops taking it before its replicas stop.
Its serving (default) version is the ready one with the largest share.

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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from inferd import devices
from inferd.config import Settings
from inferd.control import canary
from inferd.control.backend import LocalBackend
from inferd.errors import InvalidInput
from inferd.registry import ModelRecord, Registry, VersionRecord
from inferd.registry.deployments import DeploymentRecord
from inferd.registry.tables import utcnow
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
    batching: dict[str, Any] | None = None
    """The deployment's batching overrides (over the version's own)."""
    status: str = ""
    """deploying | active | failed, as last written to the registry (deployments only)."""
    fallback: bool = True
    """Failed requests (not pinned here) are retried on the serving version."""
    gpu_type: str | None = None
    """The deployment's ``resources.gpu``: its replicas see only GPUs of that type."""
    gpus: list[int] | None = None
    """The devices of ``gpu_type`` (None: no GPU asked for); replicas started for another
    placement are replaced, each once a new one is ready."""

    def ready_count(self) -> int:
        return sum(r.state == "ready" for r in self.replicas)

    def state(self) -> str:
        live = [r for r in self.replicas if not r.stopping]
        ready = sum(r.state == "ready" for r in live)
        if ready >= self.desired:
            return "active"
        if ready == 0 and any(r.state == "failed" for r in live):
            return "failed"
        return "deploying"

    def all_ready(self) -> bool:
        return self.ready_count() >= self.desired


@dataclass
class ModelState:
    name: str
    serving: str | None = None
    versions: dict[str, VersionSet] = field(default_factory=dict)
    loaded: bool = True
    """Desired state, as of the last pass."""
    traffic: dict[str, int] = field(default_factory=dict)
    """Deployed versions -> percent, newest first; empty in automatic mode."""
    mirrors: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Shadow deployments: version -> (percent of requests mirrored, output tolerance)."""
    canaries: set[str] = field(default_factory=set)
    """Canaries in progress: never the serving version while another one is ready."""


@dataclass
class CanaryWatch:
    """A canary step's analysis window: when it started and what every replica had
    counted then (see :mod:`inferd.control.canary`)."""

    step: int
    started: float
    canary_before: dict[canary.Key, canary.ReplicaSample]
    stable_before: dict[canary.Key, canary.ReplicaSample]
    restarts: int
    waiting: str = ""


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
        self._steps: set[tuple[str, str, str]] = set()
        """Rollout steps running now (model, version, step): each runs once at a time."""
        self._watches: dict[tuple[str, str], CanaryWatch] = {}
        """Canaries being analysed: (model, version) -> the current window."""
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
            records, deployments = await asyncio.to_thread(self._read_registry)
            for record in records:
                if record.versions:
                    self._reconcile_model(record, deployments.get(record.name, []))
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
        if not record.loaded:
            model.traffic, model.mirrors, model.canaries = {}, {}, set()
            self._unload(model)
            return
        if deployments:
            self._reconcile_deployments(model, record, deployments)
            return
        model.traffic, model.mirrors, model.canaries = {}, {}, set()
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

    def _reconcile_deployments(
        self, model: ModelState, record: ModelRecord, rows: list[DeploymentRecord]
    ) -> None:
        """Run exactly the deployed versions with their replica counts; drain the rest."""
        registered = {v.version: v for v in record.versions}
        active = [r for r in rows if r.status not in ("draining", "rolled_back")]
        model.traffic = {r.version: r.traffic_pct for r in active if r.strategy != "shadow"}
        model.mirrors = {
            r.version: (int(r.rollout["mirror_pct"]), float(r.rollout["tolerance"]))
            for r in active
            if r.strategy == "shadow" and r.rollout
        }
        wanted = {r.version for r in active}
        model.canaries = {
            r.version
            for r in active
            if r.strategy == "canary" and (r.rollout or {}).get("state") == "progressing"
        }
        for version, running in model.versions.items():
            if version not in wanted and not running.retiring:
                self._retire_soon(model, version, remove=True)
        for row in rows:
            if row.status == "draining" and row.version not in model.versions:
                self._spawn(self._remove_deployment(model, row.version))  # nothing runs
            if row.status in ("draining", "rolled_back") or row.version not in registered:
                self._watches.pop((model.name, row.version), None)
                continue
            vset = model.versions.get(row.version)
            if vset is not None and vset.retiring:
                continue  # still stopping from an unload or removal; a later pass restarts it
            spec = registered[row.version]
            desired = row.replicas or int(
                (spec.batching or {}).get("replicas") or self.settings.replicas
            )
            if vset is None:
                vset = VersionSet(spec, desired, batching=row.batching, status=row.status)
                model.versions[row.version] = vset
                logger.info("deploying %s:%s with %d replica(s)", model.name, row.version, desired)
            vset.desired, vset.fallback = desired, row.fallback
            if row.gpu_type != vset.gpu_type:
                vset.gpu_type = row.gpu_type
                vset.gpus = None if row.gpu_type is None else _gpus(vset)
            self._scale(vset)
            if row.strategy == "blue-green":
                self._blue_green(model, row, vset)
            elif row.strategy == "canary":
                self._canary(model, row)
        self._pick_serving(model)

    def _blue_green(self, model: ModelState, row: DeploymentRecord, vset: VersionSet) -> None:
        """Switch all traffic once every replica is ready; after the keep window, remove
        the versions it replaced (unless traffic went back to them)."""
        rollout = row.rollout or {}
        if rollout.get("done"):
            return
        switched = rollout.get("switched_at")
        if switched is None:
            if vset.state() == "active":
                self._once(model.name, row.version, "switch", self._switch_blue_green)
            return
        self._finish_after_keep(model, row, switched)

    def _finish_after_keep(self, model: ModelState, row: DeploymentRecord, since: str) -> None:
        """Once the keep window after a switch (or promotion) is over, remove what it
        replaced."""
        kept = (utcnow() - datetime.fromisoformat(since)).total_seconds()
        if kept >= float((row.rollout or {}).get("keep_old_s", 0)):
            self._once(model.name, row.version, "finish", self._finish_rollout)

    def _canary(self, model: ModelState, row: DeploymentRecord) -> None:
        """Analyse a progressing canary (in the background, one analysis at a time);
        after a promotion, remove what it replaced once the keep window is over."""
        rollout = row.rollout or {}
        state = rollout.get("state")
        if state == "promoted" and not rollout.get("done"):
            self._finish_after_keep(model, row, rollout["promoted_at"])
        if state != "progressing":
            self._watches.pop((model.name, row.version), None)
            return

        async def analyse(name: str, version: str) -> None:
            await self._analyse_canary(model, version, rollout)

        self._once(model.name, row.version, "canary", analyse)

    async def _analyse_canary(
        self, model: ModelState, version: str, rollout: dict[str, Any]
    ) -> None:
        vset = model.versions.get(version)
        if vset is None or vset.retiring:
            return
        step = int(rollout["step"])
        key = (model.name, version)
        loop = asyncio.get_running_loop()
        if vset.state() == "failed":
            why = next((r.message for r in vset.replicas if r.state == "failed" and r.message), "")
            verdict = canary.Verdict("fail", f"canary replicas cannot serve: {why or 'failed'}")
            await self._conclude_canary(model, version, rollout, verdict, None)
            return
        stable = [v for v, pct in model.traffic.items() if v != version and pct > 0]
        watch = self._watches.get(key)
        if watch is None or watch.step != step:
            if not vset.all_ready():
                return  # the window starts when every canary replica serves
            before_canary, before_stable = await asyncio.gather(
                canary.sample(self._addresses(model, [version])),
                canary.sample(self._addresses(model, stable)),
            )
            restarts = sum(r.restarts for r in vset.replicas)
            self._watches[key] = CanaryWatch(
                step, loop.time(), before_canary, before_stable, restarts
            )
            logger.info(
                "%s: canary %s at %d %%; analysis window of %.0fs starts",
                model.name, version, rollout["steps"][step], rollout["step_s"],
            )  # fmt: skip
            return
        now_canary, now_stable = await asyncio.gather(
            canary.sample(self._addresses(model, [version])),
            canary.sample(self._addresses(model, stable)),
        )
        mine = canary.window(watch.canary_before, now_canary)
        theirs = canary.window(watch.stable_before, now_stable)
        mine.crashes = max(0, sum(r.restarts for r in vset.replicas) - watch.restarts)
        elapsed = loop.time() - watch.started
        verdict = canary.judge(mine, theirs, rollout, final=elapsed >= rollout["step_s"])
        if verdict.outcome == "wait":
            if elapsed >= rollout["step_s"] and verdict.reason != watch.waiting:
                logger.info("%s: canary %s %s", model.name, version, verdict.reason)
            watch.waiting = verdict.reason
            return
        q = float(rollout["quantile"])
        analysis = {
            "step": step,
            "traffic_pct": rollout["steps"][step],
            "window_s": round(elapsed, 1),
            "canary": mine.to_dict(q),
            "stable": theirs.to_dict(q),
            "stable_versions": stable,
            "verdict": verdict.outcome,
            "reason": verdict.reason,
        }
        if verdict.outcome == "pass" and rollout.get("webhook"):
            payload = {"model": model.name, "version": version, **analysis}
            hook = await canary.call_webhook(rollout["webhook"], payload)
            if hook.outcome == "fail":
                verdict = hook
                analysis.update(verdict="fail", reason=hook.reason)
        await self._conclude_canary(model, version, rollout, verdict, analysis)

    async def _conclude_canary(
        self,
        model: ModelState,
        version: str,
        rollout: dict[str, Any],
        verdict: canary.Verdict,
        analysis: dict[str, Any] | None,
    ) -> None:
        """Move the canary to its next step, or roll it back (halt it, without
        auto_rollback), recording why."""
        step, steps = int(rollout["step"]), rollout["steps"]
        self._watches.pop((model.name, version), None)
        registry = self.registry.deployments
        if verdict.outcome == "pass":
            detail = f"step {step + 1} of {len(steps) - 1} passed: {verdict.reason}"
            change = await asyncio.to_thread(
                registry.advance_canary, model.name, version, step, analysis or {}, detail
            )
            if change is not None:
                logger.info(
                    "%s: canary %s passed %d %% (%s); now %d %%",
                    model.name, version, steps[step], verdict.reason, steps[step + 1],
                )  # fmt: skip
        else:
            rollback = bool(rollout.get("auto_rollback", True))
            await asyncio.to_thread(
                registry.end_canary, model.name, version, step, verdict.reason, analysis, rollback
            )
            logger.warning(
                "%s: canary %s failed at %d %%: %s; %s",
                model.name, version, steps[step], verdict.reason,
                "rolled back" if rollback else "halted (auto_rollback is off)",
            )  # fmt: skip
        self._spawn(self.reconcile())

    def _addresses(self, model: ModelState, versions: list[str]) -> list[tuple[str, int, str]]:
        """(id, pid, address) of the serving replicas of ``versions``."""
        return [
            (r.id, r.pid, r.spec.address)
            for v in versions
            if (vset := model.versions.get(v)) is not None
            for r in vset.replicas
            if r.state == "ready" and not r.stopping
        ]

    def _once(
        self,
        model: str,
        version: str,
        step: str,
        action: Callable[[str, str], Coroutine[Any, Any, None]],
    ) -> None:
        """Run a rollout step in the background unless the same one is still running."""
        key = (model, version, step)
        if key in self._steps:
            return
        self._steps.add(key)

        async def run() -> None:
            try:
                await action(model, version)
            except Exception:
                logger.exception("%s of %s:%s failed; the next pass retries", step, model, version)
            finally:
                self._steps.discard(key)

        self._spawn(run())

    async def _switch_blue_green(self, model: str, version: str) -> None:
        change = await asyncio.to_thread(
            self.registry.deployments.switch_blue_green, model, version
        )
        if change is not None:
            logger.info("%s: all replicas of %s ready; switched all traffic to it", model, version)
            self._spawn(self.reconcile())

    async def _finish_rollout(self, model: str, version: str) -> None:
        removed = await asyncio.to_thread(self.registry.deployments.finish_rollout, model, version)
        if removed:
            logger.info("%s: keep window over; removing %s", model, ", ".join(removed))
        self._spawn(self.reconcile())

    def _scale(self, vset: VersionSet) -> None:
        """Start or stop replicas until ``desired`` run; extra ones drain (not-ready and
        newest first) and only then leave the set. Replicas placed on other GPUs than
        the deployment's (its ``resources.gpu`` changed) are replaced: new ones start,
        and the old ones drain once the new ones are all ready."""
        live = [r for r in vset.replicas if not r.stopping and r.spec.gpus == vset.gpus]
        misplaced = [r for r in vset.replicas if not r.stopping and r.spec.gpus != vset.gpus]
        for _ in range(vset.desired - len(live)):
            self._start_replica(vset)
        if misplaced and sum(r.state == "ready" for r in live) >= vset.desired:
            for replica in misplaced:
                self._spawn(self._scale_down(vset, replica))
        extra = len(live) - vset.desired
        if extra > 0:
            victims = sorted(live, key=lambda r: (r.state == "ready", -live.index(r)))
            for replica in victims[:extra]:
                self._spawn(self._scale_down(vset, replica))

    async def _scale_down(self, vset: VersionSet, replica: Replica) -> None:
        logger.info("scaling down %s: stopping %s", vset.record.version, replica.id)
        await self._stop_replica(replica)
        if replica in vset.replicas:
            vset.replicas.remove(replica)
        self.publish()

    def _pick_serving(self, model: ModelState) -> None:
        """Deployments: the serving version is the ready one with the largest share (the
        older on a tie: the established one is the stable one, and what failed requests
        fall back to), never a canary in progress while another version is ready; a
        version at 0 % still serves while nothing else is ready."""
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
        if best != model.serving:
            logger.info("%s now serves version %s by default", model.name, best)
            model.serving = best
            self.publish()

    async def _remove_deployment(self, model: ModelState, version: str) -> None:
        await asyncio.to_thread(self.registry.deployments.remove, model.name, version)
        logger.info("%s:%s undeployed", model.name, version)

    async def _write_statuses(self) -> None:
        """Record each deployed version's state (deploying/active/failed) when it changed."""
        changes = []
        for model in self.models.values():
            if not model.traffic:
                continue
            for version, vset in model.versions.items():
                state = vset.state()
                deployed = version in model.traffic or version in model.mirrors
            if deployed and not vset.retiring and state != vset.status:
                vset.status = state
                changes.append((model.name, version, state))
        for change in changes:
            await asyncio.to_thread(self.registry.deployments.set_status, *change)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        if model.traffic:
            self._pick_serving(model)
            return
        newest = max(model.versions.values(), key=lambda v: v.record.created_at)
        if newest.retiring or model.serving == newest.record.version or not newest.all_ready():
            return
        model.serving = newest.record.version
        logger.info("%s now serves version %s", model.name, model.serving)
        self.publish()
        # The one it replaced, and any that started but was overtaken before it served
        # (two versions pushed in quick succession).
        for version, vset in list(model.versions.items()):
            if version != model.serving and not vset.retiring:
                self._retire_soon(model, version)

    def _retire_soon(self, model: ModelState, version: str, remove: bool = False) -> None:
        """Drain and stop a version's replicas in the background; ``remove``: then delete
        its (draining) deployment."""
        model.versions[version].retiring = True  # at once: the next pass must not retire twice
        self._spawn(self._retire(model, version, remove))

    def _start_replica(self, vset: VersionSet) -> None:
        n = next(self._ids)
        rid = f"{vset.record.model_name}-{vset.record.version}-{n}"
        batching = self.settings.batching.model_dump()
        batching.update({k: v for k, v in (vset.record.batching or {}).items() if k in batching})
        batching.update({k: v for k, v in (vset.batching or {}).items() if k in batching})
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
            gpus=vset.gpus,
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

    async def _retire(self, model: ModelState, version: str, remove: bool = False) -> None:
        vset = model.versions.get(version)
        if vset is None:
            return
        # Gateways got the new table before this; give in-flight requests time to land.
        await asyncio.sleep(0.2)
        await asyncio.gather(*(self._stop_replica(r) for r in vset.replicas))
        model.versions.pop(version, None)
        logger.info("%s:%s retired", model.name, version)
        self.publish()
        if remove:
            await self._remove_deployment(model, version)
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
                    version=v,
                    framework=s.record.framework,
                    signature=s.record.signature.to_dict(),
                    replicas=[r.route() for r in s.replicas],
                    desired_replicas=s.desired,
                    adapters=sorted(_adapters(s.record).get("adapters", {})),
                    fallback=s.fallback,
                    mirror_pct=state.mirrors.get(v, (0, 0.0))[0],
                    tolerance=state.mirrors.get(v, (0, 0.0))[1],
                    cache_ttl_s=_cache_ttl(s.record),
                    digest=s.record.sha256,
                    overflow_model=_overflow_model(s.record, name),
                    allow_non_finite=s.record.metadata.get("allow_non_finite") is True,
                )
                for v, s in state.versions.items()
            }
            models[name] = ModelRoute(name, state.serving, versions, state.loaded, state.traffic)
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


def _gpus(vset: VersionSet) -> list[int]:
    """The devices of the deployment's GPU type; none (CPU) for a deployment recorded
    before this machine lost them (new ones are refused at deploy time)."""
    assert vset.gpu_type is not None
    try:
        return devices.place(vset.gpu_type)
    except InvalidInput as exc:
        logger.error("%s:%s: %s", vset.record.model_name, vset.record.version, exc.message)
        return []


def _cache_ttl(record: VersionRecord) -> float | None:
    value = record.metadata.get("cache_ttl_s")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _overflow_model(record: VersionRecord, model: str) -> str | None:
    value = record.metadata.get("overflow_model")
    return value if isinstance(value, str) and value and value != model else None


def _adapters(record: VersionRecord) -> dict[str, dict[str, str]]:
    """LoRA adapters registered with a base model version (name -> folder inside the
    version's artifact folder) load with its replicas."""
    adapters = record.metadata.get("adapters")
    return {"adapters": adapters} if isinstance(adapters, dict) else {}
