"""The controller and its supervisors against an in-memory replica backend and a clock
the test moves: no processes, no sockets, no waiting.

The backend here is a second implementation of :mod:`inferd.control.backends`'s
interface, written without touching the controller: that is the check that a backend
whose replicas live elsewhere is a new module, not a controller change. A fourth
orchestrator (:mod:`inferd.control.orchestrators`), keeping its replicas as objects in
memory, is the same check one level up: a new kind of replica host is an entry in
``ORCHESTRATORS``. The registry is the real one, on a SQLite file.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.config import Settings
from inferd.control.backends import ReplicaBackend, ReplicaHandle
from inferd.control.canary import ReplicaSample
from inferd.control.controller import RETIRE_DELAY_S, Controller
from inferd.control.on_demand import SETTLE_S
from inferd.control.orchestrators import ORCHESTRATORS, Context, Orchestrator
from inferd.control.replica import Replica, route_of
from inferd.control.specs import replica_spec
from inferd.control.state import VersionSet
from inferd.registry import Registry
from inferd.shapes.control import ReplicaRoute, RoutingTable
from inferd.shapes.replica import ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec
from inferd.shapes.tensors import Signature, TensorSpec
from inferd.telemetry.metrics import Sketch
from tests.clocks import FakeClock, settle

SIGNATURE = Signature(
    inputs=(TensorSpec("x", "FP32", (-1,)),),
    outputs=(TensorSpec("prediction", "FP32", (-1,)),),
)


class FakeReplica:
    """A replica that is ready, fails or goes when the test says so."""

    def __init__(self, spec: ReplicaSpec, incarnation: int, clock: FakeClock) -> None:
        self.spec = spec
        self.incarnation = incarnation
        self.clock = clock
        self.address = f"fake:{spec.replica_id}#{incarnation}"
        self.pid = 0
        self._ready = asyncio.Event()
        self._exit: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def gone(self) -> bool:
        return self._exit.done()

    def make_ready(self) -> None:
        self._ready.set()

    def exit(self, reason: str) -> None:
        if not self._exit.done():
            self._exit.set_result(reason)

    async def wait_ready(self, timeout_s: float) -> str | None:
        gone = asyncio.ensure_future(asyncio.shield(self._exit))
        ready = asyncio.ensure_future(self.clock.wait(self._ready, timeout_s))
        await asyncio.wait((gone, ready), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        ready.cancel()
        if self._ready.is_set() and not self.gone:
            return None
        return "" if self.gone else f"not ready after {timeout_s:.0f}s"

    async def wait_gone(self) -> str:
        return await asyncio.shield(self._exit)


class FakeBackend:
    name = "fake"

    def __init__(self, clock: FakeClock, ready_at_once: bool = True) -> None:
        self.clock = clock
        self.ready_at_once = ready_at_once
        self.started: list[FakeReplica] = []
        self.stopped: list[tuple[str, bool]] = []
        self._incarnations = itertools.count(1)

    async def close(self) -> None:
        pass

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        replica = FakeReplica(spec, next(self._incarnations), self.clock)
        if self.ready_at_once:
            replica.make_ready()
        self.started.append(replica)
        return replica

    async def stop(self, handle: ReplicaHandle, *, drain: bool = True) -> None:
        assert isinstance(handle, FakeReplica)
        self.stopped.append((handle.address, drain))
        handle.exit("stopped")

    def running(self, version: str | None = None) -> list[FakeReplica]:
        return [
            r for r in self.started if not r.gone and (version is None or r.spec.version == version)
        ]


def test_a_replica_stopped_while_its_backend_starts_it_is_stopped_once_started() -> None:
    """Found by bench/replica_start.py: a server stopped while the fork server forked a
    replica waited for that replica to end by itself (it never did)."""
    from inferd.control.supervisor import Supervisor

    async def scenario() -> None:
        clock = FakeClock()
        backend = FakeBackend(clock)
        proceed = asyncio.Event()
        start = backend.start

        async def slow_start(spec: ReplicaSpec) -> ReplicaHandle:
            await proceed.wait()
            return await start(spec)

        backend.start = slow_start  # type: ignore[method-assign]
        spec = ReplicaSpec(replica_id="m-v1-1", model="m", version="v1", framework="python",
                           artifact_dir="/nowhere", address="fake:")  # fmt: skip
        supervisor = Supervisor(
            spec, backend, lambda _: None, load_timeout_s=5, backoff_max_s=5, clock=clock
        )
        supervisor.start()
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(supervisor.stop())
        await asyncio.sleep(0)
        proceed.set()
        await asyncio.wait_for(stopping, 5)
        (replica,) = backend.started
        assert replica.gone and backend.stopped == [(replica.address, False)]
        assert supervisor.state is ReplicaState.STOPPED

    asyncio.run(scenario())


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll (registry writes run in threads) until ``condition`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class World:
    def __init__(
        self,
        tmp_path: Path,
        ready_at_once: bool = True,
        replica_backend: str = "local",
        memory_budget_mb: int | None = None,
    ) -> None:
        self.registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", tmp_path / "artifacts")
        self.source = tmp_path / "model.py"
        self.source.write_text("class M:\n    pass\n")
        self.clock = FakeClock()
        self.backend = FakeBackend(self.clock, ready_at_once)
        self.tables: list[RoutingTable] = []
        settings = Settings(
            data_dir=tmp_path, load_timeout_s=10, restart_backoff_max_s=4, replicas=1
        )
        settings.models.memory_budget_mb = memory_budget_mb
        # A kind the tests register: the settings' own check knows the shipped ones only.
        settings.replica_backend = replica_backend
        self.controller = Controller(
            settings,
            self.registry,
            tmp_path,
            self.tables.append,
            backend=self.backend,
            clock=self.clock,
        )

    def push(self, model: str, *versions: str, deploy: bool = False, pinned: bool = False) -> None:
        for version in versions:
            self.registry.push(
                model, self.source, version, framework="python", signature=SIGNATURE,
                deploy=deploy, metadata={"pinned": True} if pinned else None,
            )  # fmt: skip

    async def reconcile(self) -> None:
        await self.controller.reconcile()
        await settle()

    def split(self, model: str) -> dict[str, int]:
        return {d.version: d.traffic_pct for d in self.registry.deployments.list_all(model)}

    def statuses(self, model: str) -> dict[str, str]:
        return {d.version: d.status for d in self.registry.deployments.list_all(model)}

    def serving(self, model: str) -> str | None:
        return self.tables[-1].models[model].default_version

    def states(self, model: str, version: str) -> list[str]:
        return [r.state for r in self.tables[-1].models[model].versions[version].replicas]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.registry.close()


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(coro())


def test_a_version_registered_after_the_first_runs_nothing_until_deployed(world: World) -> None:
    async def scenario() -> None:
        world.push("m", "v1")
        await world.reconcile()
        await settle()
        assert world.serving("m") == "v1"
        world.push("m", "v2")
        await world.reconcile()
        await settle()
        assert world.serving("m") == "v1" and world.backend.running("v2") == []
        assert world.registry.deployments.revision("m") > 0  # v1 pinned at 100 %
        world.registry.deployments.deploy("m", "v2", traffic_pct=10, actor="test")
        await world.reconcile()
        await settle()
        assert len(world.backend.running("v2")) == 1
        assert world.tables[-1].models["m"].traffic == {"v2": 10, "v1": 90}

    run(scenario)


def test_a_running_version_taken_into_a_deployment_reads_active(world: World) -> None:
    """Status follows what runs, whatever the controller last wrote: a version already
    serving when a deployment row names it (adopted, or deployed again after removal)
    reads active at the next pass."""

    def status(version: str) -> str:
        rows = world.registry.deployments.list_all("m")
        return next(str(r.status) for r in rows if r.version == version)

    async def scenario() -> None:
        world.push("m", "v1")
        await world.reconcile()
        await settle()
        world.push("m", "v2")  # registered, not deployed: v1 is adopted at 100 %
        await world.reconcile()
        await settle()
        assert status("v1") == "active"
        world.registry.deployments.deploy("m", "v2", actor="test")
        await world.reconcile()
        await settle()
        await world.reconcile()  # v2's replica became ready after the first
        assert status("v2") == "active" and status("v1") == "active"
        # v1's row goes and comes back while its replicas keep running
        world.registry.deployments.undeploy("m", "v1", actor="test")
        world.registry.rollouts.remove("m", "v1")
        world.registry.deployments.deploy("m", "v1", traffic_pct=50, actor="test")
        assert status("v1") == "deploying"
        await world.reconcile()
        await settle()
        assert status("v1") == "active"

    run(scenario)


def test_a_new_version_serves_once_ready_and_the_old_one_drains(world: World) -> None:
    async def scenario() -> None:
        world.backend.ready_at_once = False
        world.push("m", "v1")
        await world.reconcile()
        (v1,) = world.backend.running("v1")
        assert world.serving("m") is None and world.states("m", "v1") == ["loading"]
        v1.make_ready()
        await settle()
        assert world.serving("m") == "v1" and world.states("m", "v1") == ["ready"]

        world.push("m", "v2", deploy=True)  # as `inferd models push --deploy`
        await world.reconcile()
        (v2,) = world.backend.running("v2")
        assert world.serving("m") == "v1"  # v2 is not ready: v1 keeps serving
        v2.make_ready()
        await settle()
        assert world.serving("m") == "v2"
        assert world.backend.running("v1") == [v1]  # drains only after RETIRE_DELAY_S
        await world.clock.advance(RETIRE_DELAY_S)
        assert world.backend.running("v1") == [] and (v1.address, True) in world.backend.stopped
        assert "v1" not in world.tables[-1].models["m"].versions
        await world.controller.stop()

    run(scenario)


def _ready_without_serving(table: RoutingTable, model: str) -> bool:
    route = table.models.get(model)
    return (
        route is not None
        and route.default_version is None
        and any(r.state == "ready" for v in route.versions.values() for r in v.replicas)
    )


def test_a_replica_ready_and_the_serving_version_it_makes_come_in_one_table(
    world: World,
) -> None:
    """A table listing the first ready replica with no serving version yet would wake
    the unpinned requests held for it, and fail them (no version ready, none coming):
    the two arrive together, for a first version and for a deployment's."""

    async def scenario() -> None:
        world.backend.ready_at_once = False
        world.push("m", "v1")
        await world.reconcile()
        (v1,) = world.backend.running("v1")
        v1.make_ready()
        await settle()
        assert world.serving("m") == "v1"
        world.push("d", "v1")
        world.registry.deployments.deploy("d", "v1", traffic_pct=100, actor="test")
        await world.reconcile()
        (d1,) = world.backend.running("v1")[1:]
        d1.make_ready()
        await settle()
        assert world.serving("d") == "v1"
        assert not [t.generation for t in world.tables if _ready_without_serving(t, "m")]
        assert not [t.generation for t in world.tables if _ready_without_serving(t, "d")]
        await world.controller.stop()

    run(scenario)


def test_a_crashed_replica_restarts_with_doubling_backoff(world: World) -> None:
    async def scenario() -> None:
        world.push("m", "v1")
        await world.reconcile()
        (first,) = world.backend.running()
        first.exit("exited with code 137")
        await settle()
        (route,) = world.tables[-1].models["m"].versions["v1"].replicas
        assert (route.state, route.restarts, route.message) == (
            "failed",
            1,
            "exited with code 137",
        )
        await world.clock.advance(0.49)
        assert world.backend.running() == []
        await world.clock.advance(0.01)
        (second,) = world.backend.running()  # restarted after 0.5 s, as the same replica
        assert second.replica_id == first.replica_id and second.incarnation != first.incarnation
        assert world.states("m", "v1") == ["ready"]
        second.exit("exited with code 1")  # it had become ready: the backoff is back to 0.5
        await settle()
        await world.clock.advance(0.5)
        (third,) = world.backend.running()
        world.backend.ready_at_once = False
        third.exit("exited with code 1")
        await settle()
        await world.clock.advance(0.5)
        (fourth,) = world.backend.running()  # never ready: the next backoff doubles
        fourth.exit("exited with code 1")
        await settle()
        await world.clock.advance(0.5)
        assert world.backend.running() == []
        await world.clock.advance(0.5)
        assert len(world.backend.running()) == 1
        await world.controller.stop()

    run(scenario)


def test_a_replica_that_never_loads_is_stopped_and_retried(world: World) -> None:
    async def scenario() -> None:
        world.backend.ready_at_once = False
        world.push("m", "v1")
        await world.reconcile()
        (stuck,) = world.backend.running()
        await world.clock.advance(10)  # load_timeout_s
        assert stuck.gone and (stuck.address, False) in world.backend.stopped  # killed
        (route,) = world.tables[-1].models["m"].versions["v1"].replicas
        assert (route.state, route.message) == ("failed", "not ready after 10s")
        await world.clock.advance(0.5)
        assert len(world.backend.running()) == 1
        await world.controller.stop()
        assert world.backend.running() == []

    run(scenario)


def test_stop_ends_a_backoff_at_once(world: World) -> None:
    async def scenario() -> None:
        world.push("m", "v1")
        await world.reconcile()
        world.backend.running()[0].exit("exited with code 1")
        await settle()
        await asyncio.wait_for(world.controller.stop(), 1.0)  # no clock advance needed
        assert world.states("m", "v1") == ["stopped"]

    run(scenario)


def test_scaling_drains_not_ready_replicas_first(world: World) -> None:
    async def scenario() -> None:
        world.push("m", "v1")
        world.registry.deployments.deploy("m", "v1", replicas=3)
        await world.reconcile()
        assert len(world.backend.running("v1")) == 3 and world.states("m", "v1") == ["ready"] * 3
        world.registry.deployments.scale("m", "v1", 1)
        world.backend.running("v1")[0].exit("exited with code 1")  # the oldest, now failed
        await settle()
        await world.reconcile()
        await settle()
        survivors = world.backend.running("v1")
        assert len(survivors) == 1 and world.states("m", "v1") == ["ready"]
        assert survivors[0].replica_id.endswith("-2")  # the failed one went, then the newest
        await world.controller.stop()

    run(scenario)


def test_blue_green_switches_when_all_replicas_are_ready(world: World) -> None:
    async def scenario() -> None:
        world.push("m", "v1")
        world.registry.deployments.deploy("m", "v1")
        await world.reconcile()
        world.push("m", "v2")
        world.backend.ready_at_once = False
        world.registry.deployments.deploy(
            "m", "v2", strategy="blue-green", replicas=2, rollout={"keep_old_s": 60}
        )
        await world.reconcile()
        first, second = world.backend.running("v2")
        first.make_ready()
        await settle()
        await world.reconcile()
        assert world.tables[-1].models["m"].traffic == {"v2": 0, "v1": 100}
        second.make_ready()
        await settle()
        await world.reconcile()  # the pass sees every replica ready: the switch step runs
        await until(lambda: world.split("m") == {"v2": 100, "v1": 0})
        await world.reconcile()
        assert world.serving("m") == "v2" and world.backend.running("v1")  # kept warm
        await world.clock.advance(61)  # the keep window is over: v1 goes
        await world.reconcile()
        await until(lambda: world.statuses("m") == {"v2": "active", "v1": "draining"})
        await world.reconcile()
        await world.clock.advance(RETIRE_DELAY_S)
        await until(lambda: world.backend.running("v1") == [] and world.split("m") == {"v2": 100})
        await world.controller.stop()

    run(scenario)


class Counters:
    """What each replica has answered, as the canary analysis samples it."""

    def __init__(self) -> None:
        self.by_version: dict[str, tuple[int, int, float]] = {}

    async def sample(
        self, replicas: list[tuple[str, int, str]]
    ) -> dict[tuple[str, int], ReplicaSample]:
        out = {}
        for rid, incarnation, _ in replicas:
            version = rid.split("-")[1]
            answered, failed, seconds = self.by_version.get(version, (0, 0, 0.01))
            latency, compute = Sketch(), Sketch()
            if answered:
                latency.observe(seconds, answered)
                compute.observe(seconds, answered)
            out[(rid, incarnation)] = ReplicaSample(answered, failed, latency, compute)
        return out


def test_a_canary_moves_on_when_as_good_and_back_when_worse(world: World) -> None:
    async def scenario() -> None:
        counters = Counters()
        world.controller.analyst.sample = counters.sample
        world.push("m", "v1")
        world.registry.deployments.deploy("m", "v1")
        await world.reconcile()
        world.push("m", "v2")
        steps = {"steps": [10, 50, 100], "step_s": 30, "min_requests": 5}
        world.registry.deployments.deploy("m", "v2", strategy="canary", rollout=steps)
        await world.reconcile()
        await world.reconcile()  # all canary replicas ready: the window opens
        assert world.serving("m") == "v1"  # a canary in progress never serves by default
        counters.by_version = {"v1": (900, 0, 0.010), "v2": (100, 0, 0.010)}
        await world.clock.advance(29)
        await world.reconcile()
        assert world.split("m") == {"v2": 10, "v1": 90}  # the window is still open
        await world.clock.advance(1)  # the window is over: as good, so the next step
        await world.reconcile()
        await until(lambda: world.split("m") == {"v2": 50, "v1": 50})
        await world.reconcile()  # a new window, from the counters as they are now
        counters.by_version = {"v1": (1800, 0, 0.010), "v2": (200, 0, 0.020)}  # twice as slow
        await world.clock.advance(30)
        await world.reconcile()
        await until(lambda: world.split("m") == {"v2": 0, "v1": 100})
        (v2,) = [d for d in world.registry.deployments.list_all("m") if d.version == "v2"]
        assert v2.status == "rolled_back" and v2.canary is not None
        assert v2.canary.reason is not None and v2.canary.reason.startswith("compute p50")
        await world.reconcile()
        await world.clock.advance(RETIRE_DELAY_S)
        await until(lambda: world.backend.running("v2") == [])
        await world.controller.stop()

    run(scenario)


class MemoryReplica:
    """A replica that is an object: ready when the test says, gone once stopped."""

    pid = 0
    incarnation = 0
    placement = "memory"

    def __init__(self, spec: ReplicaSpec, on_change: Callable[[Replica], None]) -> None:
        self.spec = spec
        self.on_change = on_change
        self.state = ReplicaState.LOADING
        self.message = ""
        self.restarts = 0
        self.ever_ready = False
        self.stopping = False

    @property
    def id(self) -> str:
        return self.spec.replica_id

    @property
    def address(self) -> str:
        return f"memory:{self.id}"

    @property
    def ready(self) -> bool:
        return self.state is ReplicaState.READY and not self.stopping

    def route(self) -> ReplicaRoute:
        return route_of(self)

    def make_ready(self) -> None:
        self.state, self.ever_ready = ReplicaState.READY, True
        self.on_change(self)

    async def stop(self) -> None:
        self.stopping, self.state = True, ReplicaState.STOPPED
        self.on_change(self)


class MemoryOrchestrator:
    """A fourth orchestrator, written against :class:`Orchestrator` alone."""

    machine_bound = False

    def __init__(self, settings: Settings, context: Context) -> None:
        self.settings = settings
        self.context = context
        self.ids = itertools.count(1)
        self.replicas: list[MemoryReplica] = []
        self.retired: list[tuple[str, str]] = []
        self.closed = False

    async def start(self) -> None:
        pass

    def scale(self, vset: VersionSet, *, shrink: bool = True) -> None:
        live = [r for r in vset.live() if isinstance(r, MemoryReplica)]
        for _ in range(vset.desired - len(live)):
            rid = f"{vset.record.model_name}-{vset.record.version}-{next(self.ids)}"
            replica = MemoryReplica(
                replica_spec(self.settings, vset, rid, None), self.context.on_change
            )
            self.replicas.append(replica)
            vset.replicas.append(replica)
        for replica in live[vset.desired :] if shrink else []:
            self.context.spawn(self._drop(vset, replica))

    async def _drop(self, vset: VersionSet, replica: MemoryReplica) -> None:
        await replica.stop()
        vset.replicas.remove(replica)
        self.context.publish()

    def running(self, model: str, version: str) -> int:
        return 0

    def gpus(self, vset: VersionSet) -> None:
        return None

    def gpu_room(self, vset: VersionSet) -> None:
        return None

    def sync(self) -> None:
        pass

    def keep_only(self, running: set[tuple[str, str]]) -> None:
        pass

    def retire(self, model: str, version: str) -> None:
        self.retired.append((model, version))

    async def close(self) -> None:
        self.closed = True


def test_a_fourth_orchestrator_runs_versions_through_the_factory_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered under a new name, an orchestrator the controller has never heard of
    deploys, serves, scales and retires a version."""
    made: list[MemoryOrchestrator] = []

    def make(
        settings: Settings, run_dir: Path, context: Context, backend: ReplicaBackend | None
    ) -> Orchestrator:
        made.append(MemoryOrchestrator(settings, context))
        return made[-1]

    monkeypatch.setitem(ORCHESTRATORS, "memory", make)
    world = World(tmp_path, replica_backend="memory")

    def ids(version: str) -> list[str]:
        return [r.id for r in world.tables[-1].models["m"].versions[version].replicas]

    async def scenario() -> None:
        (memory,) = made
        world.push("m", "v1")
        world.registry.deployments.deploy("m", "v1", replicas=2, actor="test")
        await world.controller.start()
        await settle()
        assert ids("v1") == ["m-v1-1", "m-v1-2"] and world.states("m", "v1") == ["loading"] * 2
        assert world.serving("m") is None and world.backend.started == []
        memory.replicas[0].make_ready()
        await settle()
        # the ready replica and the serving version it makes, in one table
        assert world.serving("m") == "v1" and world.states("m", "v1") == ["ready", "loading"]
        assert world.tables[-1].models["m"].versions["v1"].replicas[0].placement == "memory"
        assert not [t.generation for t in world.tables if _ready_without_serving(t, "m")]

        world.registry.deployments.scale("m", "v1", 3)
        await world.reconcile()
        assert ids("v1") == ["m-v1-1", "m-v1-2", "m-v1-3"]
        world.registry.deployments.scale("m", "v1", 1)
        await world.reconcile()
        assert ids("v1") == ["m-v1-1"] and world.states("m", "v1") == ["ready"]

        world.push("m", "v2")
        world.registry.deployments.deploy("m", "v2", actor="test")  # 100 %: v1 at 0
        await world.reconcile()
        memory.replicas[-1].make_ready()
        await settle()
        assert world.serving("m") == "v2"
        world.registry.deployments.undeploy("m", "v1", actor="test")
        await world.reconcile()
        await world.clock.advance(RETIRE_DELAY_S)
        await until(lambda: world.split("m") == {"v2": 100})
        assert memory.retired == [("m", "v1")] and "v1" not in world.tables[-1].models["m"].versions
        assert all(r.state is ReplicaState.STOPPED for r in memory.replicas[:3])
        await world.controller.stop()
        assert memory.closed

    try:
        run(scenario)
    finally:
        world.registry.close()


def test_on_demand_versions_load_when_asked_and_the_least_recently_used_idle_one_leaves(
    tmp_path: Path,
) -> None:
    """Under a memory budget an unpinned version runs nothing until a request demands it;
    a load unloads the least recently used resident version with nothing in flight, never
    a pinned, busy or settling one; one that cannot be made room for loads over the
    budget, and the autoscaling pass trims that once it can. Loads and evictions are
    scaling events. Each replica measures 40 MiB (``OnDemand.figures``: no sockets)."""
    mib = 2**20
    world = World(tmp_path, memory_budget_mb=100)  # the pinned version and one more
    busy: set[str] = set()

    async def figures(replica: Replica) -> tuple[int, bool]:
        return 40 * mib, replica.spec.model in busy

    def running() -> list[str]:
        return sorted(r.spec.model for r in world.backend.running())

    def events(reason: str) -> list[str]:
        decisions = world.controller.scaling.decisions
        return sorted(m for (m, _, why), n in decisions.items() if why == reason for _ in range(n))

    async def scenario() -> None:
        on_demand = world.controller.on_demand
        assert on_demand is not None
        on_demand.figures = figures
        world.push("p", "v1", pinned=True)
        for model in ("a", "b", "c"):
            world.push(model, "v1")
        await world.reconcile()
        assert running() == ["p"]
        route = world.tables[-1].models["a"].versions["v1"]
        assert route.scale_from_zero and not route.replicas
        assert world.serving("a") == "v1"  # held and demanded, not refused

        await world.controller.demand("a", "v1")
        await settle()
        assert running() == ["a", "p"] and events("load") == ["a"]
        assert ("a", "v1") in world.controller.scaling.cold_starts
        await world.controller.demand("a", "v1")  # loaded already: nothing more
        await settle()
        assert events("load") == ["a"] and on_demand.loads == 1

        await world.clock.advance(SETTLE_S)
        await world.controller.demand("b", "v1")  # 40 + 40 + 40 > 100: a, idle, goes
        await settle()
        assert running() == ["b", "p"] and events("evict") == ["a"] and on_demand.evictions == 1

        busy.add("b")
        await world.clock.advance(SETTLE_S)
        await world.controller.demand("c", "v1")  # b is busy: c loads over the budget
        await settle()
        assert running() == ["b", "c", "p"] and on_demand.over_budget == 1
        await world.controller.autoscale()  # c settles, b is busy: both stay
        await settle()
        assert running() == ["b", "c", "p"] and on_demand.evictions == 1

        busy.clear()
        await world.clock.advance(SETTLE_S)
        world.controller.used([SimpleNamespace(model_name="b", version="v1")])  # c is older
        await world.controller.autoscale()
        await settle()
        assert running() == ["b", "p"] and events("evict") == ["a", "c"]
        assert (on_demand.loads, on_demand.evictions, on_demand.over_budget) == (3, 2, 1)
        await world.controller.stop()

    try:
        run(scenario)
    finally:
        world.registry.close()


def test_an_unknown_replica_backend_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'nomad'; available: kubernetes, local$"):
        World(tmp_path, replica_backend="nomad")
