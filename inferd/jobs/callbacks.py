"""Job callbacks: when a job ends, POST its summary to its ``callback_url``.

The body is the job's status document (as ``GET /api/v1/batch/{id}`` answers it). It is
signed with HMAC-SHA256 over ``<timestamp>.<body>`` with ``jobs.callback_secret``:

    X-Inferd-Timestamp: 1795389886
    X-Inferd-Signature: sha256=<hex of HMAC-SHA256(secret, "1795389886." + body)>

A receiver recomputes the HMAC over the raw body and compares in constant time, and
refuses old timestamps (replays). Without a secret the callback is sent unsigned.

Failures (a connection error, a timeout, any status but 2xx) are retried with
exponential backoff and full jitter (1 s, 2 s, 4 s … up to 5 min, ``callback_attempts``
tries). Every attempt is recorded in the job (time, status or error), so the job's
status shows the delivery; a server restarted mid-way resumes callbacks still pending.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from inferd.jobs.store import JobStore

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "x-inferd-signature"
TIMESTAMP_HEADER = "x-inferd-timestamp"


def sign(secret: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify(
    secret: str, timestamp: str, body: bytes, signature: str, max_age_s: float = 300
) -> bool:
    """What a receiver does (used by the tests)."""
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > max_age_s:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


class CallbackSender:
    def __init__(
        self,
        store: JobStore,
        describe: Callable[[dict[str, Any]], dict[str, Any]],
        secret: str | None,
        attempts: int = 8,
        timeout_s: float = 10.0,
        first_delay_s: float = 1.0,
        max_delay_s: float = 300.0,
    ) -> None:
        self.store = store
        self.describe = describe
        self.secret = secret
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._sending: set[str] = set()
        """Jobs whose callback is being delivered (one delivery per job at a time)."""
        self._client: httpx.AsyncClient | None = None
        """Made for the first callback (:meth:`_attempt`): a server that sends none never
        imports httpx (~5 MiB)."""

    def send_soon(self, job_id: str) -> None:
        if job_id in self._sending:
            return
        self._sending.add(job_id)
        task = asyncio.get_running_loop().create_task(self.deliver(job_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._sending.discard(job_id))

    async def resume(self) -> None:
        """Callbacks of jobs that ended and were not delivered: cancelled or failed
        ones (ended elsewhere, by a gateway), and any a restart interrupted."""
        for job in await asyncio.to_thread(self.store.pending_callbacks):
            self.send_soon(job["id"])

    async def deliver(self, job_id: str) -> None:
        job = await asyncio.to_thread(self.store.get, job_id)
        if job is None or not job["callback_url"]:
            return
        state = job["callback"] or {"state": "pending", "attempts": []}
        if state.get("state") != "pending":
            return
        body = orjson.dumps(self.describe(job))
        delay = self.first_delay_s
        while len(state["attempts"]) < self.attempts:
            attempt = await self._attempt(job["callback_url"], body)
            state["attempts"].append(attempt)
            ok = attempt.get("status") is not None and 200 <= attempt["status"] < 300
            if ok:
                state["state"] = "delivered"
            elif len(state["attempts"]) >= self.attempts:
                state["state"] = "failed"
            await asyncio.to_thread(self.store.record_callback, job_id, state)
            if state["state"] != "pending":
                level = logging.INFO if ok else logging.WARNING
                logger.log(level, "job %s: callback %s after %d attempt(s)",
                           job_id, state["state"], len(state["attempts"]))  # fmt: skip
                return
            await asyncio.sleep(random.uniform(0, delay))  # full jitter
            delay = min(delay * 2, self.max_delay_s)

    async def _attempt(self, url: str, body: bytes) -> dict[str, Any]:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        headers = {"content-type": "application/json", "user-agent": "inferd-callback"}
        if self.secret:
            now = int(time.time())
            headers[TIMESTAMP_HEADER] = str(now)
            headers[SIGNATURE_HEADER] = sign(self.secret, now, body)
        at = datetime.now(UTC).isoformat()
        try:
            reply = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return {"at": at, "status": None, "error": f"{type(exc).__name__}: {exc}"}
        return {"at": at, "status": reply.status_code}

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
