"""JSON that holds NaN and ±Infinity: what Python's ``json.dumps`` writes for non-finite
floats (``NaN``, ``Infinity``, ``-Infinity``), which standard JSON and orjson refuse.

Tensor bodies (predict, V2 infer, batch job inputs) are read with :func:`loads`, so a
non-finite number is refused by the tensor check naming the element (or taken, by a
version that allows non-finite inputs) instead of failing the whole body as "not
JSON". Only a body orjson refused that holds one of the literals pays for Python's
slower parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LITERAL = re.compile(rb"NaN|Infinity")


def loads(body: bytes | str) -> tuple[Any, bool]:
    """The JSON value of ``body`` and whether it needed the non-finite literals. Raises
    ``orjson.JSONDecodeError`` (a ValueError) when it is not JSON even with them, or
    holds what orjson refuses for another reason (a lone surrogate)."""
    try:
        return orjson.loads(body), False
    except orjson.JSONDecodeError:
        raw = body.encode() if isinstance(body, str) else body
        if not _LITERAL.search(raw):
            raise
        try:
            value = json.loads(raw)
            orjson.dumps(value)  # strings orjson would refuse (lone surrogates) stay refused
        except (ValueError, RecursionError, orjson.JSONEncodeError):
            pass
        else:
            return value, True
        raise


def dumps(value: Any, non_finite: bool) -> bytes:
    """``value`` as compact JSON; ``non_finite``: it may hold NaN or ±Infinity, written
    as the literals (orjson would write null)."""
    if not non_finite:
        return orjson.dumps(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
