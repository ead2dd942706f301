"""Inference-log rows as CloudEvents 1.0: the attributes, the data, and the redaction of
request and response bodies. Pure functions of a row; every sink encodes with these.

An event's ``id`` is the request id, its ``source`` ``inferd/<host>/<model>``, its
``type`` :data:`EVENT_TYPE`, its ``time`` the row's (RFC 3339, UTC), and its ``data``
(``application/json``) the row as the database keeps it (the user key as its hash) plus,
for a sampled request, ``payload``: the bodies (a JSON body as it came, or as its value
redacted; another one as ``request_base64`` / ``response_base64``, unless redaction is
on, since what cannot be parsed cannot be redacted) and their sizes.

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

from inferd.shapes.logs import NOT_COLUMNS, LogRow, Payload
from inferd.telemetry.log_rows import user_hash

SPEC_VERSION = "1.0"
EVENT_TYPE = "io.inferd.inference.log"
CONTENT_TYPE = "application/json"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
"""The HTTP binding's batched mode: a JSON array of structured events."""
REDACTED = "[REDACTED]"
ATTRIBUTES = ("specversion", "id", "source", "type", "time", "datacontenttype")

_COLUMNS = LogRow.__struct_fields__[: -len(NOT_COLUMNS)]
assert LogRow.__struct_fields__[-len(NOT_COLUMNS) :] == NOT_COLUMNS  # data() takes the rest
_USER = _COLUMNS.index("user")


class Bodies(msgspec.Struct, omit_defaults=True):
    """A sampled request's bodies in an event: a JSON body as it came (``msgspec.Raw``)
    or redacted (its value); None when left out; base64 for a body that is not JSON."""

    request_bytes: int
    response_bytes: int
    request: Any
    response: Any
    request_base64: str | None = None
    response_base64: str | None = None


Data = msgspec.defstruct(
    "Data",
    [("user_hash" if name == "user" else name, Any) for name in _COLUMNS]
    + [("payload", Bodies | None, None)],
    omit_defaults=True,  # only ``payload`` has a default: absent when not sampled
)
"""An event's ``data``: the row's columns as the database keeps them, then ``payload``."""


class Event(msgspec.Struct):
    """A structured CloudEvent."""

    specversion: str
    id: str
    source: str
    type: str
    time: str
    datacontenttype: str
    data: Any


class EventEncoder:
    """Rows to CloudEvents for one server: ``host`` names it in each event's source;
    ``redact``: field names whose values are replaced in bodies. Events are msgspec
    structs encoded in one call per batch (dicts cost twice the time a row)."""

    def __init__(self, redact: Iterable[str] = (), host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.redact = frozenset(redact)
        self._quoted = [orjson.dumps(name) for name in sorted(self.redact)]
        self._json = msgspec.json.Encoder()

    def _attributes(self, row: LogRow) -> tuple[str, str, str, str, str, str]:
        return (
            SPEC_VERSION,
            row.request_id or uuid.uuid4().hex,  # a CloudEvent's id is never empty
            f"inferd/{self.host}/{row.model_name}",
            EVENT_TYPE,
            rfc3339(row.timestamp),
            CONTENT_TYPE,
        )

    def attributes(self, row: LogRow) -> dict[str, str]:
        """The event's context attributes (all of them strings)."""
        return dict(zip(ATTRIBUTES, self._attributes(row), strict=True))

    def data(self, row: LogRow) -> Any:
        """The event's data (a :data:`Data`): the row's columns, the user key as its hash,
        and ``payload`` when sampled."""
        values = list(msgspec.structs.astuple(row)[: len(_COLUMNS)])
        if values[_USER] is not None:
            values[_USER] = user_hash(values[_USER])
        bodies = None if row.payload is None else self.bodies(row.payload)
        return Data(*values, bodies)

    def event(self, row: LogRow) -> Event:
        return Event(*self._attributes(row), self.data(row))

    def batch(self, rows: Sequence[LogRow]) -> bytes:
        """``application/cloudevents-batch+json``: a JSON array of structured events."""
        return self._json.encode([self.event(row) for row in rows])

    def encode(self, value: Any) -> bytes:
        """JSON of an event, its data or its bodies."""
        return self._json.encode(value)

    def bodies(self, payload: Payload) -> Bodies:
        out = Bodies(payload.request_bytes, payload.response_bytes, None, None)
        for key, body in (("request", payload.request), ("response", payload.response)):
            if body is None:
                continue
            try:
                value = orjson.loads(body)  # parsed: JSON, so it may go as it came
            except orjson.JSONDecodeError:
                if not self.redact:  # else: not JSON, so it cannot be redacted: left out
                    setattr(out, f"{key}_base64", base64.b64encode(body).decode())
                continue
            if self._may_name(body):
                setattr(out, key, redacted(value, self.redact))
            else:  # the client's bytes, not a re-encoding of them (numbers as written)
                setattr(out, key, msgspec.Raw(body))
        return out

    def _may_name(self, body: bytes) -> bool:
        """Whether ``body`` may hold a redacted name: spelt as a JSON string, or written
        with escapes (then every body is walked). Byte searches, far cheaper than a walk
        (or a regular expression's alternation)."""
        if not self._quoted:
            return False
        if b"\\" in body:
            return True
        return any(map(body.__contains__, self._quoted))


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
