"""The record of jobs in the registry's database (tables ``jobs`` and ``job_results``).

Results are written idempotently: ``(job_id, item)`` is the key and a conflicting insert
does nothing, so a chunk the queue delivered twice (a crash between writing its results
and acknowledging it) adds nothing the second time. The job's counters move by what was
actually inserted, in the same transaction, and the job finishes exactly once: the
``UPDATE … WHERE status = 'running'`` that marks it done succeeds for one writer only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, delete, func, insert, select, update

from inferd.jobs import TERMINAL
from inferd.registry.tables import job_results, jobs


@dataclass(frozen=True, slots=True)
class Result:
    item: int
    status_code: int
    output: str
    """The answer (status 200) or the error, as JSON text."""


class JobStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._insert = _insert_ignore(engine).returning(job_results.c.item)

    def create(
        self,
        job_id: str,
        kind: str,
        model: str,
        version: str | None,
        total: int,
        request: dict[str, Any],
        priority: str,
        callback_url: str | None,
        owner: str | None,
        keep_s: float,
    ) -> dict[str, Any]:
        now = datetime.now(UTC)
        row = {
            "id": job_id, "kind": kind, "model_name": model, "version": version,
            "status": "accepting", "priority": priority, "total": total, "succeeded": 0,
            "failed": 0, "request": request, "callback_url": callback_url,
            "callback": {"state": "pending", "attempts": []} if callback_url else None,
            "error": None, "owner": owner, "created_at": now, "started_at": None,
            "finished_at": None, "expires_at": now + timedelta(seconds=keep_s),
        }  # fmt: skip
        with self.engine.begin() as conn:
            conn.execute(insert(jobs).values(row))
        return row

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).mappings().first()
        return None if row is None else {str(k): v for k, v in row.items()}

    def status(self, job_id: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()

    def accepted(self, job_id: str) -> None:
        """Its inputs are all on the queue (the runner may already have started it)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(jobs)
                .where(and_(jobs.c.id == job_id, jobs.c.status == "accepting"))
                .values(status="queued")
            )

    def find(
        self,
        kind: str,
        status: str | None = None,
        model: str | None = None,
        owner: str | None = None,
        limit: int = 100,
        before: str | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs of ``kind``, newest first, filtered (``owner`` None: everyone's), older
        than the job ``before`` (a page's cursor)."""
        query = select(jobs).where(jobs.c.kind == kind)
        if before is not None:
            query = query.where(jobs.c.id < before)
        if status is not None:
            query = query.where(jobs.c.status == status)
        if model is not None:
            query = query.where(jobs.c.model_name == model)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(jobs.c.id.desc()).limit(limit)).mappings()
            return [{str(k): v for k, v in row.items()} for row in rows]

    def counts(self) -> dict[tuple[str, str], int]:
        """Jobs kept, by (kind, status)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(jobs.c.kind, jobs.c.status, func.count()).group_by(
                    jobs.c.kind, jobs.c.status
                )
            )
            return {(kind, status): int(n) for kind, status, n in rows}

    def statuses(self, job_ids: set[str]) -> dict[str, str]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(jobs.c.id, jobs.c.status).where(jobs.c.id.in_(job_ids)))
            return {job_id: status for job_id, status in rows}

    def start(self, job_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(jobs)
                .where(and_(jobs.c.id == job_id, jobs.c.status.in_(("accepting", "queued"))))
                .values(status="running", started_at=datetime.now(UTC))
            )

    def recent_rate(self, model: str) -> float | None:
        """Items per second of the model's last batch job that succeeded (of 500 inputs
        or more: a smaller one measures latency, not throughput)."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(jobs.c.total, jobs.c.started_at, jobs.c.finished_at)
                .where(and_(jobs.c.model_name == model, jobs.c.kind == "batch",
                            jobs.c.status == "succeeded", jobs.c.started_at.is_not(None),
                            jobs.c.total >= 500))
                .order_by(jobs.c.finished_at.desc())
                .limit(1)
            ).first()  # fmt: skip
        if row is None:
            return None
        seconds = (row.finished_at - row.started_at).total_seconds()
        return row.total / seconds if seconds > 0 else None

    def fail_interrupted(self, older_than_s: float = 600.0) -> int:
        """Jobs left ``accepting`` (their gateway died before queueing them all, so their
        client never got a 202): failed, saying so."""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        with self.engine.begin() as conn:
            result = conn.execute(
                update(jobs)
                .where(and_(jobs.c.status == "accepting", jobs.c.created_at < cutoff))
                .values(status="failed", finished_at=datetime.now(UTC),
                        error="submission interrupted before the job was accepted")
            )  # fmt: skip
        return int(result.rowcount or 0)

    def add_results(self, job_id: str, results: Sequence[Result]) -> bool:
        """Record results (those already there are left alone); True when this call
        completed the job (every item has a result): the caller then sends its callback."""
        if not results:
            return False
        ok = [r for r in results if r.status_code == 200]
        bad = [r for r in results if r.status_code != 200]
        with self.engine.begin() as conn:
            added = {}
            for name, part in (("succeeded", ok), ("failed", bad)):
                added[name] = 0
                if part:
                    # One cached statement, executed for many rows (SQLAlchemy batches them
                    # into multi-row INSERTs); RETURNING tells which rows were new: the
                    # drivers' rowcount is not reliable for this on every backend.
                    inserted = conn.execute(
                        self._insert,
                        [{"job_id": job_id, "item": r.item, "status_code": r.status_code,
                          "output": r.output} for r in part],
                    ).all()  # fmt: skip
                    added[name] = len(inserted)
            if not any(added.values()):
                return False
            conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id)
                .values(
                    succeeded=jobs.c.succeeded + added["succeeded"],
                    failed=jobs.c.failed + added["failed"],
                )
            )
            done = conn.execute(
                update(jobs)
                .where(
                    and_(
                        jobs.c.id == job_id,
                        jobs.c.status.in_(("accepting", "queued", "running")),
                        jobs.c.succeeded + jobs.c.failed >= jobs.c.total,
                    )
                )
                .values(status="succeeded", finished_at=datetime.now(UTC))
            )
            return bool(done.rowcount)

    def finish(self, job_id: str, status: str, error: str | None = None) -> bool:
        """End a job that is not over yet (failed, cancelled); True when this call did."""
        with self.engine.begin() as conn:
            result = conn.execute(
                update(jobs)
                .where(and_(jobs.c.id == job_id, jobs.c.status.not_in(TERMINAL)))
                .values(status=status, error=error, finished_at=datetime.now(UTC))
            )
        return bool(result.rowcount)

    def record_callback(self, job_id: str, callback: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(callback=callback))

    def pending_callbacks(self, within_s: float = 86400.0) -> list[dict[str, Any]]:
        """Jobs that ended in the last ``within_s`` and whose callback is not delivered
        yet (cancelled ones, failed ones, and any a restart interrupted)."""
        since = datetime.now(UTC) - timedelta(seconds=within_s)
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(jobs).where(
                    and_(
                        jobs.c.status.in_(TERMINAL),
                        jobs.c.callback_url.is_not(None),
                        jobs.c.finished_at > since,
                    )
                )
            ).mappings()
            found = [{str(k): v for k, v in r.items()} for r in rows]
        return [j for j in found if (j["callback"] or {}).get("state") == "pending"]

    def results_page(self, job_id: str, after: int, limit: int) -> list[tuple[int, int, str]]:
        """(item, status code, output JSON) of items after ``after``, in item order."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(job_results.c.item, job_results.c.status_code, job_results.c.output)
                .where(and_(job_results.c.job_id == job_id, job_results.c.item > after))
                .order_by(job_results.c.item)
                .limit(limit)
            ).all()
        return [(int(i), int(c), o) for i, c, o in rows]

    def count_results(self, job_id: str) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(job_results)
                    .where(job_results.c.job_id == job_id)
                ).scalar_one()
            )

    def purge(self) -> int:
        """Delete jobs (and their results) kept past ``expires_at``."""
        now = datetime.now(UTC)
        with self.engine.begin() as conn:
            old = (
                conn.execute(
                    select(jobs.c.id).where(
                        and_(jobs.c.expires_at < now, jobs.c.status.in_(TERMINAL))
                    )
                )
                .scalars()
                .all()
            )
            for job_id in old:
                conn.execute(delete(job_results).where(job_results.c.job_id == job_id))
                conn.execute(delete(jobs).where(jobs.c.id == job_id))
        return len(old)


def _insert_ignore(engine: Engine) -> Any:
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(job_results).on_conflict_do_nothing()
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(job_results).on_conflict_do_nothing()
