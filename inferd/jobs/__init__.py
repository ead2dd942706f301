"""Batch jobs and asynchronous requests through a durable queue.

A gateway accepts a job (:class:`Jobs`): it records it (``jobs`` table, status
``accepting``), puts its inputs on the queue in chunks, then marks it ``queued`` and
answers 202 — so whatever was answered 202 is on the queue. The server's
:class:`~inferd.jobs.runner.JobRunner` takes the chunks, runs them through the gateway
at the job's priority, and writes one result per input (idempotently); the callback
goes out when the last one is in (:mod:`inferd.jobs.callbacks`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from inferd.config import Settings
from inferd.errors import InferdError
from inferd.jobs.chunk import Chunk, encode_chunk
from inferd.jobs.queue import JobQueue

if TYPE_CHECKING:  # the store brings SQLAlchemy: a gateway opens it on the first job
    from inferd.jobs.files import FileStore
    from inferd.jobs.store import JobStore

logger = logging.getLogger(__name__)

TERMINAL = ("succeeded", "failed", "cancelled")
OPENAI_BATCH = "openai-batch"
"""The kind of an OpenAI batch's job (``/v1/batches``): its inputs are request lines."""


def new_job_id(kind: str) -> str:
    """Time-ordered (milliseconds, then 64 random bits): ``r-`` request, ``b-`` batch
    (of either API)."""
    return (
        f"{'r' if kind == 'request' else 'b'}-{int(time.time() * 1000):012x}{secrets.token_hex(8)}"
    )


OUTPUT_SUFFIXES = ("-output", "-errors")


def output_file_id(job_id: str, errors: bool) -> str:
    """The id of an OpenAI batch's output (or error) file: read from its job's results
    (:mod:`inferd.jobs.files`), never stored."""
    return f"file-{job_id}{OUTPUT_SUFFIXES[errors]}"


def output_of(file_id: str) -> tuple[str, bool] | None:
    """(job id, errors?) of a batch's output or error file id, else None."""
    for errors, suffix in enumerate(OUTPUT_SUFFIXES):
        if file_id.startswith("file-b-") and file_id.endswith(suffix):
            return file_id[len("file-") : -len(suffix)], bool(errors)
    return None


class QueueUnavailable(InferdError):
    status_code = 503
    code = "queue_unavailable"


class Jobs:
    def __init__(self, settings: Settings, store: JobStore, queue: JobQueue) -> None:
        self.settings = settings
        self.store = store
        self.queue = queue
        self._files: FileStore | None = None

    @property
    def files(self) -> FileStore:
        """The OpenAI batches' files, opened on first use: a gateway's ``store`` opens
        the database only when a route reads it (``api/worker.py: on_first_use``)."""
        if self._files is None:
            from inferd.jobs.files import FileStore

            self._files = FileStore(self.store.engine)
        return self._files

    async def submit(
        self,
        kind: str,
        model: str,
        version: str | None,
        items: list[bytes],
        request: dict[str, Any],
        priority: str,
        callback_url: str | None = None,
        owner: str | None = None,
    ) -> dict[str, Any]:
        """Record the job, queue its items, and return it once it is durably queued."""
        cfg = self.settings.jobs
        job_id = new_job_id(kind)
        keep_s = cfg.request_keep_s if kind == "request" else cfg.keep_s
        job = await asyncio.to_thread(
            self.store.create, job_id, kind, model, version, len(items), request, priority,
            callback_url, owner, keep_s,
        )  # fmt: skip
        size = cfg.chunk_items
        chunks = [
            encode_chunk(Chunk(job_id, start, items[start : start + size]))
            for start in range(0, len(items), size)
        ]
        topic = "requests" if kind == "request" else "batch"
        try:
            await self.queue.put(topic, chunks)
        except Exception as exc:
            logger.exception("job %s: the queue refused its inputs", job_id)
            await asyncio.to_thread(self.store.finish, job_id, "failed", f"queue: {exc}")
            raise QueueUnavailable(f"the job queue is unavailable ({type(exc).__name__})") from exc
        await asyncio.to_thread(self.store.accepted, job_id)
        job["status"] = "queued"
        return job

    async def get(self, job_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.store.get, job_id)

    async def recent_rate(self, model: str) -> float | None:
        """Inputs per second of this model's last finished batch job (500+ inputs;
        None before the first one)."""
        return await asyncio.to_thread(self.store.recent_rate, model)


def describe(job: dict[str, Any]) -> dict[str, Any]:
    """A job as ``GET /api/v1/batch/{id}`` (and the callback) shows it."""
    done = job["succeeded"] + job["failed"]
    total = job["total"]
    started, finished = job["started_at"], job["finished_at"]
    rate = eta = None
    estimate = (job["request"] or {}).get("estimate")
    if started is not None:
        elapsed = ((finished or datetime.now(UTC)) - started).total_seconds()
        if elapsed > 0 and done:
            rate = done / elapsed
            if finished is None:
                eta = (total - done) / rate
                estimate = {
                    "seconds": round(eta, 3), "items_per_s": round(rate, 3),
                    "method": "progress",
                    "basis": f"{done} of {total} inputs done at {rate:.1f} inputs/s",
                }  # fmt: skip
    if finished is not None:
        estimated_time: str | None = "0s"
    else:  # by progress, else (queued, no result yet) the estimate made at submission
        estimated_time = None if estimate is None else human_duration(estimate["seconds"])
    return {
        "batch_id": job["id"],
        "status": job["status"],
        "model": job["model_name"],
        "version": job["version"],
        "priority": job["priority"],
        "total": total,
        "succeeded": job["succeeded"],
        "failed": job["failed"],
        "progress": round(done / total, 4) if total else 1.0,
        "items_per_s": None if rate is None else round(rate, 1),
        "eta_s": None if eta is None else round(eta, 1),
        "estimated_time": estimated_time,
        "estimate": estimate,
        "created_at": _iso(job["created_at"]),
        "started_at": _iso(started),
        "finished_at": _iso(finished),
        "expires_at": _iso(job["expires_at"]),
        "error": job["error"],
        "callback_url": job["callback_url"],
        "callback": job["callback"],
        "results_url": f"/api/v1/batch/{job['id']}/results",
    }


def human_duration(seconds: float) -> str:
    """``45s``, ``5min``, ``2h``: how long, as the design documents write it."""
    if seconds < 90:
        return f"{max(1, round(seconds))}s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)}min"
    return f"{round(seconds / 3600)}h"


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


__all__ = [
    "OPENAI_BATCH",
    "TERMINAL",
    "Jobs",
    "QueueUnavailable",
    "describe",
    "human_duration",
    "new_job_id",
    "output_file_id",
    "output_of",
]
