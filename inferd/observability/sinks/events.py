"""Inference-log rows as CloudEvents 1.0: the attributes, the data, and the redaction of
request and response bodies. Pure functions of a row; every sink encodes with these.

An event's ``id`` is the request id, its ``source`` ``inferd/<host>/<model>``, its
``type`` :data:`EVENT_TYPE`, its ``time`` the row's (RFC 3339, UTC), and its ``data``
(``application/json``) the row as the database keeps it (the user key as its hash) plus,
for a sampled request, ``payload``: the bodies (a JSON body as its JSON value, redacted;
another one as ``request_base64`` / ``response_base64``, unless redaction is on, since
what cannot be parsed cannot be redacted) and their sizes.

Bodies are parsed here, in a sink's thread of the server process, never in the gateway:
the request path only keeps a reference to the bytes it received and sent.
"""

from __future__ import annotations

import base64
import socket
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
import orjson

from inferd.observability.log_rows import NOT_COLUMNS, LogRow, Payload, user_hash

SPEC_VERSION = "1.0"
EVENT_TYPE = "io.inferd.inference.log"
CONTENT_TYPE = "application/json"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
"""The HTTP binding's batched mode: a JSON array of structured events."""
REDACTED = "[REDACTED]"

_FIELDS = LogRow.__struct_fields__[: -len(NOT_COLUMNS)]
assert LogRow.__struct_fields__[-len(NOT_COLUMNS) :] == NOT_COLUMNS  # data() zips the rest


class EventEncoder:
    """Rows to CloudEvents for one server: ``host`` names it in each event's source;
    ``redact``: field names whose values are replaced in bodies."""

    def __init__(self, redact: Iterable[str] = (), host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.redact = frozenset(redact)
        self._quoted = [orjson.dumps(name) for name in self.redact]

    def attributes(self, row: LogRow) -> dict[str, str]:
        """The event's context attributes (all of them strings)."""
        return {
            "specversion": SPEC_VERSION,
            "id": row.request_id or uuid.uuid4().hex,  # a CloudEvent's id is never empty
            "source": f"inferd/{self.host}/{row.model_name}",
            "type": EVENT_TYPE,
            "time": rfc3339(row.timestamp),
            "datacontenttype": CONTENT_TYPE,
        }

    def data(self, row: LogRow) -> dict[str, Any]:
        """The row's fields as the database keeps them, then ``payload`` when sampled."""
        out = dict(zip(_FIELDS, msgspec.structs.astuple(row), strict=False))  # payload left out
        user = out.pop("user")
        out["user_hash"] = None if user is None else user_hash(user)
        if row.payload is not None:
            out["payload"] = self.payload(row.payload)
        return out

    def event(self, row: LogRow) -> dict[str, Any]:
        """The structured event: attributes and ``data``."""
        return {**self.attributes(row), "data": self.data(row)}

    def batch(self, rows: Sequence[LogRow]) -> bytes:
        """``application/cloudevents-batch+json``: a JSON array of structured events."""
        return orjson.dumps([self.event(row) for row in rows])

    def payload(self, payload: Payload) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_bytes": payload.request_bytes,
            "response_bytes": payload.response_bytes,
        }
        for key, body in (("request", payload.request), ("response", payload.response)):
            out[key] = None
            if body is None:
                continue
            try:
                value = orjson.loads(body)
            except orjson.JSONDecodeError:
                if not self.redact:  # else: not JSON, so it cannot be redacted: left out
                    out[f"{key}_base64"] = base64.b64encode(body).decode()
                continue
            out[key] = redacted(value, self.redact) if self._may_name(body) else value
        return out

    def _may_name(self, body: bytes) -> bool:
        """Whether ``body`` may hold a redacted name: spelt as a JSON string, or written
        with escapes (then every body is walked). A byte scan, cheaper than the walk."""
        if not self.redact:
            return False
        return b"\\" in body or any(name in body for name in self._quoted)


def redacted(value: Any, names: frozenset[str]) -> Any:
    """``value`` with every object field named in ``names`` replaced by
    :data:`REDACTED`, at any depth; a V2 tensor (``{"name", ..., "data"}``) so named has
    its ``data`` replaced (its name, shape and datatype stay)."""
    if isinstance(value, dict):
        tensor = "data" in value and value.get("name") in names
        return {
            key: REDACTED
            if key in names or (tensor and key == "data")
            else redacted(v, names)
            if isinstance(v, dict | list)
            else v
            for key, v in value.items()
        }
    if isinstance(value, list):  # no call per number of a long row
        return [redacted(v, names) if isinstance(v, dict | list) else v for v in value]
    return value


_second: list[tuple[int, str]] = [(-1, "")]
"""The last second formatted, as one tuple (sink threads share it: a swap, never a torn
pair)."""


def rfc3339(ts: float) -> str:
    """``ts`` (Unix seconds) as RFC 3339 in UTC with microseconds: ``…T12:00:00.000001Z``;
    the formatted second is reused for every row within it."""
    sec = int(ts)
    cached = _second[0]
    if cached[0] != sec:
        cached = _second[0] = (sec, datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{cached[1]}.{int((ts - sec) * 1_000_000):06d}Z"
