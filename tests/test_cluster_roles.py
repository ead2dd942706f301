"""The roles of ``inferd serve`` run on their own over TCP: ``inferd control`` (registry,
controller, replicas) and ``inferd gateway --control HOST:PORT``, real processes on
127.0.0.1. A gateway serves through the controller's TCP channel, stays ready with its
last routing table while the controller is gone, and follows a restarted controller
(a new epoch, whose generations start again at 1); a gateway without the cluster token
is refused before any frame."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, push_source
from tests.roles import Role, gateway_role, replica_role, wait

pytestmark = pytest.mark.slow
CALC = """
class Calc:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"y": batch["x"] * 2}
"""


def test_a_gateway_on_its_own_follows_the_controller_over_tcp_and_outlives_it(tmp_path: Path):
    push_source(tmp_path, "calc", CALC)
    control_port, http_port = free_port(), free_port()
    listen = f"127.0.0.1:{control_port}"
    url = f"http://127.0.0.1:{http_port}"
    # the job runner runs beside the controller, sending its requests to the gateway
    control = Role(tmp_path, "control", "control", "--listen", listen, "--jobs-gateway", url)
    gateway = gateway_role(tmp_path, listen, http_port)
    intruder = None
    try:

        def predict() -> httpx.Response:
            return httpx.post(f"{url}/api/v1/predict", json={"model": "calc", "input": {"x": 2}})

        wait(lambda: predict().status_code == 200, "a prediction", control, gateway)
        assert predict().json()["prediction"] == 4.0
        batch = httpx.post(
            f"{url}/api/v1/batch", json={"model": "calc", "inputs": [{"x": 1.0}, {"x": 2.0}]}
        )
        assert batch.status_code == 202, batch.text

        def job_done() -> bool:
            job = httpx.get(f"{url}/api/v1/batch/{batch.json()['batch_id']}").json()
            return job["status"] == "succeeded" and job["succeeded"] == 2

        wait(job_done, "the batch job, run by the controller's runner", control, gateway)
        assert "control" not in httpx.get(f"{url}/health/ready").json()
        # the console's figures come from the controller, over the same channel
        overview = httpx.get(f"{url}/api/v1/console/overview").json()
        assert overview["health"]["server"]["role"] == "control"
        gateways = overview["health"]["gateways"]  # one connection per gateway process
        assert gateways and all(g.startswith("127.0.0.1:") for g in gateways), gateways
        assert [m["name"] for m in overview["models"]] == ["calc"]

        # a gateway holding another token is refused before any frame, and says so
        intruder = gateway_role(
            tmp_path, listen, free_port(), name="intruder", token="not-the-cluster-token-0123456789"
        )
        wait(lambda: "wrong cluster token" in control.log(), "the refusal", control)
        wait(lambda: "refused this gateway" in intruder.log(), "the intruder's error", intruder)

        # the controller goes: the gateway stays ready on its last table and says so
        assert control.stop() == 0
        health = {}

        def stale() -> bool:
            nonlocal health
            reply = httpx.get(f"{url}/health/ready")
            health = reply.json()
            return reply.status_code == 200 and "control" in health

        wait(stale, "the gateway noticing the controller is gone", gateway)
        assert health["control"]["status"] == "unreachable"
        assert "serving with the last routing table" in health["control"]["detail"]

        # a new controller (new epoch, generations from 1 again): the gateway follows it
        control = Role(tmp_path, "control2", "control", "--listen", listen)
        wait(lambda: predict().status_code == 200, "serving again", control, gateway)
        assert "control" not in httpx.get(f"{url}/health/ready").json()
        assert "reconnected to the controller" in gateway.log()
    finally:
        codes = [r.stop() for r in (gateway, control, intruder) if r is not None]
    assert codes[:2] == [0, 0], gateway.log()[-3000:]


def test_a_replica_elsewhere_needs_the_versions_files_from_s3_or_a_mount(tmp_path: Path):
    from inferd.serving.joiner import localize
    from inferd.shapes.replica_spec import ReplicaSpec

    def spec(uri: str, folder: str) -> ReplicaSpec:
        return ReplicaSpec(
            replica_id="r", model="calc", version="v1", framework="python",
            artifact_dir=folder, address="tcp:10.0.0.2:9100", artifact_uri=uri, sha256="abc",
        )  # fmt: skip

    cache = tmp_path / "cache"
    fetched = localize(spec("s3://models/calc/v1", "/srv/controller/cache/abc"), cache, 1 << 30)
    assert fetched.artifact_dir == str(cache.resolve() / "abc")  # its digest, in this host's cache
    assert fetched.artifact_cache_dir == str(cache.resolve())
    assert fetched.artifact_cache_max_bytes == 1 << 30
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    assert localize(spec(f"file://{mounted}", str(mounted)), cache, 1).artifact_dir == str(mounted)
    with pytest.raises(ValueError, match="needs an S3 artifact store"):
        localize(spec("file:///srv/a/calc/v1", "/srv/a/calc/v1"), cache, 1)


def test_the_roles_over_mutual_tls_alone(tmp_path: Path):
    """No token: every TCP connection between the roles shows a certificate of the
    cluster's CA; a replica whose certificate another CA signed never joins."""
    from tests.test_transport import _ca, _member

    ca, ca_cert, ca_key = _ca(tmp_path, "cluster-ca")
    _, rogue_cert, rogue_key = _ca(tmp_path, "rogue-ca")

    def tls(cert: Path, key: Path) -> dict[str, str]:
        return {
            "INFERD_CLUSTER__TOKEN": "",
            "INFERD_CLUSTER__TLS_CERT": str(cert),
            "INFERD_CLUSTER__TLS_KEY": str(key),
            "INFERD_CLUSTER__TLS_CA": str(ca),
        }

    push_source(tmp_path, "calc", CALC)
    listen, http, replica_port = f"127.0.0.1:{free_port()}", free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    member = tls(*_member(tmp_path, "member", ca_cert, ca_key))
    roles = [
        Role(tmp_path, "control", "control", "--listen", listen, "--no-local-replicas", env=member),
        gateway_role(tmp_path, listen, http, env=member),
        replica_role(
            tmp_path / "r", "replica", listen, "calc", f"127.0.0.1:{replica_port}", env=member
        ),
    ]
    try:
        body = {"model": "calc", "input": {"x": 4}}
        wait(
            lambda: httpx.post(f"{url}/api/v1/predict", json=body).status_code == 200,
            "a prediction through the replica over mutual TLS",
            *roles,
        )
        assert httpx.post(f"{url}/api/v1/predict", json=body).json()["prediction"] == 8.0
        rogue = replica_role(
            tmp_path / "x",
            "rogue",
            listen,
            "calc",
            f"127.0.0.1:{free_port()}",
            env=tls(*_member(tmp_path, "rogue", rogue_cert, rogue_key)),
        )
        roles.append(rogue)
        wait(
            lambda: "closed the connection before answering the join" in rogue.log(),
            "the rogue's refusal",
            rogue,
        )
        shown = httpx.get(f"{url}/api/v1/deployments/calc").json()
        assert sum(len(v["replicas"]) for v in shown["versions"]) == 1  # never joined
    finally:
        for role in reversed(roles):
            role.stop()
