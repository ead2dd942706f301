"""The Kubernetes replica backend: a Deployment of replica pods per running version.

Kubernetes schedules, restarts and networks the replicas; inferd does none of it. The
controller's orchestrator (:mod:`inferd.control.orchestrators.kubernetes`) says, per
running version, which spec its replicas serve and how many there are
(:meth:`KubernetesBackend.want`); this backend keeps one Deployment per version to
that (server-side apply of the whole object when the spec changes, the ``scale``
subresource when only the count does), deletes the Deployments of versions that stop
running, and reports every replica pod it sees (:class:`PodSeen`, from one watch on the
pods of this instance) so the controller routes to the ready ones.

What it creates, and nothing else:

- ``Deployment`` ``<instance>-<model>-<version>`` in ``kubernetes.namespace``, labelled
  ``app.kubernetes.io/{name,instance,component,managed-by}`` and owned (an
  ``ownerReference``) by the ``kubernetes.owner`` Deployment, so that deleting the
  controller's Deployment (``helm uninstall``) garbage-collects every replica;
- in its pod template: ``inferd replica --spec-env INFERD_REPLICA_SPEC`` (the version's
  spec in the environment; the pod's name is its replica id), the replica protocol
  on ``replica_port``, probes on ``health_port`` (``/health/live``, ``/health/ready``),
  a termination grace above ``shutdown_grace_s`` (SIGTERM drains), resources (a
  deployment's ``resources.gpu`` becomes an ``nvidia.com/gpu`` limit and a node
  selector on ``gpu_node_label``), a non-root, read-only, capability-less container
  with ``emptyDir`` volumes for the model cache and ``/tmp``. With ``node_cache_path``
  the cache is the node's ``hostPath``, shared by its replica pods, so no container
  that runs a version's code may write it: the replica container mounts it read-only
  (``--read-only-cache``), and the init container ``fetch`` — the chart's image
  (``kubernetes.image``, never a version's own ``image``) running ``inferd replica
  --spec-env … --fetch-only``, no version's code — is its one writer: it downloads and
  checks the version's entry, or hashes the cached one again and replaces it when it
  changed.

The API calls are the few that RBAC grants (the Helm chart's Role): deployments get,
list, create/patch (apply), delete; ``deployments/scale`` patch; pods list and watch;
and, for leader election, leases (:mod:`inferd.control.leader`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.config import KubernetesConfig, Settings
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

SPEC_ENV = "INFERD_REPLICA_SPEC"
MANAGER = "inferd"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
FAILING = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Container waiting reasons that mean the replica cannot come up by waiting."""
RETRY_MAX_S = 30.0


class KubernetesUnavailable(SystemExit):
    """The Kubernetes API cannot be used (no configuration, unreachable, refused): the
    controller stops with the reason, not a traceback."""


def connect(namespace: str) -> Any:
    """A client of the API: in-cluster (the pod's service account) or ``KUBECONFIG``."""
    from lightkube import AsyncClient
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.core.exceptions import ConfigError

    try:
        config = KubeConfig.from_env()
    except ConfigError as exc:
        raise KubernetesUnavailable(
            f"error: replica_backend is kubernetes but no Kubernetes API is configured "
            f"(not in a pod, and KUBECONFIG: {exc})"
        ) from None
    return AsyncClient(config, namespace=namespace, field_manager=MANAGER)


def unavailable(what: str, exc: Exception) -> KubernetesUnavailable:
    """The error that stops a controller which cannot do ``what`` through the API."""
    from lightkube import ApiError

    if isinstance(exc, ApiError):
        why = f"{exc.status.code} {exc.status.reason}: {exc.status.message}"
    else:
        why = f"{type(exc).__name__}: {exc}"
    return KubernetesUnavailable(f"error: the Kubernetes API refused {what}: {why}")


@dataclass(frozen=True)
class PodSeen:
    """One replica pod as the API shows it now."""

    name: str
    model: str
    version: str
    ip: str | None
    ready: bool
    deleting: bool
    """Kubernetes is stopping it (a scale-down, an undeploy, an eviction)."""
    deleted: bool = False
    restarts: int = 0
    """Its container's restarts (the replica's crash count)."""
    problem: str = ""
    """Why it is not ready, when the API says (unschedulable, crash loop, image pull)."""
    failed: bool = False
    """The problem will not pass by waiting (a crash loop, an image that cannot be had)."""


def deployment_name(instance: str, model: str, version: str) -> str:
    """A DNS label for ``model:version`` (pods' names add 17 characters): readable, with
    a digest of the exact names when they had to be changed or shortened."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{instance}-{model}-{version}".lower()).strip("-")
    if slug == f"{instance}-{model}-{version}" and len(slug) <= 46:
        return slug
    digest = hashlib.sha256(f"{model}\0{version}".encode()).hexdigest()[:8]
    return f"{slug[:37].rstrip('-')}-{digest}"


def labels(instance: str) -> dict[str, str]:
    """The labels of every replica pod of ``instance`` (the pod watch's selector)."""
    return {
        "app.kubernetes.io/name": "inferd",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": "replica",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def manifest(
    settings: Settings,
    namespace: str,
    spec: ReplicaSpec,
    replicas: int,
    gpu_type: str | None,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Deployment of ``spec``'s version, as applied."""
    kube = settings.kubernetes
    name = deployment_name(kube.instance, spec.model, spec.version)
    selector = {**labels(kube.instance), "inferd.io/deployment": name}
    pod_labels = {**selector, **_label_values(spec.model, spec.version)}
    names = {"inferd.io/model": spec.model, "inferd.io/version": spec.version}
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": pod_labels,
        "annotations": names,
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "revisionHistoryLimit": 2,
            "progressDeadlineSeconds": math.ceil(settings.load_timeout_s) + 60,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": pod_labels, "annotations": names},
                "spec": _pod_spec(settings, spec, gpu_type),
            },
        },
    }


def _pod_spec(settings: Settings, spec: ReplicaSpec, gpu_type: str | None) -> dict[str, Any]:
    """One replica pod: its container, where it may run, its grace and its volumes."""
    kube = settings.kubernetes
    node_selector = dict(kube.node_selector)
    tolerations = list(kube.tolerations)
    if gpu_type is not None:
        if gpu_type.lower() != "any":
            node_selector[kube.gpu_node_label] = gpu_type
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # SIGTERM drains what was accepted within shutdown_grace_s; then it is killed
        "terminationGracePeriodSeconds": math.ceil(settings.shutdown_grace_s) + 10,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(kube, spec, gpu_type)],
        "volumes": [
            {"name": "data", "emptyDir": {"sizeLimit": kube.data_size_limit}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    if kube.node_cache_path:
        cache = {"path": kube.node_cache_path, "type": "DirectoryOrCreate"}
        pod["volumes"].append({"name": "artifact-cache", "hostPath": cache})
        pod["initContainers"] = [_fetch_step(kube, pod["containers"][0])]
    if kube.service_account:
        pod["serviceAccountName"] = kube.service_account
    if kube.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in kube.image_pull_secrets]
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    return pod


def _container(kube: KubernetesConfig, spec: ReplicaSpec, gpu_type: str | None) -> dict[str, Any]:
    """``inferd replica --spec-env`` with its ports, probes, resources and limits."""
    limits: dict[str, Any] = {"memory": kube.memory_request}
    if gpu_type is not None:
        limits["nvidia.com/gpu"] = 1
    cache_env: list[dict[str, str]] = []
    cache_mount: list[dict[str, Any]] = []
    read_only: list[str] = []
    if kube.node_cache_path:  # the node's artifact cache: its fetch step writes it
        cache_env = [{"name": "INFERD_ARTIFACT_CACHE__DIR", "value": NODE_CACHE}]
        cache_mount = [{"name": "artifact-cache", "mountPath": NODE_CACHE, "readOnly": True}]
        read_only = ["--read-only-cache"]
    return {
        "name": "replica",
        "image": image_of(kube, spec),
        "imagePullPolicy": kube.image_pull_policy,
        "command": ["inferd"],
        "args": [  # $(VAR): expanded by the kubelet from the container's environment
            *("replica", "--spec-env", SPEC_ENV, "--replica-id", "$(POD_NAME)"),
            *("--listen", f"$(POD_IP):{kube.replica_port}"),
            *("--health-listen", f"$(POD_IP):{kube.health_port}"),
            *read_only,
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": SPEC_ENV, "value": spec.to_json()},
            {"name": "INFERD_DATA_DIR", "value": "/data"},
            # the root file system is read-only: caches (the C kernel's, libraries') in /tmp
            {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
            {"name": "INFERD_LOG_JSON", "value": "true"},
            *cache_env,
        ],
        "envFrom": [{"secretRef": {"name": s}} for s in kube.env_from_secrets]
        + [{"configMapRef": {"name": c}} for c in kube.env_from_config_maps],
        "ports": [
            {"name": "replica", "containerPort": kube.replica_port, "protocol": "TCP"},
            {"name": "health", "containerPort": kube.health_port, "protocol": "TCP"},
        ],
        "startupProbe": _probe("/health/live", period_s=2, failures=60),
        "livenessProbe": _probe("/health/live", period_s=10, failures=3),
        "readinessProbe": _probe("/health/ready", period_s=2, failures=2),
        "resources": {
            "requests": {"cpu": kube.cpu_request, "memory": kube.memory_request},
            "limits": limits,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "tmp", "mountPath": "/tmp"},
            *cache_mount,
        ],
    }


def _fetch_step(kube: KubernetesConfig, replica: dict[str, Any]) -> dict[str, Any]:
    """The init container that fills the node's artifact cache for ``replica`` (the
    replica container): the chart's image, the replica's spec, store credentials and
    requests, the cache mounted writable; no GPU, no ports, no version's code."""
    keep = {SPEC_ENV, "INFERD_LOG_JSON", "XDG_CACHE_HOME", "INFERD_ARTIFACT_CACHE__DIR"}
    return {
        "name": "fetch",
        "image": kube.image,
        "imagePullPolicy": kube.image_pull_policy,
        "command": ["inferd"],
        "args": ["replica", "--spec-env", SPEC_ENV, "--fetch-only"],
        "env": [e for e in replica["env"] if e["name"] in keep],
        "envFrom": replica["envFrom"],
        "resources": {
            "requests": dict(replica["resources"]["requests"]),
            "limits": {"memory": kube.memory_request},
        },
        "securityContext": dict(replica["securityContext"]),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "artifact-cache", "mountPath": NODE_CACHE},
        ],
    }


NODE_CACHE = "/cache"
"""Where a pod mounts its node's artifact cache (``kubernetes.node_cache_path``)."""

TORCH_FRAMEWORKS = frozenset({"torch", "transformers", "gpt2", "llm"})


def image_of(kube: KubernetesConfig, spec: ReplicaSpec) -> str:
    """The image a version's pods run: its ``image`` metadata, else the PyTorch image
    for frameworks that need it, else the default one."""
    chosen = spec.metadata.get("image")
    if isinstance(chosen, str) and chosen:
        return chosen
    if spec.framework in TORCH_FRAMEWORKS and kube.torch_image:
        return kube.torch_image
    return kube.image


def _probe(path: str, *, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "health"},
        "periodSeconds": period_s,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _label_values(model: str, version: str) -> dict[str, str]:
    """Model and version as label values where they are valid ones (for people's
    selectors; the exact names are annotations)."""
    valid = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
    return {
        f"inferd.io/{key}": value
        for key, value in (("model", model), ("version", version))
        if valid.match(value)
    }


def seen(pod: Any, deleted: bool = False) -> PodSeen | None:
    """What a pod (lightkube's object) says of its replica; None: not one of ours."""
    meta = pod.metadata
    names = meta.annotations or {}
    if "inferd.io/model" not in names or "inferd.io/version" not in names:
        return None
    status = pod.status
    ready = False
    problem, failed = "", False
    restarts = 0
    unscheduled = ""
    if status is not None:
        for condition in status.conditions or []:
            if condition.type == "Ready":
                ready = condition.status == "True"
            if condition.type == "PodScheduled" and condition.status == "False":
                unscheduled = f"{condition.reason or 'Unschedulable'}: {condition.message or ''}"
        for container in status.containerStatuses or []:
            restarts += container.restartCount or 0
            waiting = container.state.waiting if container.state is not None else None
            if waiting is not None and waiting.reason:
                problem = f"{waiting.reason}: {waiting.message or ''}".rstrip(": ")
                failed = waiting.reason in FAILING
            last = container.lastState.terminated if container.lastState is not None else None
            if last is not None and not problem:
                problem = f"its container exited with code {last.exitCode} ({last.reason})"
        stuck = _failing_step(status.initContainerStatuses or [])
        if stuck is not None:
            problem, failed = stuck, True
        if unscheduled:  # no node takes it (yet): what the scheduler says, not a crash
            problem, failed = unscheduled.rstrip(": "), False
        if status.phase == "Failed":
            problem = f"{status.reason or 'Failed'}: {status.message or ''}".rstrip(": ")
            failed = True
    return PodSeen(
        name=meta.name,
        model=names["inferd.io/model"],
        version=names["inferd.io/version"],
        ip=(status.podIP if status is not None else None) or None,
        ready=ready and meta.deletionTimestamp is None,
        deleting=meta.deletionTimestamp is not None,
        deleted=deleted,
        restarts=restarts,
        problem=problem,
        failed=failed,
    )


def _failing_step(steps: list[Any]) -> str | None:
    """Why an init container (the fetch step) cannot finish, when it cannot by
    waiting (a crash loop, an image that cannot be had); None: none is stuck."""
    for step in steps:
        waiting = step.state.waiting if step.state is not None else None
        if waiting is not None and waiting.reason in FAILING:
            last = step.lastState.terminated if step.lastState is not None else None
            exited = f", exited with code {last.exitCode}" if last is not None else ""
            return f"its {step.name} step: {waiting.reason}{exited}"
    return None


@dataclass
class _Wanted:
    manifest: dict[str, Any] | None
    """None: the Deployment must go."""
    replicas: int
    digest: str


class KubernetesBackend:
    """Deployments of replica pods; see the module's docstring."""

    name = "kubernetes"

    def __init__(self, settings: Settings, client: Any = None) -> None:
        self.settings = settings
        self.kube = settings.kubernetes
        self.namespace = namespace_of(self.kube)
        self._client = client
        self._owner: dict[str, Any] | None = None
        self._wanted: dict[str, _Wanted] = {}
        self._applied: dict[str, tuple[str, int]] = {}
        """Deployment name -> (spec digest, replicas) as the API has them (or had when
        this controller last looked)."""
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._on_pod: Callable[[PodSeen], None] = lambda _: None
        self._pods: dict[str, PodSeen] = {}

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self.namespace)
        return self._client

    async def start(self, on_pod: Callable[[PodSeen], None]) -> None:
        """Find the owner and the Deployments this instance has, then keep them as
        wanted and report pods. :class:`KubernetesUnavailable` when that cannot be."""
        from lightkube.resources.apps_v1 import Deployment

        if self.settings.artifact_store is None or not self.settings.artifact_store.startswith(
            "s3://"
        ):
            raise KubernetesUnavailable(
                "error: the kubernetes replica backend needs an S3 artifact store "
                "(artifact_store: s3://bucket/prefix): replica pods fetch versions' files "
                "from it"
            )
        self._on_pod = on_pod
        try:
            if self.kube.owner:
                owner = await self.client.get(Deployment, self.kube.owner, namespace=self.namespace)
                self._owner = {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": owner.metadata.name,
                    "uid": owner.metadata.uid,
                    "blockOwnerDeletion": False,
                }
            async for found in self.client.list(
                Deployment, namespace=self.namespace, labels=labels(self.kube.instance)
            ):
                annotations = found.metadata.annotations or {}
                digest = annotations.get("inferd.io/spec-digest", "")
                self._applied[found.metadata.name] = (digest, found.spec.replicas or 0)
        except Exception as exc:  # refused, unreachable: the controller cannot run
            what = f"the replica backend's first calls in namespace {self.namespace!r}"
            raise unavailable(what, exc) from None
        logger.info(
            "kubernetes backend: namespace %s, %d replica Deployment(s) of instance %s found",
            self.namespace, len(self._applied), self.kube.instance,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_pods()), loop.create_task(self._sync())]

    def want(self, spec: ReplicaSpec, replicas: int, gpu_type: str | None) -> None:
        """``spec``'s version runs ``replicas`` pods (applied in the background)."""
        body = manifest(self.settings, self.namespace, spec, replicas, gpu_type, self._owner)
        name = body["metadata"]["name"]
        template = body["spec"]["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
        body["metadata"]["annotations"]["inferd.io/spec-digest"] = digest
        wanted = _Wanted(body, replicas, digest)
        if self._wanted.get(name) != wanted:
            self._wanted[name] = wanted
            self._kick(name)

    def remove(self, model: str, version: str) -> None:
        """``model:version`` runs no pods: its Deployment is deleted (they drain)."""
        name = deployment_name(self.kube.instance, model, version)
        self._wanted[name] = _Wanted(None, 0, "")
        self._kick(name)

    def keep_only(self, versions: set[tuple[str, str]]) -> None:
        """Delete this instance's Deployments of every other version (versions retired
        while no controller ran)."""
        keep = {deployment_name(self.kube.instance, m, v) for m, v in versions}
        for name in list(self._applied):
            if name not in keep and name not in self._wanted:
                logger.info("deleting replica Deployment %s: its version no longer runs", name)
                self._wanted[name] = _Wanted(None, 0, "")
                self._kick(name)

    def pods(self) -> list[PodSeen]:
        return list(self._pods.values())

    async def close(self) -> None:
        """Stop watching and applying; the pods keep serving (the next controller adopts
        them)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    def _kick(self, name: str) -> None:
        self._dirty.add(name)
        self._wake.set()

    async def _sync(self) -> None:
        """Bring each dirty Deployment to what is wanted, one call at a time; a failed
        call is retried with a backoff (the wanted state may have moved on by then)."""
        backoff = 0.5
        while True:
            await self._wake.wait()
            self._wake.clear()
            failed = False
            for name in sorted(self._dirty):
                self._dirty.discard(name)
                try:
                    await self._sync_one(name)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning(
                        "replica Deployment %s: %s; retrying in %.1fs", name, exc, backoff
                    )
                    self._dirty.add(name)
                    failed = True
            if failed:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                self._wake.set()
            else:
                backoff = 0.5

    async def _sync_one(self, name: str) -> None:
        from lightkube import ApiError
        from lightkube.codecs import from_dict
        from lightkube.resources.apps_v1 import Deployment
        from lightkube.types import CascadeType, PatchType

        wanted = self._wanted.get(name)
        if wanted is None:
            return
        if wanted.manifest is None:
            try:
                await self.client.delete(
                    Deployment, name, namespace=self.namespace, cascade=CascadeType.BACKGROUND
                )
                logger.info("deleted replica Deployment %s", name)
            except ApiError as exc:
                if exc.status.code != 404:
                    raise
            self._applied.pop(name, None)
            if self._wanted.get(name) is wanted:
                del self._wanted[name]
            return
        applied = self._applied.get(name)
        if applied is not None and applied[0] == wanted.digest:
            if applied[1] != wanted.replicas:
                try:
                    await self.client.patch(
                        Deployment.Scale, name, {"spec": {"replicas": wanted.replicas}},
                        namespace=self.namespace, patch_type=PatchType.MERGE,
                    )  # fmt: skip
                except ApiError as exc:
                    if exc.status.code != 404:
                        raise
                    self._applied.pop(name, None)  # deleted behind our back: apply it again
                    self._kick(name)
                    return
                logger.info("scaled replica Deployment %s to %d", name, wanted.replicas)
                self._applied[name] = (wanted.digest, wanted.replicas)
            return
        await self.client.apply(from_dict(wanted.manifest), field_manager=MANAGER, force=True)
        logger.info("applied replica Deployment %s (%d replica(s))", name, wanted.replicas)
        self._applied[name] = (wanted.digest, wanted.replicas)

    async def _watch_pods(self) -> None:
        """List this instance's replica pods, then follow them; after any error, list
        again (pods that went meanwhile are reported deleted)."""
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import OnErrorAction, OnErrorResult

        def stop(exc: Exception, count: int) -> OnErrorResult:
            logger.warning("watching replica pods failed: %s; listing again", exc)
            return OnErrorResult(OnErrorAction.STOP)

        selector = labels(self.kube.instance)
        backoff = 0.5
        while True:
            try:
                listing = self.client.list(Pod, namespace=self.namespace, labels=selector)
                now: set[str] = set()
                async for pod in listing:
                    now.add(pod.metadata.name)
                    self._report(pod)
                for name in set(self._pods) - now:
                    self._forget(name)
                backoff = 0.5
                async for kind, pod in self.client.watch(
                    Pod, namespace=self.namespace, labels=selector,
                    resource_version=listing.resourceVersion, on_error=stop,
                ):  # fmt: skip
                    self._report(pod, deleted=kind == "DELETED")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("listing replica pods failed: %s; again in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX_S)

    def _report(self, pod: Any, deleted: bool = False) -> None:
        found = seen(pod, deleted)
        if found is None:
            return
        if deleted:
            self._pods.pop(found.name, None)
        else:
            self._pods[found.name] = found
        self._on_pod(found)

    def _forget(self, name: str) -> None:
        last = self._pods.pop(name)
        self._on_pod(
            PodSeen(last.name, last.model, last.version, last.ip, False, True, deleted=True)
        )


def namespace_of(kube: KubernetesConfig) -> str:
    """The namespace replica Deployments (and the Lease) live in."""
    return kube.namespace or _own_namespace()


def _own_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"
