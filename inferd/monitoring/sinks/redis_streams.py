"""A payload sink that appends each row to a Redis stream: ``XADD`` with an approximate
``MAXLEN`` bound (``~``: Redis trims whole nodes, cheaply), one pipeline per batch.

``redis://host:port/db?stream=NAME&maxlen=N`` (``rediss://`` for TLS; a password as in
any Redis URL). Each entry's fields are the CloudEvent's attributes (``specversion``,
``id``, ``source``, ``type``, ``time``, ``datacontenttype``) and ``data``, the JSON
data, so a consumer filters on attributes without parsing."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.typing import EncodableT, FieldT

from inferd.config import PayloadLogConfig
from inferd.monitoring.sinks import display_name
from inferd.monitoring.sinks.events import EventEncoder
from inferd.shapes.logs import LogRow

DEFAULT_STREAM = "inferd:inference-log"
DEFAULT_MAXLEN = 1_000_000


class RedisStreamSink:
    def __init__(self, uri: str, cfg: PayloadLogConfig, encoder: EventEncoder) -> None:
        parts = urlsplit(uri)
        query = dict(parse_qsl(parts.query))
        self.stream = query.pop("stream", DEFAULT_STREAM)
        try:
            self.maxlen = int(query.pop("maxlen", DEFAULT_MAXLEN))
        except ValueError:
            raise ValueError(f"payload sink {display_name(uri)}: maxlen must be a number") from None
        self.name = f"{display_name(uri)}?stream={self.stream}"
        self.encoder = encoder
        url = urlunsplit(parts._replace(query=urlencode(query)))  # the rest is redis-py's
        self._redis = redis.Redis.from_url(
            url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s
        )

    def fields(self, row: LogRow) -> dict[FieldT, EncodableT]:
        """A row's stream entry: the event's attributes and its JSON ``data``."""
        fields: dict[FieldT, EncodableT] = {}
        fields.update(self.encoder.attributes(row))
        fields["data"] = self.encoder.encode(self.encoder.data(row))
        return fields

    def send(self, rows: Sequence[LogRow]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for row in rows:
            pipe.xadd(self.stream, self.fields(row), maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def close(self) -> None:
        self._redis.close()
