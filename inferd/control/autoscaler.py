"""The autoscaling decision for one deployed version: from what its replicas counted,
how many replicas it should have, and why.

The controller looks at every autoscaled version every few seconds and hands
:meth:`Autoscaler.observe` one :class:`Signals` (figures from the replicas' own counters
and sketches, differenced since the previous look: never the gateways' guesses). The
autoscaler keeps, per signal, since when it has been over or under its threshold, and
decides (:class:`Decision`, kept as the version's recent scaling events):

- **up** as soon as one signal has been over for its window: utilisation (to the
  replica count that would bring it to ``utilisation_up``), queue depth (one more per
  ``queue_up`` requests waiting) or p99 (one more); several at once when far over, at
  most ``max_step_up``, never while earlier new replicas are still starting;
- **down**, one replica at a time, only when every signal has been calm for its window
  (utilisation low, queue empty, p99 under ``latency_down`` of the SLA), and
  ``down_cooldown_s`` after any change: a load that stays put never flaps;
- **to zero** (``min_replicas`` 0) after ``idle_timeout_s`` without a request, and
  **from zero** when a request is held for the version (:meth:`Autoscaler.demand`);
- within capacity: when the machine has room for fewer replicas than wanted
  (``room``), it scales to what fits and records why, once, instead of thrashing.

Pure: time comes in with the signals, so the tests drive it with any clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from inferd.registry.autoscaling import AutoscalingPolicy

EVENTS_KEPT = 50


@dataclass(frozen=True, slots=True)
class Signals:
    """One look at a version's replicas."""

    t: float
    """Clock time of the look (seconds)."""
    ready: int
    """Replicas serving now."""
    utilisation: float
    """Mean share of the time since the last look the ready replicas spent computing."""
    queued: int
    """Requests waiting in the replicas (summed)."""
    requests: int
    """Requests the replicas answered since the last look."""
    p99_ms: float | None = None
    """p99 of those requests' time in the replicas (None: none answered)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """A scaling event: the replica count it set, from what, and the figures behind it."""

    t: float
    replicas: int
    desired: int
    reason: str
    """utilisation | queue | latency | calm | idle | demand | bounds | capacity"""
    detail: str
    figures: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "t": self.t,
            "from": self.replicas,
            "to": self.desired,
            "reason": self.reason,
            "detail": self.detail,
            "figures": self.figures,
        }


class Autoscaler:
    def __init__(self, policy: AutoscalingPolicy, replicas: int, now: float) -> None:
        self.policy = policy
        self.desired = min(max(replicas, policy.min_replicas), policy.max_replicas)
        self.events: deque[Decision] = deque(maxlen=EVENTS_KEPT)
        self._changed = now - max(policy.up_cooldown_s, policy.down_cooldown_s)
        self._active = now  # the last time a request was seen (idle_timeout counts from it)
        self._over: dict[str, float] = {}  # signal -> since when it is over its threshold
        self._calm: dict[str, float] = {}  # signal -> since when it is calm
        self._short_of_room: int | None = None

    def retune(self, policy: AutoscalingPolicy) -> None:
        """A new policy for the same version (a deployment changed): windows go on."""
        self.policy = policy

    def demand(self, now: float) -> Decision | None:
        """A request is waiting for a version scaled to zero: start one replica."""
        self._active = now
        if self.desired > 0:
            return None
        return self._set(now, 0, 1, "demand", "a request is waiting: starting a replica", {})

    def observe(self, s: Signals, room: int | None = None, limit: str = "") -> Decision | None:
        """Take one look; the decision when the desired count changes (None otherwise).
        ``room``: how many replicas of this version the machine can run at most, and
        ``limit`` what bounds it (memory, cores)."""
        policy = self.policy
        if s.requests > 0 or s.queued > 0 or s.ready < self.desired:
            # A replica still starting counts as activity: the idle clock runs from once
            # the version serves (a start longer than ``idle_timeout_s`` would otherwise
            # be stopped, its held request started it again, and so on, never served).
            self._active = s.t
        latency_over = (
            policy.sla_p99_ms is not None and s.p99_ms is not None and s.p99_ms > policy.sla_p99_ms
        )
        latency_calm = (
            policy.sla_p99_ms is None
            or s.p99_ms is None
            or s.p99_ms < policy.latency_down * policy.sla_p99_ms
        )
        self._track("utilisation", s.utilisation > policy.utilisation_up, s.t, self._over)
        self._track("queue", s.queued > policy.queue_up, s.t, self._over)
        self._track("latency", latency_over, s.t, self._over)
        self._track("utilisation", s.utilisation < policy.utilisation_down, s.t, self._calm)
        self._track("queue", s.queued == 0, s.t, self._calm)
        self._track("latency", latency_calm, s.t, self._calm)
        figures = {
            "ready": float(s.ready),
            "utilisation": round(s.utilisation, 4),
            "queued": float(s.queued),
            "requests": float(s.requests),
        }
        if s.p99_ms is not None:
            figures["p99_ms"] = round(s.p99_ms, 3)
        current = self.desired
        if current < policy.min_replicas or current > policy.max_replicas:
            bounded = min(max(current, policy.min_replicas), policy.max_replicas)
            why = f"outside min_replicas {policy.min_replicas}..max_replicas {policy.max_replicas}"
            return self._set(s.t, current, bounded, "bounds", why, figures)
        wanted = self._wanted_up(s, figures)
        if wanted is not None:
            reason, count, detail = wanted
            return self._up(s.t, current, count, reason, detail, figures, room, limit)
        self._short_of_room = None
        return self._down(s, current, figures)

    def _wanted_up(self, s: Signals, figures: dict[str, float]) -> tuple[str, int, str] | None:
        policy, current = self.policy, self.desired
        if current == 0 or current >= policy.max_replicas:
            return None
        if s.ready < current or s.t - self._changed < policy.up_cooldown_s:
            return None  # new replicas are still starting, or just started
        candidates: list[tuple[int, str, str]] = []
        if self._held("utilisation", policy.up_window_s, s.t, self._over):
            count = math.ceil(current * s.utilisation / policy.utilisation_up)
            detail = (
                f"utilisation {s.utilisation:.0%} over {policy.utilisation_up:.0%} for "
                f"{policy.up_window_s:g}s"
            )
            candidates.append((count, "utilisation", detail))
        if self._held("queue", 0.0, s.t, self._over):
            count = current + math.ceil(s.queued / policy.queue_up)
            candidates.append(
                (count, "queue", f"{s.queued} requests waiting, over {policy.queue_up}")
            )
        if self._held("latency", policy.latency_window_s, s.t, self._over):
            detail = (
                f"p99 {figures.get('p99_ms', 0):g} ms over the SLA {policy.sla_p99_ms:g} ms "
                f"for {policy.latency_window_s:g}s"
            )
            candidates.append((current + 1, "latency", detail))
        if not candidates:
            return None
        count, reason, detail = max(candidates)
        count = min(max(count, current + 1), current + policy.max_step_up, policy.max_replicas)
        return reason, count, detail

    def _up(
        self,
        t: float,
        current: int,
        count: int,
        reason: str,
        detail: str,
        figures: dict[str, float],
        room: int | None,
        limit: str = "",
    ) -> Decision | None:
        if room is not None and count > room:
            if room <= current:
                if self._short_of_room != room:  # once while the room stays what it is
                    self._short_of_room = room
                    why = f"{detail}: wants {count} replicas, the machine has room for {room}"
                    if limit:
                        why += f" ({limit})"
                    self.events.append(Decision(t, current, current, "capacity", why, figures))
                return None
            detail = f"{detail}; room for {room} of the {count} wanted"
            count = room
        return self._set(t, current, count, reason, detail, figures)

    def _down(self, s: Signals, current: int, figures: dict[str, float]) -> Decision | None:
        policy = self.policy
        if policy.min_replicas == 0 and current > 0 and s.t - self._active >= policy.idle_timeout_s:
            detail = f"no request for {policy.idle_timeout_s:g}s"
            return self._set(s.t, current, 0, "idle", detail, figures)
        if current <= max(policy.min_replicas, 1) or s.t - self._changed < policy.down_cooldown_s:
            return None
        calm = (
            self._held("utilisation", policy.down_window_s, s.t, self._calm)
            and self._held("queue", policy.queue_empty_s, s.t, self._calm)
            and self._held("latency", policy.down_window_s, s.t, self._calm)
        )
        if not calm:
            return None
        detail = (
            f"utilisation {s.utilisation:.0%} under {policy.utilisation_down:.0%} for "
            f"{policy.down_window_s:g}s, queue empty for {policy.queue_empty_s:g}s"
        )
        if policy.sla_p99_ms is not None:
            detail += f", p99 under {policy.latency_down:.0%} of the SLA"
        return self._set(s.t, current, current - 1, "calm", detail, figures)

    def _set(
        self,
        t: float,
        current: int,
        desired: int,
        reason: str,
        detail: str,
        figures: dict[str, float],
    ) -> Decision | None:
        if desired == current:
            return None
        decision = Decision(t, current, desired, reason, detail, figures)
        self.desired = desired
        self._changed = t
        self.events.append(decision)
        return decision

    @staticmethod
    def _track(signal: str, holds: bool, t: float, since: dict[str, float]) -> None:
        if holds:
            since.setdefault(signal, t)
        else:
            since.pop(signal, None)

    @staticmethod
    def _held(signal: str, window_s: float, t: float, since: dict[str, float]) -> bool:
        start = since.get(signal)
        return start is not None and t - start >= window_s
