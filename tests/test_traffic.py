"""Traffic splits between deployed versions: the split itself (unit), then the real
server: proportions, sticky users, and zero failed requests while versions switch, roll
back, scale down and go away."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferd.registry import Registry
from inferd.routing.targets import Split, Target, user_point
from inferd.shapes.tensors import Signature
from tests.conftest import InferdServer, push_folder, served

SIG = Signature.from_dict({"inputs": [], "outputs": []})
MODEL = """
import numpy as np


class Fast:
    signature = {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        if (batch["features"] == 666).any():
            raise ValueError("the model refuses 666")
        return {"prediction": batch["features"].sum(axis=1).astype(np.float32)}
"""
BODY = {"inputs": [{"features": [1, 2, 3, 4]}]}
BROKEN = MODEL.replace(
    'if (batch["features"] == 666).any():', 'if (batch["features"] != 0).any():  # warm-up passes'
)


def _targets(*versions: str) -> list[Target]:
    return [Target("m", v, SIG, "python") for v in versions]


# -- the split ------------------------------------------------------------------------


def test_split_proportions_and_sticky_users():
    new, old = _targets("v2", "v1")
    split = Split([(30, new), (70, old)])
    picks = Counter(split.choose().version for _ in range(20_000))
    assert abs(picks["v2"] / 20_000 - 0.30) < 0.02
    users = [f"user-{i}" for i in range(5_000)]
    first = {u: split.choose(u).version for u in users}
    assert all(split.choose(u).version == first[u] for u in users)  # sticky
    assert abs(sum(v == "v2" for v in first.values()) / len(users) - 0.30) < 0.03
    assert 0 <= user_point("x") < 1 and user_point("x") == user_point("x")


def test_moving_the_split_moves_only_that_share_of_users():
    new, old = _targets("v2", "v1")
    before = Split([(10, new), (90, old)])
    after = Split([(20, new), (80, old)])
    users = [f"user-{i}" for i in range(10_000)]
    moved = [u for u in users if before.choose(u).version != after.choose(u).version]
    assert abs(len(moved) / len(users) - 0.10) < 0.015
    assert all(after.choose(u).version == "v2" for u in moved)  # only old -> new


# -- the real server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("traffic")
    src = data / "src"
    src.mkdir()
    (src / "model.py").write_text(MODEL)
    for version in ("v1", "v2", "v3"):
        push_folder(data, "fast", src, version, batching={"max_wait_ms": 0}, deploy=True)
    broken = data / "broken"
    broken.mkdir()
    (broken / "model.py").write_text(BROKEN)
    push_folder(data, "shaky", src, "v1", deploy=True)
    push_folder(data, "shaky", broken, "v2", deploy=True)
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InferdServer]:
    with served(data) as srv:
        yield srv


@pytest.fixture(scope="module")
def registry(data: Path) -> Iterator[Registry]:
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        yield reg


def _version(client: httpx.Client, user: str | None = None) -> str:
    headers = {"x-user-id": user} if user else {}
    reply = client.post("/api/v1/models/fast/predict", json=BODY, headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-inferd-model-version"] == reply.json()["version"]
    return str(reply.json()["version"])


def _ready(server: InferdServer, *versions: str) -> None:
    """Until every gateway process's table has a ready replica of each of ``versions``."""

    def all_ready(client: httpx.Client) -> bool:
        return all(_ready_count(server, v, client=client) > 0 for v in versions)

    server.wait_all_gateways(all_ready, timeout_s=60, what=f"versions {versions} ready")


def test_split_proportions_and_stickiness_on_the_server(server, registry):
    # v3 is the newest: automatic mode serves it; the first deployment adopts it.
    assert _version(server.client) == "v3"
    registry.deployments.deploy("fast", "v2", traffic_pct=30, actor="test")
    _ready(server, "v2", "v3")
    counts = Counter(_version(server.client) for _ in range(1500))
    assert set(counts) == {"v2", "v3"}
    assert abs(counts["v2"] / 1500 - 0.30) < 0.05, counts

    users = [f"u{i}" for i in range(300)]
    first = {u: _version(server.client, u) for u in users}
    assert all(_version(server.client, u) == first[u] for u in users[:100])
    registry.deployments.set_traffic("fast", {"v2": 40, "v3": 60}, actor="test")
    time.sleep(1.5)  # the controller's next pass publishes it (0.3 s in tests)
    second = {u: _version(server.client, u) for u in users}
    moved = [u for u in users if first[u] != second[u]]
    assert 0.03 < len(moved) / len(users) < 0.18, len(moved)
    assert all(second[u] == "v2" for u in moved)
    pinned = server.client.post(
        "/api/v1/models/fast/predict", json={**BODY, "params": {"version": "v3"}}
    )
    assert pinned.json()["version"] == "v3"


class Load:
    """Steady requests from a few threads until stopped; counts answers and failures."""

    def __init__(
        self, url: str, threads: int = 3, model: str = "fast", body: dict | None = None
    ) -> None:
        self.url = url
        self.path = f"/api/v1/models/{model}/predict"
        self.body = BODY if body is None else body
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.versions: Counter[str] = Counter()
        self.failures: list[str] = []
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    reply = client.post(self.path, json=self.body)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if reply.status_code != 200:
                    self.failures.append(f"{reply.status_code} {reply.text}")
                else:
                    self.versions[reply.json()["version"]] += 1
                    self.latencies.append(time.perf_counter() - started)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)


def test_zero_failed_requests_through_switch_rollback_scale_down_and_removal(server, registry):
    deployments = registry.deployments
    with Load(server.url) as load:
        _under_way(server, load)
        # Switch: v1 takes all traffic once its replicas are ready, not before.
        deployments.deploy("fast", "v1", traffic_pct=100, replicas=2, actor="test")
        server.wait_for(lambda: load.versions["v1"] > 50, timeout_s=60, what="v1 serving")
        # Instant rollback to the last stable split (v3 at 100 %).
        before = load.versions["v3"]
        deployments.rollback("fast", actor="test")
        server.wait_for(lambda: load.versions["v3"] > before + 50, timeout_s=30, what="rollback")
        # Scale v3 up, then down: the extra replica drains before it stops.
        scaled = server.client.patch(
            "/api/v1/deployments/fast/v3", json={"resources": {"replicas": 2}}
        )
        assert scaled.status_code == 200 and scaled.json()["deployment"]["replicas"] == 2
        bad = server.client.patch("/api/v1/deployments/fast/v3", json={"replicas": -1})
        assert bad.status_code == 422
        negative = server.client.patch(
            "/api/v1/deployments/fast/v3", json={"resources": {"replicas": -1}}
        )
        assert negative.status_code == 422 and "replicas" in negative.json()["error"]["message"]
        server.wait_for(lambda: _ready_count(server, "v3") == 2, timeout_s=60, what="v3 x2")
        deployments.scale("fast", "v3", 1)
        server.wait_for(lambda: _running(server, "v3") == 1, timeout_s=60, what="v3 x1")
        # Remove the versions without traffic: they drain and their rows go away.
        deployments.undeploy("fast", "v1", actor="test")
        deployments.set_traffic("fast", {"v3": 100}, actor="test")
        deployments.undeploy("fast", "v2", actor="test")
        _wait_deployed(server, registry, "fast", {"v3"})
        _under_way(server, load)  # and on, after the removals
    assert load.failures == [], load.failures[:5]
    assert sum(load.versions.values()) > 300
    # What v3's replica measured: the steady load, and one request the model refused.
    refused = server.client.post(
        "/api/v1/models/fast/predict", json={"inputs": [{"features": [666, 0, 0, 0]}]}
    )
    assert refused.status_code == 500
    (v3,) = server.client.get("/api/v1/deployments/fast").json()["versions"]
    live = v3["live"]
    assert live["requests"] > 100 and live["errors"] == 1
    assert 0 < live["error_rate"] < 0.01 and 0 < live["p50_ms"] <= live["p99_ms"] < 1000
    history = deployments.history("fast")
    assert [h.reason for h in history[:4]] == ["undeploy", "manual", "undeploy", "rollback"]


def test_blue_green_switches_at_once_when_all_replicas_are_ready_then_removes_the_old(
    server, registry
):
    deployments = registry.deployments
    assert {d.version for d in deployments.list_all("fast")} == {"v3"}  # after the test above
    with Load(server.url) as load:
        _under_way(server, load)
        record = deployments.deploy(
            "fast",
            "v1",
            traffic_pct=100,
            replicas=2,
            strategy="blue-green",
            rollout={"keep_old_s": 3},
            actor="test",
        )
        assert record.traffic_pct == 0  # held until both replicas are ready
        server.wait_for(lambda: load.versions["v1"] > 0, timeout_s=60, what="the switch")
        # The first v1 answer came after the switch, which needs both replicas ready.
        assert _ready_count(server, "v1") == 2
        switched = time.monotonic()
        time.sleep(0.5)  # requests already sent to v3 land
        served_v3 = load.versions["v3"]
        _wait_deployed(server, registry, "fast", {"v1"})  # v3 gone after the keep window
        assert time.monotonic() - switched > 1.5  # kept (warm) for the window first
        assert load.versions["v3"] == served_v3  # but took no traffic after the switch
    assert load.failures == [], load.failures[:5]
    reasons = [h.reason for h in deployments.history("fast", 3)]
    assert reasons[:2] == ["blue_green_done", "blue_green_switch"]


def test_failures_of_a_split_version_fall_back_to_the_serving_one(server, registry):
    """shaky v2 raises on every real request; at 50 % with fallback every request is
    still answered (by v1), a request pinned to v2 is not; without fallback half fail."""
    deployments = registry.deployments
    deployments.deploy("shaky", "v1", traffic_pct=100, actor="test")  # v2 (newest) kept at 0
    deployments.set_traffic("shaky", {"v1": 50, "v2": 50}, actor="test")  # v1 serves: a tie

    def shaky(pin: str | None = None) -> httpx.Response:
        body = {**BODY, "params": {"version": pin}} if pin else BODY
        return server.client.post("/api/v1/models/shaky/predict", json=body)

    _split_everywhere(server, "shaky", {"v1": 50, "v2": 50}, serving="v1")
    replies = [shaky() for _ in range(60)]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies][:3]
    assert {r.json()["version"] for r in replies} == {"v1"}
    fell_back = [r for r in replies if r.headers.get("x-inferd-fallback-from") == "v2"]
    assert 10 < len(fell_back) < 50  # about half chose v2 first
    assert shaky("v2").status_code == 500  # pinned: no fallback

    deployments.set_traffic("shaky", {"v1": 100}, actor="test")
    deployments.undeploy("shaky", "v2", actor="test")
    _wait_deployed(server, registry, "shaky", {"v1"})
    deployments.deploy("shaky", "v2", traffic_pct=50, fallback=False, actor="test")
    _split_everywhere(server, "shaky", {"v1": 50, "v2": 50}, serving="v1")
    codes = Counter(shaky().status_code for _ in range(60))
    assert codes[500] > 10 and codes[200] > 10, codes


def _split_everywhere(
    server: InferdServer, model: str, split: dict[str, int], serving: str
) -> None:
    """Until every gateway process's table has ``model`` split as ``split`` with
    ``serving`` as its serving version and a ready replica of each version in it. A
    gateway whose table lagged still served the newest version (automatic mode) at
    100 %, so a failure there had no other version to fall back to."""

    def applied(client: httpx.Client) -> bool:
        overview = client.get("/api/v1/console/overview").json()
        entry = next(m for m in overview["models"] if m["name"] == model)
        ready = {v["version"] for v in entry["versions"] if v["replicas"].get("ready")}
        same_split = entry["traffic"] == split
        return entry["serving_version"] == serving and same_split and ready >= set(split)

    server.wait_all_gateways(applied, timeout_s=60, what=f"{model} split as {split}")


def _wait_deployed(server: InferdServer, registry: Registry, model: str, versions: set) -> None:
    """Until exactly ``versions`` of ``model`` are deployed (removed ones have drained)."""
    server.wait_for(
        lambda: {d.version for d in registry.deployments.list_all(model)} == versions,
        timeout_s=60,
        what=f"deployments of {model} to be {sorted(versions)}",
    )


def _under_way(server: InferdServer, load: Load, requests: int = 50) -> None:
    """Until the load has had ``requests`` more answers (or failures)."""
    done = sum(load.versions.values()) + len(load.failures)
    server.wait_for(
        lambda: sum(load.versions.values()) + len(load.failures) >= done + requests,
        timeout_s=30,
        what=f"{requests} more requests of the load",
    )


def _replicas(
    server: InferdServer, version: str, model: str = "fast", client: httpx.Client | None = None
) -> list[dict]:
    detail = (client or server.client).get(f"/api/v1/models/{model}").json()
    found = next((v for v in detail["versions"] if v["version"] == version), None)
    return found["replicas"] if found else []


def _ready_count(
    server: InferdServer, version: str, model: str = "fast", client: httpx.Client | None = None
) -> int:
    return sum(r["state"] == "ready" for r in _replicas(server, version, model, client))


def _running(server: InferdServer, version: str) -> int:
    return sum(r["state"] in ("ready", "loading", "starting") for r in _replicas(server, version))
