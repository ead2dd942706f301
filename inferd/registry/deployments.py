"""Deployments: which versions of a model run, with how many replicas, and the traffic
split between them; every change of the split is kept in ``traffic_history``.

The registry is the desired state; the controller makes the replicas match it and the
gateways route by the split it publishes. Rules:

- A model without deployment rows is in *automatic* mode: its newest version takes all
  traffic (the behaviour before deployments existed). Its first deployment adopts the
  newest version as a deployment, so nothing that runs changes by surprise.
- The split of a model always sums to 100 over its deployed versions. Deploying a
  version at ``p`` % scales the others down to ``100 - p`` in proportion.
- Every write runs in one transaction that first locks the model's row (PostgreSQL) or
  takes the write lock (SQLite), so concurrent changes apply one after the other; a
  change may name the ``revision`` it was computed from and is refused (409) when
  another change came first (optimistic concurrency for read-modify-write clients).
- Removing a deployment is two steps: ``undeploy`` marks it draining (it must have no
  traffic); the controller deletes the row once its replicas have stopped.

Strategies, statuses, reasons and each strategy's rollout are typed in
:mod:`inferd.registry.rollout`; the row-level steps are in
:mod:`inferd.registry.deployment_rows`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferd.errors import Conflict, InvalidInput, ModelNotFound
from inferd.registry import autoscaling as autoscaling_module
from inferd.registry import deployment_rows as rows_
from inferd.registry import rollout as plans
from inferd.registry.autoscaling import AutoscalingPolicy
from inferd.registry.checks import check_batching
from inferd.registry.deployment_rows import scale_split
from inferd.registry.rollout import (
    CANARY_DEFAULTS,
    KEEP_OLD_S,
    MAX_REPLICAS,
    BlueGreenRollout,
    CanaryRollout,
    CanaryState,
    DeploymentStatus,
    Reason,
    Rollout,
    ShadowRollout,
    Strategy,
    check_split,
)
from inferd.registry.tables import Deployment, ModelVersion, ScalingEvent, TrafficChange, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry

__all__ = [
    "CANARY_DEFAULTS",
    "KEEP_OLD_S",
    "MAX_REPLICAS",
    "DeploymentRecord",
    "Deployments",
    "TrafficRecord",
    "check_split",
    "scale_split",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploymentRecord:
    deployment_id: str
    model_name: str
    version: str
    status: DeploymentStatus
    replicas: int | None
    """None: the server's default (``replicas`` setting, or the version's batching)."""
    gpu_type: str | None
    traffic_pct: int
    strategy: Strategy
    batching: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    fallback: bool = True
    """A request this version fails (not pinned to it) is retried on the serving version."""
    rollout: Rollout | None = None
    """The strategy's settings and progress (None for rolling)."""
    autoscaling: AutoscalingPolicy | None = None
    """None: ``replicas`` runs, fixed; else the autoscaler sets the count in its bounds."""

    @property
    def canary(self) -> CanaryRollout | None:
        return self.rollout if isinstance(self.rollout, CanaryRollout) else None

    @property
    def blue_green(self) -> BlueGreenRollout | None:
        return self.rollout if isinstance(self.rollout, BlueGreenRollout) else None

    @property
    def shadow(self) -> ShadowRollout | None:
        return self.rollout if isinstance(self.rollout, ShadowRollout) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "model_name": self.model_name,
            "version": self.version,
            "status": self.status.value,
            "replicas": self.replicas,
            "gpu_type": self.gpu_type,
            "traffic_pct": self.traffic_pct,
            "strategy": self.strategy.value,
            "batching": self.batching,
            "fallback": self.fallback,
            "rollout": None if self.rollout is None else plans.to_dict(self.rollout),
            "autoscaling": autoscaling_module.dump(self.autoscaling),
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TrafficRecord:
    revision: int
    model_name: str
    split: dict[str, int]
    reason: Reason
    actor: str
    detail: str | None
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "split": self.split,
            "reason": self.reason.value,
            "actor": self.actor,
            "detail": self.detail,
            "created_at": self.created_at.isoformat(),
        }


def _deployment(row: Deployment) -> DeploymentRecord:
    return DeploymentRecord(
        deployment_id=row.deployment_id,
        model_name=row.model_name,
        version=row.version,
        status=DeploymentStatus(row.status),
        replicas=row.replicas,
        gpu_type=row.gpu_type,
        traffic_pct=row.traffic_pct,
        strategy=Strategy(row.strategy),
        batching=dict(row.batching) if row.batching is not None else None,
        created_at=row.created_at,
        updated_at=row.updated_at,
        fallback=row.fallback,
        rollout=plans.load(row.strategy, row.rollout),
        autoscaling=autoscaling_module.load(row.autoscaling),
    )


def autoscaling_policy(raw: Any) -> AutoscalingPolicy | None:
    if raw is not None and not isinstance(raw, dict):
        raise InvalidInput("autoscaling must be an object or null", field="autoscaling")
    return autoscaling_module.load(raw)


def _change(row: TrafficChange) -> TrafficRecord:
    return TrafficRecord(
        revision=row.id,
        model_name=row.model_name,
        split=dict(row.split),
        reason=Reason(row.reason),
        actor=row.actor,
        detail=row.detail,
        created_at=row.created_at,
    )


class Deployments:
    """The deployment and traffic part of the registry (same database, same rules)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    # -- reads ----------------------------------------------------------------------------

    def list_all(self, model: str | None = None) -> list[DeploymentRecord]:
        """Deployments, by model then newest version first."""
        with Session(self._registry.engine) as session:
            query = select(Deployment, ModelVersion.created_at).join(
                ModelVersion,
                (ModelVersion.model_name == Deployment.model_name)
                & (ModelVersion.version == Deployment.version),
            )
            if model is not None:
                query = query.where(Deployment.model_name == model)
            rows = session.execute(
                query.order_by(Deployment.model_name, ModelVersion.created_at.desc())
            ).all()
            return [_deployment(row[0]) for row in rows]

    def by_model(self) -> dict[str, list[DeploymentRecord]]:
        """Every deployment, by model (newest version first): what a reconcile pass runs."""
        found: dict[str, list[DeploymentRecord]] = {}
        for row in self.list_all():
            found.setdefault(row.model_name, []).append(row)
        return found

    def runs(self, model: str, version: str) -> bool:
        """Whether ``model:version`` is deployed to run (deploying or active): its
        replicas are, or are about to be, started."""
        with Session(self._registry.engine) as session:
            status = session.scalar(
                select(Deployment.status).where(
                    (Deployment.model_name == model) & (Deployment.version == version)
                )
            )
        return status in (DeploymentStatus.DEPLOYING, DeploymentStatus.ACTIVE)

    def history(self, model: str, limit: int = 50) -> list[TrafficRecord]:
        """Traffic changes of ``model``, newest first."""
        with Session(self._registry.engine) as session:
            rows = session.scalars(
                select(TrafficChange)
                .where(TrafficChange.model_name == model)
                .order_by(TrafficChange.id.desc())
                .limit(limit)
            )
            return [_change(row) for row in rows]

    def revision(self, model: str) -> int:
        """The id of the model's latest traffic change (0: none yet)."""
        with Session(self._registry.engine) as session:
            return rows_.revision(session, model)

    # -- writes ---------------------------------------------------------------------------

    def deploy(self, model: str, version: str, **options: Any) -> DeploymentRecord:
        """Run ``version`` with ``replicas`` and give it ``traffic_pct`` % of the traffic
        (default 100; the other deployed versions share the rest in proportion).
        Blue-green takes 100 and holds it at 0 % until the controller switches it; a
        canary takes its first step; a shadow takes none and mirrors ``traffic_pct`` %.
        ``options``: those of :meth:`deploy_in`."""
        with self._write() as session:
            return self.deploy_in(session, model, version, **options)

    def deploy_in(
        self,
        session: Session,
        model: str,
        version: str,
        *,
        traffic_pct: int | None = None,
        replicas: int | None = None,
        gpu_type: str | None = None,
        strategy: str = "rolling",
        batching: dict[str, Any] | None = None,
        fallback: bool = True,
        rollout: dict[str, Any] | None = None,
        autoscaling: dict[str, Any] | None = None,
        actor: str = "api",
    ) -> DeploymentRecord:
        """:meth:`deploy` inside the caller's write transaction (a push that deploys)."""
        policy = autoscaling_policy(autoscaling)
        plans.check_deploy(
            100 if traffic_pct is None else traffic_pct, replicas, strategy, gpu_type,
            gpus_here=self._registry.gpus_here,
        )  # fmt: skip
        if not isinstance(fallback, bool):
            raise InvalidInput(f"fallback must be true or false, not {fallback!r}")
        kind = Strategy(strategy)
        traffic_pct, plan = plans.check(kind, traffic_pct, rollout)
        batching = check_batching(batching)
        rows_.lock_model(session, model)
        framework = rows_.require_version(session, model, version)
        existing = rows_.of_model(session, model)
        rows_.check_deployable(model, version, kind, framework, existing)
        if not existing and (adopted := rows_.adopt_newest(session, model, version)):
            # Automatic mode served the newest version: it becomes a deployment, kept
            # (warm, for rollback) even at 0 % until it is undeployed.
            existing = [adopted]
        live = [r for r in existing if rows_.live(r)]
        if kind is Strategy.BLUE_GREEN and any(r.traffic_pct for r in live):
            traffic_pct = 0  # until all its replicas are ready; then all at once
        if not any(r.traffic_pct for r in live) and (traffic_pct < 100 or kind is Strategy.SHADOW):
            what = "to mirror" if kind is Strategy.SHADOW else "taking traffic"
            raise InvalidInput(
                f"{model!r} has no other version {what}: deploy {version!r} with "
                "strategy rolling and traffic_percent 100 first"
            )
        rest = scale_split({r.version: r.traffic_pct for r in live}, 100 - traffic_pct)
        now = utcnow()
        for row in live:
            row.traffic_pct, row.updated_at = rest[row.version], now
        row = rows_.new(
            model,
            version,
            traffic_pct,
            kind,
            replicas=replicas,
            gpu_type=gpu_type,
            batching=batching,
            fallback=fallback,
            rollout=plans.dump(plan),
            autoscaling=autoscaling_module.dump(policy),
        )
        session.add(row)
        split = {**rest, version: traffic_pct}
        rows_.record(session, model, split, Reason.DEPLOY, actor, f"deployed {version}")
        return _deployment(row)

    def set_traffic(
        self,
        model: str,
        split: dict[str, int],
        *,
        actor: str = "api",
        reason: Reason = Reason.MANUAL,
        detail: str | None = None,
        revision: int | None = None,
    ) -> TrafficRecord:
        """Set the whole split (versions left out get 0 %). With ``revision``, refuse
        (409) when the model's traffic changed since that revision."""
        split = check_split(split)
        with self._write() as session:
            rows_.lock_model(session, model)
            current = rows_.revision(session, model)
            if revision is not None and revision != current:
                raise Conflict(
                    f"the traffic of {model!r} changed since revision {revision} (now "
                    f"{current}); read it again and retry",
                    revision=current,
                )
            rows = {r.version: r for r in rows_.of_model(session, model)}
            unknown = sorted(set(split) - set(rows))
            if unknown:
                raise ModelNotFound(
                    f"version(s) {unknown} of {model!r} are not deployed; deployed: {sorted(rows)}",
                    model=model,
                )
            idle = sorted(v for v, pct in split.items() if pct and not rows_.live(rows[v]))
            if idle:
                raise InvalidInput(
                    f"version(s) {idle} take no traffic (being removed, rolled back, or a shadow)"
                )
            now = utcnow()
            for version, row in rows.items():
                row.traffic_pct, row.updated_at = split.get(version, 0), now
            rows_.stop_canaries(rows.values(), CanaryState.OVERRIDDEN, f"traffic set by {actor}")
            full = {v: r.traffic_pct for v, r in rows.items()}
            return _change(rows_.record(session, model, full, reason, actor, detail))

    def scale(self, model: str, version: str, replicas: int) -> DeploymentRecord:
        """Change a deployment's replica count (the controller starts new ones, or drains
        the extra ones before stopping them)."""
        plans.check_deploy(0, replicas, "rolling")
        with self._write() as session:
            rows_.lock_model(session, model)
            row = rows_.one(session, model, version)
            if row.status == DeploymentStatus.DRAINING:
                raise Conflict(f"{model}:{version} is being removed", model=model, version=version)
            row.replicas, row.updated_at = replicas, utcnow()
            return _deployment(row)

    def set_autoscaling(
        self, model: str, version: str, policy: dict[str, Any] | None
    ) -> DeploymentRecord:
        """Give a deployment an autoscaling policy (None: back to its fixed ``replicas``)."""
        checked = autoscaling_policy(policy)
        with self._write() as session:
            rows_.lock_model(session, model)
            row = rows_.one(session, model, version)
            if row.status == DeploymentStatus.DRAINING:
                raise Conflict(f"{model}:{version} is being removed", model=model, version=version)
            row.autoscaling, row.updated_at = autoscaling_module.dump(checked), utcnow()
            return _deployment(row)

    def record_scaling(self, model: str, version: str, event: dict[str, Any]) -> None:
        """Keep one autoscaling decision (``Decision.to_dict()``) of a deployed version."""
        with Session(self._registry.engine) as session, session.begin():
            session.add(
                ScalingEvent(
                    model_name=model,
                    version=version,
                    from_replicas=int(event["from"]),
                    to_replicas=int(event["to"]),
                    reason=str(event["reason"]),
                    detail=str(event["detail"]),
                    figures=dict(event.get("figures") or {}),
                )
            )

    def scaling_events(self, model: str, limit: int = 20) -> list[dict[str, Any]]:
        """The model's latest autoscaling decisions, newest first."""
        with Session(self._registry.engine) as session:
            rows = session.scalars(
                select(ScalingEvent)
                .where(ScalingEvent.model_name == model)
                .order_by(ScalingEvent.id.desc())
                .limit(limit)
            )
            return [
                {
                    "version": r.version,
                    "from": r.from_replicas,
                    "to": r.to_replicas,
                    "reason": r.reason,
                    "detail": r.detail,
                    "figures": r.figures,
                    "at": r.created_at.isoformat(),
                }
                for r in rows
            ]

    def rollback(self, model: str, *, actor: str = "api") -> TrafficRecord:
        """Back to the last stable split: the latest one before now that gave one
        still-deployed version all the traffic."""
        with self._write() as session:
            rows_.lock_model(session, model)
            rows = {r.version: r for r in rows_.of_model(session, model) if rows_.live(r)}
            if not rows:
                raise InvalidInput(f"{model!r} has no deployments to roll back")
            stable = rows_.last_stable(session, model, rows)
            now = utcnow()
            for version, row in rows.items():
                row.traffic_pct, row.updated_at = (100 if version == stable else 0), now
            rows_.stop_canaries(
                [r for v, r in rows.items() if v != stable],
                CanaryState.ROLLED_BACK,
                f"rollback by {actor}",
            )
            split = {v: (100 if v == stable else 0) for v in rows}
            change = rows_.record(
                session, model, split, Reason.ROLLBACK, actor, f"back to {stable}"
            )
            return _change(change)

    def undeploy(self, model: str, version: str, *, actor: str = "api") -> DeploymentRecord:
        """Start removing a deployment: it must take no traffic; it drains, then the
        controller deletes it."""
        with self._write() as session:
            rows_.lock_model(session, model)
            row = rows_.one(session, model, version)
            if row.traffic_pct:
                raise Conflict(
                    f"{model}:{version} still takes {row.traffic_pct} % of the traffic; move it "
                    "to other versions first (PUT .../traffic) or roll back",
                    model=model,
                    version=version,
                )
            row.status, row.updated_at = DeploymentStatus.DRAINING.value, utcnow()
            split = rows_.split_of(session, model)
            rows_.record(session, model, split, Reason.UNDEPLOY, actor, f"removing {version}")
            return _deployment(row)

    def _write(self) -> contextlib.AbstractContextManager[Session]:
        return rows_.write(self._registry)
