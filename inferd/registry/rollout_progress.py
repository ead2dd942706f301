"""The controller's writes to deployments: rollout progress (a blue-green switch, a
canary's next step, rollback or halt, the end of a keep window) and what it observes of
replicas (a deployment's status, the removal of a drained one).

Each write is one transaction that locks the model first, like every deployment write
(:mod:`inferd.registry.deployments`), and checks that the rollout is still where the
controller saw it: a step computed from an older read (a person changed the traffic
meanwhile) does nothing and returns None or an empty list.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from inferd.registry import deployment_rows as rows_
from inferd.registry import rollout as plans
from inferd.registry.deployments import TrafficRecord, _change
from inferd.registry.rollout import (
    BlueGreenRollout,
    CanaryRollout,
    CanaryState,
    DeploymentStatus,
    Reason,
    Strategy,
)
from inferd.registry.tables import Deployment, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry


class RolloutProgress:
    """The controller's part of the deployment tables (``registry.rollouts``)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def switch_blue_green(self, model: str, version: str) -> TrafficRecord | None:
        """All traffic to a blue-green deployment at once (the controller, once all its
        replicas are ready); the others stay deployed at 0 %. None if already done."""
        with self._write() as session:
            rows_.lock_model(session, model)
            row = rows_.one(session, model, version)
            plan = plans.load(row.strategy, row.rollout)
            if (
                not isinstance(plan, BlueGreenRollout)
                or plan.switched_at
                or row.status == DeploymentStatus.DRAINING
            ):
                return None
            now = utcnow()
            rows = rows_.of_model(session, model)
            for other in rows:
                other.traffic_pct, other.updated_at = (100 if other is row else 0), now
            plan.switched_at = now.isoformat()
            row.rollout = plans.dump(plan)
            split = {r.version: r.traffic_pct for r in rows}
            detail = f"all replicas of {version} ready"
            change = rows_.record(session, model, split, Reason.BLUE_GREEN_SWITCH, "inferd", detail)
            return _change(change)

    def advance_canary(
        self, model: str, version: str, step: int, analysis: dict[str, Any], detail: str
    ) -> TrafficRecord | None:
        """The canary passed the analysis of ``step``: give it the next step's share (the
        other versions share the rest in proportion); at 100 % it is promoted. None when
        the rollout moved on meanwhile (a manual change, another pass)."""
        with self._write() as session:
            found = rows_.canary_at(session, model, version, step)
            if found is None:
                return None
            row, plan = found
            pct = plan.steps[step + 1]
            now = rows_.give(session, model, row, pct)
            plan.step, plan.analysis = step + 1, analysis
            plan.analyses = [*plan.analyses, analysis]
            reason = Reason.CANARY_STEP
            if pct == 100:
                plan.state, plan.promoted_at = CanaryState.PROMOTED, now.isoformat()
                reason = Reason.CANARY_PROMOTED
            row.rollout = plans.dump(plan)
            split = rows_.split_of(session, model)
            return _change(rows_.record(session, model, split, reason, "inferd", detail))

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
            found = rows_.canary_at(session, model, version, step)
            if found is None:
                return None
            row, plan = found
            now = utcnow()
            plan.reason, plan.analysis, plan.ended_at = reason, analysis, now.isoformat()
            if analysis is not None:
                plan.analyses = [*plan.analyses, analysis]
            if not rollback:
                plan.state = CanaryState.HALTED
                row.rollout, row.updated_at = plans.dump(plan), now
                return None
            rows_.give(session, model, row, 0)
            row.status = DeploymentStatus.ROLLED_BACK.value
            plan.state = CanaryState.ROLLED_BACK
            row.rollout = plans.dump(plan)
            split = rows_.split_of(session, model)
            change = rows_.record(session, model, split, Reason.CANARY_ROLLBACK, "inferd", reason)
            return _change(change)

    def finish_rollout(self, model: str, version: str) -> list[str]:
        """After the keep window of a blue-green switch or a canary promotion: remove the
        versions it replaced (those still at 0 %), unless traffic went back to them (a
        rollback). Returns what it removes."""
        with self._write() as session:
            rows_.lock_model(session, model)
            row = rows_.one(session, model, version)
            plan = plans.load(row.strategy, row.rollout)
            if not isinstance(plan, BlueGreenRollout | CanaryRollout):
                return []
            if not plan.completed_at() or plan.done:
                return []
            plan.done = True
            row.rollout = plans.dump(plan)
            if row.traffic_pct != 100:
                return []  # rolled back meanwhile: keep what serves
            now = utcnow()
            removed = []
            for other in rows_.of_model(session, model):
                if (
                    other is not row
                    and other.traffic_pct == 0
                    and other.status != DeploymentStatus.DRAINING
                    and other.strategy != Strategy.SHADOW
                ):
                    other.status, other.updated_at = DeploymentStatus.DRAINING.value, now
                    removed.append(other.version)
            if removed:
                split = rows_.split_of(session, model)
                detail = f"removing {', '.join(removed)} after the keep window"
                reason = (
                    Reason.CANARY_DONE
                    if row.strategy == Strategy.CANARY
                    else Reason.BLUE_GREEN_DONE
                )
                rows_.record(session, model, split, reason, "inferd", detail)
            return removed

    def set_status(self, model: str, version: str, status: DeploymentStatus) -> None:
        """The controller's view of a deployment (deploying, active, failed); a draining
        or rolled-back deployment keeps its status."""
        with self._write() as session:
            row = session.scalar(
                select(Deployment).where(
                    Deployment.model_name == model, Deployment.version == version
                )
            )
            if row is not None and not DeploymentStatus(row.status).gone and row.status != status:
                row.status, row.updated_at = DeploymentStatus(status).value, utcnow()

    def remove(self, model: str, version: str) -> None:
        """Delete a drained deployment (the controller, once its replicas stopped)."""
        with self._write() as session:
            session.execute(
                delete(Deployment).where(
                    Deployment.model_name == model,
                    Deployment.version == version,
                    Deployment.status == DeploymentStatus.DRAINING.value,
                )
            )

    def _write(self) -> contextlib.AbstractContextManager[Session]:
        return rows_.write(self._registry)
