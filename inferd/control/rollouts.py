"""Rollout strategies as the controller sees them: at each pass it asks the strategy of
every deployment what to do next, and which of the model's versions take traffic,
mirror it, or must not be the serving one. The strategies' settings and progress live
in the registry (:mod:`inferd.registry.rollout`); these objects only read them.

A new strategy is a subclass here and an entry in :data:`POLICIES`; the controller
does not change. The steps they ask for run in the background (:class:`Steps`), each at
most once at a time: a canary's window outlasts many passes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any

from inferd.control.analyst import CanaryAnalyst
from inferd.control.state import ModelState, VersionSet
from inferd.registry.deployments import DeploymentRecord
from inferd.registry.rollout import DeploymentStatus, Strategy
from inferd.registry.rollout_progress import RolloutProgress

logger = logging.getLogger(__name__)


class Step(enum.StrEnum):
    SWITCH = "switch"
    """Blue-green: every replica is ready; move all the traffic to it now."""
    FINISH = "finish"
    """The keep window after a switch or promotion is over: remove what it replaced."""
    ANALYSE = "canary"
    """A canary in progress: analyse its current window (and move it on, or back)."""


class RolloutPolicy:
    """Rolling: the version takes its share as soon as it has ready replicas."""

    takes_traffic = True

    def mirror(self, row: DeploymentRecord) -> tuple[int, float] | None:
        """(percent of the model's requests mirrored to it, output tolerance), for a
        version that only shadows."""
        return None

    def holds_back(self, row: DeploymentRecord) -> bool:
        """Never the serving version (what failed requests fall back to) while another
        one is ready."""
        return False

    def next_step(self, row: DeploymentRecord, vset: VersionSet, now: datetime) -> Step | None:
        return None


class BlueGreen(RolloutPolicy):
    """Switch all traffic once every replica is ready; after the keep window, remove
    the versions it replaced (unless traffic went back to them)."""

    def next_step(self, row: DeploymentRecord, vset: VersionSet, now: datetime) -> Step | None:
        plan = row.blue_green
        if plan is None or plan.done:
            return None
        if plan.switched_at is None:
            return Step.SWITCH if vset.state() is DeploymentStatus.ACTIVE else None
        return _after_keep(plan.switched_at, plan.keep_old_s, now)


class Canary(RolloutPolicy):
    """Analyse each step's window in the background; after a promotion, remove what it
    replaced once the keep window is over."""

    def holds_back(self, row: DeploymentRecord) -> bool:
        return row.canary is not None and row.canary.progressing

    def next_step(self, row: DeploymentRecord, vset: VersionSet, now: datetime) -> Step | None:
        plan = row.canary
        if plan is None:
            return None
        if plan.progressing:
            return Step.ANALYSE
        if plan.promoted_at is not None and not plan.done:
            return _after_keep(plan.promoted_at, plan.keep_old_s, now)
        return None


class Shadow(RolloutPolicy):
    """Takes no live traffic: gateways mirror a share of the requests to it."""

    takes_traffic = False

    def mirror(self, row: DeploymentRecord) -> tuple[int, float] | None:
        plan = row.shadow
        return None if plan is None else (plan.mirror_pct, plan.tolerance)


POLICIES: dict[Strategy, RolloutPolicy] = {
    Strategy.ROLLING: RolloutPolicy(),
    Strategy.BLUE_GREEN: BlueGreen(),
    Strategy.CANARY: Canary(),
    Strategy.SHADOW: Shadow(),
}


def policy(row: DeploymentRecord) -> RolloutPolicy:
    return POLICIES[row.strategy]


def route(model: ModelState, rows: list[DeploymentRecord]) -> None:
    """The model's traffic split, mirrors and canaries in progress, as its deployments'
    policies say (``rows`` empty: a model in automatic mode, or unloaded, has none)."""
    active = [r for r in rows if not r.status.gone]
    model.traffic = {r.version: r.traffic_pct for r in active if policy(r).takes_traffic}
    model.mirrors = {r.version: m for r in active if (m := policy(r).mirror(r)) is not None}
    model.canaries = {r.version for r in active if policy(r).holds_back(r)}


def _after_keep(since: str, keep_s: float, now: datetime) -> Step | None:
    kept = (now - datetime.fromisoformat(since)).total_seconds()
    return Step.FINISH if kept >= keep_s else None


async def run_step(
    rollouts: RolloutProgress,
    analyst: CanaryAnalyst,
    model: ModelState,
    row: DeploymentRecord,
    step: Step,
) -> bool:
    """Run a rollout step; whether it changed the registry (then a new pass is due)."""
    if step is Step.SWITCH:
        change = await asyncio.to_thread(rollouts.switch_blue_green, model.name, row.version)
        if change is not None:
            logger.info(
                "%s: all replicas of %s ready; switched all traffic to it", model.name, row.version
            )
        return change is not None
    if step is Step.FINISH:
        removed = await asyncio.to_thread(rollouts.finish_rollout, model.name, row.version)
        if removed:
            logger.info("%s: keep window over; removing %s", model.name, ", ".join(removed))
        return True
    assert row.canary is not None
    return await analyst.analyse(model, row.version, row.canary)


class Steps:
    """The rollout steps running now, for the controller."""

    def __init__(
        self,
        rollouts: RolloutProgress,
        analyst: CanaryAnalyst,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        reconcile_soon: Callable[[], None],
    ) -> None:
        self.rollouts = rollouts
        self.analyst = analyst
        self.spawn = spawn
        self.reconcile_soon = reconcile_soon
        self._running: set[tuple[str, str, Step]] = set()
        """(model, version, step) running now: each runs once at a time."""

    def once(self, model: ModelState, row: DeploymentRecord, step: Step) -> None:
        """Run ``step`` in the background unless the same one is still running; a step
        that changed the registry asks for a new pass."""
        key = (model.name, row.version, step)
        if key in self._running:
            return
        self._running.add(key)
        self.spawn(self._run(key, model, row, step))

    async def _run(
        self, key: tuple[str, str, Step], model: ModelState, row: DeploymentRecord, step: Step
    ) -> None:
        try:
            if await run_step(self.rollouts, self.analyst, model, row, step):
                self.reconcile_soon()
        except Exception:
            logger.exception("%s of %s:%s failed; the next pass retries", step, *key[:2])
        finally:
            self._running.discard(key)
