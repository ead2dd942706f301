"""A payload sink that POSTs batches of CloudEvents to an HTTP endpoint, in the HTTP
binding's batched mode (``application/cloudevents-batch+json``: a JSON array of
structured events). Credentials in the URL (``https://user:pass@host/path``) become
basic auth; ``payload_log.http_headers`` are added to every request (a bearer token).
A 2xx answer delivers the batch; 408, 429 and 5xx (and no answer) are tried again;
another 4xx refuses it for good."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from inferd.config import PayloadLogConfig
from inferd.monitoring.sinks import Refused, display_name
from inferd.monitoring.sinks.events import BATCH_CONTENT_TYPE, EventEncoder
from inferd.shapes.logs import LogRow

_TRY_AGAIN = frozenset({408, 425, 429})


class HttpSink:
    def __init__(self, uri: str, cfg: PayloadLogConfig, encoder: EventEncoder) -> None:
        self.name = display_name(uri)
        self.url = uri
        self.encoder = encoder
        headers = {"content-type": BATCH_CONTENT_TYPE, **cfg.http_headers}
        self._client = httpx.Client(timeout=cfg.timeout_s, headers=headers)

    def send(self, rows: Sequence[LogRow]) -> None:
        response = self._client.post(self.url, content=self.encoder.batch(rows))
        code = response.status_code
        if code < 300:
            return
        message = f"HTTP {code}: {response.text[:200]}"
        if code < 500 and code not in _TRY_AGAIN:
            raise Refused(message)
        raise OSError(message)

    def close(self) -> None:
        self._client.close()
