"""Inference-log rows as the gateway makes them: the bounded buffer handlers record rows
(:class:`~inferd.shapes.logs.LogRow`) into, and the shipper that sends a gateway's rows
(and its counters) to the server over the control socket.

No SQLAlchemy here: a gateway never writes the database log itself (the server's
writer, :mod:`inferd.monitoring.inference_log`, does), so its predict path does not
import the database layer for its rows.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import Counter, deque
from collections.abc import Callable

from inferd.shapes.logs import LogRow, Payload


def user_hash(user: str) -> str:
    """A user key as stored: 16 hex digits of its BLAKE2b hash (the same key always gives
    the same hash, so rows of one user group together without storing who it is). The
    database log and the payload sinks store this, never the key."""
    return hashlib.blake2b(user.encode(), digest_size=8).hexdigest()


class RowBuffer:
    """Rows recorded by request handlers, bounded: past ``max_buffer_rows`` new rows are
    dropped and counted. ``record`` and ``drain`` are safe from different threads."""

    keep_predictions = True
    """Rows carry what single-row requests predicted (for feedback); off when the rows
    only feed /metrics (the log itself is off)."""
    payload_rate = 0.0
    """Share of requests whose bodies ride with their rows (``payload_log``; 0: off, and
    handlers then skip :meth:`payload` altogether)."""
    max_payload_bytes = 64 * 1024
    max_payload_buffer_bytes = 64 * 1024 * 1024
    """Bodies held between two drains; past it, sampled requests' bodies are left out."""

    def __init__(self, max_buffer_rows: int = 100_000) -> None:
        self.max_buffer_rows = max_buffer_rows
        self.dropped = 0
        """Rows not kept: the buffer was full, or the database refused a batch."""
        self._rows: deque[LogRow] = deque()
        self._payload_bytes = 0

    def payload(self, request: bytes | None, response: bytes | None) -> Payload | None:
        """A request's bodies for its row when it is sampled (None: not sampled). The
        bytes are the ones received and sent, not copies; a body over
        ``max_payload_bytes``, or past the bodies' buffer, is left out (and counted in
        ``payload_skipped``): redaction and encoding happen in the server's sinks."""
        rate = self.payload_rate
        if not rate or (rate < 1 and random.random() >= rate):
            return None
        request_n = 0 if request is None else len(request)
        response_n = 0 if response is None else len(response)
        if request_n > self.max_payload_bytes:
            request = None
        if response_n > self.max_payload_bytes:
            response = None
        held = (request is not None and request_n) + (response is not None and response_n)
        if self._payload_bytes + held > self.max_payload_buffer_bytes:
            request = response = None
            held = 0
        self._payload_bytes += held
        left_out = (request is None and request_n > 0) + (response is None and response_n > 0)
        if left_out:
            COUNTERS["payload_skipped"] += left_out
        return Payload(request, response, request_n, response_n)

    def record(self, row: LogRow) -> None:
        if len(self._rows) >= self.max_buffer_rows:
            self.dropped += 1
            return
        self._rows.append(row)

    def extend(self, rows: list[LogRow]) -> None:
        """Rows recorded elsewhere (a gateway's), as far as the buffer has room."""
        room = max(0, self.max_buffer_rows - len(self._rows))
        self._rows.extend(rows[:room])
        self.dropped += max(0, len(rows) - room)

    def drain(self) -> list[LogRow]:
        self._payload_bytes = 0
        pending = self._rows
        return [pending.popleft() for _ in range(len(pending))]


COUNTERS: Counter[str] = Counter()
"""This gateway process's counters that have no log row (``rate_limited:requests``, ...),
shipped as deltas with the rows for ``/metrics``."""


class LogShipper(RowBuffer):
    """A gateway's rows, sent to the server process about once a second over the
    control socket (one msgpack frame, written from the event loop). Writing to the
    database from a gateway's own thread cost it 14-19 % of its throughput: the driver's
    Python work holds the GIL the event loop needs (bench/inference_log.py)."""

    def __init__(
        self,
        send: Callable[[list[LogRow], dict[str, int]], bool],
        flush_interval_s: float = 1.0,
        max_buffer_rows: int = 100_000,
        keep_predictions: bool = True,
    ) -> None:
        super().__init__(max_buffer_rows)
        self.keep_predictions = keep_predictions
        self._send = send
        self.flush_interval_s = flush_interval_s
        self._task: asyncio.Task[None] | None = None
        self._dropped_shipped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            self.ship()

    def ship(self) -> int:
        rows = self.drain()
        counters = dict(COUNTERS)
        COUNTERS.clear()
        if self.dropped > self._dropped_shipped:
            counters["log_dropped"] = self.dropped - self._dropped_shipped
            self._dropped_shipped = self.dropped
        if (rows or counters) and not self._send(rows, counters):
            self.dropped += len(rows)  # the server is gone; this gateway stops too
            return 0
        return len(rows)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.ship()
