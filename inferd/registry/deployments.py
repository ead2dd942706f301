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
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from inferd.errors import Conflict, InvalidInput, ModelNotFound
from inferd.registry.tables import Deployment, Model, ModelVersion, TrafficChange, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry

STRATEGIES = ("rolling", "blue-green")
"""rolling: the version takes its share as soon as it has ready replicas. blue-green: it
takes none until all its replicas are ready, then all of it at once; the versions it
replaced stay deployed (warm, at 0 %) for ``keep_old_s`` for an instant rollback, then
are removed. Canary and shadow come with their controllers."""
REASONS = ("deploy", "manual", "rollback", "undeploy", "blue_green_switch", "blue_green_done")
KEEP_OLD_S = 300.0
"""Blue-green: how long the replaced versions stay deployed after the switch."""
MAX_REPLICAS = 64


@dataclass(frozen=True, slots=True)
class DeploymentRecord:
    deployment_id: str
    model_name: str
    version: str
    status: str
    replicas: int | None
    """None: the server's default (``replicas`` setting, or the version's batching)."""
    gpu_type: str | None
    traffic_pct: int
    strategy: str
    batching: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    fallback: bool = True
    """A request this version fails (not pinned to it) is retried on the serving version."""
    rollout: dict[str, Any] | None = None
    """The strategy's settings and progress (blue-green: keep_old_s, switched_at, done)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "model_name": self.model_name,
            "version": self.version,
            "status": self.status,
            "replicas": self.replicas,
            "gpu_type": self.gpu_type,
            "traffic_pct": self.traffic_pct,
            "strategy": self.strategy,
            "batching": self.batching,
            "fallback": self.fallback,
            "rollout": self.rollout,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class TrafficRecord:
    revision: int
    model_name: str
    split: dict[str, int]
    reason: str
    actor: str
    detail: str | None
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "split": self.split,
            "reason": self.reason,
            "actor": self.actor,
            "detail": self.detail,
            "created_at": self.created_at.isoformat(),
        }


def _deployment(row: Deployment) -> DeploymentRecord:
    return DeploymentRecord(
        row.deployment_id,
        row.model_name,
        row.version,
        row.status,
        row.replicas,
        row.gpu_type,
        row.traffic_pct,
        row.strategy,
        dict(row.batching) if row.batching is not None else None,
        row.created_at,
        row.updated_at,
        row.fallback,
        dict(row.rollout) if row.rollout is not None else None,
    )


def _change(row: TrafficChange) -> TrafficRecord:
    return TrafficRecord(
        row.id,
        row.model_name,
        dict(row.split),
        row.reason,
        row.actor,
        row.detail,
        row.created_at,
    )


def scale_split(split: dict[str, int], total: int) -> dict[str, int]:
    """``split`` scaled to sum ``total`` in proportion (largest remainders round up);
    an all-zero split puts ``total`` on its first version."""
    if not split:
        return {}
    weight = sum(split.values())
    if weight == 0:
        first = next(iter(split))
        return {v: (total if v == first else 0) for v in split}
    exact = {v: w * total / weight for v, w in split.items()}
    out = {v: int(x) for v, x in exact.items()}
    left = total - sum(out.values())
    for v in sorted(exact, key=lambda v: exact[v] - out[v], reverse=True)[:left]:
        out[v] += 1
    return out


def check_split(split: Any) -> dict[str, int]:
    """A traffic split from a request: ``{version: percent}``, integers 0-100 summing
    to 100 (422 otherwise)."""
    if not isinstance(split, dict) or not split:
        raise InvalidInput('traffic must be an object of version -> percent, e.g. {"v1": 100}')
    for version, pct in split.items():
        if not isinstance(pct, int) or isinstance(pct, bool) or not 0 <= pct <= 100:
            raise InvalidInput(
                f"traffic for {version!r} must be an integer percent from 0 to 100, not {pct!r}"
            )
    total = sum(split.values())
    if total != 100:
        raise InvalidInput(f"traffic percents must sum to 100; these sum to {total}", got=split)
    return dict(split)


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
            return _revision(session, model)

    # -- writes ---------------------------------------------------------------------------

    def deploy(
        self,
        model: str,
        version: str,
        *,
        traffic_pct: int,
        replicas: int | None = None,
        gpu_type: str | None = None,
        strategy: str = "rolling",
        batching: dict[str, Any] | None = None,
        fallback: bool = True,
        rollout: dict[str, Any] | None = None,
        actor: str = "api",
    ) -> DeploymentRecord:
        """Run ``version`` with ``replicas`` and give it ``traffic_pct`` % of the traffic
        (the other deployed versions share the rest in proportion). Blue-green takes
        ``traffic_pct`` 100 and holds it at 0 % until the controller switches it."""
        _check_deploy(traffic_pct, replicas, strategy, gpu_type)
        if not isinstance(fallback, bool):
            raise InvalidInput(f"fallback must be true or false, not {fallback!r}")
        rollout = _check_rollout(strategy, traffic_pct, rollout)
        from inferd.registry.registry import _check_batching

        batching = _check_batching(batching)
        with self._write() as session:
            _lock_model(session, model)
            _require_version(session, model, version)
            rows = _rows(session, model)
            if any(r.version == version for r in rows):
                raise Conflict(
                    f"version {version!r} of {model!r} is already deployed; change its "
                    f"traffic with PUT /api/v1/deployments/{model}/traffic",
                    model=model,
                    version=version,
                )
            if not rows and (adopted := _adopt_newest(session, model, version)) is not None:
                # Automatic mode served the newest version: it becomes a deployment, kept
                # (warm, for rollback) even at 0 % until it is undeployed.
                rows = [adopted]
            live = [r for r in rows if r.status != "draining"]
            if strategy == "blue-green" and any(r.traffic_pct for r in live):
                traffic_pct = 0  # until all its replicas are ready; then all at once
            if traffic_pct < 100 and not any(r.traffic_pct for r in live):
                raise InvalidInput(
                    f"{model!r} has no other version taking traffic: deploy {version!r} "
                    "with traffic_percent 100"
                )
            rest = scale_split({r.version: r.traffic_pct for r in live}, 100 - traffic_pct)
            now = utcnow()
            for row in live:
                row.traffic_pct, row.updated_at = rest[row.version], now
            row = Deployment(
                deployment_id=uuid.uuid4().hex,
                model_name=model,
                version=version,
                status="deploying",
                replicas=replicas,
                gpu_type=gpu_type,
                traffic_pct=traffic_pct,
                strategy=strategy,
                batching=batching,
                fallback=fallback,
                rollout=rollout,
                created_at=now,
                updated_at=now,
            )
            session.add(row)
            split = {**rest, version: traffic_pct}
            _record(session, model, split, "deploy", actor, f"deployed {version}")
            session.flush()
            return _deployment(row)

    def set_traffic(
        self,
        model: str,
        split: dict[str, int],
        *,
        actor: str = "api",
        reason: str = "manual",
        detail: str | None = None,
        revision: int | None = None,
    ) -> TrafficRecord:
        """Set the whole split (versions left out get 0 %). With ``revision``, refuse
        (409) when the model's traffic changed since that revision."""
        split = check_split(split)
        with self._write() as session:
            _lock_model(session, model)
            current = _revision(session, model)
            if revision is not None and revision != current:
                raise Conflict(
                    f"the traffic of {model!r} changed since revision {revision} (now "
                    f"{current}); read it again and retry",
                    revision=current,
                )
            rows = {r.version: r for r in _rows(session, model)}
            unknown = sorted(set(split) - set(rows))
            if unknown:
                raise ModelNotFound(
                    f"version(s) {unknown} of {model!r} are not deployed; deployed: {sorted(rows)}",
                    model=model,
                )
            draining = sorted(v for v, pct in split.items() if pct and rows[v].status == "draining")
            if draining:
                raise InvalidInput(f"version(s) {draining} are being removed and take no traffic")
            now = utcnow()
            for version, row in rows.items():
                row.traffic_pct, row.updated_at = split.get(version, 0), now
            full = {v: r.traffic_pct for v, r in rows.items()}
            return _record(session, model, full, reason, actor, detail)

    def switch_blue_green(self, model: str, version: str) -> TrafficRecord | None:
        """All traffic to a blue-green deployment at once (the controller, once all its
        replicas are ready); the others stay deployed at 0 %. None if already done."""
        with self._write() as session:
            _lock_model(session, model)
            row = _row(session, model, version)
            rollout = dict(row.rollout or {})
            if (
                row.strategy != "blue-green"
                or rollout.get("switched_at")
                or row.status == "draining"
            ):
                return None
            now = utcnow()
            rows = _rows(session, model)
            for other in rows:
                other.traffic_pct, other.updated_at = (100 if other is row else 0), now
            row.rollout = {**rollout, "switched_at": now.isoformat()}
            split = {r.version: r.traffic_pct for r in rows}
            detail = f"all replicas of {version} ready"
            return _record(session, model, split, "blue_green_switch", "inferd", detail)

    def finish_blue_green(self, model: str, version: str) -> list[str]:
        """After the keep window: remove the versions the switch replaced (those still at
        0 %), unless traffic went back to them (a rollback). Returns what it removes."""
        with self._write() as session:
            _lock_model(session, model)
            row = _row(session, model, version)
            rollout = dict(row.rollout or {})
            if not rollout.get("switched_at") or rollout.get("done"):
                return []
            row.rollout = {**rollout, "done": True}
            if row.traffic_pct != 100:
                return []  # rolled back meanwhile: keep what serves
            now = utcnow()
            removed = []
            for other in _rows(session, model):
                if other is not row and other.traffic_pct == 0 and other.status != "draining":
                    other.status, other.updated_at = "draining", now
                    removed.append(other.version)
            if removed:
                split = {r.version: r.traffic_pct for r in _rows(session, model)}
                detail = f"removing {', '.join(removed)} after the keep window"
                _record(session, model, split, "blue_green_done", "inferd", detail)
            return removed

    def scale(self, model: str, version: str, replicas: int) -> DeploymentRecord:
        """Change a deployment's replica count (the controller starts new ones, or drains
        the extra ones before stopping them)."""
        _check_deploy(0, replicas, "rolling")
        with self._write() as session:
            _lock_model(session, model)
            row = _row(session, model, version)
            if row.status == "draining":
                raise Conflict(f"{model}:{version} is being removed", model=model, version=version)
            row.replicas, row.updated_at = replicas, utcnow()
            return _deployment(row)

    def rollback(self, model: str, *, actor: str = "api") -> TrafficRecord:
        """Back to the last stable split: the latest one before now that gave one
        still-deployed version all the traffic."""
        with self._write() as session:
            _lock_model(session, model)
            rows = {r.version: r for r in _rows(session, model) if r.status != "draining"}
            if not rows:
                raise InvalidInput(f"{model!r} has no deployments to roll back")
            current = {v: r.traffic_pct for v, r in rows.items()}
            changes = session.scalars(
                select(TrafficChange)
                .where(TrafficChange.model_name == model)
                .order_by(TrafficChange.id.desc())
            )
            for change in changes:
                full = [v for v, pct in change.split.items() if pct == 100]
                if full and full[0] in rows and current.get(full[0]) != 100:
                    stable = full[0]
                    break
            else:
                raise InvalidInput(
                    f"{model!r} has no earlier stable split (one version at 100 %) to roll back to"
                )
            now = utcnow()
            for version, row in rows.items():
                row.traffic_pct, row.updated_at = (100 if version == stable else 0), now
            split = {v: (100 if v == stable else 0) for v in rows}
            return _record(session, model, split, "rollback", actor, f"back to {stable}")

    def undeploy(self, model: str, version: str, *, actor: str = "api") -> DeploymentRecord:
        """Start removing a deployment: it must take no traffic; it drains, then the
        controller deletes it."""
        with self._write() as session:
            _lock_model(session, model)
            row = _row(session, model, version)
            if row.traffic_pct:
                raise Conflict(
                    f"{model}:{version} still takes {row.traffic_pct} % of the traffic; move it "
                    "to other versions first (PUT .../traffic) or roll back",
                    model=model,
                    version=version,
                )
            row.status, row.updated_at = "draining", utcnow()
            split = {r.version: r.traffic_pct for r in _rows(session, model)}
            _record(session, model, split, "undeploy", actor, f"removing {version}")
            return _deployment(row)

    # -- the controller's ---------------------------------------------------------------

    def set_status(self, model: str, version: str, status: str) -> None:
        """The controller's view of a deployment (deploying, active, failed); a draining
        deployment keeps its status."""
        with self._write() as session:
            row = session.scalar(
                select(Deployment).where(
                    Deployment.model_name == model, Deployment.version == version
                )
            )
            if row is not None and row.status not in ("draining", status):
                row.status, row.updated_at = status, utcnow()

    def remove(self, model: str, version: str) -> None:
        """Delete a drained deployment (the controller, once its replicas stopped)."""
        with self._write() as session:
            session.execute(
                delete(Deployment).where(
                    Deployment.model_name == model,
                    Deployment.version == version,
                    Deployment.status == "draining",
                )
            )

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        """A session in one write transaction (the registry's own way of writing)."""
        with Session(self._registry._write_engine) as session, session.begin():
            yield session


def _check_deploy(traffic_pct: Any, replicas: Any, strategy: Any, gpu_type: Any = None) -> None:
    if not isinstance(traffic_pct, int) or isinstance(traffic_pct, bool):
        raise InvalidInput("traffic_percent must be an integer from 0 to 100")
    if not 0 <= traffic_pct <= 100:
        raise InvalidInput(f"traffic_percent must be from 0 to 100, not {traffic_pct}")
    if replicas is not None and (
        not isinstance(replicas, int) or isinstance(replicas, bool) or not replicas >= 1
    ):
        raise InvalidInput(f"replicas must be an integer >= 1, not {replicas!r}")
    if replicas is not None and replicas > MAX_REPLICAS:
        raise InvalidInput(f"replicas must be at most {MAX_REPLICAS}, not {replicas}")
    if gpu_type is not None and (not isinstance(gpu_type, str) or not 0 < len(gpu_type) <= 64):
        raise InvalidInput(f"gpu must be a GPU type name of 1 to 64 characters, not {gpu_type!r}")
    if strategy not in STRATEGIES:
        raise InvalidInput(f"strategy {strategy!r} is not available; use one of {list(STRATEGIES)}")


def _check_rollout(strategy: str, traffic_pct: int, rollout: Any) -> dict[str, Any] | None:
    """The strategy's settings, checked, with defaults filled in."""
    if rollout is not None and not isinstance(rollout, dict):
        raise InvalidInput("rollout must be an object")
    rollout = dict(rollout or {})
    if strategy != "blue-green":
        if rollout:
            raise InvalidInput(f"strategy {strategy!r} takes no rollout settings")
        return None
    if traffic_pct != 100:
        raise InvalidInput("blue-green moves all traffic at once: traffic_percent must be 100")
    unknown = sorted(set(rollout) - {"keep_old_s"})
    if unknown:
        raise InvalidInput(f"unknown blue-green rollout setting(s) {unknown}; known: keep_old_s")
    keep = rollout.get("keep_old_s", KEEP_OLD_S)
    if not isinstance(keep, int | float) or isinstance(keep, bool) or not 0 <= keep <= 86400:
        raise InvalidInput(f"keep_old_s must be a number of seconds from 0 to 86400, not {keep!r}")
    return {"keep_old_s": float(keep), "switched_at": None, "done": False}


def _lock_model(session: Session, model: str) -> Model:
    """The model's row, locked until the transaction ends (PostgreSQL; SQLite writes
    hold the database's write lock already)."""
    row = session.get(Model, model, with_for_update=True)
    if row is None:
        raise ModelNotFound(f"model {model!r} not found", model=model)
    return row


def _require_version(session: Session, model: str, version: str) -> None:
    found = session.scalar(
        select(ModelVersion.id).where(
            ModelVersion.model_name == model, ModelVersion.version == version
        )
    )
    if found is None:
        raise ModelNotFound(
            f"version {version!r} of model {model!r} is not registered",
            model=model,
            version=version,
        )


def _row(session: Session, model: str, version: str) -> Deployment:
    row = session.scalar(
        select(Deployment).where(Deployment.model_name == model, Deployment.version == version)
    )
    if row is None:
        raise ModelNotFound(
            f"version {version!r} of {model!r} is not deployed", model=model, version=version
        )
    return row


def _rows(session: Session, model: str) -> list[Deployment]:
    return list(
        session.scalars(
            select(Deployment)
            .join(
                ModelVersion,
                (ModelVersion.model_name == Deployment.model_name)
                & (ModelVersion.version == Deployment.version),
            )
            .where(Deployment.model_name == model)
            .order_by(ModelVersion.created_at.desc())
        )
    )


def _adopt_newest(session: Session, model: str, deploying: str) -> Deployment | None:
    """The version automatic mode serves (the newest), as a deployment at 100 %; None
    when that is the version being deployed."""
    newest = session.scalar(
        select(ModelVersion)
        .where(ModelVersion.model_name == model)
        .order_by(ModelVersion.created_at.desc(), ModelVersion.id.desc())
        .limit(1)
    )
    if newest is None or newest.version == deploying:
        return None
    now = utcnow()
    row = Deployment(
        deployment_id=uuid.uuid4().hex,
        model_name=model,
        version=newest.version,
        status="deploying",
        replicas=None,
        gpu_type=None,
        traffic_pct=100,
        strategy="rolling",
        batching=None,
        fallback=True,
        created_at=now,
        updated_at=now,
    )
    session.add(row)
    _record(session, model, {newest.version: 100}, "deploy", "inferd", "serving before deployments")
    return row


def _revision(session: Session, model: str) -> int:
    latest = session.scalar(
        select(TrafficChange.id)
        .where(TrafficChange.model_name == model)
        .order_by(TrafficChange.id.desc())
        .limit(1)
    )
    return int(latest or 0)


def _record(
    session: Session, model: str, split: dict[str, int], reason: str, actor: str, detail: str | None
) -> TrafficRecord:
    row = TrafficChange(
        model_name=model,
        split=split,
        reason=reason,
        actor=actor,
        detail=detail,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return _change(row)
