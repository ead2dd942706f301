"""What the controller holds between passes: per model, the versions that run and their
replicas (whoever runs them, :class:`~inferd.control.replica.Replica`), and how a pass
brings a deployed version's set up to date (:func:`deployed`) and finds the deployment
statuses to write (:func:`status_changes`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferd.control.autoscaler import Autoscaler
from inferd.control.replica import Replica
from inferd.registry import VersionRecord
from inferd.registry.deployments import DeploymentRecord
from inferd.registry.rollout import DeploymentStatus
from inferd.shapes.graph import GRAPH_FRAMEWORK
from inferd.shapes.replica import ReplicaState

logger = logging.getLogger(__name__)


@dataclass
class VersionSet:
    record: VersionRecord
    desired: int
    replicas: list[Replica] = field(default_factory=list)
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
    """The devices of ``gpu_type`` on this machine (None: no GPU asked for, or the
    orchestrator's scheduler places replicas on GPU nodes), each replica on one of them
    (:mod:`inferd.control.gpu_place`); replicas on others are replaced once new ones are
    ready."""
    gpu_short: str | None = None
    """Why no GPU takes another replica, as last recorded (None: they all fit)."""
    autoscaler: Autoscaler | None = None
    """The deployment's autoscaling (None: ``desired`` is the deployment's fixed count)."""
    on_demand: bool = False
    """Loaded on demand under the memory budget (:mod:`inferd.control.on_demand`):
    ``desired`` is 1 while it is loaded, 0 while not."""

    @property
    def replicaless(self) -> bool:
        """An inference graph: no replica runs it (the gateways do), so it is ready as
        soon as it is deployed."""
        return self.record.framework == GRAPH_FRAMEWORK

    @property
    def name(self) -> str:
        return f"{self.record.model_name}:{self.record.version}"

    def live(self) -> list[Replica]:
        """Its replicas that are not being stopped."""
        return [r for r in self.replicas if not r.stopping]

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

    def best_deployed(self) -> str | None:
        """Deployments: the version that should serve by default, the ready one with the
        largest share (the older on a tie: the established one is the stable one, and
        what failed requests fall back to), never a canary in progress while another
        version is ready; a version at 0 % still serves while nothing else is ready. An
        on-demand version counts as ready: a request for it waits while it loads."""
        ready = [
            v
            for v, s in self.versions.items()
            if not s.retiring
            and (s.ready_count() > 0 or s.on_demand or s.replicaless)
            and (v in self.traffic)
        ]
        order = list(self.traffic)  # newest first: the older version wins a tie
        return max(
            ready,
            key=lambda v: (v not in self.canaries, self.traffic[v], order.index(v)),
            default=None,
        )

    def ready_replicas(self, versions: list[str]) -> list[Replica]:
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


def replica_count(record: VersionRecord, default_replicas: int) -> int:
    """The replicas a version runs when nothing else says: its own, else the default
    (a graph: none, the gateways run it)."""
    if record.framework == GRAPH_FRAMEWORK:
        return 0
    return int((record.batching or {}).get("replicas") or default_replicas)


def deployed(
    model: ModelState,
    row: DeploymentRecord,
    record: VersionRecord,
    default_replicas: int,
    now: float,
    running: int,
    gpus: Callable[[VersionSet], list[int] | None],
    on_demand: bool = False,
) -> VersionSet:
    """The running set of a deployed version, created or brought up to date; an
    autoscaled one runs what its autoscaler wants (starting from the fixed count, or
    from the ``running`` replicas the orchestrator already has when a controller takes
    over). ``gpus``: the devices a deployment's ``resources.gpu`` gives its replicas
    (the orchestrator's :meth:`~inferd.control.orchestrators.Orchestrator.gpus`).
    ``on_demand``: under a memory budget, a version whose count the deployment does not
    fix runs only while it is used (:mod:`inferd.control.on_demand`)."""
    desired = row.replicas or int((record.batching or {}).get("replicas") or default_replicas)
    vset = model.versions.get(row.version)
    if vset is None:
        first = 0 if on_demand and row.autoscaling is None and not row.replicas else desired
        first = 0 if record.framework == GRAPH_FRAMEWORK else first
        vset = VersionSet(record, first, batching=row.batching, status=row.status)
        model.versions[row.version] = vset
        logger.info("deploying %s with %d replica(s)", vset.name, desired)
    if row.autoscaling is None:
        vset.autoscaler = None
    elif vset.autoscaler is None:
        # A controller taking over an autoscaled version goes on from what runs.
        vset.autoscaler = Autoscaler(row.autoscaling, len(vset.live()) or running or desired, now)
    else:
        vset.autoscaler.retune(row.autoscaling)
    if vset.autoscaler is not None:
        desired = vset.autoscaler.desired
    vset.on_demand = on_demand and vset.autoscaler is None and not row.replicas
    vset.on_demand = vset.on_demand and record.framework != GRAPH_FRAMEWORK
    if vset.on_demand:  # loaded while used (its desired is the on-demand loads' call)
        desired = min(vset.desired, 1)
    if vset.replicaless:
        vset.autoscaler, desired = None, 0
    vset.desired, vset.fallback = desired, row.fallback
    vset.status = row.status  # what the registry says now: status_changes compares
    if row.gpu_type != vset.gpu_type:
        vset.gpu_type = row.gpu_type
        vset.gpus = gpus(vset) if row.gpu_type is not None else None
    return vset


def status_changes(models: dict[str, ModelState]) -> list[tuple[str, str, DeploymentStatus]]:
    """The deployed versions whose state differs from what their deployment row says
    (read this pass; now recorded as written)."""
    changes = []
    for model in models.values():
        if not model.traffic:
            continue
        for version, vset in model.versions.items():
            state = vset.state()
            deployed = version in model.traffic or version in model.mirrors
            if deployed and not vset.retiring and state != vset.status:
                vset.status = state
                changes.append((model.name, version, state))
    return changes
