"""Payload sinks: the inference log's rows (with the bodies of sampled requests, when
``payload_log.payloads`` is on) shipped as CloudEvents to an HTTP endpoint, Redis
Streams, Kafka, or as Parquet files to an S3-compatible store.

Design rule: a sink never slows or fails a request, nor the database log. Gateways ship
their rows to the server process as they always do (bodies ride along as the bytes they
received and sent, only for sampled requests); the control plane offers each frame's
rows to every sink's :class:`SinkRunner` (on its event loop: a bounded deque, nothing
else). Each sink has its own thread, which sends batches of ``batch_rows`` at least every
``flush_interval_s``, encoding and redacting there (:mod:`.events`). A failed batch is
tried again ``attempts`` times with exponential backoff (the backoff persists while the
sink keeps failing, so a dead sink is not hammered); then it is given up and counted as
failed. While a sink is slow or down its buffer fills, and new rows are dropped and
counted (``max_buffer_rows``, and ``max_buffer_mb`` of bodies). A failing sink writes
one log line a minute, not one per batch. Delivery is at least once: a batch retried
after a send that half-landed may arrive twice (an event's ``id`` is the request's).

A sink is a :class:`Sink`, chosen by URI scheme in :func:`open_sink`; the schemes and
their modules are :data:`SINKS`. An unknown scheme is refused when settings load (and
here, for callers that build settings by hand), never at the first row.
"""

from __future__ import annotations

import importlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from inferd.config import PayloadLogConfig
from inferd.monitoring.inference_log import lower_priority
from inferd.monitoring.sinks.events import EventEncoder
from inferd.shapes.logs import LogRow

if TYPE_CHECKING:
    from inferd.monitoring.exposition import Text

logger = logging.getLogger(__name__)

SINKS = {
    "http": "http:HttpSink",
    "https": "http:HttpSink",
    "redis": "redis_streams:RedisStreamSink",
    "rediss": "redis_streams:RedisStreamSink",
    "kafka": "kafka:KafkaSink",
    "s3": "parquet:S3ParquetSink",
}
"""URI scheme -> ``module:class`` in this package (imported only when used, so a server
without a Kafka sink never imports aiokafka)."""

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
REPORT_EVERY_S = 60.0
"""A failing sink's log line: at most one per this many seconds."""


class Sink(Protocol):
    """Where a batch of rows goes. ``send`` is only ever called from the sink's own
    thread, one batch at a time."""

    name: str
    """The sink without credentials (its metrics' ``sink`` label, its log lines)."""

    def send(self, rows: Sequence[LogRow]) -> None:
        """Deliver ``rows``, or raise: :class:`Refused` when trying again cannot help (the
        batch is given up at once), any other exception to be tried again."""
        ...

    def close(self) -> None:
        """Release connections (after the last ``send``)."""
        ...


class Refused(Exception):
    """The sink answered, and refused the batch for good (an HTTP 4xx, say)."""


def open_sink(uri: str, cfg: PayloadLogConfig, encoder: EventEncoder) -> Sink:
    """The sink ``uri`` names; ValueError for an unknown scheme or a malformed URI."""
    scheme = urlsplit(uri).scheme.lower()
    where = SINKS.get(scheme)
    if where is None:
        known = ", ".join(f"{s}://" for s in SINKS)
        raise ValueError(f"payload sink {uri!r}: unknown scheme {scheme!r}; known: {known}")
    module, _, name = where.partition(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    sink: Sink = cls(uri, cfg, encoder)
    return sink


def open_sinks(cfg: PayloadLogConfig, host: str | None = None) -> list[SinkRunner]:
    """A started runner per configured sink (none when ``sinks`` is empty)."""
    encoder = EventEncoder(cfg.redact, host)
    runners = [SinkRunner(open_sink(uri, cfg, encoder), cfg) for uri in cfg.sinks]
    names = [r.name for r in runners]
    if len(set(names)) != len(names):
        for runner in runners:
            runner.sink.close()
        raise ValueError(f"payload_log.sinks lists a sink twice: {names}")
    for runner in runners:
        runner.start()
    return runners


def display_name(uri: str, keep_query: bool = False) -> str:
    """``uri`` without its user and password (and query, unless ``keep_query``)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    query = f"?{parts.query}" if keep_query and parts.query else ""
    return f"{parts.scheme}://{host}{parts.path}{query}"


def _held_bytes(row: LogRow) -> int:
    """What a row's bodies hold in a buffer (rows without bodies: none counted)."""
    p = row.payload
    if p is None:
        return 0
    return (0 if p.request is None else len(p.request)) + (
        0 if p.response is None else len(p.response)
    )


class SinkRunner:
    """One sink's bounded buffer and thread. Counters: ``sent``, ``dropped`` (no room
    in the buffer), ``failed`` (batches given up), ``errors`` (sends that raised);
    rows offered = sent + dropped + failed + ``depth``."""

    def __init__(self, sink: Sink, cfg: PayloadLogConfig) -> None:
        self.sink = sink
        self.name = sink.name
        self.batch_rows = cfg.batch_rows
        self.flush_interval_s = cfg.flush_interval_s
        self.max_rows = cfg.max_buffer_rows
        self.max_bytes = int(cfg.max_buffer_mb * 1024 * 1024)
        self.attempts = cfg.attempts
        self.bodies = cfg.payloads
        """Rows may carry bodies: ``offer`` then counts their bytes."""
        self.join_s = cfg.timeout_s + 2.0
        """How long ``close`` waits for the thread: a send in flight may take
        ``timeout_s`` (a sink that accepts and never answers)."""
        self.sent = self.dropped = self.failed = self.errors = 0
        self._rows: deque[LogRow] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backoff_s = 0.0
        self._reported = -REPORT_EVERY_S

    @property
    def depth(self) -> int:
        return len(self._rows)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"payload-sink {self.name}", daemon=True
        )
        self._thread.start()

    def offer(self, rows: Sequence[LogRow]) -> None:
        """Rows for this sink, as far as the buffer has room; the rest are dropped and
        counted. Called on the server's event loop: it never waits on the sink."""
        with self._lock:
            room = max(0, self.max_rows - len(self._rows))
            if not self.bodies or not room:  # nothing to weigh row by row
                kept = rows[:room]
                self._rows.extend(kept)
                self.dropped += len(rows) - len(kept)
            else:
                self._weighed(rows)
            full = len(self._rows) >= self.batch_rows
        if full:
            self._wake.set()

    def _weighed(self, rows: Sequence[LogRow]) -> None:
        """Rows with bodies, as far as the buffer's rows and bytes allow (under the lock)."""
        for row in rows:
            size = _held_bytes(row)
            if len(self._rows) >= self.max_rows or self._bytes + size > self.max_bytes:
                self.dropped += 1
                continue
            self._rows.append(row)
            self._bytes += size

    def _take(self) -> list[LogRow]:
        with self._lock:
            batch = [self._rows.popleft() for _ in range(min(self.batch_rows, len(self._rows)))]
            if self.bodies:
                self._bytes -= sum(map(_held_bytes, batch))
        return batch

    def _run(self) -> None:
        lower_priority()  # the gateways and replicas come first on a busy machine
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            while not self._stop.is_set() and (batch := self._take()):
                self._deliver(batch, final=False)
        while batch := self._take():  # what is left at close: one try each
            self._deliver(batch, final=True)

    def _deliver(self, batch: list[LogRow], final: bool) -> None:
        """Send ``batch``, trying again after a backoff; give it up after ``attempts``
        (at close: one try, none if the sink is failing)."""
        for _ in range(1 if final else self.attempts):
            if self._backoff_s and (final or self._stop.wait(self._backoff_s)):
                break  # failing, and closing: do not hold the server's shutdown
            try:
                self.sink.send(batch)
            except Refused as exc:
                self._failing(exc)
                break
            except Exception as exc:
                self._failing(exc)
                continue
            self.sent += len(batch)
            self._recovered()
            return
        self.failed += len(batch)

    def _failing(self, exc: Exception) -> None:
        self.errors += 1
        self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, self._backoff_s * 2))
        self._backoff_s *= random.uniform(0.8, 1.0)  # sinks failing together spread out
        now = time.monotonic()
        if now - self._reported >= REPORT_EVERY_S:  # one line a minute, not one per batch
            self._reported = now
            logger.warning(
                "payload sink %s failing: %s: %s (so far %d row(s) dropped, %d failed)",
                self.name, type(exc).__name__, exc, self.dropped, self.failed,
            )  # fmt: skip

    def _recovered(self) -> None:
        if self._backoff_s:
            self._backoff_s = 0.0
            logger.info("payload sink %s delivers again", self.name)
            self._reported = -REPORT_EVERY_S

    def close(self) -> None:
        """Send what is left (one try per batch) and stop, within about ``timeout_s``;
        rows still buffered then are counted as dropped."""
        self._stop.set()
        self._wake.set()
        stuck = False
        if self._thread is not None:
            self._thread.join(self.join_s)
            stuck = self._thread.is_alive()
        with self._lock:
            self.dropped += len(self._rows)
            self._rows.clear()
            self._bytes = 0
        if stuck:  # its send still runs (a daemon thread): its connection stays its own
            logger.warning("payload sink %s did not finish in time", self.name)
            return
        self.sink.close()


SINK_COUNTERS = {
    "sent": ("inferd_payload_sink_rows_sent_total", "Inference log rows a payload sink delivered."),
    "dropped": (
        "inferd_payload_sink_rows_dropped_total",
        "Rows a payload sink had no room for: its buffer was full (the sink slow or down).",
    ),
    "failed": (
        "inferd_payload_sink_rows_failed_total",
        "Rows of batches a payload sink gave up on after payload_log.attempts tries.",
    ),
    "errors": (
        "inferd_payload_sink_send_errors_total",
        "Sends to a payload sink that failed (every try counts).",
    ),
}


def write_sinks(out: Text, runners: Sequence[SinkRunner], skipped: int) -> None:
    """The sinks' counters and buffers; ``skipped``: bodies the gateways left out."""
    for key, (name, help_) in SINK_COUNTERS.items():
        out.family(name, "counter", help_)
        for runner in runners:
            out.sample(name, {"sink": runner.name}, getattr(runner, key))
    out.family(
        "inferd_payload_sink_buffer_rows", "gauge", "Rows waiting in a payload sink's buffer."
    )
    for runner in runners:
        out.sample("inferd_payload_sink_buffer_rows", {"sink": runner.name}, runner.depth)
    out.family(
        "inferd_payload_log_skipped_bodies_total",
        "counter",
        "Bodies of sampled requests not logged: over payload_log.max_payload_bytes, or "
        "past a gateway's payload_log.max_buffer_mb.",
    )
    out.sample("inferd_payload_log_skipped_bodies_total", {}, skipped)
