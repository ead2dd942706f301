"""The inference log: one row per inference request, written off the request path.

Handlers call :meth:`InferenceLog.record` (a tuple appended to a deque: well under a
microsecond); a background thread inserts what accumulated in one transaction every
``flush_interval_s``. The buffer is bounded: when the database falls behind, new rows
are dropped and counted (``dropped``) rather than growing memory or slowing requests.
User keys are stored as a hash (never the key itself), computed in that thread.

Each row says which version answered (the experiment assignment of a traffic split,
sticky per user), whether a fallback answered instead, the status code and latency.

On PostgreSQL the table is partitioned by day (migration 0004): :func:`maintain`
(the server process, at start and hourly) creates the partitions for the next days and
drops those past ``retention_days``; on SQLite it deletes old rows in chunks.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, insert, select, text

from inferd.registry.tables import inference_logs

logger = logging.getLogger(__name__)

Row = tuple[Any, ...]
_FIELDS = (
    "timestamp", "request_id", "model_name", "version", "api", "status_code", "latency_ms",
    "user_hash", "fallback_from", "cache_hit", "prompt_tokens", "completion_tokens",
)  # fmt: skip


def user_hash(user: str) -> str:
    """A user key as stored: 16 hex digits of its BLAKE2b hash (the same key always gives
    the same hash, so rows of one user group together without storing who it is)."""
    return hashlib.blake2b(user.encode(), digest_size=8).hexdigest()


class InferenceLog:
    """Batches rows from one process into the ``inference_logs`` table."""

    def __init__(
        self, engine: Engine, flush_interval_s: float = 1.0, max_buffer_rows: int = 100_000
    ) -> None:
        self.engine = engine
        self.flush_interval_s = flush_interval_s
        self.max_buffer_rows = max_buffer_rows
        self.written = 0
        self.dropped = 0
        """Rows not kept: the buffer was full, or the database refused a batch."""
        self._rows: deque[Row] = deque()
        """Appended by request handlers, drained by the writer thread (both thread-safe)."""
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_error = 0.0

    def record(
        self,
        request_id: str,
        model: str,
        version: str | None,
        api: str,
        status_code: int,
        latency_ms: float,
        user: str | None = None,
        fallback_from: str | None = None,
        cache_hit: bool | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        row = (
            time.time(), request_id, model, version, api, status_code, latency_ms, user,
            fallback_from, cache_hit, prompt_tokens, completion_tokens,
        )  # fmt: skip
        if len(self._rows) >= self.max_buffer_rows:
            self.dropped += 1
            return
        self._rows.append(row)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inference-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> int:
        """Write what accumulated; returns how many rows were written."""
        pending = self._rows
        rows = [pending.popleft() for _ in range(len(pending))]
        if not rows:
            return 0
        values = [_as_values(row) for row in rows]
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(inference_logs), values)
        except Exception as exc:
            self.dropped += len(rows)
            now = time.monotonic()
            if now - self._last_error > 60:  # one line a minute, not one per batch
                self._last_error = now
                logger.error("inference log: dropped %d row(s): %s", len(rows), exc)
            return 0
        self.written += len(rows)
        return len(rows)

    def close(self) -> None:
        """Stop the thread and write what is left."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self.flush()


def _as_values(row: Row) -> dict[str, Any]:
    values = dict(zip(_FIELDS, row, strict=True))
    values["timestamp"] = datetime.fromtimestamp(row[0], UTC)
    user = values["user_hash"]
    values["user_hash"] = None if user is None else user_hash(user)
    return values


# -- upkeep (the server process) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Upkeep:
    created: list[str]
    dropped: list[str]
    deleted_rows: int = 0


def maintain(
    engine: Engine, retention_days: int, ahead_days: int = 3, now: datetime | None = None
) -> Upkeep:
    """PostgreSQL: daily partitions from today to ``ahead_days`` ahead, and none older
    than ``retention_days``. SQLite: delete rows older than ``retention_days``."""
    now = now or datetime.now(UTC)
    cutoff = (now - timedelta(days=retention_days)).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    if engine.dialect.name != "postgresql":
        deleted = 0
        with engine.begin() as conn:
            result = conn.execute(delete(inference_logs).where(inference_logs.c.timestamp < cutoff))
            deleted = result.rowcount or 0
        return Upkeep([], [], deleted)
    created, dropped = [], []
    with engine.begin() as conn:
        existing = set(
            conn.execute(
                text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "JOIN pg_class p ON p.oid = i.inhparent "
                    "JOIN pg_namespace n ON n.oid = p.relnamespace "
                    "WHERE p.relname = 'inference_logs' AND n.nspname = current_schema()"
                )
            ).scalars()
        )
        today = now.date()
        for offset in range(-1, ahead_days + 1):  # yesterday too: late rows, clock skew
            day = today + timedelta(days=offset)
            name = partition_name(day)
            if name in existing or datetime(day.year, day.month, day.day, tzinfo=UTC) < cutoff:
                continue
            start, end = day.isoformat(), (day + timedelta(days=1)).isoformat()
            conn.execute(
                text(
                    f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF inference_logs "
                    f"FOR VALUES FROM ('{start} 00:00:00+00') TO ('{end} 00:00:00+00')"
                )
            )
            created.append(name)
        for name in sorted(existing):
            day = _partition_day(name)
            if day is not None and datetime(day.year, day.month, day.day, tzinfo=UTC) < cutoff:
                conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
                dropped.append(name)
    return Upkeep(created, dropped)


def partition_name(day: Any) -> str:
    return f"inference_logs_{day:%Y%m%d}"


def _partition_day(name: str) -> Any:
    try:
        return datetime.strptime(name.removeprefix("inference_logs_"), "%Y%m%d").date()
    except ValueError:
        return None  # not one of ours


# -- reading ----------------------------------------------------------------------------------


def query(
    engine: Engine,
    *,
    model: str | None = None,
    version: str | None = None,
    status_code: int | None = None,
    request_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Rows matching every filter given, newest first."""
    t = inference_logs
    q = select(*(t.c[name] for name in ("id", *_FIELDS)))
    for column, value in (
        (t.c.model_name, model),
        (t.c.version, version),
        (t.c.status_code, status_code),
        (t.c.request_id, request_id),
    ):
        if value is not None:
            q = q.where(column == value)
    if since is not None:
        q = q.where(t.c.timestamp >= since)
    if until is not None:
        q = q.where(t.c.timestamp < until)
    q = q.order_by(t.c.timestamp.desc(), t.c.id.desc()).limit(limit)
    names = ("id", *_FIELDS)
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    out = []
    for row in rows:
        item = dict(zip(names, row, strict=True))
        item["timestamp"] = item["timestamp"].isoformat()
        out.append(item)
    return out
