"""End-to-end harness: the real ``inferd serve`` as a subprocess on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import OperationalError

from inferd.registry import Registry

pytest_plugins = ("tests.cpu_usage",)

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_s3(bucket: str, log: Path | None = None) -> Iterator[dict[str, str]]:
    """moto's standalone S3 server on 127.0.0.1 holding ``bucket``: the AWS environment
    that reaches it (endpoint and test credentials). ``log``: where its request log
    goes (a line per request: what the store was asked for)."""
    import s3fs

    port = free_port()
    out = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=out,
        stderr=out,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        s3fs.S3FileSystem(key="test", secret="test", endpoint_url=env["AWS_ENDPOINT_URL"]).mkdir(
            bucket
        )
        yield env
    finally:
        proc.terminate()
        proc.wait(10)
        if log is not None:
            out.close()  # type: ignore[union-attr]


class InferdServer:
    """Starts ``python -m inferd serve``; ``stop()`` sends SIGTERM and checks a clean exit."""

    def __init__(
        self,
        data_dir: Path,
        demo: bool = False,
        workers: int = 1,
        env: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: the server serves TLS (``env`` names its files); the client context
        that trusts it, for ``client`` and the readiness polls."""
        self.data_dir = data_dir
        self.port = free_port()
        self.grpc_port = free_port()
        self.verify: ssl.SSLContext | bool = tls or True
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log_path = data_dir / f"server-{self.port}.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "inferd",
            "serve",
            "--port",
            str(self.port),
            "--grpc-port",
            str(self.grpc_port),
            "--workers",
            str(workers),
            "--data-dir",
            str(data_dir),
        ]
        if demo:
            cmd.append("--demo")
        full_env = {
            **os.environ,
            "INFERD_RECONCILE_INTERVAL_S": "0.3",
            "INFERD_SHUTDOWN_GRACE_S": "10",
            **(env or {}),
        }
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- closed in stop()
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT
        )
        self.client = httpx.Client(base_url=self.url, timeout=30, verify=self.verify)
        _STARTED.append(self)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 120, path: str = "/health/ready") -> None:
        """Until ``path`` answers 200 on 8 new connections in a row: each gateway process
        answers for itself (the kernel spreads connections over them), and one may get
        the routing table a moment after another."""
        deadline = time.monotonic() + timeout_s
        in_a_row = 0
        # One client, no keep-alive: a new connection each poll, without the ~25 ms of
        # CPU a new client costs (its TLS context) every time.
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=10, verify=self.verify, limits=limits) as fresh:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    raise AssertionError(f"server exited with {code}:\n{self.log()}")
                try:
                    ok = fresh.get(self.url + path).status_code == 200
                except httpx.TransportError:
                    ok = False
                in_a_row = in_a_row + 1 if ok else 0
                if in_a_row >= 8:
                    return
                time.sleep(0.01 if ok else 0.1)
        raise AssertionError(f"server not ready within {timeout_s}s:\n{self.log()[-5000:]}")

    def wait_for(self, predicate, timeout_s: float = 60, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()[-5000:]}")

    def wait_all_gateways(
        self,
        check: Callable[[httpx.Client], object],
        timeout_s: float = 60,
        what: str = "condition",
        in_a_row: int = 8,
    ) -> None:
        """Until ``check(client)`` holds ``in_a_row`` times in a row, each request of
        ``client`` on a new connection (no keep-alive). As in :meth:`wait_ready`: each
        gateway process answers from its own routing table and the kernel spreads new
        connections over them, so with 2 processes the chance that 8 in a row all
        missed a lagging one is 1 in 256."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(
            base_url=self.url, timeout=10, verify=self.verify, limits=limits
        ) as fresh:
            while seen < in_a_row:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"timed out waiting for {what} on every gateway process "
                        f"({seen} in a row):\n{self.log()[-5000:]}"
                    )
                seen = seen + 1 if check(fresh) else 0
                if not seen:
                    time.sleep(0.05)

    def wait_job(self, job_id: str, timeout_s: float = 60) -> dict:
        """A batch job's status document once it ended (succeeded, failed, cancelled)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.client.get(f"/api/v1/batch/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return dict(job)
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} not done: {job}\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 30) -> int:
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"server did not stop within {timeout_s}s") from None
        self._log.close()
        return self.process.returncode


_STARTED: list[InferdServer] = []


@pytest.fixture(autouse=True, scope="session")
def _no_server_outlives_the_tests() -> Iterator[None]:
    """Safety net: a test that failed before stopping its server does not leave it running."""
    yield
    for server in _STARTED:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(autouse=True)
def _no_s3_client_outlives_its_test() -> Iterator[None]:
    """s3fs keeps one client per set of arguments for the process: a store made with no
    endpoint argument (read from ``AWS_ENDPOINT_URL``) would get, in a later test on the
    same worker, the client an earlier test made for its own S3 server, long stopped."""
    yield
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()


ARITHMETIC_MODEL = """
import numpy as np


class Arithmetic:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        x = batch["x"]
        return {"y": np.asarray(EXPRESSION, dtype=np.float32)}
"""


def arithmetic_model(expression: str) -> str:
    """The source of a Python model computing ``y = expression`` of an FP32 input ``x``."""
    return ARITHMETIC_MODEL.replace("EXPRESSION", expression)


def upload_arithmetic(
    client: httpx.Client, model: str, version: str, expression: str
) -> httpx.Response:
    """Register ``model:version`` computing ``y = expression`` over the API (a tar.gz
    upload with its sha256), as ``inferd models push --url`` does."""
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = arithmetic_model(expression).encode()
        info = tarfile.TarInfo("model.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue()
    return client.post(
        f"/api/v1/models/{model}/versions",
        params={"version": version, "sha256": hashlib.sha256(body).hexdigest()},
        content=body,
        headers={"content-type": "application/gzip"},
    )


def local_registry(data: Path) -> Registry:
    """The registry of a server whose data folder is ``data`` (SQLite, local artifacts)."""
    return Registry(f"sqlite:///{data.resolve() / 'inferd.db'}", data / "artifacts")


def push_folder(
    data: Path,
    model: str,
    folder: Path,
    version: str = "v1",
    *,
    framework: str | None = None,
    batching: dict[str, object] | None = None,
    deploy: bool = False,
    **metadata: object,
) -> None:
    """Register ``folder`` as ``model:version`` in ``data`` as ``inferd models push``
    does (inspect and warm it up, copy it, record it), but in this process: a subprocess
    per push cost 1-3 s of the suite. The CLI itself has its own tests. ``deploy``: as
    ``--deploy`` (the new version takes all the traffic)."""
    from inferd.runtimes import inspect_artifact

    found, signature = inspect_artifact(folder, framework, dict(metadata), None)
    with local_registry(data) as registry:
        registry.push(
            model,
            folder,
            version,
            framework=found,
            signature=signature,
            metadata=dict(metadata),
            batching=batching or None,
            deploy=deploy,
        )


def create_key(data: Path, name: str, *scopes: str, models: list[str] | None = None) -> str:
    """An API key in ``data``'s registry, as ``inferd keys create`` makes it: the secret."""
    with local_registry(data) as registry:
        return registry.keys.create(name, list(scopes) or ["infer"], models, "test")[1]


def push_source(data: Path, model: str, source: str, *options: str, version: str = "v1") -> None:
    """Register ``source`` (a model.py with one Python model class) as ``model:version``
    in ``data``, as ``inferd models push`` does (``options``: more of its options), in
    this process (:func:`push_folder`). ``--meta``, ``--batching`` and ``--deploy`` are
    read here; any other option goes through the CLI."""
    src = data / f"src-{model}-{version}"
    src.mkdir(parents=True)
    (src / "model.py").write_text(source)
    metadata: dict[str, object] = {}
    batching = None
    deploy = "--deploy" in options
    rest = [o for o in options if o != "--deploy"]
    while rest[:1] in (["--meta"], ["--batching"]) and len(rest) >= 2:
        flag, value = rest.pop(0), rest.pop(0)
        if flag == "--batching":
            batching = json.loads(value)
            continue
        key, _, text = value.partition("=")
        try:
            metadata[key] = json.loads(text)
        except json.JSONDecodeError:
            metadata[key] = text
    if rest:
        run_cli("models", "push", model, str(src), "--version", version, *options, data_dir=data)
        return
    push_folder(data, model, src, version, batching=batching, deploy=deploy, **metadata)


def run_cli(
    *args: str,
    data_dir: Path,
    check: bool = True,
    input_: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "inferd", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "INFERD_DATA_DIR": str(data_dir), **(env or {})},
        input=input_,
        timeout=120,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"inferd {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    """One server with the demo models for the read-only end-to-end tests."""
    server = InferdServer(
        tmp_path_factory.mktemp("demo"),
        demo=True,
        workers=2,
        # the demo LLM trains for ~2 min; generation has its own tests (tiny model).
        # Passive OpenMP threads for the demo build, as replicas have: with the other
        # test worker holding a core, spinning ones took the cross-encoder's training
        # from ~60 s to ~90 s and ~115 CPU-seconds (on an idle machine they are faster).
        env={
            "INFERD_MAX_BODY_BYTES": str(1 << 20),
            "INFERD_DEMO_LLM": "0",
            "OMP_WAIT_POLICY": "PASSIVE",
        },
    )
    try:
        server.wait_ready(timeout_s=240)
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.log()[-3000:]


POSTGRES_URL = os.environ.get(
    "INFERD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    admin = create_engine(POSTGRES_URL)
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        admin.dispose()
        if os.environ.get("INFERD_SKIP_POSTGRES") == "1":
            pytest.skip("PostgreSQL not reachable and INFERD_SKIP_POSTGRES=1")
        pytest.fail(
            f"PostgreSQL not reachable at {POSTGRES_URL} ({exc.orig}); "
            "start it or set INFERD_SKIP_POSTGRES=1 to skip these tests"
        )
    schema = f"inferd_test_{uuid.uuid4().hex}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def redis_url() -> str:
    """The machine's Redis (``INFERD_TEST_REDIS_URL``), checked reachable; skipped only
    with ``INFERD_SKIP_REDIS=1``."""
    return reachable_redis_url()


def reachable_redis_url() -> str:
    """:func:`redis_url`'s check, for fixtures of a wider scope."""
    import redis

    url = os.environ.get("INFERD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.from_url(url).ping()
    except redis.ConnectionError:
        if os.environ.get("INFERD_SKIP_REDIS") == "1":
            pytest.skip("Redis not reachable and INFERD_SKIP_REDIS=1")
        pytest.fail(f"Redis not reachable at {url}; start it or set INFERD_SKIP_REDIS=1")
    return url


# Registry tests run on both backends: a fresh SQLite file, and a fresh PostgreSQL schema.
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db' / 'registry.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def artifact_root(tmp_path: Path) -> Path:
    return tmp_path / "artifacts"


@pytest.fixture
def registry(database_url: str, artifact_root: Path) -> Iterator[Registry]:
    with Registry(database_url, artifact_root) as reg:
        yield reg


@contextlib.contextmanager
def served(
    data_dir: Path,
    workers: int = 2,
    ready_timeout_s: float = 120,
    env: dict[str, str] | None = None,
) -> Iterator[InferdServer]:
    """``inferd serve`` on ``data_dir``, ready; stopped (and checked to exit 0) after."""
    server = InferdServer(data_dir, workers=workers, env=env)
    try:
        server.wait_ready(timeout_s=ready_timeout_s)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


TINY_TEXT = (
    "The server answers every request. A model version is immutable once pushed. "
    "Replicas load the model and warm it up before they report ready. "
    "This product is great and the battery lasts all day. "
) * 20


def build_tiny_gpt2(folder: Path, seed: int = 0, n_positions: int = 128) -> Path:
    """A tiny random GPT-2 (2 layers) with a byte-level BPE tokenizer, HF layout."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        [TINY_TEXT], vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_positions=n_positions,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def gpu_memory_by_pid() -> dict[int, int]:
    """pid -> MiB of GPU memory, as the driver (``nvidia-smi``) sees it."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            found[int(pid)] = int(mib.strip() or 0)
    return found


def fake_gpus(folder: Path, *names: str, memory_mib: int = 81920) -> dict[str, str]:
    """An environment whose ``nvidia-smi`` reports ``names`` as GPUs 0, 1, ... of
    ``memory_mib`` each (what the local backend reads to place replicas; this machine
    has no GPU): a ``PATH`` with a script answering ``--query-gpu=index,name,memory.total
    --format=csv,noheader,nounits`` first."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(f"{i}, {name}, {memory_mib}" for i, name in enumerate(names))
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
    tool.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def gpt2_vocab128(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    """A tiny random GPT-2 (2 layers, 64 wide, 128 token ids, EOS 0): Hugging Face's
    model and inferd's, loaded from the same folder."""
    transformers = pytest.importorskip("transformers")
    import torch

    from inferd.llm.model import GPT2

    torch.manual_seed(1)
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=256,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2-vocab128")
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, GPT2.load(folder)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadfile``: the test files that use :func:`demo_server` go to one
    worker as one unit, so that the demo models are built and served once, not once
    per worker (a build and a start: ~2.5 min of a core on this machine)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    here = Path(__file__).parent
    demo = {p.name for p in here.glob("test_*.py") if "demo_server" in p.read_text()}

    class DemoTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "demo_server" if Path(scope).name in demo else scope

    return DemoTogether(config, log)
