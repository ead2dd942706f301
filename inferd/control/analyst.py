"""Runs canary analysis windows (the checks are :mod:`inferd.control.canary`'s) and
records the verdicts in the registry: the next step, a rollback, or a halt.

One window per canary step: it starts when every canary replica serves, with a sample
of every replica's counters on both sides; each later pass samples again and asks for a
verdict until one comes (see :func:`inferd.control.canary.judge`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from inferd.clock import SYSTEM, Clock
from inferd.control import canary
from inferd.control.state import ModelState
from inferd.registry.rollout import CanaryRollout, DeploymentStatus
from inferd.registry.rollout_progress import RolloutProgress

logger = logging.getLogger(__name__)

Sampler = Callable[[list[tuple[str, int, str]]], Awaitable[dict[canary.Key, canary.ReplicaSample]]]


@dataclass
class Window:
    """A canary step's analysis window: when it started and what every replica had
    counted then."""

    step: int
    started: float
    canary_before: dict[canary.Key, canary.ReplicaSample]
    stable_before: dict[canary.Key, canary.ReplicaSample]
    restarts: int
    waiting: str = ""


class CanaryAnalyst:
    def __init__(
        self,
        rollouts: RolloutProgress,
        clock: Clock = SYSTEM,
        sample: Sampler = canary.sample,
        graphs: canary.GraphFigures | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.clock = clock
        self.sample = sample
        self.graphs = graphs or canary.GraphFigures()
        """Inference graph versions' figures (no replica to sample: the gateways' rows)."""
        self._windows: dict[tuple[str, str], Window] = {}

    def keep_only(self, model: str, canaries: set[str]) -> None:
        """Forget the windows of versions that are no canary in progress any more."""
        for key in [k for k in self._windows if k[0] == model and k[1] not in canaries]:
            del self._windows[key]

    async def analyse(self, model: ModelState, version: str, plan: CanaryRollout) -> bool:
        """One look at the canary's window; True when it concluded (the registry moved
        it on or back)."""
        vset = model.versions.get(version)
        if vset is None or vset.retiring:
            return False
        if vset.state() is DeploymentStatus.FAILED:
            why = vset.failure() or "failed"
            verdict = canary.Verdict("fail", f"canary replicas cannot serve: {why}")
            await self._conclude(model.name, version, plan, verdict, None)
            return True
        stable = [v for v, pct in model.traffic.items() if v != version and pct > 0]
        key = (model.name, version)
        window = self._windows.get(key)
        if window is None or window.step != plan.step:
            if vset.all_ready():  # the window starts when every canary replica serves
                await self._open(model, version, stable, plan)
            return False
        now_canary, now_stable = await asyncio.gather(
            self._sample(model, [version]), self._sample(model, stable)
        )
        mine = canary.window(window.canary_before, now_canary)
        theirs = canary.window(window.stable_before, now_stable)
        mine.crashes = max(0, sum(r.restarts for r in vset.replicas) - window.restarts)
        elapsed = self.clock.monotonic() - window.started
        verdict = canary.judge(mine, theirs, plan, final=elapsed >= plan.step_s)
        if verdict.outcome == "wait":
            if elapsed >= plan.step_s and verdict.reason != window.waiting:
                logger.info("%s: canary %s %s", model.name, version, verdict.reason)
            window.waiting = verdict.reason
            return False
        analysis = {
            "step": plan.step,
            "traffic_pct": plan.steps[plan.step],
            "window_s": round(elapsed, 1),
            "canary": mine.to_dict(plan.quantile),
            "stable": theirs.to_dict(plan.quantile),
            "stable_versions": stable,
            "verdict": verdict.outcome,
            "reason": verdict.reason,
        }
        if verdict.outcome == "pass" and plan.webhook:
            hook = await canary.call_webhook(
                plan.webhook, {"model": model.name, "version": version, **analysis}
            )
            if hook.outcome == "fail":
                verdict = hook
                analysis.update(verdict="fail", reason=hook.reason)
        await self._conclude(model.name, version, plan, verdict, analysis)
        return True

    async def _open(
        self, model: ModelState, version: str, stable: list[str], plan: CanaryRollout
    ) -> None:
        before_canary, before_stable = await asyncio.gather(
            self._sample(model, [version]), self._sample(model, stable)
        )
        restarts = sum(r.restarts for r in model.versions[version].replicas)
        self._windows[(model.name, version)] = Window(
            plan.step, self.clock.monotonic(), before_canary, before_stable, restarts
        )
        logger.info(
            "%s: canary %s at %d %%; analysis window of %.0fs starts",
            model.name, version, plan.steps[plan.step], plan.step_s,
        )  # fmt: skip

    async def _sample(
        self, model: ModelState, versions: list[str]
    ) -> dict[canary.Key, canary.ReplicaSample]:
        """The replicas' samples of ``versions``, and the gateways' of those that are
        inference graphs."""
        found = await self.sample(_addresses(model, versions))
        graphs = [v for v in versions if (s := model.versions.get(v)) and s.replicaless]
        if graphs:
            found.update(self.graphs.samples(model.name, graphs))
        return found

    async def _conclude(
        self,
        model: str,
        version: str,
        plan: CanaryRollout,
        verdict: canary.Verdict,
        analysis: dict[str, Any] | None,
    ) -> None:
        """Move the canary to its next step, or roll it back (halt it, without
        auto_rollback), recording why."""
        step, steps = plan.step, plan.steps
        self._windows.pop((model, version), None)
        if verdict.outcome == "pass":
            detail = f"step {step + 1} of {len(steps) - 1} passed: {verdict.reason}"
            change = await asyncio.to_thread(
                self.rollouts.advance_canary, model, version, step, analysis or {}, detail
            )
            if change is not None:
                logger.info(
                    "%s: canary %s passed %d %% (%s); now %d %%",
                    model, version, steps[step], verdict.reason, steps[step + 1],
                )  # fmt: skip
            return
        rollback = plan.auto_rollback
        await asyncio.to_thread(
            self.rollouts.end_canary, model, version, step, verdict.reason, analysis, rollback
        )
        logger.warning(
            "%s: canary %s failed at %d %%: %s; %s",
            model, version, steps[step], verdict.reason,
            "rolled back" if rollback else "halted (auto_rollback is off)",
        )  # fmt: skip


def _addresses(model: ModelState, versions: list[str]) -> list[tuple[str, int, str]]:
    """(id, incarnation, address) of the serving replicas of ``versions``."""
    return [(r.id, r.incarnation, r.address) for r in model.ready_replicas(versions)]
