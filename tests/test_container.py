"""The container image (``Dockerfile``) and the one-host cluster (``compose.yaml``).

Always: the pinned requirements satisfy pyproject's, the health check finds the role's
port, the kernel compiled at image build time loads where there is no compiler, and the
compose file has the cluster's shape. With ``INFERD_TEST_CONTAINERS=1`` (minutes, root,
podman): ``scripts/container-base.sh`` makes the base image from Debian's packages (no
image can be pulled here), the image is built on it, serves the demo as a non-root user
and turns healthy, and ``compose.yaml`` comes up under podman-compose with local
stand-ins for the public images (``tests/containers/``), all but Grafana, which has no
Debian or PyPI package: a prediction through both gateways, Prometheus scraping.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import yaml
from packaging.requirements import Requirement

from tests.conftest import ROOT, free_port

CONTAINERS = os.environ.get("INFERD_TEST_CONTAINERS") == "1"
needs_podman = pytest.mark.skipif(
    not CONTAINERS, reason="set INFERD_TEST_CONTAINERS=1 (minutes; root, podman)"
)
IMAGE = "localhost/inferd:test"
STANDINS = ("postgres", "redis", "s3", "prometheus")
IRIS = {"inputs": [{"features": [5.1, 3.5, 1.4, 0.2]}]}


def _healthcheck() -> ModuleType:
    path = ROOT / "deploy" / "container" / "healthcheck.py"
    spec = importlib.util.spec_from_file_location("inferd_image_healthcheck", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["base", "llm"])
def test_the_pinned_requirements_satisfy_pyproject(variant: str):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = (ROOT / "deploy" / "container" / f"requirements-{variant}.txt").read_text()
    extras = lock.splitlines()[0].split("[")[1].split("]")[0].split(",")
    pins = dict(line.split("==") for line in lock.splitlines() if line and line[0] != "#")
    wanted = [*project["dependencies"]]
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    for line in wanted:
        requirement = Requirement(line)
        name = requirement.name.lower()
        assert name in pins, f"{name} is not pinned in requirements-{variant}.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} does not satisfy {line}: run scripts/container-lock.sh"
        )


def test_the_health_check_finds_each_roles_port(tmp_path: Path):
    check = _healthcheck()
    argv = ["/opt/venv/bin/python3", "/opt/venv/bin/inferd"]
    assert check.target([*argv, "serve", "--demo"], {}) == ("http", 8000)
    assert check.target([*argv, "serve"], {"INFERD_PORT": "9000"}) == ("http", 9000)
    assert check.target([*argv, "gateway", "--control=c:7070", "--port", "8080"], {}) == (
        "http",
        8080,
    )
    assert check.target([*argv, "control", "--demo"], {}) == ("tcp", 7070)
    env = {"INFERD_CLUSTER__CONTROL_LISTEN": "0.0.0.0:7171"}
    assert check.target([*argv, "control"], env) == ("tcp", 7171)
    assert check.target([*argv, "replica", "--listen=0.0.0.0:9200"], {}) == ("tcp", 9200)
    assert check.target([*argv, "replica", "--model", "m"], {}) == ("tcp", 9100)
    header = "  sl  local_address rem_address   st tx_queue rx_queue\n"
    # 0x1F90 = 8080 listening (0A); 0x1F91 = 8081 only connected (01)
    (tmp_path / "tcp").write_text(
        header + "   0: 00000000:1F90 00000000:0000 0A 00000000:00000000\n"
        "   1: 0100007F:1F91 0100007F:D431 01 00000000:00000000\n"
    )
    assert check.listening(8080, tmp_path)
    assert not check.listening(8081, tmp_path)


def test_the_kernel_built_with_the_image_loads_without_a_compiler(tmp_path: Path, monkeypatch):
    from inferd.llm import native

    if shutil.which("cc") is None:
        pytest.skip("no C compiler here to build the kernel with")
    prebuilt = tmp_path / "paged_attention.so"
    native.build(prebuilt, "cc", native.PORTABLE_FLAGS)
    monkeypatch.setattr(native, "PREBUILT", prebuilt)
    monkeypatch.setenv("CC", "no-such-compiler")
    native.kernel.cache_clear()
    try:
        lib = native.kernel()
        assert lib is not None and Path(lib._name) == prebuilt
    finally:
        native.kernel.cache_clear()


def test_the_compose_file_is_the_cluster_with_every_image_overridable():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "s3", "prometheus", "grafana", "control"} <= set(services)
    gateways = [s for s in services if s.startswith("gateway-")]
    replicas = [s for s in services if s.startswith("replica-")]
    assert len(gateways) == 2 and len(replicas) == 3
    for name, service in services.items():
        assert service["image"].startswith("${IMAGE_"), name
    assert "--no-local-replicas" in services["control"]["command"]
    mounts = " ".join(services["prometheus"]["volumes"] + services["grafana"]["volumes"])
    assert "./deploy/prometheus/alerts.yml" in mounts
    assert "./deploy/grafana/inferd.json" in mounts


# --- with podman (INFERD_TEST_CONTAINERS=1) ------------------------------------------------


def _podman(*args: str, timeout_s: float = 60, check: bool = True) -> str:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}: {done.stderr[-3000:]}")
    return done.stdout.strip()


def _wait(predicate: Callable[[], object], what: str, timeout_s: float, logs: Callable[[], str]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{logs()}")


@pytest.fixture(scope="module")
def base_image() -> str:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "container-base.sh")],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image(base_image: str) -> str:
    """The image built from this tree (podman's layer cache makes a rebuild quick)."""
    started = time.monotonic()
    _podman(
        "build", "--format", "docker", "--build-arg", f"BASE_IMAGE={base_image}",
        "-t", IMAGE, str(ROOT), timeout_s=1800,
    )  # fmt: skip
    size = _podman("image", "inspect", IMAGE, "--format", "{{.Size}}")
    print(f"built {IMAGE} in {time.monotonic() - started:.0f}s, {int(size) / 1e6:.0f} MB")
    return IMAGE


@pytest.mark.slow
@needs_podman
def test_the_image_serves_the_demo_as_a_non_root_user_and_turns_healthy(image: str):
    name = f"inferd-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    _podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image,
            "serve", "--demo", "--workers", "1")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        logs = lambda: _podman("logs", name, check=False)[-4000:]  # noqa: E731

        def ready() -> bool:
            return httpx.get(f"{url}/health/ready", timeout=5).status_code == 200

        _wait(ready, "the demo to be ready", 240, logs)
        reply = httpx.post(f"{url}/api/v1/models/iris/predict", json=IRIS, timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["label"] == "setosa"
        models = httpx.get(f"{url}/api/v1/models", timeout=10).json()
        assert "fraud" in json.dumps(models) and "sentiment" in json.dumps(models)

        assert _podman("exec", name, "id", "-u") == "10001"
        assert _podman("exec", name, "sh", "-c", "command -v cc gcc || true") == ""
        # podman schedules health checks with systemd timers; without systemd, run it
        _podman("healthcheck", "run", name)
        health = _podman("inspect", name, "--format", "{{.State.Healthcheck.Status}}")
        assert health == "healthy"
    finally:
        _podman("rm", "-f", "-v", "-t", "5", name, check=False)


@pytest.fixture(scope="module")
def standins(base_image: str) -> dict[str, str]:
    """Local images for postgres, redis, the S3 store and Prometheus."""
    built = {}
    for name in STANDINS:
        tag = f"localhost/inferd-standin-{name}:test"
        _podman("build", "-f", f"{name}.Containerfile", "-t", tag,
                str(ROOT / "tests" / "containers"), timeout_s=900)  # fmt: skip
        built[name] = tag
    return built


def _compose_command() -> list[str]:
    found = shutil.which("podman-compose") or str(Path(sys.executable).parent / "podman-compose")
    if not Path(found).exists():
        pytest.fail("podman-compose is not installed (pip install -e '.[dev]')")
    return [found]


@pytest.fixture
def compose(image: str, standins: dict[str, str]) -> Iterator[tuple[dict[str, str], Callable]]:
    project = f"inferd-test-{uuid.uuid4().hex[:8]}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("INFERD_")},
        "IMAGE_INFERD": image,
        "IMAGE_POSTGRES": standins["postgres"],
        "IMAGE_REDIS": standins["redis"],
        "IMAGE_S3": standins["s3"],
        "IMAGE_PROMETHEUS": standins["prometheus"],
        "PORT_HTTP": str(free_port()),
        "PORT_HTTP_2": str(free_port()),
        "PORT_GRPC": str(free_port()),
        "PORT_PROMETHEUS": str(free_port()),
        "PORT_GRAFANA": str(free_port()),
    }
    base = [*_compose_command(), "-p", project, "-f", str(ROOT / "compose.yaml")]

    def run(*args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(
            [*base, *args], capture_output=True, text=True, env=env, cwd=ROOT,
            timeout=timeout_s, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done.stdout

    try:
        yield env, run
    finally:
        # the project's containers with their anonymous volumes (the image's /data), then
        # what down removes: named volumes, the network
        # (newest first: podman refuses to remove a container others were made to require)
        label = f"label=io.podman.compose.project={project}"
        containers = _podman("ps", "-aq", "--sort", "created", "--filter", label, check=False)
        for container in reversed(containers.split()):
            _podman("rm", "-f", "-v", "-t", "5", container, check=False)
        subprocess.run([*base, "down", "-v", "-t", "5"], capture_output=True, env=env,
                       cwd=ROOT, timeout=300, check=False)  # fmt: skip
        _podman("network", "rm", "-f", f"{project}_default", check=False)
        assert not _podman("ps", "-aq", "--filter", label, check=False)


@pytest.mark.slow
@needs_podman
def test_compose_serves_the_demo_through_two_gateways_and_prometheus_scrapes(compose):
    env, run = compose
    assert "grafana" in run("config")  # the whole file, Grafana included, is valid
    services = [s for s in yaml.safe_load(run("config"))["services"] if s != "grafana"]
    started = time.monotonic()
    run("up", "-d", "--no-build", *services, timeout_s=600)

    def logs() -> str:
        return "\n".join(
            f"--- {s}\n" + run("logs", "--tail", "15", s, timeout_s=60)[-2500:]
            for s in ("control", "gateway-1", "replica-iris", "s3-bucket")
        )

    urls = [f"http://127.0.0.1:{env['PORT_HTTP']}", f"http://127.0.0.1:{env['PORT_HTTP_2']}"]
    for url in urls:

        def predicts(url: str = url) -> bool:
            reply = httpx.post(f"{url}/api/v1/models/iris/predict", json=IRIS, timeout=10)
            return reply.status_code == 200 and reply.json()["outputs"][0]["label"] == "setosa"

        _wait(predicts, f"a prediction through {url}", 420, logs)
    print(f"compose: predictions through both gateways {time.monotonic() - started:.0f}s after up")
    fraud = {"inputs": [{"features": [0.0] * 30}]}
    reply = httpx.post(f"{urls[1]}/api/v1/models/fraud/predict", json=fraud, timeout=30)
    assert reply.status_code == 200, reply.text
    reply = httpx.post(
        f"{urls[0]}/api/v1/predict",
        json={"model": "sentiment", "input": {"text": "This product is amazing!"}},
        timeout=30,
    )
    assert reply.status_code == 200 and reply.json()["prediction"] == "positive", reply.text

    prometheus = f"http://127.0.0.1:{env['PORT_PROMETHEUS']}"

    def scraped() -> bool:
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]
        return any(t["health"] == "up" for t in targets["activeTargets"])

    _wait(scraped, "Prometheus to scrape a gateway", 120, logs)
    query = {"query": 'inferd_requests_total{model="iris"}'}

    def counted() -> bool:
        reply = httpx.get(f"{prometheus}/api/v1/query", params=query, timeout=5).json()
        return bool(reply["data"]["result"])

    _wait(counted, "iris's requests in Prometheus", 120, logs)
    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
    assert sum(len(g["rules"]) for g in rules) == 9
    assert all(r["health"] == "ok" for g in rules for r in g["rules"])
