"""The job runner: takes chunks from the queue and runs them through the gateway.

It runs in the server process, beside the controller, and calls the server's own
gateway over HTTP (``127.0.0.1``) with an internal credential, so a job's requests take
exactly the path online ones take (routing, traffic splits, fallback, cache, inference
log, metrics) at the job's priority: batch jobs at ``batch``, the lowest, which the
replicas refuse first when their queue fills (the runner then waits and tries again:
an item is never failed for want of capacity).

At most ``jobs.concurrency`` chunks are in flight; their queue leases are renewed while
they run. A chunk's results are written (idempotently) before it is acknowledged, so a
crash at any point loses nothing and duplicates nothing: the chunk comes back after its
lease and its results are already there. Async requests (topic ``requests``) are taken
before batch chunks (topic ``batch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from inferd import nonfinite_json
from inferd.jobs import OPENAI_BATCH, TERMINAL
from inferd.jobs.callbacks import CallbackSender
from inferd.jobs.chunk import Chunk, decode_chunk
from inferd.jobs.queue import Delivery, JobQueue
from inferd.jobs.store import JobStore, Result

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

TOPICS = ("requests", "batch")
RETRY_STATUS = (429, 502, 503)
"""A refusal for capacity (or a gateway restarting): the chunk waits and tries again,
for as long as it takes."""
STOP_TIMEOUT_S = 5.0
DEADLINE_RETRIES = 8
"""A 504 (the request's deadline passed, e.g. while a job at the lowest priority waited
behind online traffic) is tried again this many times, with backoff, before it stands
as the items' result: a model too slow for the deadline must not loop for ever."""


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        queue: JobQueue,
        gateway_url: str,
        token: str,
        concurrency: int = 4,
        lease_s: float = 60.0,
        poll_s: float = 0.2,
        callbacks: CallbackSender | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.store = store
        self.queue = queue
        self.concurrency = concurrency
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.callbacks = callbacks
        self._gateway_url = gateway_url
        self._token = token
        self._verify = verify
        self._client: httpx.AsyncClient | None = None
        """Made for the first chunk (:meth:`_post`): a server that runs no job never
        imports httpx (~5 MiB)."""
        self._running: dict[str, tuple[str, asyncio.Task[None]]] = {}
        """Message id -> (topic, its task)."""
        self._task: asyncio.Task[None] | None = None
        self._slot_free = asyncio.Event()
        self._stopping = False
        self._down_since: float | None = None
        self._down_logged = 0.0
        self._down_wait = 0.5
        self._leases: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._job_of: dict[str, str] = {}
        """Message id -> the job its chunk belongs to (for chunks in flight)."""
        self._dropped: set[str] = set()
        """Messages whose task was cancelled because their job ended (acknowledged)."""
        self.items_ok = 0
        self.items_failed = 0
        self.redelivered = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="job-runner")
        self._leases = loop.create_task(self._renew_leases(), name="job-leases")
        self._watcher = loop.create_task(self._watch_cancelled(), name="job-cancels")

    async def stop(self) -> None:
        """Stop taking work; what runs is cancelled (its messages come back after their
        leases: nothing is lost)."""
        # The loops also stop on their own flag: a queue client may swallow a
        # cancellation that lands inside one of its commands (redis-py 8 does).
        self._stopping = True
        self._slot_free.set()
        own = [t for t in (self._task, self._leases, self._watcher) if t is not None]
        tasks = [*own, *(t for _, t in self._running.values())]
        for task in tasks:
            task.cancel()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            if late:
                logger.warning("job runner: %d task(s) did not stop in time", len(late))
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        """Keep ``concurrency`` chunks in flight: take more as soon as one finishes; poll
        the queue every ``poll_s`` only while it is empty."""
        while not self._stopping:
            free = self.concurrency - len(self._running)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            taken = 0
            for topic in TOPICS:
                if self._stopping:
                    return
                try:
                    messages = await self.queue.take(topic, free - taken, self.lease_s)
                except Exception as exc:
                    await self._queue_down(exc)
                    messages = []
                else:
                    self._down_since = None
                for message in messages:
                    task = asyncio.get_running_loop().create_task(self._one(topic, message))
                    self._running[message.id] = (topic, task)
                taken += len(messages)
                if taken >= free:
                    break
            if taken == 0:
                self._slot_free.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_free.wait(), self.poll_s)

    async def _queue_down(self, exc: Exception) -> None:
        """The queue cannot be read: say so (once a minute), wait, try again (backoff up
        to 30 s); the gateways refuse new jobs meanwhile (503)."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since, self._down_logged, self._down_wait = now, 0.0, 0.5
        if now - self._down_logged > 60:
            self._down_logged = now
            logger.error("job queue %s unreachable: %s: %s", self.queue.url,
                         type(exc).__name__, exc)  # fmt: skip
        await asyncio.sleep(self._down_wait)
        self._down_wait = min(self._down_wait * 2, 30.0)

    async def _renew_leases(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.lease_s / 3)
            by_topic: dict[str, list[str]] = {}
            for mid, (topic, _) in list(self._running.items()):
                by_topic.setdefault(topic, []).append(mid)
            for topic, ids in by_topic.items():
                with contextlib.suppress(Exception):
                    await self.queue.extend(topic, ids, self.lease_s)

    async def _watch_cancelled(self, every_s: float = 0.5) -> None:
        """Chunks in flight of a job that ended meanwhile (cancelled) stop at once: their
        requests are cancelled (the gateway and the replica drop them) and their messages
        acknowledged."""
        while not self._stopping:
            await asyncio.sleep(every_s)
            jobs = set(self._job_of.values())
            if not jobs:
                continue
            try:
                statuses = await asyncio.to_thread(self.store.statuses, jobs)
            except Exception:
                logger.exception("job runner: reading job statuses failed")
                continue
            for mid, job_id in list(self._job_of.items()):
                if statuses.get(job_id, "cancelled") in TERMINAL and mid in self._running:
                    self._dropped.add(mid)
                    self._running[mid][1].cancel()

    async def _one(self, topic: str, message: Delivery) -> None:
        try:
            chunk = decode_chunk(message.payload)
            self._job_of[message.id] = chunk.job_id
            if message.deliveries > 1:
                self.redelivered += 1
                logger.info("job %s: items from %d delivered again (attempt %d)",
                            chunk.job_id, chunk.start, message.deliveries)  # fmt: skip
            await self._chunk(chunk)
            await self.queue.ack(topic, [message.id])
        except asyncio.CancelledError:
            if message.id in self._dropped:  # its job ended: the chunk is not wanted
                with contextlib.suppress(Exception):
                    await self.queue.ack(topic, [message.id])
            raise
        except msgspec.DecodeError:
            logger.error("job queue: undecodable message %s dropped", message.id)
            await self.queue.ack(topic, [message.id])
        except Exception:
            # Left un-acknowledged: delivered again after its lease.
            logger.exception("job chunk failed; it will be delivered again")
        finally:
            self._running.pop(message.id, None)
            self._job_of.pop(message.id, None)
            self._dropped.discard(message.id)
            self._slot_free.set()

    async def _chunk(self, chunk: Chunk) -> None:
        job = await asyncio.to_thread(self.store.get, chunk.job_id)
        if job is None or job["status"] in TERMINAL:
            return  # cancelled (or removed): its remaining chunks are dropped
        if job["status"] != "running":
            await asyncio.to_thread(self.store.start, chunk.job_id)
        if job["kind"] == "request":
            results = [await self._request(job, chunk)]
        elif job["kind"] == OPENAI_BATCH:
            results = await self._openai(job, chunk)
        else:
            try:
                results = await self._batch(job, chunk)
            except JobFailed as exc:
                logger.warning("job %s failed: %s", chunk.job_id, exc)
                ended = await asyncio.to_thread(self.store.finish, chunk.job_id, "failed", str(exc))
                if ended and self.callbacks is not None:
                    self.callbacks.send_soon(chunk.job_id)
                return
        finished = await asyncio.to_thread(self.store.add_results, chunk.job_id, results)
        ok = sum(1 for r in results if r.status_code == 200)
        self.items_ok += ok
        self.items_failed += len(results) - ok
        if finished and self.callbacks is not None:
            self.callbacks.send_soon(chunk.job_id)

    async def _request(self, job: dict[str, Any], chunk: Chunk) -> Result:
        """An async request: the stored body sent to its route; its answer, whatever it
        is, is the result (an error answer is the request's error, as online)."""
        request = job["request"]
        headers = {"content-type": "application/json", **request.get("headers", {})}
        status, body = await self._post(request["path"], chunk.items[0], headers)
        return Result(chunk.start, status, body.decode())

    async def _openai(self, job: dict[str, Any], chunk: Chunk) -> list[Result]:
        """An OpenAI batch's lines (checked when it was created), all at once: each
        answer, whatever its status, becomes the line's output line."""
        lines = [orjson.loads(raw) for raw in chunk.items]
        return list(
            await asyncio.gather(
                *(self._openai_line(job, line, chunk.start + i) for i, line in enumerate(lines))
            )
        )

    async def _openai_line(self, job: dict[str, Any], line: dict[str, Any], item: int) -> Result:
        rid = f"{job['id']}-{item}"
        headers = {
            "content-type": "application/json",
            "x-request-id": rid,
            "x-inferd-priority": job["priority"],
        }
        status, body = await self._post(line["url"], orjson.dumps(line["body"]), headers)
        try:
            answer: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            answer = body.decode("utf-8", "replace")
        error = None
        if status != 200:
            shaped = answer.get("error") if isinstance(answer, dict) else None
            if isinstance(shaped, dict):
                error = {"code": shaped.get("code"), "message": shaped.get("message")}
            else:
                error = {"code": str(status), "message": str(shaped or answer)[:500]}
        out = {
            "id": f"batch_req_{rid}",
            "custom_id": line["custom_id"],
            "response": {"status_code": status, "request_id": rid, "body": answer},
            "error": error,
        }
        return Result(item, status, orjson.dumps(out).decode())

    async def _batch(self, job: dict[str, Any], chunk: Chunk) -> list[Result]:
        results: dict[int, Result] = {}
        rows: list[Any] = []
        raws: list[bytes] = []
        items: list[int] = []
        for offset, raw in enumerate(chunk.items):
            item = chunk.start + offset
            try:
                rows.append(nonfinite_json.loads(raw)[0])
            except orjson.JSONDecodeError as exc:
                message = f"input {item} is not JSON: {exc}"
                results[item] = _error(item, 422, "invalid_input", message)
                continue
            raws.append(raw)
            items.append(item)
        if rows and job["request"].get("route") == "generate":
            for row, item in zip(rows, items, strict=True):
                results[item] = await self._generate(job, row, item)
        elif rows:
            for result in await self._predict(job, raws, items):
                results[result.item] = result
        return [results[i] for i in sorted(results)]

    async def _generate(self, job: dict[str, Any], row: Any, item: int) -> Result:
        """One generation per input (``{"prompt", ...}``); the engine batches them."""
        if not isinstance(row, dict):
            return _error(item, 422, "invalid_input", f"input {item} must be an object")
        body = {**row, "stream": False, "priority": job["priority"]}
        path = f"/api/v1/models/{job['model_name']}/generate"
        if job["version"]:
            body["params"] = {**(row.get("params") or {}), "version": job["version"]}
        status, reply = await self._post(path, orjson.dumps(body))
        return Result(item, status, reply.decode())

    async def _predict(
        self, job: dict[str, Any], rows: list[bytes], items: list[int]
    ) -> list[Result]:
        """The rows (each its JSON, sent as it came) in one request; when it fails for
        its content (one bad input, or the model failing on one), each row alone, so
        only the bad ones fail."""
        status, body = await self._post(_path(job), _predict_body(job, rows))
        if status == 200:
            outputs = orjson.loads(body)["outputs"]
            return [
                Result(i, 200, orjson.dumps(o).decode())
                for i, o in zip(items, outputs, strict=True)
            ]
        if status == 404:  # the model (or its pinned version) is gone: the job cannot go on
            raise JobFailed(_message(body))
        if len(rows) == 1:
            return [Result(items[0], status, body.decode())]
        found = []
        for row, item in zip(rows, items, strict=True):
            found.extend(await self._predict(job, [row], [item]))
        return found

    async def _post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """POST until the answer is not a capacity refusal (backoff with jitter, honouring
        Retry-After); connection errors too (the gateway restarting)."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self._gateway_url,
                headers={"authorization": f"Bearer {self._token}"},
                timeout=httpx.Timeout(None, connect=10),
                limits=httpx.Limits(max_connections=self.concurrency + 2),
                verify=self._verify,
            )
        delay, timeouts = 0.1, 0
        while True:
            try:
                reply = await self._client.post(
                    path, content=body, headers=headers or {"content-type": "application/json"}
                )
            except httpx.TransportError as exc:
                logger.warning("job runner: gateway unreachable (%s); retrying", exc)
            else:
                if reply.status_code == 504:
                    timeouts += 1
                if reply.status_code not in RETRY_STATUS and (
                    reply.status_code != 504 or timeouts > DEADLINE_RETRIES
                ):
                    return reply.status_code, reply.content
                retry_after = reply.headers.get("retry-after", "")
                if retry_after.isdigit():
                    delay = max(delay, min(float(retry_after), 30.0))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 30.0)


class JobFailed(Exception):
    """The job cannot go on (its model was removed): it ends ``failed``, saying why."""


def _message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]


def _path(job: dict[str, Any]) -> str:
    return f"/api/v1/models/{job['model_name']}/predict"


def _predict_body(job: dict[str, Any], rows: list[bytes]) -> bytes:
    """The predict request of ``rows`` (JSON texts, joined as they are: a NaN literal
    reaches the route's tensor check as the client wrote it)."""
    params: dict[str, Any] = {"priority": job["priority"]}
    if job["version"]:
        params["version"] = job["version"]
    return b'{"inputs":[' + b",".join(rows) + b'],"params":' + orjson.dumps(params) + b"}"


def _error(item: int, status: int, code: str, message: str) -> Result:
    body = {"error": {"code": code, "message": message}}
    return Result(item, status, orjson.dumps(body).decode())
