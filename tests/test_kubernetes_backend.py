"""The Kubernetes replica backend, end to end against the API test double.

No Kubernetes cluster can run here. ``tests/kube_fake.py`` stands in for the API server
(the real paths and shapes of the few calls the backend's Role grants) with a
Deployment controller and a kubelet that run each pod as a real ``inferd replica``
process, from the pod template the backend wrote. The real ``inferd serve`` runs with
``replica_backend: kubernetes`` and talks to it through the maintained client library
(lightkube) as it would to a cluster, with an S3 artifact store (moto's server) the
pods fetch versions from.
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from inferd.config import KubernetesConfig, Settings
from inferd.control.backends.kubernetes import deployment_name, manifest
from inferd.shapes.replica_spec import ReplicaSpec
from tests.conftest import (
    InferdServer,
    arithmetic_model,
    free_port,
    moto_s3,
    upload_arithmetic,
)
from tests.kube_fake import FakeKube

pytest.importorskip("lightkube")
pytestmark = pytest.mark.slow
BUCKET = "inferd-k8s"
TOKEN = "k8s-test-cluster-token-0123456789"
NS = "inferd"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    pytest.importorskip("s3fs")
    with moto_s3(BUCKET) as env:
        yield env


@pytest.fixture()
def kube(tmp_path: Path, s3: dict[str, str]) -> Iterator[FakeKube]:
    fake = FakeKube(tmp_path / "kube", namespace=NS)
    fake.start()
    secret = {"INFERD_CLUSTER__TOKEN": TOKEN, **s3}
    fake.secrets["inferd-env"] = {
        k: base64.b64encode(v.encode()).decode() for k, v in secret.items()
    }
    fake.config_maps["inferd-config"] = {"INFERD_LOG_LEVEL": "INFO"}
    try:
        yield fake
    finally:
        fake.stop()


def _env(tmp_path: Path, kube: FakeKube, s3: dict[str, str]) -> dict[str, str]:
    """The settings the Helm chart gives the control (and the gateways)."""
    return {
        **s3,
        "KUBECONFIG": str(kube.kubeconfig(tmp_path / "kubeconfig")),
        "INFERD_REPLICA_BACKEND": "kubernetes",
        "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/models",
        "INFERD_DATABASE_URL": f"sqlite:///{tmp_path / 'registry.db'}",
        "INFERD_CLUSTER__TOKEN": TOKEN,
        "INFERD_KUBERNETES__NAMESPACE": NS,
        "INFERD_KUBERNETES__OWNER": "inferd-control",
        "INFERD_KUBERNETES__IMAGE": "inferd:test",
        "INFERD_KUBERNETES__ENV_FROM_SECRETS": '["inferd-env"]',
        "INFERD_KUBERNETES__ENV_FROM_CONFIG_MAPS": '["inferd-config"]',
        # Long enough that a fake API slowed by a busy machine (the suite runs 3 workers
        # on 2 cores) does not cost the leader its Lease mid-test (a 1 s renewal timed out
        # twice); these tests hand the Lease over by releasing it, not by expiry.
        "INFERD_KUBERNETES__LEASE_DURATION_S": "10",
        "INFERD_SHUTDOWN_GRACE_S": "3",
    }


def _server(
    tmp_path: Path,
    kube: FakeKube,
    s3: dict[str, str],
    name: str = "srv",
) -> InferdServer:
    return InferdServer(tmp_path / name, workers=1, env=_env(tmp_path, kube, s3))


def _upload(server: InferdServer, model: str, version: str, expression: str) -> None:
    _upload_to(server.client, model, version, expression)


def _upload_to(client: httpx.Client, model: str, version: str, expression: str) -> None:
    reply = upload_arithmetic(client, model, version, expression)
    assert reply.status_code == 201, reply.text


def _y(server: InferdServer, model: str, x: float) -> float | None:
    reply = server.client.post(f"/api/v1/models/{model}/predict", json={"inputs": [{"x": x}]})
    return reply.json()["outputs"][0]["y"] if reply.status_code == 200 else None


def _ready_pods(kube: FakeKube, deployment: str) -> list[dict]:
    return [
        p
        for p in kube.pod_list()
        if p["metadata"]["labels"].get("inferd.io/deployment") == deployment
        and "deletionTimestamp" not in p["metadata"]
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
    ]


def _calls(kube: FakeKube, method: str, suffix: str) -> list[tuple]:
    return [r for r in kube.requests if r[0] == method and r[1].split("?")[0].endswith(suffix)]


def test_versions_run_as_deployments_of_replica_pods_that_scale_roll_back_and_survive(
    tmp_path: Path, kube: FakeKube, s3: dict[str, str]
):
    owner_uid = kube.add_owner("inferd-control")
    server = _server(tmp_path, kube, s3)
    v1, v2 = deployment_name("inferd", "calc", "v1"), deployment_name("inferd", "calc", "v2")
    try:
        server.wait_ready()
        _upload(server, "calc", "v1", "x * 7")
        server.wait_for(lambda: _y(server, "calc", 2.0) == 14.0, 90, "calc:v1 served by a pod")

        # one Deployment, applied server-side by inferd, owned by the controller's own
        applied = _calls(kube, "PATCH", f"/deployments/{v1}")
        assert applied and applied[0][2] == "application/apply-patch+yaml"
        assert "fieldManager=inferd" in applied[0][1] and "force=true" in applied[0][1]
        dep = kube.deployment(v1)
        assert dep is not None
        assert dep["metadata"]["ownerReferences"][0]["uid"] == owner_uid
        assert dep["spec"]["replicas"] == 1
        pod = _ready_pods(kube, v1)[0]
        assert pod["metadata"]["annotations"]["inferd.io/model"] == "calc"
        detail = server.client.get("/api/v1/models/calc/versions/v1").json()
        replica = detail["replicas"][0]
        assert replica["id"] == pod["metadata"]["name"]
        assert replica["state"] == "ready" and "stats" in replica  # the gateway reached it

        # scaled through the scale subresource, not by rewriting the Deployment
        reply = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "resources": {"replicas": 2}},
        )
        assert reply.status_code == 201, reply.text
        server.wait_for(lambda: len(_ready_pods(kube, v1)) == 2, 60, "two ready pods")
        scales = _calls(kube, "PATCH", f"/deployments/{v1}/scale")
        assert scales and scales[-1][3] == {"spec": {"replicas": 2}}
        assert scales[-1][2] == "application/merge-patch+json"
        server.wait_for(
            lambda: (
                sum(
                    r["state"] == "ready"
                    for r in server.client.get("/api/v1/models/calc/versions/v1").json()["replicas"]
                )
                == 2
            ),
            30,
            "both pods routed",
        )

        # a crashed container is Kubernetes' to restart; the other pod serves meanwhile
        victim = _ready_pods(kube, v1)[0]["metadata"]["name"]
        kube.kill_container(victim)
        assert all(_y(server, "calc", float(i)) == 7.0 * i for i in range(20))
        server.wait_for(
            lambda: any(
                r["id"] == victim and r["restarts"] >= 1 and r["state"] == "ready"
                for r in server.client.get("/api/v1/models/calc/versions/v1").json()["replicas"]
            ),
            60,
            "the crashed pod restarted, counted and routed again",
        )

        # a new version rolls out as its own Deployment; v1's stays (0 %) for a rollback
        _upload(server, "calc", "v2", "x * 9")
        reply = server.client.post(
            "/api/v1/deployments", json={"model_name": "calc", "version": "v2"}
        )
        assert reply.status_code == 201, reply.text
        server.wait_for(lambda: _y(server, "calc", 1.0) == 9.0, 90, "v2 serving")
        assert kube.deployment(v2)["metadata"]["annotations"]["inferd.io/version"] == "v2"
        reply = server.client.post("/api/v1/deployments/calc/rollback")
        assert reply.status_code == 200, reply.text
        server.wait_for(lambda: _y(server, "calc", 1.0) == 7.0, 30, "back on v1")

        # undeployed: its Deployment is deleted, its pods drain and go
        reply = server.client.delete("/api/v1/deployments/calc/v2")
        assert reply.status_code == 202, reply.text
        server.wait_for(lambda: kube.deployment(v2) is None, 60, "v2's Deployment deleted")
        server.wait_for(
            lambda: (
                not any(
                    p["metadata"]["labels"].get("inferd.io/deployment") == v2
                    for p in kube.pod_list()
                )
            ),
            60,
            "v2's pods gone",
        )
    finally:
        assert server.stop() == 0, server.log()[-4000:]
    # the controller stopped: its pods keep serving, and the next controller adopts them
    # (the same spec is not applied again)
    assert len(_ready_pods(kube, v1)) == 2
    applies = len(_calls(kube, "PATCH", f"/deployments/{v1}"))
    again = _server(tmp_path, kube, s3, "srv2")
    try:
        again.wait_ready()
        again.wait_for(lambda: _y(again, "calc", 1.0) == 7.0, 30, "serving after restart")
        assert len(_calls(kube, "PATCH", f"/deployments/{v1}")) == applies
    finally:
        assert again.stop() == 0, again.log()[-4000:]


def test_the_chart_s_roles_scale_a_deployment_to_zero_and_a_request_brings_a_pod_back(
    tmp_path: Path, kube: FakeKube, s3: dict[str, str]
):
    """``inferd control`` and ``inferd gateway`` as the chart runs them; the autoscaler
    drives the Deployment's scale."""
    from tests.roles import Role, gateway_role, wait

    kube.add_owner("inferd-control")
    env = {**_env(tmp_path, kube, s3), "INFERD_AUTOSCALE_INTERVAL_S": "0.3"}
    listen, port = f"127.0.0.1:{free_port()}", free_port()
    control = Role(tmp_path / "control", "control", "control", "--listen", listen, env=env)
    gateway = gateway_role(tmp_path / "gateway", listen, port, env=env)
    roles = (control, gateway)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    name = deployment_name("inferd", "calc", "v1")

    def y(x: float) -> float | None:
        reply = client.post("/api/v1/models/calc/predict", json={"inputs": [{"x": x}]})
        return reply.json()["outputs"][0]["y"] if reply.status_code == 200 else None

    try:
        wait(lambda: client.get("/health/ready?models=none").status_code == 200, "gateway", *roles)
        _upload_to(client, "calc", "v1", "x * 3")
        policy = {"min_replicas": 0, "max_replicas": 2, "idle_timeout_s": 2}
        reply = client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "autoscaling": policy},
        )
        assert reply.status_code == 201, reply.text
        wait(lambda: y(1.0) == 3.0, "a first pod serving", *roles, timeout_s=60)
        wait(
            lambda: (
                (kube.deployment(name) or {}).get("spec", {}).get("replicas") == 0
                and not kube.pod_list()
            ),
            "the Deployment scaled to zero after 2 s idle, its pod gone",
            *roles,
            timeout_s=30,
        )
        assert _calls(kube, "PATCH", f"/deployments/{name}/scale")[-1][3] == {
            "spec": {"replicas": 0}
        }
        cold = client.post("/api/v1/models/calc/predict", json={"inputs": [{"x": 5}]})
        assert cold.status_code == 200, cold.text  # held while a pod started
        assert cold.json()["outputs"] == [{"y": 15.0}]
        assert float(cold.headers["x-inferd-cold-start-ms"]) > 0
        assert kube.deployment(name)["spec"]["replicas"] == 1

        # a GPU the cluster has no node for: accepted (the scheduler places pods, not
        # the gateway's host), and the replica says why it does not come up
        _upload_to(client, "calc", "v2", "x * 4")
        reply = client.post(
            "/api/v1/deployments",
            json={
                "model_name": "calc", "version": "v2", "traffic_percent": 0,
                "resources": {"gpu": "a100"},
            },
        )  # fmt: skip
        assert reply.status_code == 201, reply.text
        gpu = deployment_name("inferd", "calc", "v2")
        wait(lambda: kube.deployment(gpu) is not None, "the GPU Deployment", *roles)
        container = kube.deployment(gpu)["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1

        def unschedulable() -> bool:
            found = client.get("/api/v1/models/calc/versions/v2").json()["replicas"]
            return any("Unschedulable" in r.get("message", "") for r in found)

        wait(unschedulable, "the scheduler's reason on the replica", *roles, timeout_s=30)
        assert y(1.0) == 3.0  # v1 serves on
        lease = kube.objects["leases"]["inferd-controller"]
        assert lease["spec"]["holderIdentity"]  # the control led through the Lease
    finally:
        client.close()
        codes = [r.stop() for r in reversed(roles)]
        assert codes == [0, 0], "\n".join(r.log()[-3000:] for r in roles)
    assert not kube.objects["leases"]["inferd-controller"]["spec"]["holderIdentity"]


def test_a_controller_that_cannot_use_the_api_says_why_and_stops(tmp_path: Path):
    """No configuration, or a Role without leases: one line saying so, no traceback."""
    kube = FakeKube(tmp_path / "kube", namespace=NS)
    kube.start()
    kube.forbid = {"leases"}
    base = {
        "PATH": "/usr/bin:/bin",
        "INFERD_REPLICA_BACKEND": "kubernetes",
        "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/models",
        "INFERD_CLUSTER__TOKEN": TOKEN,
        "INFERD_KUBERNETES__NAMESPACE": NS,
    }
    cases = {
        "no Kubernetes API is configured": {"KUBECONFIG": str(tmp_path / "none")},
        'cannot get resource "leases"': {
            "KUBECONFIG": str(kube.kubeconfig(tmp_path / "kubeconfig"))
        },
    }
    try:
        for said, env in cases.items():
            done = subprocess.run(
                [sys.executable, "-m", "inferd", "control", "--listen", f"127.0.0.1:{free_port()}",
                 "--data-dir", str(tmp_path / "data")],
                env={**base, **env}, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode != 0 and said in done.stderr, done.stderr[-2000:]
            assert "Traceback" not in done.stderr, done.stderr[-3000:]
    finally:
        kube.stop()


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: modification time and size."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")
    }


def test_a_node_s_cache_is_written_by_fetch_steps_only_and_a_changed_entry_fetched_again(
    tmp_path: Path, kube: FakeKube, s3: dict[str, str]
):
    from inferd.registry.store import digest_of

    kube.add_owner("inferd-control")
    env = {**_env(tmp_path, kube, s3), "INFERD_KUBERNETES__NODE_CACHE_PATH": "/var/cache/inferd"}
    server = InferdServer(tmp_path / "srv", workers=1, env=env)
    name = deployment_name("inferd", "calc", "v1")
    node = kube.root / "node" / "var" / "cache" / "inferd"  # the fake node's hostPath

    def replicas() -> list[dict]:
        return server.client.get("/api/v1/models/calc/versions/v1").json()["replicas"]

    try:
        server.wait_ready()
        pushed = upload_arithmetic(server.client, "calc", "v1", "x * 7")
        assert pushed.status_code == 201, pushed.text
        sha = pushed.json()["version"]["sha256"]
        server.wait_for(lambda: _y(server, "calc", 2.0) == 14.0, 90, "calc:v1 served by a pod")
        entry = node / sha
        assert digest_of(entry) == sha  # the pod's fetch step filled the node's cache
        (pod,) = _ready_pods(kube, name)
        (step,) = pod["status"]["initContainerStatuses"]
        assert step["name"] == "fetch" and step["state"]["terminated"]["exitCode"] == 0

        # the replica container writes nothing there: a crash restarts it alone (no
        # fetch step), and it serves the entry as it is
        before = _snapshot(node)
        first = pod["metadata"]["name"]
        kube.kill_container(first)
        server.wait_for(
            lambda: any(r["id"] == first and r["restarts"] >= 1 and r["state"] == "ready"
                        for r in replicas()),
            60, "the crashed replica container restarted and routed again",
        )  # fmt: skip
        assert _snapshot(node) == before

        # an entry changed on the node (what a pod that could write it might do): the
        # next pod's fetch step hashes it, finds it changed and fetches it again
        (entry / "model.py").write_text(arithmetic_model("x * 1000"))
        reply = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "resources": {"replicas": 2}},
        )
        assert reply.status_code == 201, reply.text
        server.wait_for(lambda: len(_ready_pods(kube, name)) == 2, 90, "a second pod ready")
        server.wait_for(
            lambda: sum(r["state"] == "ready" for r in replicas()) == 2, 30, "both routed"
        )
        assert digest_of(entry) == sha
        with ThreadPoolExecutor(8) as pool:  # at once: both pods answer
            answers = set(pool.map(lambda _: _y(server, "calc", 1.0), range(64)))
        assert answers == {7.0}
        (second,) = [p for p in _ready_pods(kube, name) if p["metadata"]["name"] != first]
        log = (kube.root / f"{second['metadata']['name']}.log").read_text()
        assert "changed since it was fetched" in log, log[-3000:]
    finally:
        assert server.stop() == 0, server.log()[-4000:]


def test_a_replica_container_serves_its_node_s_entry_or_else_fetches_its_own(tmp_path: Path):
    from inferd.registry.artifact_cache import ArtifactCache
    from inferd.serving.joiner import localize
    from inferd.serving.pod import from_node

    sha = "ab" * 32
    spec = ReplicaSpec(
        replica_id="", model="calc", version="v1", framework="python", artifact_dir="",
        address="", artifact_uri="s3://models/calc/v1", sha256=sha,
    )  # fmt: skip
    node, own = tmp_path / "node", (tmp_path / "data" / "artifact-cache", 1 << 30)
    on_node = localize(spec, node, 1 << 30)

    def fill(folder: Path) -> int:
        folder.mkdir()
        (folder / "model.py").write_text("y = x")
        return 5

    ArtifactCache(node, 1 << 30).open(sha, fill, hold=False)  # the pod's fetch step
    served, held = from_node(on_node, own)
    assert held is not None and served.artifact_dir == str(node / sha)
    assert served.artifact_uri == ""  # nothing left to fetch: served as it is
    assert ArtifactCache(node, 1).evict() == []  # held while the replica runs
    held.close()
    assert ArtifactCache(node, 1).evict() == [sha]  # evicted, say, while it restarted
    served, held = from_node(on_node, own)
    assert held is None and served.artifact_uri == spec.artifact_uri  # fetched, but ...
    assert served.artifact_dir == str(own[0].resolve() / sha)  # ... into its own folder


def test_a_fetch_step_that_cannot_finish_is_the_replica_s_problem():
    from lightkube.resources.core_v1 import Pod

    from inferd.control.backends.kubernetes import seen

    def waiting(name: str, reason: str, **extra: object) -> dict:
        return {"name": name, "image": "inferd:1", "imageID": "", "ready": False,
                "restartCount": 2, "state": {"waiting": {"reason": reason}}, **extra}  # fmt: skip

    names = {"inferd.io/model": "m", "inferd.io/version": "v"}
    pod = Pod.from_dict({
        "metadata": {"name": "p", "annotations": names},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [waiting("replica", "PodInitializing")],
            "initContainerStatuses": [waiting(
                "fetch", "CrashLoopBackOff",
                lastState={"terminated": {"exitCode": 1, "reason": "Error"}},
            )],
        },
    })  # fmt: skip
    found = seen(pod)
    assert found is not None and found.failed and not found.ready
    assert found.problem == "its fetch step: CrashLoopBackOff, exited with code 1"


def test_the_deployment_asks_for_gpus_probes_and_drains_as_kubernetes_expects():
    settings = Settings(
        kubernetes=KubernetesConfig(
            image="registry.example.com/inferd:1.0",
            service_account="inferd-replica",
            env_from_secrets=["inferd-env"],
            node_selector={"pool": "inference"},
        ),
        shutdown_grace_s=30,
    )
    spec = ReplicaSpec(
        replica_id="",
        model="Big_Model.v2",
        version="2024-01-01",
        framework="onnx",
        artifact_dir="/tmp/x",
        address="",
    )
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ctl", "uid": "u-1"}
    body = manifest(settings, "prod", spec, 3, "a100", owner)
    pod = body["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"pool": "inference", "nvidia.com/gpu.product": "a100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_s
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    name = body["metadata"]["name"]
    assert len(name) <= 46 and name.startswith("inferd-big-model-v2-2024-01-01")
    assert body["metadata"]["annotations"]["inferd.io/model"] == "Big_Model.v2"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert ReplicaSpec.from_json(env["INFERD_REPLICA_SPEC"]).model == "Big_Model.v2"
    try:
        from tests.k8s_schemas import validate
    except ImportError:  # pragma: no cover - the chart's tests bring it
        return
    validate(body)


def test_replica_pods_of_a_node_share_its_artifact_cache_when_given_one():
    spec = ReplicaSpec(
        replica_id="", model="calc", version="v1", framework="python", artifact_dir="",
        address="", artifact_uri="s3://models/calc/v1", sha256="ab" * 32,
    )  # fmt: skip
    own = manifest(Settings(), "prod", spec, 1, None, None)["spec"]["template"]["spec"]
    assert all(v["name"] != "artifact-cache" for v in own["volumes"])  # its emptyDir
    kube = KubernetesConfig(node_cache_path="/var/cache/inferd")
    body = manifest(Settings(kubernetes=kube), "prod", spec, 1, None, None)
    pod = body["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "artifact-cache"]
    assert volume["hostPath"] == {"path": "/var/cache/inferd", "type": "DirectoryOrCreate"}
    container = pod["containers"][0]
    # the replica, which runs the version's code, cannot write the node's cache ...
    mount = {"name": "artifact-cache", "mountPath": "/cache", "readOnly": True}
    assert mount in container["volumeMounts"]
    assert container["args"][-1] == "--read-only-cache"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["INFERD_ARTIFACT_CACHE__DIR"] == "/cache"
    # ... only its fetch step does: the chart's image, fetching and checking, no model
    (step,) = pod["initContainers"]
    assert step["name"] == "fetch" and step["image"] == kube.image
    assert step["args"] == ["replica", "--spec-env", "INFERD_REPLICA_SPEC", "--fetch-only"]
    assert {"name": "artifact-cache", "mountPath": "/cache"} in step["volumeMounts"]
    assert not any(m.get("readOnly") for m in step["volumeMounts"])
    assert step["securityContext"] == container["securityContext"]
    assert "ports" not in step and "nvidia.com/gpu" not in step["resources"]["limits"]
    step_env = {e["name"]: e.get("value") for e in step["env"]}
    assert step_env["INFERD_ARTIFACT_CACHE__DIR"] == "/cache"
    assert step_env["INFERD_REPLICA_SPEC"] == env["INFERD_REPLICA_SPEC"]
    assert step["envFrom"] == container["envFrom"]  # the store's credentials
    # a version naming its own image runs it in the replica container only
    own_image = msgspec.structs.replace(spec, metadata={"image": "someone/else:1"})
    steps = manifest(Settings(kubernetes=kube), "prod", own_image, 1, "any", None)
    chosen = steps["spec"]["template"]["spec"]
    assert chosen["containers"][0]["image"] == "someone/else:1"
    assert chosen["initContainers"][0]["image"] == kube.image
    # what the pod's own settings make of it: the version's folder is the node's entry
    from inferd.config import Settings as PodSettings
    from inferd.serving.joiner import localize

    here = PodSettings(artifact_cache={"dir": env["INFERD_ARTIFACT_CACHE__DIR"]})
    local = localize(spec, here.artifact_cache_dir, here.artifact_cache_max_bytes)
    assert local.artifact_dir == f"/cache/{'ab' * 32}"
    try:
        from tests.k8s_schemas import validate
    except ImportError:  # pragma: no cover - the chart's tests bring it
        return
    validate(body)


def test_versions_that_need_pytorch_run_the_torch_image_unless_they_name_one():
    from inferd.control.backends.kubernetes import image_of

    kube = KubernetesConfig(image="inferd:1", torch_image="inferd:1-llm")

    def spec(framework: str, **metadata: object) -> ReplicaSpec:
        return ReplicaSpec(
            replica_id="", model="m", version="v", framework=framework, artifact_dir="",
            address="", metadata=metadata,
        )  # fmt: skip

    assert image_of(kube, spec("xgboost")) == "inferd:1"
    assert image_of(kube, spec("gpt2")) == "inferd:1-llm"
    assert image_of(kube, spec("llm", image="vllm-inferd:2")) == "vllm-inferd:2"
    assert image_of(KubernetesConfig(image="inferd:1"), spec("torch")) == "inferd:1"


def test_a_lease_elects_one_controller_and_hands_over(tmp_path: Path):
    from lightkube import AsyncClient
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.resources.coordination_v1 import Lease

    from inferd.control.lease import LeaseLeadership

    kube = FakeKube(tmp_path / "kube", namespace=NS)
    kube.start()
    config = KubernetesConfig(lease_duration_s=2)

    def client() -> AsyncClient:
        return AsyncClient(KubeConfig.from_file(kube.kubeconfig(tmp_path / "kc")), namespace=NS)

    async def scenario() -> None:
        said: list[str] = []
        a = await LeaseLeadership.acquire(config, NS, said.append, client(), "ctl-a")
        b_task = asyncio.create_task(
            LeaseLeadership.acquire(config, NS, said.append, client(), "ctl-b")
        )
        await asyncio.sleep(3 * config.lease_duration_s)  # a renews: b keeps waiting
        assert not b_task.done() and not a.lost.is_set()
        assert any("ctl-a leads" in s for s in said)
        started = time.monotonic()
        await a.release()  # a clean stop hands over at once, not after the duration
        b = await asyncio.wait_for(b_task, 5)
        assert time.monotonic() - started < 1.5 * 2
        lease = kube.objects["leases"][config.lease_name]
        assert lease["spec"]["holderIdentity"] == "ctl-b"
        assert lease["spec"]["leaseTransitions"] == 1

        # b hangs (stops renewing without a word): c takes over once the Lease expired,
        # and b, when it wakes, sees it lost and stops leading
        assert b._renew is not None
        b._renew.cancel()
        c = await asyncio.wait_for(
            LeaseLeadership.acquire(config, NS, said.append, client(), "ctl-c"), 10
        )
        assert kube.objects["leases"][config.lease_name]["spec"]["holderIdentity"] == "ctl-c"
        b._renew = asyncio.create_task(b._renew_forever())
        await asyncio.wait_for(b.lost.wait(), 5)
        assert "taken by ctl-c" in b.why
        await b.release()
        # a renewal cancelled at stop after its write landed leaves c an old copy
        # (resourceVersion moved): the release still clears the holder
        assert c._renew is not None
        c._renew.cancel()
        other = client()
        await other.replace(await other.get(Lease, config.lease_name, namespace=NS))
        await other.close()
        await c.release()
        assert kube.objects["leases"][config.lease_name]["spec"]["holderIdentity"] == ""

    try:
        asyncio.run(scenario())
    finally:
        kube.stop()


def test_a_pod_answers_its_probes(tmp_path: Path):
    """``inferd replica --spec-env`` alone: health says loading, then ready; SIGTERM
    fails readiness at once and the process leaves with 0."""
    model = tmp_path / "src"
    model.mkdir()
    (model / "model.py").write_text(arithmetic_model("x + 1"))
    from tests.conftest import local_registry, push_folder

    push_folder(tmp_path / "data", "inc", model)
    record = local_registry(tmp_path / "data").get_version("inc", "v1")
    spec = ReplicaSpec(
        replica_id="",
        model="inc",
        version="v1",
        framework=record.framework,
        artifact_dir=str(record.artifact_path),
        address="",
        signature=record.signature,
    )
    port, health = free_port(), free_port()
    env = {
        "INFERD_REPLICA_SPEC": spec.to_json(),
        "INFERD_CLUSTER__TOKEN": TOKEN,
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferd", "replica", "--spec-env", "INFERD_REPLICA_SPEC",
         "--replica-id", "inc-pod-1", "--listen", f"127.0.0.1:{port}",
         "--health-listen", f"127.0.0.1:{health}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        states = []
        while time.monotonic() < deadline:
            try:
                reply = httpx.get(f"http://127.0.0.1:{health}/health/ready", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            states.append(reply.json()["state"])
            if reply.status_code == 200:
                break
            assert reply.status_code == 503
            time.sleep(0.05)
        assert states[-1] == "ready", states
        live = httpx.get(f"http://127.0.0.1:{health}/health/live", timeout=1)
        assert live.status_code == 200
        assert httpx.get(f"http://127.0.0.1:{health}/nope", timeout=1).status_code == 404
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode()
    assert "serving inc:v1 as inc-pod-1" in output, output[-2000:]
