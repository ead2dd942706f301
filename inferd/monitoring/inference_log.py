"""The inference log: one row per inference request, written off the request path.

Handlers ``record`` a :class:`~inferd.shapes.logs.LogRow` (appended to a
deque: half a microsecond). A gateway process ships its rows to the server process every
``flush_interval_s`` (:class:`~inferd.telemetry.log_rows.LogShipper`); there a
background thread inserts what accumulated in one transaction (:class:`InferenceLog`,
this module: the server side, the only one that needs SQLAlchemy). The buffer is
bounded: when the database falls behind, new rows are dropped and counted (``dropped``)
rather than growing memory or slowing requests. User keys are stored as a hash (never
the key itself), computed in that thread.

Each row says which version answered (the experiment assignment of a traffic split,
sticky per user), whether a fallback answered instead, the status code and latency.

On PostgreSQL the table is partitioned by day (migration 0004): :func:`maintain`
(the server process, at start and hourly) creates the partitions for the next days and
drops those past ``retention_days``; on SQLite it deletes old rows in chunks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, event, select, text

from inferd.registry.engine import create_registry_engine
from inferd.registry.tables import inference_logs
from inferd.shapes.logs import NOT_COLUMNS, LogRow
from inferd.telemetry.log_rows import RowBuffer, user_hash

logger = logging.getLogger(__name__)


_FIELDS = tuple(
    "user_hash" if name == "user" else name
    for name in LogRow.__struct_fields__
    if name not in NOT_COLUMNS
)
"""The ``inference_logs`` columns a row fills, in :class:`LogRow`'s order (its payload
is the sinks' alone)."""
CHUNK_ROWS = 32766 // len(_FIELDS)
"""Rows per INSERT statement: a parameter per column each, within SQLite's default
limit of 32766 parameters per statement (PostgreSQL's is 65535)."""


class InferenceLog(RowBuffer):
    """Writes rows (its own, and those gateways ship) to the ``inference_logs`` table
    from a background thread, in one transaction every ``flush_interval_s``."""

    def __init__(
        self, engine: Engine, flush_interval_s: float = 1.0, max_buffer_rows: int = 100_000
    ) -> None:
        super().__init__(max_buffer_rows)
        self.engine = engine
        self.flush_interval_s = flush_interval_s
        self.written = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_error = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inference-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        while not self._stopping:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> int:
        """Write what accumulated; returns how many rows were written. Straight through
        the driver, rows as parameter lists: the ORM's per-row dicts and type processing cost
        several times the CPU."""
        rows = self.drain()
        if not rows:
            return 0
        try:
            self._insert(rows)
        except Exception as exc:
            self.dropped += len(rows)
            now = time.monotonic()
            if now - self._last_error > 60:  # one line a minute, not one per batch
                self._last_error = now
                logger.error("inference log: dropped %d row(s): %s", len(rows), exc)
            return 0
        self.written += len(rows)
        return len(rows)

    def _insert(self, rows: list[LogRow]) -> None:
        """Multi-row INSERTs of up to ``CHUNK_ROWS`` rows, one transaction: one statement
        per chunk, not one per row, so the thread takes the GIL back a few times per
        flush instead of thousands (the convoy effect would slow this process's event
        loop)."""
        sqlite = self.engine.dialect.name == "sqlite"
        when = _sqlite_time if sqlite else _aware_time
        mark = "?" if self.engine.dialect.paramstyle == "qmark" else "%s"
        one = f"({', '.join([mark] * len(_FIELDS))})"
        columns = ", ".join(f'"{name}"' for name in _FIELDS)
        raw = self.engine.raw_connection()
        try:
            cursor = raw.cursor()
            if sqlite:  # the registry's SQLite connections are in autocommit mode
                cursor.execute("BEGIN IMMEDIATE")
            try:
                for start in range(0, len(rows), CHUNK_ROWS):
                    chunk = rows[start : start + CHUNK_ROWS]
                    values: list[Any] = []
                    for r in chunk:
                        values.extend((
                            when(r.timestamp), r.request_id, r.model_name, r.version, r.api,
                            r.status_code, r.latency_ms,
                            None if r.user is None else user_hash(r.user),
                            r.fallback_from, r.cache_hit, r.prompt_tokens,
                            r.completion_tokens, r.prediction, r.gateway_ms, r.cache_ms,
                            r.queue_ms, r.batch_ms, r.compute_ms, r.cached_tokens,
                            r.routed_by, r.expected_cached,
                        ))  # fmt: skip
                    sql = f"INSERT INTO inference_logs ({columns}) VALUES " + ", ".join(
                        [one] * len(chunk)
                    )
                    cursor.execute(sql, values)
            except Exception:
                if sqlite:
                    cursor.execute("ROLLBACK")
                else:
                    raw.rollback()
                raise
            if sqlite:
                cursor.execute("COMMIT")
            else:
                raw.commit()
        finally:
            raw.close()

    def close(self) -> None:
        """Stop the thread and write what is left."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self.flush()


WRITER_NICE = 10
"""The writer thread's nice value: on a machine busy serving, the scheduler favours the
gateways and replicas, and logging takes what is left (its buffer absorbs the delay;
past ``max_buffer_rows`` rows are dropped and counted, never requests slowed)."""


def lower_priority() -> None:
    """Lower this thread's scheduling priority (Linux: nice applies per thread id); the
    payload sinks' threads too."""
    with contextlib.suppress(AttributeError, OSError):  # elsewhere: normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


def log_engine(database_url: str) -> Engine:
    """The writer's own engine: on SQLite, commits do not wait for the disk
    (``synchronous = NORMAL``, safe in WAL mode: a power cut may lose the last second of
    log rows, never corrupt the file); the registry's connections keep ``FULL``."""
    engine = create_registry_engine(database_url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _no_sync)
    return engine


def _no_sync(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous = NORMAL")
    cursor.close()


_second: list[Any] = [None, ""]


def _sqlite_time(ts: float) -> str:
    """``ts`` as the text SQLAlchemy's SQLite DATETIME stores (UTC, microseconds); the
    formatted second is reused for every row within it."""
    sec = int(ts)
    if _second[0] != sec:
        _second[1] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec))
        _second[0] = sec
    return f"{_second[1]}.{int((ts - sec) * 1_000_000):06d}"


def _aware_time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


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
