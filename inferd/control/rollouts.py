"""Rollout strategies as the controller sees them: at each pass it asks the strategy of
every deployment what to do next, and which of the model's versions take traffic,
mirror it, or must not be the serving one. The strategies' settings and progress live
in the registry (:mod:`inferd.registry.rollout`); these objects only read them.

A new strategy is a subclass here and an entry in :data:`POLICIES`; the controller
does not change.
"""

from __future__ import annotations

import enum
from datetime import datetime

from inferd.control.state import VersionSet
from inferd.registry.deployments import DeploymentRecord
from inferd.registry.rollout import DeploymentStatus, Strategy


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


def _after_keep(since: str, keep_s: float, now: datetime) -> Step | None:
    kept = (now - datetime.fromisoformat(since)).total_seconds()
    return Step.FINISH if kept >= keep_s else None
