"""Reading Server-Sent Events payloads as tokens, for inferd, OpenAI-style and other servers.

One ``data:`` payload is classified by what it holds: an inferd token event
(``{"token": ...}``), an OpenAI chunk whose first choice carries text or delta content,
a final event with ``usage.completion_tokens`` (which then overrides the count), an
error object, ``[DONE]``, or anything else with content (counted as one token).
"""

from __future__ import annotations

from typing import Any

import orjson

Event = tuple[int, int | None, bool]
"""(tokens in this event, completion tokens if it reports usage, is it an error)"""


def parse_event(data: bytes) -> Event:
    if data == b"[DONE]" or not data:
        return 0, None, False
    try:
        event: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return 1, None, False  # plain-text events: one token each
    if not isinstance(event, dict):
        return 1, None, False
    if "error" in event:
        return 0, None, True
    usage = event.get("usage")
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if "token" in event:
        return 1, completion, False
    choices = event.get("choices")
    if isinstance(choices, list):
        first: dict[str, Any] = choices[0] if choices and isinstance(choices[0], dict) else {}
        delta = first.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        return int(bool(first.get("text") or delta.get("content"))), completion, False
    return (0 if completion is not None else 1), completion, False
