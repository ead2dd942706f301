"""A deployment's ``autoscaling`` block: the design documents' policy as defaults, every
threshold a field.

=========================  ==========================  =============================
signal                     scale up when               scale down when
=========================  ==========================  =============================
utilisation (share of      > ``utilisation_up`` (80 %)  < ``utilisation_down`` (30 %)
time replicas compute)     for ``up_window_s`` (2 min)  for ``down_window_s`` (10 min)
queue depth (requests      > ``queue_up`` (50)          empty for ``queue_empty_s``
waiting)                                                (5 min)
p99 latency                > ``sla_p99_ms``             < ``latency_down`` (50 %) of it
=========================  ==========================  =============================

Scaling down needs every signal calm (utilisation low, queue empty, latency well under
the SLA, for their windows); scaling up needs one signal over. Persisted as JSON in the
deployment row through :func:`load`/:func:`dump`, like the rollouts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from inferd.errors import InvalidInput


class AutoscalingPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    min_replicas: int = 1
    """0 allows scaling to zero after ``idle_timeout_s`` without requests."""
    max_replicas: int = 4
    utilisation_up: float = 0.8
    up_window_s: float = 120.0
    utilisation_down: float = 0.3
    down_window_s: float = 600.0
    queue_up: int = 50
    """Requests waiting in the version's replicas (summed) above which it scales up."""
    queue_empty_s: float = 300.0
    sla_p99_ms: float | None = None
    """The version's latency SLA; None: latency does not scale it."""
    latency_window_s: float = 30.0
    """How long p99 must stay above the SLA before it scales up."""
    latency_down: float = 0.5
    max_step_up: int = 4
    """Most replicas added at once (when far over: a queue of 4x ``queue_up`` adds 4)."""
    up_cooldown_s: float = 30.0
    """After any change, time before the next scale-up (new replicas start meanwhile)."""
    down_cooldown_s: float = 120.0
    """After any change, time before the next scale-down: one at a time, never flapping."""
    idle_timeout_s: float = 300.0
    """With ``min_replicas`` 0: time without a request before its replicas stop."""

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.min_replicas <= self.max_replicas:
            problems.append("0 <= min_replicas <= max_replicas")
        if self.max_replicas < 1:
            problems.append("max_replicas >= 1")
        if not 0 <= self.utilisation_down < self.utilisation_up:
            problems.append("0 <= utilisation_down < utilisation_up")
        if self.queue_up < 1 or self.max_step_up < 1:
            problems.append("queue_up and max_step_up >= 1")
        if self.sla_p99_ms is not None and self.sla_p99_ms <= 0:
            problems.append("sla_p99_ms > 0")
        if not 0 < self.latency_down < 1:
            problems.append("0 < latency_down < 1")
        windows = (
            self.up_window_s, self.down_window_s, self.queue_empty_s, self.latency_window_s,
            self.up_cooldown_s, self.down_cooldown_s, self.idle_timeout_s,
        )  # fmt: skip
        if min(windows) < 0:
            problems.append("windows and cooldowns >= 0")
        if problems:
            raise InvalidInput(f"autoscaling: expected {'; '.join(problems)}")


def load(raw: dict[str, Any] | None) -> AutoscalingPolicy | None:
    """The policy of an ``autoscaling`` JSON object (None: a fixed replica count); a bad
    field is a 422 naming it."""
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, AutoscalingPolicy)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"autoscaling: {exc}") from None


def dump(policy: AutoscalingPolicy | None) -> dict[str, Any] | None:
    return None if policy is None else msgspec.to_builtins(policy)
