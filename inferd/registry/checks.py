"""Checks of what callers give the registry: per-version batching defaults and a
model's descriptive fields and tags."""

from __future__ import annotations

from typing import Any

import pydantic

from inferd.config import BatchingConfig
from inferd.errors import InvalidInput

_BATCHING_KEYS = frozenset(BatchingConfig.model_fields) | {"replicas"}


def check_batching(batching: dict[str, Any] | None) -> dict[str, Any] | None:
    """The given per-version batching defaults, validated; unset keys stay unset."""
    if batching is None:
        return None
    unknown = set(batching) - _BATCHING_KEYS
    if unknown:
        raise InvalidInput(
            f"unknown batching keys {sorted(unknown)}; known {sorted(_BATCHING_KEYS)}"
        )
    replicas = batching.get("replicas")
    if replicas is not None and (
        type(replicas) is not int or not 1 <= replicas <= 64  # same bounds as Settings
    ):
        raise InvalidInput(f"batching.replicas must be an integer 1..64, got {replicas!r}")
    given = set(batching) - {"replicas"}
    try:
        checked = BatchingConfig.model_validate({k: batching[k] for k in given})
    except pydantic.ValidationError as exc:
        raise InvalidInput(f"invalid batching: {exc}") from None
    result = checked.model_dump(include=given)
    if replicas is not None:
        result["replicas"] = replicas
    return result


_MODEL_FIELD_LIMITS = {"description": 4096, "owner": 256, "framework": 64}


def model_fields(**values: Any) -> dict[str, Any]:
    """Model fields given to create or update, checked."""
    for key, value in values.items():
        if key == "framework" and not value:
            raise InvalidInput("framework must be a non-empty string")
        if value is not None and (
            not isinstance(value, str) or len(value) > _MODEL_FIELD_LIMITS[key]
        ):
            raise InvalidInput(
                f"{key} must be a string of at most {_MODEL_FIELD_LIMITS[key]} characters"
            )
    return values


def check_tags(tags: Any) -> dict[str, str]:
    if not isinstance(tags, dict) or len(tags) > 64:
        raise InvalidInput("tags must be an object of at most 64 string values")
    for key, value in tags.items():
        if not (isinstance(key, str) and 0 < len(key) <= 128):
            raise InvalidInput(f"tag name {key!r} must be a string of 1 to 128 characters")
        if not (isinstance(value, str) and len(value) <= 256):
            raise InvalidInput(f"tag {key!r} must have a string value of at most 256 characters")
    return dict(tags)
