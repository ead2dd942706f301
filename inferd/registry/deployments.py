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

from inferd import devices
from inferd.errors import Conflict, InvalidInput, ModelNotFound
from inferd.registry.tables import Deployment, Model, ModelVersion, TrafficChange, utcnow
from inferd.runtimes import GENERATIVE

if TYPE_CHECKING:
    from inferd.registry.registry import Registry

STRATEGIES = ("rolling", "blue-green", "canary", "shadow")
"""rolling: the version takes its share as soon as it has ready replicas. blue-green: it
takes none until all its replicas are ready, then all of it at once; the versions it
replaced stay deployed (warm, at 0 %) for ``keep_old_s`` for an instant rollback, then
are removed. canary: it takes the first of its ``steps`` and moves to the next one each
time an analysis window finds it no worse than the stable versions (the controller,
:mod:`inferd.control.canary`), or goes back to 0 % with the reason recorded. shadow: it
takes no traffic; gateways mirror ``mirror_pct`` % of the model's requests to it and
count how often it agrees with the live answer."""
REASONS = (
    "deploy",
    "manual",
    "rollback",
    "undeploy",
    "blue_green_switch",
    "blue_green_done",
    "canary_step",
    "canary_promoted",
    "canary_rollback",
    "canary_done",
)
KEEP_OLD_S = 300.0
"""Blue-green and canary: how long the replaced versions stay deployed after the switch."""
CANARY_STEPS = (1, 10, 50, 100)
CANARY_DEFAULTS: dict[str, Any] = {
    "step_s": 60.0,
    "min_requests": 50,
    "max_error_rate_increase": 0.01,
    "max_latency_increase": 0.1,
    "min_latency_increase_ms": 1.0,
    "latency": "compute",
    "quantile": 0.99,
    "max_p99_ms": None,
    "webhook": None,
    "auto_rollback": True,
    "keep_old_s": KEEP_OLD_S,
}
"""Canary analysis settings (``rollout`` of a canary deployment); see
:mod:`inferd.control.canary` for what each one means."""
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
        traffic_pct: int | None = None,
        replicas: int | None = None,
        gpu_type: str | None = None,
        strategy: str = "rolling",
        batching: dict[str, Any] | None = None,
        fallback: bool = True,
        rollout: dict[str, Any] | None = None,
        actor: str = "api",
    ) -> DeploymentRecord:
        """Run ``version`` with ``replicas`` and give it ``traffic_pct`` % of the traffic
        (default 100; the other deployed versions share the rest in proportion).
        Blue-green takes 100 and holds it at 0 % until the controller switches it; a
        canary takes its first step; a shadow takes none and mirrors ``traffic_pct`` %."""
        _check_deploy(100 if traffic_pct is None else traffic_pct, replicas, strategy, gpu_type)
        if not isinstance(fallback, bool):
            raise InvalidInput(f"fallback must be true or false, not {fallback!r}")
        traffic_pct, rollout = _check_rollout(strategy, traffic_pct, rollout)
        from inferd.registry.registry import _check_batching

        batching = _check_batching(batching)
        with self._write() as session:
            _lock_model(session, model)
            framework = _require_version(session, model, version)
            if strategy in ("canary", "shadow") and framework in GENERATIVE:
                raise InvalidInput(
                    f"{strategy} deployments compare predict answers and latencies; "
                    f"{model}:{version} generates text ({framework}): use rolling or "
                    "blue-green, and move its traffic with PUT .../traffic"
                )
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
            live = [r for r in rows if _live(r)]
            if strategy == "blue-green" and any(r.traffic_pct for r in live):
                traffic_pct = 0  # until all its replicas are ready; then all at once
            if strategy == "canary" and _progressing(live):
                raise Conflict(
                    f"{model!r} already has a canary in progress; wait for it or roll back",
                    model=model,
                )
            if strategy == "shadow" and any(
                r.strategy == "shadow" and r.status != "draining" for r in rows
            ):
                raise Conflict(f"{model!r} already has a shadow deployment", model=model)
            if not any(r.traffic_pct for r in live) and (traffic_pct < 100 or strategy == "shadow"):
                what = "to mirror" if strategy == "shadow" else "taking traffic"
                raise InvalidInput(
                    f"{model!r} has no other version {what}: deploy {version!r} with "
                    "strategy rolling and traffic_percent 100 first"
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
            idle = sorted(v for v, pct in split.items() if pct and not _live(rows[v]))
            if idle:
                raise InvalidInput(
                    f"version(s) {idle} take no traffic (being removed, rolled back, or a shadow)"
                )
            now = utcnow()
            for version, row in rows.items():
                row.traffic_pct, row.updated_at = split.get(version, 0), now
            _stop_canaries(rows.values(), "overridden", f"traffic set by {actor}")
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

    def advance_canary(
        self, model: str, version: str, step: int, analysis: dict[str, Any], detail: str
    ) -> TrafficRecord | None:
        """The canary passed the analysis of ``step``: give it the next step's share (the
        other versions share the rest in proportion); at 100 % it is promoted. None when
        the rollout moved on meanwhile (a manual change, another pass)."""
        with self._write() as session:
            found = _canary_at(session, model, version, step)
            if found is None:
                return None
            row, rollout = found
            pct = rollout["steps"][step + 1]
            now = _give(session, model, row, pct)
            rollout.update(step=step + 1, analysis=analysis)
            reason = "canary_step"
            if pct == 100:
                rollout.update(state="promoted", promoted_at=now.isoformat())
                reason = "canary_promoted"
            row.rollout = rollout
            split = {r.version: r.traffic_pct for r in _rows(session, model)}
            return _record(session, model, split, reason, "inferd", detail)

    def end_canary(
        self,
        model: str,
        version: str,
        step: int,
        reason: str,
        analysis: dict[str, Any] | None,
        rollback: bool,
    ) -> TrafficRecord | None:
        """The canary failed the analysis of ``step``: back to 0 % (its traffic returns to
        the other versions in proportion) with ``reason`` kept in its rollout and in the
        history; or, without ``rollback`` (auto_rollback off), halt where it is for a
        person to decide. None when the rollout moved on meanwhile."""
        with self._write() as session:
            found = _canary_at(session, model, version, step)
            if found is None:
                return None
            row, rollout = found
            now = utcnow()
            rollout.update(reason=reason, analysis=analysis, ended_at=now.isoformat())
            if not rollback:
                row.rollout, row.updated_at = {**rollout, "state": "halted"}, now
                return None
            _give(session, model, row, 0)
            row.status = "rolled_back"
            row.rollout = {**rollout, "state": "rolled_back"}
            split = {r.version: r.traffic_pct for r in _rows(session, model)}
            return _record(session, model, split, "canary_rollback", "inferd", reason)

    def finish_rollout(self, model: str, version: str) -> list[str]:
        """After the keep window of a blue-green switch or a canary promotion: remove the
        versions it replaced (those still at 0 %), unless traffic went back to them (a
        rollback). Returns what it removes."""
        with self._write() as session:
            _lock_model(session, model)
            row = _row(session, model, version)
            rollout = dict(row.rollout or {})
            completed = rollout.get("switched_at") or rollout.get("promoted_at")
            if not completed or rollout.get("done"):
                return []
            row.rollout = {**rollout, "done": True}
            if row.traffic_pct != 100:
                return []  # rolled back meanwhile: keep what serves
            now = utcnow()
            removed = []
            for other in _rows(session, model):
                if (
                    other is not row
                    and other.traffic_pct == 0
                    and other.status != "draining"
                    and other.strategy != "shadow"
                ):
                    other.status, other.updated_at = "draining", now
                    removed.append(other.version)
            if removed:
                split = {r.version: r.traffic_pct for r in _rows(session, model)}
                detail = f"removing {', '.join(removed)} after the keep window"
                reason = "canary_done" if row.strategy == "canary" else "blue_green_done"
                _record(session, model, split, reason, "inferd", detail)
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
            rows = {
                r.version: r
                for r in _rows(session, model)
                if r.status not in ("draining", "rolled_back") and r.strategy != "shadow"
            }
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
            _stop_canaries(
                [r for v, r in rows.items() if v != stable], "rolled_back", f"rollback by {actor}"
            )
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
            if row is not None and row.status not in ("draining", "rolled_back", status):
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
    if gpu_type is not None:
        devices.place(gpu_type)  # refused unless this machine has one
    if strategy not in STRATEGIES:
        raise InvalidInput(f"strategy {strategy!r} is not available; use one of {list(STRATEGIES)}")


def _check_rollout(
    strategy: str, traffic_pct: int | None, rollout: Any
) -> tuple[int, dict[str, Any] | None]:
    """(the version's starting share, the strategy's settings checked and completed)."""
    if rollout is not None and not isinstance(rollout, dict):
        raise InvalidInput("rollout must be an object")
    rollout = dict(rollout or {})
    if strategy == "blue-green":
        if traffic_pct not in (None, 100):
            raise InvalidInput("blue-green moves all traffic at once: traffic_percent must be 100")
        _known_settings(strategy, rollout, {"keep_old_s"})
        keep = _seconds(rollout, "keep_old_s", KEEP_OLD_S)
        return 100, {"keep_old_s": keep, "switched_at": None, "done": False}
    if strategy == "canary":
        return _check_canary(traffic_pct, rollout)
    if strategy == "shadow":
        _known_settings(strategy, rollout, {"tolerance"})
        mirror = 100 if traffic_pct is None else traffic_pct
        if mirror < 1:
            raise InvalidInput("a shadow mirrors traffic_percent 1 to 100 % of the requests")
        tolerance = rollout.get("tolerance", 1e-5)
        if not _number(tolerance) or not 0 <= tolerance <= 1e6:
            raise InvalidInput(f"tolerance must be a number >= 0, not {tolerance!r}")
        return 0, {"mirror_pct": mirror, "tolerance": float(tolerance)}
    if rollout:
        raise InvalidInput(f"strategy {strategy!r} takes no rollout settings")
    return (100 if traffic_pct is None else traffic_pct), None


def _canary_steps(traffic_pct: int | None, rollout: dict[str, Any]) -> list[int]:
    if traffic_pct == 100:
        raise InvalidInput("a canary starts below 100 % of the traffic (its first step)")
    steps = rollout.get("steps")
    if steps is None:
        first = CANARY_STEPS[0] if traffic_pct is None else traffic_pct
        steps = [first, *(s for s in CANARY_STEPS if s > first)]
    if (
        not isinstance(steps, list)
        or len(steps) < 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in steps)
        or steps != sorted(set(steps))
        or steps[0] < 1
        or steps[-1] != 100
    ):
        raise InvalidInput(
            f"steps must be increasing integer percents ending at 100, e.g. [1, 10, 50, 100]; "
            f"got {steps!r}"
        )
    if traffic_pct is not None and traffic_pct != steps[0]:
        raise InvalidInput(
            f"a canary starts at its first step ({steps[0]} %); traffic_percent is {traffic_pct}"
        )
    return steps


def _check_canary(traffic_pct: int | None, rollout: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    _known_settings("canary", rollout, {"steps", *CANARY_DEFAULTS})
    steps = _canary_steps(traffic_pct, rollout)
    out = {**CANARY_DEFAULTS, **rollout, "steps": steps}
    out["step_s"] = _seconds(out, "step_s", CANARY_DEFAULTS["step_s"], low=1.0)
    out["keep_old_s"] = _seconds(out, "keep_old_s", KEEP_OLD_S)
    minimum = out["min_requests"]
    if not isinstance(minimum, int) or isinstance(minimum, bool) or not 1 <= minimum <= 10**9:
        raise InvalidInput(f"min_requests must be an integer >= 1, not {minimum!r}")
    for key, high in (
        ("max_error_rate_increase", 1.0),
        ("max_latency_increase", 100.0),
        ("min_latency_increase_ms", 60_000.0),
    ):
        value = out[key]
        if not _number(value) or not 0 <= value <= high:
            raise InvalidInput(f"{key} must be a number from 0 to {high:g}, not {value!r}")
        out[key] = float(value)
    quantile = out["quantile"]
    if not _number(quantile) or not 0 < quantile < 1:
        raise InvalidInput(f"quantile must be between 0 and 1, e.g. 0.99; not {quantile!r}")
    if out["latency"] not in ("compute", "total"):
        raise InvalidInput(f"latency must be 'compute' or 'total', not {out['latency']!r}")
    limit = out["max_p99_ms"]
    if limit is not None and (not _number(limit) or not limit > 0):
        raise InvalidInput(f"max_p99_ms must be a positive number of milliseconds, not {limit!r}")
    hook = out["webhook"]
    if hook is not None and (
        not isinstance(hook, str)
        or not hook.startswith(("http://", "https://"))
        or len(hook) > 2048
    ):
        raise InvalidInput(f"webhook must be an http(s) URL, not {hook!r}")
    if not isinstance(out["auto_rollback"], bool):
        raise InvalidInput(f"auto_rollback must be true or false, not {out['auto_rollback']!r}")
    out.update(state="progressing", step=0, reason=None, analysis=None, promoted_at=None)
    out["done"] = False
    return steps[0], out


def _known_settings(strategy: str, rollout: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(rollout) - known)
    if unknown:
        raise InvalidInput(
            f"unknown {strategy} rollout setting(s) {unknown}; known: {sorted(known)}"
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seconds(rollout: dict[str, Any], key: str, default: float, low: float = 0.0) -> float:
    value = rollout.get(key, default)
    if not _number(value) or not low <= value <= 86400:
        raise InvalidInput(f"{key} must be seconds from {low:g} to 86400, not {value!r}")
    return float(value)


def _lock_model(session: Session, model: str) -> Model:
    """The model's row, locked until the transaction ends (PostgreSQL; SQLite writes
    hold the database's write lock already)."""
    row = session.get(Model, model, with_for_update=True)
    if row is None:
        raise ModelNotFound(f"model {model!r} not found", model=model)
    return row


def _require_version(session: Session, model: str, version: str) -> str:
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


def _canary_at(
    session: Session, model: str, version: str, step: int
) -> tuple[Deployment, dict[str, Any]] | None:
    """The canary row (model locked) and a copy of its rollout, when it is still in
    progress at ``step``; None when the rollout moved on."""
    _lock_model(session, model)
    row = _row(session, model, version)
    rollout = dict(row.rollout or {})
    if row.strategy != "canary" or rollout.get("state") != "progressing":
        return None
    if rollout.get("step") != step or row.status in ("draining", "rolled_back"):
        return None
    return row, rollout


def _give(session: Session, model: str, row: Deployment, pct: int) -> datetime:
    """``pct`` % to ``row``; the other live versions share the rest in proportion."""
    others = [r for r in _rows(session, model) if r is not row and _live(r)]
    rest = scale_split({r.version: r.traffic_pct for r in others}, 100 - pct)
    now = utcnow()
    for other in others:
        other.traffic_pct, other.updated_at = rest[other.version], now
    row.traffic_pct, row.updated_at = pct, now
    return now


def _live(row: Deployment) -> bool:
    """A deployment that takes (or may take) live traffic."""
    return row.status not in ("draining", "rolled_back") and row.strategy != "shadow"


def _progressing(rows: Any) -> list[Deployment]:
    return [
        r
        for r in rows
        if r.strategy == "canary" and (r.rollout or {}).get("state") == "progressing"
    ]


def _stop_canaries(rows: Any, state: str, reason: str) -> None:
    """A person changed the traffic: canaries in progress stop moving on their own
    (``rolled_back`` ones also stop running)."""
    now = utcnow()
    for row in _progressing(rows):
        ended = {"state": state, "reason": reason, "ended_at": now.isoformat()}
        row.rollout = {**(row.rollout or {}), **ended}
        if state == "rolled_back":
            row.status, row.traffic_pct = "rolled_back", 0
        row.updated_at = now


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
