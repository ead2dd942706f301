"""inferd across real network hosts: network namespaces on this machine, joined by a
bridge (tests/netns.py). Host A is the test's own namespace (``inferd control`` with no
local replicas, ``inferd gateway``, the load); hosts B and C run ``inferd replica``,
which joins over TCP with the cluster token. Under steady load from A:

- replicas on B and C join and share the traffic;
- every inferd process on B killed: no failed request (in-flight ones are retried on
  C), B out of routing at once (its connection closed);
- B's link cut: no failed request, B out of routing within the replica timeout
  (``cluster.replica_timeout_s``, 3 s), and back once the link is;
- a replica holding another token is refused and never routed to.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import netns
from tests.conftest import ROOT, free_port, push_source
from tests.roles import Role, gateway_role, replica_role, wait

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
]
HOSTNAME_MODEL = """
import os

import numpy as np


class Where:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "host", "datatype": "BYTES", "shape": [-1]}],
    }

    def predict(self, batch):
        tag = os.environ.get("HOST_TAG", "here")
        return {"host": np.array([tag] * len(batch["x"]), dtype=object)}
"""
PORT = 9100


def _replicas(url: str) -> dict[str, str]:
    """Replica id -> state, as the controller routes them."""
    shown = httpx.get(f"{url}/api/v1/deployments/where", timeout=5).json()
    return {r["id"]: r["state"] for v in shown["versions"] for r in v["replicas"]}


def _hosts_answering(url: str, n: int = 64) -> set[str]:
    """The hosts that answered ``n`` predicts sent 8 at a time (sequential ones all go
    to the same idle replica)."""
    body = {"model": "where", "input": {"x": 1.0}}
    with httpx.Client(timeout=10) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(lambda _: client.post(f"{url}/api/v1/predict", json=body), range(n))
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies][:3]
    return {r.json()["prediction"] for r in replies}


def _answered(url: str) -> int:
    """Requests the replicas of ``where`` answered since they started (their live
    figures, which the gateway asks them for)."""
    shown = httpx.get(f"{url}/api/v1/deployments/where", timeout=5).json()
    return sum((v["live"] or {}).get("requests", 0) for v in shown["versions"])


class Load:
    """``inferd bench --rate`` from host A for ``seconds``; its report when done."""

    def __init__(self, url: str, out: Path, rate: int, seconds: int) -> None:
        self.url = url
        self.out = out
        self.answered = _answered(url)
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "inferd", "bench", url, "--target", "predict",
                "--model", "where", "--rate", str(rate), "--duration", f"{seconds}s",
                "--warmup", "0s", "--timeout", "30s", "--body", '{"inputs": [{"x": 1}]}',
                "--json", str(out),
            ],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def under_way(self, *roles: Role, requests: int = 20) -> None:
        """Until the replicas have answered ``requests`` of its requests, half a second
        of it at 40 a second (bench takes a second or two to start)."""
        wait(lambda: _answered(self.url) >= self.answered + requests, "the load under way", *roles)

    def report(self) -> dict:
        _, err = self.process.communicate(timeout=120)
        assert self.process.returncode == 0, err
        (run,) = json.loads(self.out.read_text())["levels"]
        return run


def _until_gone(url: str, host: str, since: float, bound_s: float) -> float:
    """Seconds from ``since`` until no replica of ``host`` is routed to."""
    deadline = since + bound_s + 10
    while time.monotonic() < deadline:
        if not any(f"-{host}-" in rid or rid.endswith(host) for rid in _ready(url)):
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"{host} still routed to {deadline - since:.0f}s later")


def _ready(url: str) -> list[str]:
    return [rid for rid, state in _replicas(url).items() if state == "ready"]


def test_replicas_on_other_hosts_join_share_traffic_and_leave_without_failed_requests(
    tmp_path: Path,
):
    push_source(tmp_path, "where", HOSTNAME_MODEL)
    with netns.Network() as net:
        b, c = net.add("b"), net.add("c")
        listen = f"{net.gateway_address}:{free_port()}"
        http = free_port()
        url = f"http://127.0.0.1:{http}"
        control = Role(tmp_path, "control", "control", "--listen", listen, "--no-local-replicas")
        gateway = gateway_role(tmp_path, listen, http)

        def replica(host: netns.Host, name: str, **kw) -> Role:
            return replica_role(
                tmp_path,
                name,
                listen,
                "where",
                f"{host.address}:{PORT}",
                netns=host.netns,
                env={"HOST_TAG": host.name},
                **kw,
            )

        roles = [control, gateway, replica(b, "replica-b"), replica(c, "replica-c")]
        try:
            wait(lambda: len(_ready(url)) == 2, "both replicas ready", *roles)
            assert _hosts_answering(url) == {"b", "c"}  # they share the traffic

            # every inferd process on B killed under load
            load = Load(url, tmp_path / "kill.json", rate=40, seconds=8)
            load.under_way(*roles)
            killed = time.monotonic()
            b.kill_all()
            gone_after_kill = _until_gone(url, "b", killed, bound_s=5)
            run = load.report()
            assert run["errors"] == 0 and run["requests"] >= 250, run
            assert gone_after_kill <= 5, gone_after_kill

            roles.append(replica(b, "replica-b2"))
            wait(lambda: len(_ready(url)) == 2, "B back", *roles)

            # B's link cut under load, then restored
            load = Load(url, tmp_path / "cut.json", rate=40, seconds=12)
            load.under_way(*roles)
            cut = time.monotonic()
            b.cut()
            gone_after_cut = _until_gone(url, "b", cut, bound_s=5)
            threading.Timer(max(0.0, 7.5 - (time.monotonic() - cut)), b.restore).start()
            run = load.report()
            assert run["errors"] == 0 and run["requests"] >= 400, run
            assert gone_after_cut <= 5, gone_after_cut
            wait(lambda: len(_ready(url)) == 2, "B back after its link", *roles)
            assert _hosts_answering(url) == {"b", "c"}

            # a replica holding another token is refused and never routed to
            intruder = replica(c, "intruder", token="not-the-cluster-token-0123456789")
            roles.append(intruder)
            wait(lambda: "wrong cluster token" in control.log(), "the refusal", control)
            assert len(_replicas(url)) == 2
            print(
                f"\nB left routing {gone_after_kill:.2f}s after its processes were killed, "
                f"{gone_after_cut:.2f}s after its link was cut"
            )
        finally:
            for role in reversed(roles):
                role.stop()


def test_a_replica_on_another_host_loads_its_version_from_the_s3_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Host B has nothing of the version: its replica fetches the files from the
    S3-compatible store (moto's server, reachable on the switch), checks them against
    the registered digest, and serves."""
    pytest.importorskip("s3fs")
    import s3fs

    from inferd.registry import Registry
    from inferd.runtimes import inspect_artifact

    with netns.Network() as net:
        b = net.add("b")
        s3_port = free_port()
        moto = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", net.gateway_address, "-p", str(s3_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        aws = {
            "AWS_ENDPOINT_URL": f"http://{net.gateway_address}:{s3_port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        for key, value in aws.items():
            monkeypatch.setenv(key, value)
        roles: list[Role] = []
        try:
            fs = s3fs.S3FileSystem(endpoint_url=aws["AWS_ENDPOINT_URL"], key="test", secret="test")
            deadline = time.monotonic() + 30
            while True:
                try:
                    fs.mkdir("cluster-models")
                    break
                except OSError:
                    assert time.monotonic() < deadline, "moto did not start"
                    time.sleep(0.2)
            control_data = tmp_path / "a"
            src = tmp_path / "src"
            src.mkdir()
            (src / "model.py").write_text(HOSTNAME_MODEL)
            framework, signature = inspect_artifact(src, None, {}, None)
            store = "s3://cluster-models/inferd"
            database = f"sqlite:///{control_data.resolve() / 'inferd.db'}"
            with Registry(database, control_data / "artifacts", artifact_store=store) as registry:
                registry.push("where", src, "v1", framework=framework, signature=signature)
            listen, http = f"{net.gateway_address}:{free_port()}", free_port()
            url = f"http://127.0.0.1:{http}"
            env = {"INFERD_ARTIFACT_STORE": store}
            roles += [
                Role(
                    control_data,
                    "control",
                    "control",
                    "--listen",
                    listen,
                    "--no-local-replicas",
                    env=env,
                ),
                gateway_role(control_data, listen, http, env=env),
                replica_role(
                    tmp_path / "b",
                    "replica",
                    listen,
                    "where",
                    f"{b.address}:{PORT}",
                    netns=b.netns,
                    env={"HOST_TAG": "b"},
                ),
            ]
            wait(lambda: len(_ready(url)) == 1, "the replica on B, from S3", *roles)
            assert _hosts_answering(url, 8) == {"b"}
            (fetched,) = (tmp_path / "b" / "artifact-cache").glob("*/model.py")
            assert fetched.read_text() == HOSTNAME_MODEL  # B's own copy, from the store
            record = httpx.get(f"{url}/api/v1/models/where/versions/v1", timeout=10).json()
            assert fetched.parent.name == record["sha256"]  # B's cache, by content
        finally:
            for role in reversed(roles):
                role.stop()
            moto.terminate()
            moto.wait(10)


def test_a_stream_to_a_cut_off_host_fails_fast_with_a_clear_error(tmp_path: Path):
    """A generation whose only replica's host was just cut off does not hang for its
    deadline: once the host is out of routing (the replica timeout) the stream ends with
    a 503 naming the replica."""
    from tests.conftest import build_tiny_gpt2, push_folder

    push_folder(tmp_path, "tiny", build_tiny_gpt2(tmp_path / "src" / "tiny"), "v1")
    with netns.Network() as net:
        b = net.add("b")
        listen, http = f"{net.gateway_address}:{free_port()}", free_port()
        url = f"http://127.0.0.1:{http}"
        roles = [
            Role(tmp_path, "control", "control", "--listen", listen, "--no-local-replicas"),
            gateway_role(tmp_path, listen, http),
            replica_role(tmp_path, "replica", listen, "tiny", f"{b.address}:{PORT}", netns=b.netns),
        ]
        try:

            def ready() -> bool:
                shown = httpx.get(f"{url}/api/v1/deployments/tiny", timeout=5).json()
                return any(r["state"] == "ready" for v in shown["versions"] for r in v["replicas"])

            wait(ready, "the generation replica on B", *roles, timeout_s=120)
            body = {"prompt": "The server", "max_tokens": 50, "stream": True}
            assert httpx.post(f"{url}/api/v1/models/tiny/generate", json=body).status_code == 200
            b.cut()
            started = time.monotonic()
            reply = httpx.post(f"{url}/api/v1/models/tiny/generate", json=body, timeout=60)
            took = time.monotonic() - started
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["code"] in ("replica_unavailable", "model_not_ready")
            assert took <= 6, took  # the replica timeout (3 s) and a table, not the deadline
        finally:
            b.restore()
            for role in reversed(roles):
                role.stop()
