"""Row-level steps of the deployment writes (:mod:`inferd.registry.deployments`): each
runs inside the caller's write transaction, on ORM rows, and never commits.

Rows keep strategies and statuses as strings; the enums of :mod:`inferd.registry.rollout`
are ``StrEnum`` s, so they compare equal to them and are stored as their values.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferd.errors import Conflict, InvalidInput, ModelNotFound
from inferd.registry import rollout as plans
from inferd.registry.rollout import CanaryRollout, CanaryState, DeploymentStatus, Reason, Strategy
from inferd.registry.tables import Deployment, Model, ModelVersion, TrafficChange, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry
from inferd.runtimes import GENERATIVE


@contextlib.contextmanager
def write(registry: Registry) -> Iterator[Session]:
    """A session in one write transaction (the registry's own way of writing)."""
    with Session(registry._write_engine) as session, session.begin():
        yield session


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


def lock_model(session: Session, model: str) -> Model:
    """The model's row, locked until the transaction ends (PostgreSQL; SQLite writes
    hold the database's write lock already)."""
    row = session.get(Model, model, with_for_update=True)
    if row is None:
        raise ModelNotFound(f"model {model!r} not found", model=model)
    return row


def require_version(session: Session, model: str, version: str) -> str:
    """The registered version's framework (404 when it is not registered)."""
    found = session.scalar(
        select(ModelVersion.framework).where(
            ModelVersion.model_name == model, ModelVersion.version == version
        )
    )
    if found is None:
        raise ModelNotFound(
            f"version {version!r} of model {model!r} is not registered",
            model=model,
            version=version,
        )
    return str(found)


def one(session: Session, model: str, version: str) -> Deployment:
    row = session.scalar(
        select(Deployment).where(Deployment.model_name == model, Deployment.version == version)
    )
    if row is None:
        raise ModelNotFound(
            f"version {version!r} of {model!r} is not deployed", model=model, version=version
        )
    return row


def of_model(session: Session, model: str) -> list[Deployment]:
    """The model's deployments, newest version first."""
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


def split_of(session: Session, model: str) -> dict[str, int]:
    return {r.version: r.traffic_pct for r in of_model(session, model)}


def new(
    model: str,
    version: str,
    traffic_pct: int,
    strategy: Strategy = Strategy.ROLLING,
    **rest: object,
) -> Deployment:
    now = utcnow()
    fields: dict[str, object] = {
        "replicas": None,
        "gpu_type": None,
        "batching": None,
        "fallback": True,
        "rollout": None,
        "autoscaling": None,
        **rest,
    }
    return Deployment(
        deployment_id=uuid.uuid4().hex,
        model_name=model,
        version=version,
        status=DeploymentStatus.DEPLOYING.value,
        traffic_pct=traffic_pct,
        strategy=strategy.value,
        created_at=now,
        updated_at=now,
        **fields,
    )


def adopt_newest(
    session: Session,
    model: str,
    deploying: str,
    why: str = "",
    actor: str = "inferd",
) -> Deployment | None:
    """The version automatic mode serves (the newest), as a deployment at 100 %; None
    when that is the version being deployed, or the model has no version yet. ``why``:
    what made it a deployment (the history says "<why>; <version> keeps serving")."""
    newest = session.scalar(
        select(ModelVersion)
        .where(ModelVersion.model_name == model)
        .order_by(ModelVersion.created_at.desc(), ModelVersion.id.desc())
        .limit(1)
    )
    if newest is None or newest.version == deploying:
        return None
    row = new(model, newest.version, 100)
    session.add(row)
    detail = f"{why}; {newest.version} keeps serving" if why else "serving before deployments"
    record(session, model, {newest.version: 100}, Reason.DEPLOY, actor, detail)
    return row


def canary_at(
    session: Session, model: str, version: str, step: int
) -> tuple[Deployment, CanaryRollout] | None:
    """The canary row (model locked) and its rollout, when it is still in progress at
    ``step``; None when the rollout moved on."""
    lock_model(session, model)
    row = one(session, model, version)
    plan = plans.load(row.strategy, row.rollout)
    if not isinstance(plan, CanaryRollout) or not plan.progressing:
        return None
    if plan.step != step or DeploymentStatus(row.status).gone:
        return None
    return row, plan


def give(session: Session, model: str, row: Deployment, pct: int) -> datetime:
    """``pct`` % to ``row``; the other live versions share the rest in proportion."""
    others = [r for r in of_model(session, model) if r is not row and live(r)]
    rest = scale_split({r.version: r.traffic_pct for r in others}, 100 - pct)
    now = utcnow()
    for other in others:
        other.traffic_pct, other.updated_at = rest[other.version], now
    row.traffic_pct, row.updated_at = pct, now
    return now


def live(row: Deployment) -> bool:
    """A deployment that takes (or may take) live traffic."""
    return not DeploymentStatus(row.status).gone and row.strategy != Strategy.SHADOW


def progressing(rows: Iterable[Deployment]) -> list[tuple[Deployment, CanaryRollout]]:
    """The canaries in progress among ``rows``, with their rollouts."""
    out = []
    for row in rows:
        if row.strategy == Strategy.CANARY:
            plan = plans.load(row.strategy, row.rollout)
            if isinstance(plan, CanaryRollout) and plan.progressing:
                out.append((row, plan))
    return out


def stop_canaries(rows: Iterable[Deployment], state: CanaryState, reason: str) -> None:
    """A person changed the traffic: canaries in progress stop moving on their own
    (``rolled_back`` ones also stop running)."""
    now = utcnow()
    for row, plan in progressing(rows):
        plan.state, plan.reason, plan.ended_at = state, reason, now.isoformat()
        row.rollout = plans.dump(plan)
        if state is CanaryState.ROLLED_BACK:
            row.status, row.traffic_pct = DeploymentStatus.ROLLED_BACK.value, 0
        row.updated_at = now


def revision(session: Session, model: str) -> int:
    latest = session.scalar(
        select(TrafficChange.id)
        .where(TrafficChange.model_name == model)
        .order_by(TrafficChange.id.desc())
        .limit(1)
    )
    return int(latest or 0)


def record(
    session: Session,
    model: str,
    split: dict[str, int],
    reason: Reason,
    actor: str,
    detail: str | None,
) -> TrafficChange:
    """Keep a change of the split in the history."""
    row = TrafficChange(
        model_name=model,
        split=split,
        reason=reason.value,
        actor=actor,
        detail=detail,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return row


def check_deployable(
    model: str, version: str, kind: Strategy, framework: str, existing: list[Deployment]
) -> None:
    """What the model's current deployments rule out for a new one."""
    if kind in (Strategy.CANARY, Strategy.SHADOW) and framework in GENERATIVE:
        raise InvalidInput(
            f"{kind.value} deployments compare predict answers and latencies; "
            f"{model}:{version} generates text ({framework}): use rolling or "
            "blue-green, and move its traffic with PUT .../traffic"
        )
    if any(r.version == version for r in existing):
        raise Conflict(
            f"version {version!r} of {model!r} is already deployed; change its "
            f"traffic with PUT /api/v1/deployments/{model}/traffic",
            model=model,
            version=version,
        )
    serving = [r for r in existing if live(r)]
    if kind is Strategy.CANARY and progressing(serving):
        raise Conflict(
            f"{model!r} already has a canary in progress; wait for it or roll back", model=model
        )
    if kind is Strategy.SHADOW and any(
        r.strategy == Strategy.SHADOW and r.status != DeploymentStatus.DRAINING for r in existing
    ):
        raise Conflict(f"{model!r} already has a shadow deployment", model=model)


def last_stable(session: Session, model: str, rows: dict[str, Deployment]) -> str:
    """The version of the latest split that gave one still-deployed version all the
    traffic, other than the current one."""
    current = {v: r.traffic_pct for v, r in rows.items()}
    changes = session.scalars(
        select(TrafficChange)
        .where(TrafficChange.model_name == model)
        .order_by(TrafficChange.id.desc())
    )
    for change in changes:
        full = [v for v, pct in change.split.items() if pct == 100]
        if full and full[0] in rows and current.get(full[0]) != 100:
            return full[0]
    raise InvalidInput(
        f"{model!r} has no earlier stable split (one version at 100 %) to roll back to"
    )
