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

import orjson

from inferd.observability.log_rows import NOT_COLUMNS, LogRow, Payload, user_hash

SPEC_VERSION = "1.0"
EVENT_TYPE = "io.inferd.inference.log"
CONTENT_TYPE = "application/json"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
"""The HTTP binding's batched mode: a JSON array of structured events."""
REDACTED = "[REDACTED]"

_FIELDS = tuple(name for name in LogRow.__struct_fields__ if name not in NOT_COLUMNS)


class EventEncoder:
    """Rows to CloudEvents for one server: ``host`` names it in each event's source;
    ``redact``: field names whose values are replaced in bodies."""

    def __init__(self, redact: Iterable[str] = (), host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.redact = frozenset(redact)

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
        out = {name: getattr(row, name) for name in _FIELDS}
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
            out[key] = redacted(value, self.redact) if self.redact else value
        return out


def redacted(value: Any, names: frozenset[str]) -> Any:
    """``value`` with every object field named in ``names`` replaced by
    :data:`REDACTED`, at any depth; a V2 tensor (``{"name", ..., "data"}``) so named has
    its ``data`` replaced (its name, shape and datatype stay)."""
    if isinstance(value, dict):
        tensor = "data" in value and value.get("name") in names
        return {
            key: REDACTED if key in names or (tensor and key == "data") else redacted(v, names)
            for key, v in value.items()
        }
    if isinstance(value, list):
        return [redacted(v, names) for v in value]
    return value


def rfc3339(ts: float) -> str:
    """``ts`` (Unix seconds) as RFC 3339 in UTC with microseconds: ``…T12:00:00.000001Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")[:-6] + "Z"
