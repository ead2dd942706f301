"""What the controller holds between passes: per model, the versions that run and the
supervisors of their replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.control.autoscaler import Autoscaler
from inferd.control.joined import JoinedReplica, ReportedReplica
from inferd.control.supervisor import ReplicaState, Supervisor
from inferd.registry import VersionRecord
from inferd.registry.rollout import DeploymentStatus


@dataclass
class VersionSet:
    record: VersionRecord
    desired: int
    replicas: list[Supervisor | ReportedReplica] = field(default_factory=list)
    retiring: bool = False
    """Its replicas are being stopped; the set goes away once they are."""
    batching: dict[str, Any] | None = None
    """The deployment's batching overrides (over the version's own)."""
    status: DeploymentStatus | None = None
    """deploying | active | failed, as the deployment row read this pass says, or as
    written since (deployments only)."""
    fallback: bool = True
    """Failed requests (not pinned here) are retried on the serving version."""
    gpu_type: str | None = None
    """The deployment's ``resources.gpu``: its replicas see only GPUs of that type."""
    gpus: list[int] | None = None
    """The devices of ``gpu_type`` (None: no GPU asked for), each replica on one of them
    (:mod:`inferd.control.gpu_place`); replicas on others are replaced once new ones are
    ready."""
    gpu_short: str | None = None
    """Why no GPU takes another replica, as last recorded (None: they all fit)."""
    autoscaler: Autoscaler | None = None
    """The deployment's autoscaling (None: ``desired`` is the deployment's fixed count)."""

    @property
    def name(self) -> str:
        return f"{self.record.model_name}:{self.record.version}"

    def live(self) -> list[Supervisor | ReportedReplica]:
        """Its replicas that are not being stopped."""
        return [r for r in self.replicas if not r.stopping]

    def own(self, live: bool = False) -> list[Supervisor]:
        """The replicas this controller started (``live``: not being stopped)."""
        return [r for r in self.replicas if isinstance(r, Supervisor) and not (live and r.stopping)]

    def joined(self) -> list[JoinedReplica]:
        """The replicas that joined from other hosts."""
        return [r for r in self.replicas if isinstance(r, JoinedReplica)]

    def ready_count(self) -> int:
        return sum(r.state is ReplicaState.READY for r in self.replicas)

    def state(self) -> DeploymentStatus:
        live = self.live()
        ready = sum(r.state is ReplicaState.READY for r in live)
        if ready >= self.desired:
            return DeploymentStatus.ACTIVE
        if ready == 0 and any(r.state is ReplicaState.FAILED for r in live):
            return DeploymentStatus.FAILED
        return DeploymentStatus.DEPLOYING

    def all_ready(self) -> bool:
        return self.ready_count() >= self.desired

    def failure(self) -> str:
        """Why its replicas cannot serve, as the first failed one says."""
        return next(
            (r.message for r in self.replicas if r.state is ReplicaState.FAILED and r.message),
            "",
        )


@dataclass
class ModelState:
    name: str
    serving: str | None = None
    versions: dict[str, VersionSet] = field(default_factory=dict)
    loaded: bool = True
    """Desired state, as of the last pass."""
    traffic: dict[str, int] = field(default_factory=dict)
    """Deployed versions -> percent, newest first; empty in automatic mode."""
    mirrors: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Shadow deployments: version -> (percent of requests mirrored, output tolerance)."""
    canaries: set[str] = field(default_factory=set)
    """Canaries in progress: never the serving version while another one is ready."""

    def ready_replicas(self, versions: list[str]) -> list[Supervisor | ReportedReplica]:
        """The serving replicas of ``versions``."""
        return [
            r
            for v in versions
            if (vset := self.versions.get(v)) is not None
            for r in vset.replicas
            if r.ready
        ]


def reachable(models: dict[str, ModelState]) -> list[tuple[dict[str, str], str]]:
    """(labels, address) of every replica that answers status frames now (ready, or
    draining what it accepted): what ``/metrics`` and the console ask."""
    return [
        ({"model": name, "version": version, "replica": replica.id}, replica.address)
        for name, model in models.items()
        for version, vset in model.versions.items()
        for replica in vset.replicas
        if replica.state in (ReplicaState.READY, ReplicaState.DRAINING) and replica.address
    ]
