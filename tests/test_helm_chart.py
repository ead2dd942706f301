"""The Helm chart (deploy/helm/inferd), rendered as `helm template` renders it and checked.

Helm cannot be installed here, so ``scripts/helm-render.sh`` renders with the real
``helm`` when one is on PATH and otherwise with ``deploy/helm/render`` (Helm's template
engine in miniature, built from Debian's Go packages). Every object of every values
file in ``deploy/helm/inferd/ci/`` is validated against the OpenAPI schemas of the
newest Kubernetes versions ``kubernetes-validate`` bundles (:mod:`tests.k8s_schemas`);
the Prometheus Operator's custom resources, which have no bundled schema, get checks of
their own. The rest asserts what the Kubernetes replica backend relies on: the RBAC
rules, the settings the control is given, labels and selectors, network policies, TLS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferd import __version__
from inferd.config import NOT_SETTINGS_PREFIXES, Settings
from tests.k8s_schemas import VERSIONS, InvalidObject, validate

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "inferd"
RENDER = ROOT / "scripts" / "helm-render.sh"
CI_VALUES = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "ml"
FULLNAME = "demo-inferd"
CRD_GROUP = "monitoring.coreos.com/"
USER_SECRETS = {"inferd-extra-env", "replica-s3-keys"}
"""Secrets the ci values name that the user makes (existingSecret)."""

Obj = dict[str, Any]


@pytest.fixture(scope="module", autouse=True)
def renderer() -> None:
    build = subprocess.run(["bash", str(RENDER), "--build"], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"no Helm renderer (helm, or Go from Debian's packages): {build.stderr}")


def run_render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(RENDER), RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@cache
def render(*args: str) -> tuple[Obj, ...]:
    done = run_render(*args)
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def render_ci(name: str, *args: str) -> tuple[Obj, ...]:
    return render("-f", str(CHART / "ci" / name), *args)


def render_error(*args: str) -> str:
    done = run_render(*args)
    assert done.returncode != 0, "rendered values that should be refused"
    return done.stderr


def find(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def container(objs: tuple[Obj, ...], role: str) -> Obj:
    pod = one(objs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]
    return pod["containers"][0]


def env_of(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def replica_pod_labels(release: str = RELEASE) -> dict[str, str]:
    """The labels the kubernetes backend puts on replica pods."""
    return {
        "app.kubernetes.io/name": "inferd",
        "app.kubernetes.io/instance": release,
        "app.kubernetes.io/component": "replica",
        "app.kubernetes.io/managed-by": "inferd",
        "inferd.io/model": "fraud",
        "inferd.io/version": "v1",
    }


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions: In, NotIn, Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if (op == "In" and value not in expr["values"]) or (
            op == "NotIn" and value in expr["values"]
        ):
            return False
        if op == "Exists" and value is None:
            return False
    return True


# --- every object, every values file ---------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES)
def test_every_object_is_valid_on_the_supported_kubernetes_versions(values: str) -> None:
    objs = render_ci(values)
    assert len(VERSIONS) == 4, VERSIONS
    kinds = set()
    for obj in objs:
        kinds.add(obj["kind"])
        if obj["apiVersion"].startswith(CRD_GROUP):
            check_custom_resource(obj, objs)
        else:
            validate(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert "namespace" not in obj["metadata"], "helm install --namespace places them"
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "two objects of one kind share a name"
    assert {"Deployment", "Service", "Role", "RoleBinding", "ServiceAccount"} <= kinds
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Namespace"}, kinds


def check_custom_resource(obj: Obj, objs: tuple[Obj, ...]) -> None:
    """What a ServiceMonitor or PrometheusRule must hold (no bundled schema for them)."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    spec = obj["spec"]
    if obj["kind"] == "ServiceMonitor":
        service = one(objs, "Service", f"{FULLNAME}-gateway")
        assert selects(spec["selector"], service["metadata"]["labels"])
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        ports = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
            assert endpoint["scheme"] in ("http", "https")
    elif obj["kind"] == "PrometheusRule":
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert isinstance(rule["alert"], str) and isinstance(rule["expr"], str)
    else:
        raise AssertionError(f"unexpected custom resource {obj['kind']}")


def test_the_validator_refuses_what_an_api_server_would() -> None:
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "two", "selector": {}, "templat": {}},
    }
    with pytest.raises(InvalidObject) as caught:
        validate(bad)
    message = str(caught.value)
    assert "Deployment 'x'" in message and VERSIONS[0] in message
    assert "templat" in message and "replicas" in message
    with pytest.raises(InvalidObject, match="no schema for ServiceMonitor"):
        validate({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor"})


# --- the control and the kubernetes replica backend ------------------------------------


def test_rbac_is_exactly_what_the_backend_uses() -> None:
    for values in CI_VALUES:
        objs = render_ci(values)
        role = one(objs, "Role", f"{FULLNAME}-control")
        rules = {
            (g, r, tuple(sorted(rule["verbs"])))
            for rule in role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
        }
        assert rules == {
            (
                "apps",
                "deployments",
                ("create", "delete", "get", "list", "patch", "update", "watch"),
            ),
            ("apps", "deployments/scale", ("get", "patch", "update")),
            ("", "pods", ("get", "list", "watch")),
            ("coordination.k8s.io", "leases", ("create", "get", "update")),
        }
        binding = one(objs, "RoleBinding", f"{FULLNAME}-control")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": f"{FULLNAME}-control",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": f"{FULLNAME}-control", "namespace": NAMESPACE}
        ]
        pod = one(objs, "Deployment", f"{FULLNAME}-control")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == f"{FULLNAME}-control"
        for role_name in ("gateway", "replica"):
            account = one(objs, "ServiceAccount", f"{FULLNAME}-{role_name}")
            assert account["automountServiceAccountToken"] is False
            assert not [
                b
                for b in find(objs, "RoleBinding")
                if b["subjects"][0]["name"] == account["metadata"]["name"]
            ]


def test_the_control_gets_the_kubernetes_backend_settings() -> None:
    objs = render_ci("external-tls-monitoring-values.yaml")
    control = container(objs, "control")
    env = env_of(control)
    assert control["command"] == ["inferd"]
    assert control["args"] == ["control", "--listen", "0.0.0.0:7000"]
    assert env["INFERD_REPLICA_BACKEND"] == "kubernetes"
    assert env["INFERD_KUBERNETES__OWNER"] == f"{FULLNAME}-control"
    assert find(objs, "Deployment", env["INFERD_KUBERNETES__OWNER"])
    assert env["INFERD_KUBERNETES__INSTANCE"] == RELEASE
    assert (
        env["INFERD_KUBERNETES__IMAGE"]
        == control["image"]
        == "registry.example.com/ml/inferd:0.1.0"
    )
    assert env["INFERD_KUBERNETES__IMAGE_PULL_POLICY"] == control["imagePullPolicy"] == "Always"
    assert json.loads(env["INFERD_KUBERNETES__IMAGE_PULL_SECRETS"]) == ["registry-credentials"]
    assert env["INFERD_KUBERNETES__SERVICE_ACCOUNT"] == f"{FULLNAME}-replica"
    # Replica pods run model code: the cluster token and the store's keys, not the
    # database's or Redis' credentials (nor existingSecret, which may hold them).
    assert json.loads(env["INFERD_KUBERNETES__ENV_FROM_SECRETS"]) == [f"{FULLNAME}-replica-env"]
    replica_env = one(objs, "Secret", f"{FULLNAME}-replica-env")["stringData"]
    assert replica_env == {"INFERD_CLUSTER__TOKEN": "a-cluster-token-of-32-characters"}
    assert json.loads(env["INFERD_KUBERNETES__ENV_FROM_CONFIG_MAPS"]) == [f"{FULLNAME}-env"]
    assert env["INFERD_KUBERNETES__NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert (env["INFERD_KUBERNETES__REPLICA_PORT"], env["INFERD_KUBERNETES__HEALTH_PORT"]) == (
        "9000",
        "9001",
    )
    assert env["INFERD_KUBERNETES__LEADER_ELECTION"] == "true"
    assert env["INFERD_KUBERNETES__LEASE_NAME"] == f"{FULLNAME}-controller"
    deployment = one(objs, "Deployment", f"{FULLNAME}-control")
    assert deployment["spec"]["replicas"] == 2
    # A new control is not ready while the old one leads: a rolling update would hang.
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert control["readinessProbe"] == {
        "tcpSocket": {"port": "control"},
        "periodSeconds": 5,
        "failureThreshold": 2,
    }
    # The gateways reach the control through its Service, on the control channel's port.
    gateway = container(objs, "gateway")
    assert gateway["args"][:3] == ["gateway", "--control", f"{FULLNAME}-control:7000"]
    service = one(objs, "Service", f"{FULLNAME}-control")
    assert service["spec"]["ports"] == [
        {"name": "control", "port": 7000, "targetPort": "control", "protocol": "TCP"}
    ]


def test_gpu_values_reach_the_replica_pods_settings() -> None:
    env = env_of(container(render_ci("gpu-values.yaml"), "control"))
    assert json.loads(env["INFERD_KUBERNETES__NODE_SELECTOR"]) == {"nvidia.com/gpu.present": "true"}
    assert json.loads(env["INFERD_KUBERNETES__TOLERATIONS"]) == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert env["INFERD_KUBERNETES__GPU_NODE_LABEL"] == "nvidia.com/gpu.product"
    assert (env["INFERD_KUBERNETES__CPU_REQUEST"], env["INFERD_KUBERNETES__MEMORY_REQUEST"]) == (
        "2",
        "16Gi",
    )
    assert env["INFERD_KUBERNETES__DATA_SIZE_LIMIT"] == "100Gi"
    assert env["INFERD_KUBERNETES__NODE_CACHE_PATH"] == "/var/cache/inferd"
    assert json.loads(env["INFERD_KUBERNETES__ENV_FROM_SECRETS"]) == [
        f"{FULLNAME}-replica-env",
        "replica-s3-keys",
    ]
    # The default is the backend's default: no node selector, no tolerations.
    default = env_of(container(render_ci("default-values.yaml"), "control"))
    assert json.loads(default["INFERD_KUBERNETES__NODE_SELECTOR"]) == {}
    assert json.loads(default["INFERD_KUBERNETES__TOLERATIONS"]) == []
    assert "INFERD_KUBERNETES__NODE_CACHE_PATH" not in default  # each pod its own cache


def chart_environment(objs: tuple[Obj, ...], role: str, config_file: Path) -> dict[str, str]:
    """The environment a role's container starts with (envFrom, then env); a replica pod's
    is what the control hands the backend (kubernetes.env_from_*)."""
    if role == "replica":
        control = env_of(container(objs, "control"))
        env = {}
        for name in json.loads(control["INFERD_KUBERNETES__ENV_FROM_CONFIG_MAPS"]):
            env.update(one(objs, "ConfigMap", name)["data"])
        for name in json.loads(control["INFERD_KUBERNETES__ENV_FROM_SECRETS"]):
            env.update({} if name in USER_SECRETS else one(objs, "Secret", name)["stringData"])
        return env
    c = container(objs, role)
    env: dict[str, str] = {}
    for source in c["envFrom"]:
        if "configMapRef" in source:
            env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            name = source["secretRef"]["name"]
            env.update({} if name in USER_SECRETS else one(objs, "Secret", name)["stringData"])
    for name, value in env_of(c).items():
        env[name] = NAMESPACE if isinstance(value, dict) else value
    env["INFERD_CONFIG"] = str(config_file)
    return env


def settings_of(
    objs: tuple[Obj, ...], role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """inferd's settings in a role's pod: an unknown INFERD_* name or a bad value raises."""
    config = tmp_path / "config.yaml"
    config.write_text(one(objs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    for name in list(os.environ):
        if name.startswith("INFERD_") and not name.startswith(NOT_SETTINGS_PREFIXES):
            monkeypatch.delenv(name)
    for name, value in chart_environment(objs, role, config).items():
        monkeypatch.setenv(name, value)
    return Settings()


@pytest.mark.parametrize("values", CI_VALUES)
@pytest.mark.parametrize("role", ["control", "gateway", "replica"])
def test_what_the_chart_sets_loads_as_inferd_settings(
    values: str, role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_of(render_ci(values), role, tmp_path, monkeypatch)
    assert str(settings.data_dir) == "/data"
    assert settings.artifact_store == "s3://models/inferd"
    assert settings.cluster.token and len(settings.cluster.token) >= 16
    if role == "replica":
        assert settings.database_url is None and settings.redis_url is None
        return
    assert settings.database_url and settings.database_url.startswith("postgresql+psycopg://")
    assert settings.redis_url and settings.queue_url and settings.queue_url.endswith("/1")
    # the gateways accept deployments whose GPUs are the cluster's, not their host's
    assert settings.replica_backend == "kubernetes"
    if role == "control":
        assert settings.kubernetes.owner == f"{FULLNAME}-control"
        assert settings.kubernetes.namespace == NAMESPACE
    if values.startswith("external"):
        assert settings.request_timeout_s == 20 and settings.cache.enabled
        assert settings.hold_timeout_s == 10
        if role == "gateway":
            assert str(settings.tls.cert_file) == "/etc/inferd/tls/tls.crt"


@pytest.mark.parametrize("values", CI_VALUES)
def test_the_replica_deployments_the_control_creates_fit_the_chart(
    values: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's own manifest, from the settings the chart gives the control."""
    from inferd.control.backends.kubernetes import manifest
    from inferd.shapes.replica_spec import ReplicaSpec

    objs = render_ci(values)
    settings = settings_of(objs, "control", tmp_path, monkeypatch)
    spec = ReplicaSpec(
        replica_id="",
        model="fraud",
        version="v1",
        framework="xgboost",
        artifact_dir="/data/artifacts/fraud/v1",
        address="",
    )
    control = one(objs, "Deployment", f"{FULLNAME}-control")
    owner = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": settings.kubernetes.owner,
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    body = manifest(settings, NAMESPACE, spec, 2, "any", owner)
    validate(body)
    assert body["metadata"]["ownerReferences"][0]["name"] == control["metadata"]["name"]
    pod = body["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert selects({"matchLabels": control["spec"]["selector"]["matchLabels"]}, labels) is False
    for policy in find(objs, "NetworkPolicy"):
        chosen = selects(policy["spec"]["podSelector"], labels)
        assert chosen == policy["metadata"]["name"].endswith("-replica")
    for service in find(objs, "Service"):
        assert not selects({"matchLabels": service["spec"]["selector"]}, labels)
    account = one(objs, "ServiceAccount", pod["spec"]["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    c = pod["spec"]["containers"][0]
    assert c["image"] == container(objs, "control")["image"]
    for source in c["envFrom"]:
        ref = source.get("secretRef") or source["configMapRef"]
        kind = "Secret" if "secretRef" in source else "ConfigMap"
        assert find(objs, kind, ref["name"]) or ref["name"] in USER_SECRETS
    # with the node's artifact cache: read-only to the replica, written by a fetch step
    # of the chart's own image, as unprivileged as the replica
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    if settings.kubernetes.node_cache_path is None:
        assert "artifact-cache" not in volumes and "initContainers" not in pod["spec"]
        return
    assert volumes["artifact-cache"]["hostPath"]["path"] == settings.kubernetes.node_cache_path
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "artifact-cache"]
    assert mount["readOnly"] is True
    (step,) = pod["spec"]["initContainers"]
    assert step["image"] == container(objs, "control")["image"]
    assert step["args"][-1] == "--fetch-only"
    (writable,) = [m for m in step["volumeMounts"] if m["name"] == "artifact-cache"]
    assert not writable.get("readOnly")
    assert step["securityContext"]["readOnlyRootFilesystem"] is True
    assert step["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert step["resources"]["limits"]["memory"]


# --- labels, selectors, scaling --------------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES)
def test_selectors_match_the_pods_they_mean(values: str) -> None:
    objs = render_ci(values)
    workloads = find(objs, "Deployment") + find(objs, "StatefulSet")
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads}
    for w in workloads:
        assert selects(w["spec"]["selector"], pods[w["metadata"]["name"]])
        assert set(w["spec"]["selector"]["matchLabels"]) == {
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
        }
    for service in find(objs, "Service"):
        chosen = [
            n
            for n, labels in pods.items()
            if selects({"matchLabels": service["spec"]["selector"]}, labels)
        ]
        assert chosen == [service["metadata"]["name"]], (service["metadata"]["name"], chosen)
        assert not selects({"matchLabels": service["spec"]["selector"]}, replica_pod_labels())
    for pdb in find(objs, "PodDisruptionBudget"):
        assert [n for n, labels in pods.items() if selects(pdb["spec"]["selector"], labels)] == [
            pdb["metadata"]["name"]
        ]
    for hpa in find(objs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in pods


def test_gateways_autoscale_on_cpu_unless_switched_off() -> None:
    default = render_ci("default-values.yaml")
    hpa = one(default, "HorizontalPodAutoscaler", f"{FULLNAME}-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 70},
            },
        }
    ]
    assert "replicas" not in one(default, "Deployment", f"{FULLNAME}-gateway")["spec"]
    assert one(default, "PodDisruptionBudget", f"{FULLNAME}-gateway")["spec"]["minAvailable"] == 1
    assert not find(default, "PodDisruptionBudget", f"{FULLNAME}-control")
    fixed = render_ci("external-tls-monitoring-values.yaml")
    assert not find(fixed, "HorizontalPodAutoscaler")
    assert one(fixed, "Deployment", f"{FULLNAME}-gateway")["spec"]["replicas"] == 3
    assert one(fixed, "PodDisruptionBudget", f"{FULLNAME}-gateway")["spec"]["minAvailable"] == 2
    service = one(fixed, "Service", f"{FULLNAME}-gateway")
    assert service["spec"]["type"] == "LoadBalancer"
    assert [(p["name"], p["port"], p["appProtocol"]) for p in service["spec"]["ports"]] == [
        ("http", 8000, "https"),
        ("grpc", 8001, "grpc"),
    ]
    # --set on top of a values file, typed as Helm types it.
    scaled = render_ci(
        "default-values.yaml", "--set", "gateway.autoscaling.enabled=false,gateway.replicas=5"
    )
    assert one(scaled, "Deployment", f"{FULLNAME}-gateway")["spec"]["replicas"] == 5


# --- network policies ------------------------------------------------------------------


def ingress_ports(policy: Obj) -> dict[int, list[Obj] | None]:
    """port -> the peers allowed (None: anyone)."""
    return {
        port["port"]: rule.get("from")
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }


def peer_labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "inferd",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": component,
    }


def peers_allow(peers: list[Obj] | None, component: str) -> bool:
    if peers is None:
        return True
    return any(
        "podSelector" in p
        and "namespaceSelector" not in p
        and selects(p["podSelector"], peer_labels(component))
        for p in peers
    )


def test_network_policies_between_the_roles() -> None:
    assert not find(render_ci("default-values.yaml"), "NetworkPolicy")
    objs = render_ci("external-tls-monitoring-values.yaml")
    policies = {
        p["metadata"]["name"].removeprefix(f"{FULLNAME}-"): p for p in find(objs, "NetworkPolicy")
    }
    assert set(policies) == {"replica", "control", "gateway"}  # no bundled PostgreSQL/Redis here
    replica = policies["replica"]
    assert selects(replica["spec"]["podSelector"], replica_pod_labels())
    ports = ingress_ports(replica)
    assert set(ports) == {9000, 9001}
    assert ports[9001] is None  # the kubelet's probes
    allowed = [c for c in ("gateway", "control", "replica", "redis") if peers_allow(ports[9000], c)]
    assert allowed == ["gateway", "control"]
    control = ingress_ports(policies["control"])
    assert set(control) == {7000}
    assert [c for c in ("gateway", "control", "replica") if peers_allow(control[7000], c)] == [
        "gateway"
    ]
    gateway = ingress_ports(policies["gateway"])
    assert set(gateway) == {8000, 8001}
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    } in gateway[8000]
    assert peers_allow(gateway[8000], "control")  # the job runner
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        egress = policy["spec"]["egress"]
        assert {"port": 53, "protocol": "UDP"} in egress[0]["ports"]
        assert {"port": 5432, "protocol": "TCP"} in egress[-1]["ports"]
    # Bundled PostgreSQL and Redis take connections from inferd's own pods only; egress
    # is not restricted by default.
    gpu = {p["metadata"]["name"]: p for p in find(render_ci("gpu-values.yaml"), "NetworkPolicy")}
    for name, port in ((f"{FULLNAME}-postgresql", 5432), (f"{FULLNAME}-redis", 6379)):
        peers = ingress_ports(gpu[name])[port]
        assert peers is not None
        assert all(
            any(selects(p["podSelector"], peer_labels(c)) for p in peers)
            for c in ("control", "gateway")
        )
        assert any(selects(p["podSelector"], replica_pod_labels()) for p in peers)
        assert not any(selects(p["podSelector"], peer_labels("redis")) for p in peers)
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in gpu.values())


# --- TLS, security, settings objects ---------------------------------------------------


def test_tls_from_a_secret_on_the_gateways() -> None:
    objs = render_ci("external-tls-monitoring-values.yaml")
    gateway = container(objs, "gateway")
    pod = one(objs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "inferd-tls"}} in pod["volumes"]
    assert {"name": "tls", "mountPath": "/etc/inferd/tls", "readOnly": True} in gateway[
        "volumeMounts"
    ]
    env = env_of(gateway)
    assert env["INFERD_TLS__CERT_FILE"] == "/etc/inferd/tls/tls.crt"
    assert env["INFERD_TLS__KEY_FILE"] == "/etc/inferd/tls/tls.key"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert gateway[probe]["httpGet"]["scheme"] == "HTTPS"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health/ready?models=none"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health/live"
    monitor = one(objs, "ServiceMonitor", f"{FULLNAME}-gateway")
    assert monitor["spec"]["endpoints"][0]["scheme"] == "https"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    plain = container(render_ci("default-values.yaml"), "gateway")
    assert plain["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert "INFERD_TLS__CERT_FILE" not in env_of(plain)
    assert all(m["name"] != "tls" for m in plain["volumeMounts"])


@pytest.mark.parametrize("values", CI_VALUES)
def test_pods_run_unprivileged_with_a_read_only_root(values: str) -> None:
    objs = render_ci(values)
    for w in find(objs, "Deployment") + find(objs, "StatefulSet"):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    for role in ("control", "gateway"):
        pod = one(objs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for path in ("/data", "/tmp"):
            assert "emptyDir" in volumes[mounts[path]]
        assert (
            volumes[mounts["/etc/inferd/config.yaml"]]["configMap"]["name"] == f"{FULLNAME}-config"
        )
        assert env_of(pod["containers"][0])["INFERD_CONFIG"] == "/etc/inferd/config.yaml"


def test_settings_secret_and_bundled_services() -> None:
    objs = render_ci("default-values.yaml")
    secret = one(objs, "Secret", f"{FULLNAME}-env")["stringData"]
    token = secret["INFERD_CLUSTER__TOKEN"]
    assert len(token) == 32 and token.isalnum()
    assert one(objs, "Secret", f"{FULLNAME}-replica-env")["stringData"] == {
        "INFERD_CLUSTER__TOKEN": token,
        "AWS_ACCESS_KEY_ID": "inferd",
        "AWS_SECRET_ACCESS_KEY": "inferd-secret-key",
    }
    password = one(objs, "Secret", f"{FULLNAME}-postgresql")["stringData"]["password"]
    assert secret["INFERD_DATABASE_URL"] == (
        f"postgresql+psycopg://inferd:{password}@{FULLNAME}-postgresql:5432/inferd"
    )
    redis_password = one(objs, "Secret", f"{FULLNAME}-redis")["stringData"]["password"]
    assert secret["INFERD_REDIS_URL"] == f"redis://:{redis_password}@{FULLNAME}-redis:6379/0"
    assert secret["AWS_SECRET_ACCESS_KEY"] == "inferd-secret-key"
    assert set(one(objs, "ConfigMap", f"{FULLNAME}-env")["data"]) >= {
        "INFERD_DATA_DIR",
        "INFERD_ARTIFACT_STORE",
        "AWS_ENDPOINT_URL",
    }
    postgres = one(objs, "StatefulSet", f"{FULLNAME}-postgresql")
    assert (
        postgres["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        == "10Gi"
    )
    assert one(objs, "Service", f"{FULLNAME}-postgresql")["spec"]["ports"][0]["port"] == 5432
    assert one(objs, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["volumes"]
    external = render_ci("external-tls-monitoring-values.yaml")
    assert not find(external, "StatefulSet")
    secret = one(external, "Secret", f"{FULLNAME}-env")["stringData"]
    assert secret["INFERD_CLUSTER__TOKEN"] == "a-cluster-token-of-32-characters"
    assert secret["INFERD_DATABASE_URL"].endswith("@db.example.com:5432/inferd")
    assert secret["INFERD_QUEUE_URL"] == "redis://:secret@redis.example.com:6379/1"
    for role in ("control", "gateway"):
        refs = [
            s.get("secretRef", s.get("configMapRef"))["name"]
            for s in container(external, role)["envFrom"]
        ]
        assert refs == [f"{FULLNAME}-env", f"{FULLNAME}-env", "inferd-extra-env"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "postgresql.enabled=false"], "inferd needs PostgreSQL on Kubernetes"),
        (["--set", "redis.enabled=false"], "inferd needs Redis on Kubernetes"),
        (["--set", "artifactStore.url="], "needs an S3-compatible artifact store"),
        (["--set", "clusterToken=short"], "clusterToken must have 16 characters or more"),
        (["--set", "tls.enabled=true"], "tls.enabled needs tls.secretName"),
        (["--set", "gateway.replica=3"], "Additional property replica is not allowed"),
    ],
)
def test_values_that_cannot_run_are_refused_with_the_reason(args: list[str], message: str) -> None:
    error = render_error("-f", str(CHART / "ci" / "default-values.yaml"), *args)
    assert message in error, error
    assert error.startswith("Error: ")


# --- the monitoring copies -------------------------------------------------------------


def test_dashboard_and_alert_rules_are_copies_of_deploy() -> None:
    deploy = ROOT / "deploy"
    dashboard = deploy / "grafana" / "inferd.json"
    alerts = deploy / "prometheus" / "alerts.yml"
    assert (CHART / "files" / "grafana-dashboard.json").read_bytes() == dashboard.read_bytes(), (
        "cp deploy/grafana/inferd.json deploy/helm/inferd/files/grafana-dashboard.json"
    )
    assert (CHART / "files" / "alerts.yml").read_bytes() == alerts.read_bytes(), (
        "cp deploy/prometheus/alerts.yml deploy/helm/inferd/files/alerts.yml"
    )
    objs = render_ci("external-tls-monitoring-values.yaml")
    config_map = one(objs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["inferd.json"]) == json.loads(dashboard.read_text())
    rule = one(objs, "PrometheusRule", FULLNAME)
    assert rule["spec"] == yaml.safe_load(alerts.read_text())
    assert not find(render_ci("default-values.yaml"), "PrometheusRule")


def test_chart_metadata_follows_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    objs = render_ci("default-values.yaml")
    assert container(objs, "control")["image"] == f"inferd:{__version__}"
    if shutil.which("helm") is None:  # the renderer's own: NOTES.txt and partials render nothing
        sources = run_render("-f", str(CHART / "ci" / "default-values.yaml")).stdout
        assert "NOTES.txt" not in sources and "_helpers.tpl" not in sources
