"""Request priorities, as every API names them and the replica's queue takes them.

A request's priority travels to the replica as one integer: a level from 1 (first) to
the model's ``priority_levels``, 0 for its default level, or a name's code (a negative
number, :data:`NAMED_PRIORITIES`) that the replica maps to the level it stands for
(:func:`named_levels`), so the gateway never needs a model's batching settings.
"""

from __future__ import annotations

from inferd.errors import InvalidInput
from inferd.replica_config import BatchingConfig

NAMED_PRIORITIES = {"high": -1, "normal": -2, "low": -3, "batch": -4}
"""How the gateway sends a priority name: the replica knows the levels it stands for."""


def named_levels(config: BatchingConfig) -> dict[str, int]:
    """The level each priority name stands for: ``high`` the first, ``normal`` the
    default, ``low`` the one after the default, ``batch`` the last."""
    last, normal = config.priority_levels, config.default_priority
    return {"high": 1, "normal": normal, "low": min(normal + 1, last), "batch": last}


def priority_code(value: object, field: str = "'priority'") -> int:
    """A request's ``priority`` as it travels: a level number (0: the default) or a
    name's code; InvalidInput naming ``field`` (as the request spells it) otherwise."""
    if isinstance(value, str) and value in NAMED_PRIORITIES:
        return NAMED_PRIORITIES[value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise InvalidInput(
        f"{field} must be high, normal, low, batch or a level number >= 1, not {value!r}"
    )
