"""The typed vocabulary of deployments: strategies, statuses, history reasons, and each
strategy's persisted rollout (its settings and progress).

A deployment row keeps its rollout as JSON in the ``rollout`` column. It is written and
read only through the structs below (:func:`dump` and :func:`load`), which stamp and
check ``schema``: a row written before the field existed has the layout of schema 1, so
a server that restarts resumes an old rollout where it stood; a row from a newer inferd
is refused by name instead of being half understood. A change of layout bumps
:data:`SCHEMA` and teaches :func:`load` to upgrade the older one.

``to_dict`` of a rollout is the JSON users see in the API (without ``schema``).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from inferd import devices
from inferd.errors import InvalidInput

SCHEMA = 1
"""The layout of the ``rollout`` column this code writes."""


class Strategy(enum.StrEnum):
    """rolling: the version takes its share as soon as it has ready replicas. blue-green:
    it takes none until all its replicas are ready, then all of it at once; the versions
    it replaced stay deployed (warm, at 0 %) for ``keep_old_s`` for an instant rollback,
    then are removed. canary: it takes the first of its ``steps`` and moves to the next
    one each time an analysis window finds it no worse than the stable versions
    (:mod:`inferd.control.canary`), or goes back to 0 % with the reason recorded. shadow:
    it takes no traffic; gateways mirror ``mirror_pct`` % of the model's requests to it
    and count how often it agrees with the live answer."""

    ROLLING = "rolling"
    BLUE_GREEN = "blue-green"
    CANARY = "canary"
    SHADOW = "shadow"


class DeploymentStatus(enum.StrEnum):
    """deploying/active/failed: the controller's view of its replicas; draining: being
    removed (deleted once its replicas stopped); rolled_back: a failed canary, kept
    (stopped, at 0 %) with its analysis for people to read."""

    DEPLOYING = "deploying"
    ACTIVE = "active"
    FAILED = "failed"
    DRAINING = "draining"
    ROLLED_BACK = "rolled_back"

    @property
    def gone(self) -> bool:
        """Runs no replicas and takes no traffic any more."""
        return self in (DeploymentStatus.DRAINING, DeploymentStatus.ROLLED_BACK)


class CanaryState(enum.StrEnum):
    PROGRESSING = "progressing"
    PROMOTED = "promoted"
    HALTED = "halted"
    """Failed with auto_rollback off: it stays where it is for a person to decide."""
    ROLLED_BACK = "rolled_back"
    OVERRIDDEN = "overridden"
    """A person set the traffic while it progressed: it stops moving on its own."""


class Reason(enum.StrEnum):
    """Why the traffic split changed (``traffic_history.reason``)."""

    DEPLOY = "deploy"
    MANUAL = "manual"
    ROLLBACK = "rollback"
    UNDEPLOY = "undeploy"
    BLUE_GREEN_SWITCH = "blue_green_switch"
    BLUE_GREEN_DONE = "blue_green_done"
    CANARY_STEP = "canary_step"
    CANARY_PROMOTED = "canary_promoted"
    CANARY_ROLLBACK = "canary_rollback"
    CANARY_DONE = "canary_done"


KEEP_OLD_S = 300.0
"""Blue-green and canary: how long the replaced versions stay deployed after the switch."""
CANARY_STEPS = (1, 10, 50, 100)


class BlueGreenRollout(msgspec.Struct, kw_only=True):
    keep_old_s: float = KEEP_OLD_S
    switched_at: str | None = None
    """ISO time all traffic moved to it; the keep window counts from here."""
    done: bool = False
    """The keep window is over and what it replaced was removed (or kept on a rollback)."""

    def completed_at(self) -> str | None:
        return self.switched_at


class CanaryRollout(msgspec.Struct, kw_only=True):
    """Settings (see :mod:`inferd.control.canary` for what each one means) and progress."""

    steps: list[int]
    step_s: float = 60.0
    min_requests: int = 50
    max_error_rate_increase: float = 0.01
    max_latency_increase: float = 0.1
    min_latency_increase_ms: float = 1.0
    latency: str = "compute"
    quantile: float = 0.99
    max_p99_ms: float | None = None
    webhook: str | None = None
    auto_rollback: bool = True
    keep_old_s: float = KEEP_OLD_S
    state: CanaryState = CanaryState.PROGRESSING
    step: int = 0
    """Index into ``steps`` of the share it has now."""
    reason: str | None = None
    analysis: dict[str, Any] | None = None
    """The last analysis window's figures and verdict."""
    analyses: list[dict[str, Any]] = []
    """Every concluded analysis window, oldest first (the console shows each step's
    figures and verdict); rows written before it have none."""
    promoted_at: str | None = None
    done: bool = False
    ended_at: str | msgspec.UnsetType = msgspec.UNSET
    """When it failed, halted or was overridden (absent before)."""

    def completed_at(self) -> str | None:
        return self.promoted_at

    @property
    def progressing(self) -> bool:
        return self.state is CanaryState.PROGRESSING


class ShadowRollout(msgspec.Struct, kw_only=True):
    mirror_pct: int
    tolerance: float = 1e-5


Rollout = BlueGreenRollout | CanaryRollout | ShadowRollout
_TYPES: dict[Strategy, type[BlueGreenRollout] | type[CanaryRollout] | type[ShadowRollout]] = {
    Strategy.BLUE_GREEN: BlueGreenRollout,
    Strategy.CANARY: CanaryRollout,
    Strategy.SHADOW: ShadowRollout,
}
_CANARY_SETTINGS = (
    "step_s",
    "min_requests",
    "max_error_rate_increase",
    "max_latency_increase",
    "min_latency_increase_ms",
    "latency",
    "quantile",
    "max_p99_ms",
    "webhook",
    "auto_rollback",
    "keep_old_s",
)
CANARY_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in msgspec.structs.fields(CanaryRollout) if f.name in _CANARY_SETTINGS
}
"""The canary analysis settings a deployment may give (besides ``steps``), with their
defaults."""


def load(strategy: str, data: dict[str, Any] | None) -> Rollout | None:
    """The rollout of a deployment row as its strategy's struct (None for rolling)."""
    kind = _TYPES.get(Strategy(strategy))
    if kind is None or data is None:
        return None
    schema = data.get("schema", 1)
    if not isinstance(schema, int) or schema > SCHEMA:
        raise ValueError(
            f"a {strategy} rollout of schema {schema!r} was written by a newer inferd "
            f"(this one reads up to {SCHEMA})"
        )
    fields = {k: v for k, v in data.items() if k != "schema"}
    return msgspec.convert(fields, kind)


def dump(rollout: Rollout | None) -> dict[str, Any] | None:
    """What the ``rollout`` column stores."""
    return None if rollout is None else {"schema": SCHEMA, **to_dict(rollout)}


def to_dict(rollout: Rollout) -> dict[str, Any]:
    """The rollout as users see it."""
    return msgspec.to_builtins(rollout)  # type: ignore[no-any-return]


# -- what a deploy request may say -------------------------------------------------------

STRATEGIES = tuple(s.value for s in Strategy)
MAX_REPLICAS = 64


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


def check_deploy(
    traffic_pct: Any, replicas: Any, strategy: Any, gpu_type: Any = None, gpus_here: bool = True
) -> None:
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
    if gpu_type is not None and gpus_here:
        devices.place(gpu_type)  # refused unless this machine has one
    if strategy not in STRATEGIES:
        raise InvalidInput(f"strategy {strategy!r} is not available; use one of {list(STRATEGIES)}")


def check(strategy: Strategy, traffic_pct: int | None, settings: Any) -> tuple[int, Rollout | None]:
    """(the version's starting share, the strategy's rollout checked and completed)."""
    if settings is not None and not isinstance(settings, dict):
        raise InvalidInput("rollout must be an object")
    given = dict(settings or {})
    if strategy is Strategy.BLUE_GREEN:
        if traffic_pct not in (None, 100):
            raise InvalidInput("blue-green moves all traffic at once: traffic_percent must be 100")
        _known_settings(strategy, given, {"keep_old_s"})
        return 100, BlueGreenRollout(keep_old_s=_seconds(given, "keep_old_s", KEEP_OLD_S))
    if strategy is Strategy.CANARY:
        return _check_canary(traffic_pct, given)
    if strategy is Strategy.SHADOW:
        _known_settings(strategy, given, {"tolerance"})
        mirror = 100 if traffic_pct is None else traffic_pct
        if mirror < 1:
            raise InvalidInput("a shadow mirrors traffic_percent 1 to 100 % of the requests")
        tolerance = given.get("tolerance", 1e-5)
        if not _number(tolerance) or not 0 <= tolerance <= 1e6:
            raise InvalidInput(f"tolerance must be a number >= 0, not {tolerance!r}")
        return 0, ShadowRollout(mirror_pct=mirror, tolerance=float(tolerance))
    if given:
        raise InvalidInput(f"strategy {strategy.value!r} takes no rollout settings")
    return (100 if traffic_pct is None else traffic_pct), None


def _canary_steps(traffic_pct: int | None, given: dict[str, Any]) -> list[int]:
    if traffic_pct == 100:
        raise InvalidInput("a canary starts below 100 % of the traffic (its first step)")
    steps = given.get("steps")
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


def _check_canary(traffic_pct: int | None, given: dict[str, Any]) -> tuple[int, CanaryRollout]:
    _known_settings(Strategy.CANARY, given, {"steps", *_CANARY_SETTINGS})
    steps = _canary_steps(traffic_pct, given)
    out = {**CANARY_DEFAULTS, **given}
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
    return steps[0], CanaryRollout(**{**out, "steps": steps})


def _known_settings(strategy: Strategy, given: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise InvalidInput(
            f"unknown {strategy.value} rollout setting(s) {unknown}; known: {sorted(known)}"
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seconds(given: dict[str, Any], key: str, default: float, low: float = 0.0) -> float:
    value = given.get(key, default)
    if not _number(value) or not low <= value <= 86400:
        raise InvalidInput(f"{key} must be seconds from {low:g} to 86400, not {value!r}")
    return float(value)
