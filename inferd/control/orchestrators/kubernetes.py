"""Replicas as Kubernetes pods (``replica_backend: kubernetes``): where an orchestrator
keeps replicas alive, per-replica supervision does not fit, so the controller only says
each version's spec and count (a Deployment per version, kept so by
:class:`~inferd.control.backends.kubernetes.KubernetesBackend`) and routes to the pods
the API reports (:class:`~inferd.control.pods.PodReplica`), ready once their readiness
probe passes, draining once Kubernetes deletes them.

Pods outlive the controller: the next one finds them through the API, and goes on from
them (an autoscaled version from the pods it runs, :meth:`Kubernetes.running`). The
cluster's scheduler places a deployment's ``resources.gpu`` on GPU nodes and decides
what fits: no device of this machine is chosen, and its memory and cores bound nothing.
"""

from __future__ import annotations

import logging

import msgspec

from inferd.config import Settings
from inferd.control.backends.kubernetes import KubernetesBackend, PodSeen
from inferd.control.orchestrators import Context
from inferd.control.pods import PodReplica
from inferd.control.specs import replica_spec
from inferd.control.state import VersionSet

logger = logging.getLogger(__name__)


class Kubernetes:
    machine_bound = False

    def __init__(
        self, settings: Settings, context: Context, api: KubernetesBackend | None = None
    ) -> None:
        self.settings = settings
        self.context = context
        self.api = api or KubernetesBackend(settings)

    async def start(self) -> None:
        await self.api.start(self._on_pod)

    def scale(self, vset: VersionSet, *, shrink: bool = True) -> None:
        """The version's Deployment runs ``desired`` pods of its spec."""
        if vset.retiring:
            return
        # Pods fetch the files from the S3 store into their node's cache (their own
        # settings: localize): no folder of this host in their spec.
        spec = msgspec.structs.replace(
            replica_spec(self.settings, vset, "", None), artifact_dir="", artifact_cache_dir=""
        )
        self.api.want(spec, vset.desired, vset.gpu_type)

    def running(self, model: str, version: str) -> int:
        """Replica pods of ``model:version`` Kubernetes runs now."""
        pods = self.api.pods()
        return sum(p.model == model and p.version == version and not p.deleting for p in pods)

    def gpus(self, vset: VersionSet) -> None:
        return None  # the scheduler places pods on GPU nodes

    def gpu_room(self, vset: VersionSet) -> None:
        return None  # the cluster's scheduler (and its autoscaler) decides what fits

    def sync(self) -> None:
        for pod in self.api.pods():
            self._on_pod(pod)  # pods of versions that run from this pass on

    def keep_only(self, running: set[tuple[str, str]]) -> None:
        self.api.keep_only(running)

    def retire(self, model: str, version: str) -> None:
        self.api.remove(model, version)  # Kubernetes drains and deletes its pods

    async def close(self) -> None:
        await self.api.close()  # the pods keep serving; the next controller adopts them

    def _on_pod(self, pod: PodSeen) -> None:
        """The API says something new of a replica pod: its replica in its version's set
        (pods of versions that do not run here are left to the backend, which deletes
        their Deployments)."""
        state = self.context.models.get(pod.model)
        vset = state.versions.get(pod.version) if state is not None else None
        if vset is None:
            return
        replica = next(
            (r for r in vset.replicas if isinstance(r, PodReplica) and r.id == pod.name), None
        )
        if replica is None:
            if pod.deleted:
                return
            spec = replica_spec(self.settings, vset, pod.name, None)
            port = self.settings.kubernetes.replica_port
            replica = PodReplica(spec, port, self.context.on_change)
            replica.stopping = vset.retiring
            vset.replicas.append(replica)
        replica.update(pod)
        if pod.deleted and replica in vset.replicas:
            vset.replicas.remove(replica)
            self.context.publish()
