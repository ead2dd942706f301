"""Dynamic batching: many concurrent requests, few ``predict_batch`` calls.

Callers ``await batcher.submit(inputs, rows)`` with one request's columnar inputs. A
single loop takes queued requests until the batch holds ``max_batch_size`` rows or
``max_wait_ms`` passed since its first request arrived, concatenates them, runs one
``predict_batch`` in the executor thread (model code never runs on the event loop),
and splits the outputs back by row ranges. While one batch computes, the next one
fills, so under load batches grow on their own and the wait costs nothing.

Rules: sizes count rows, not requests; a request larger than ``max_batch_size`` is
queued as pieces of that size (its outputs joined in order); a request that waited past
its deadline, or was cancelled, is dropped before it is computed; when a batch fails,
each of its requests is computed alone, so a failure is the failing requests' only;
at most ``max_queue_rows`` rows wait, beyond that ``submit`` raises :class:`Overloaded`.

Text (length-bucketed batching): a request may come with each row's length (tokens).
A batch is padded to its longest row, so short texts batched with long ones pay for
the long ones. With ``length_buckets`` (upper bounds, e.g. 16, 32, 64 ... tokens), a
batch takes the oldest request and then only requests of its length bucket, oldest
first; the others wait for the next batch (nothing starves: the oldest request always
goes next). A request larger than ``max_batch_size`` is cut into pieces of rows sorted
by length. ``stats.tokens`` / ``stats.padded_tokens`` count real and padded tokens.

Priorities (the Open Inference Protocol's schedule policy): each request has a level
from 1 (first) to ``priority_levels``; 0 means ``default_priority``; the names ``high``,
``normal``, ``low`` and ``batch`` travel as negative numbers (:mod:`inferd.priority`)
and mean the levels :func:`named_levels` gives them. Batches take requests level by
level, first in first out within a level, so a level waits while a better one has
requests (a starved request still ends at its deadline).

Load shedding: levels after the default one are refused at once while the queue holds
``low_queue_share`` (the last level: ``batch_queue_share``) of ``max_queue_rows``; a
request that does not fit in a full queue takes the place of queued requests of worse
levels, newest first, which fail with :class:`Overloaded` (shed). Every refusal carries a
Retry-After estimated from the queue and the measured throughput.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from inferd.config import BatchingConfig
from inferd.errors import InvalidInput, Overloaded, RequestTimeout
from inferd.observability.metrics import Histogram, Sketch
from inferd.priority import NAMED_PRIORITIES, named_levels
from inferd.serving.protocol import Columns

PredictFn = Callable[[Columns], Columns]

BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
MAX_RETRY_AFTER_S = 60


def priority_name(config: BatchingConfig, level: int) -> str:
    """A level's name in counters: its priority name, else ``level_<n>``."""
    for name, value in named_levels(config).items():
        if value == level and (name != "low" or level != config.priority_levels):
            return name
    return f"level_{level}"


@dataclass(slots=True)
class BatchTrace:
    """A traced request's timing: when it arrived, and, filled when its batch computed,
    the batch's wall-clock start and end (``time.time_ns``, as spans take them) and size."""

    arrived_ns: int = 0
    started_ns: int = 0
    ended_ns: int = 0
    rows: int = 0
    requests: int = 0


@dataclass(slots=True)
class _Pending:
    inputs: Columns
    rows: int
    deadline: float
    future: asyncio.Future[Columns]
    arrived: float = field(default_factory=time.monotonic)
    priority: int = 0
    trace: BatchTrace | None = None
    length: int = 0
    """Its longest row (tokens), 0 when rows have no length."""
    tokens: int = 0
    """Sum of its rows' lengths."""
    bucket: int = -1
    """Its length bucket (-1: rows have no length, or buckets are off)."""


@dataclass(slots=True)
class BatchStats:
    batches: int = 0
    rows: int = 0
    requests: int = 0
    expired: int = 0
    rejected: int = 0
    """Refused because the queue was full (or over its level's share)."""
    shed: int = 0
    """Taken out of the queue to make room for a request of a better level."""
    compute_s: float = 0.0
    tokens: int = 0
    """Text models: tokens of the rows computed."""
    padded_tokens: int = 0
    """Text models: tokens computed, padding included (rows x longest row, per batch)."""

    def as_dict(self) -> dict[str, float]:
        stats = {
            "batches": self.batches,
            "rows": self.rows,
            "requests": self.requests,
            "expired": self.expired,
            "rejected": self.rejected,
            "shed": self.shed,
            "compute_s": round(self.compute_s, 6),
        }
        if self.padded_tokens:
            stats["tokens"] = self.tokens
            stats["padded_tokens"] = self.padded_tokens
        return stats


class DynamicBatcher:
    def __init__(self, predict: PredictFn, config: BatchingConfig, executor: Executor) -> None:
        self._predict = predict
        self._config = config
        self._executor = executor
        self._levels: dict[int, deque[_Pending]] = {}
        """Waiting requests by priority level; only levels with requests are present."""
        self._queued_rows = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.stats = BatchStats()
        self.batch_rows = Histogram(BATCH_ROWS_BUCKETS)
        """Rows of each computed batch (how full batches are)."""
        self.compute = Sketch()
        """Seconds each answered request's batch computed (a canary analysis compares it:
        unlike queue time, it does not depend on how much traffic a version gets)."""
        self.busy = False
        self._flush_due = False
        named = named_levels(config)
        self._named = {code: named[name] for name, code in NAMED_PRIORITIES.items()}
        self._limits = [
            _admission_limit(config, level) for level in range(config.priority_levels + 1)
        ]
        """Queued rows beyond which a request of each level is refused (index: level)."""
        self.shed_by_level: dict[int, int] = {}
        """Requests refused or shed, per level."""
        self._bounds = sorted(config.length_buckets)

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _flush(self) -> None:
        self._flush_due = True
        self._wakeup.set()

    def idle(self) -> bool:
        return not self._levels and not self.busy

    def submit(
        self,
        inputs: Columns,
        rows: int,
        timeout_s: float,
        priority: int = 0,
        trace: BatchTrace | None = None,
        lengths: np.ndarray | None = None,
    ) -> asyncio.Future[Columns]:
        """Queue one request; ``trace``, when given, is filled with its batch's timing;
        ``lengths``: each row's length (tokens), for length-bucketed batching."""
        config = self._config
        if priority < 0 and priority in self._named:
            level = self._named[priority]
        elif 0 <= priority <= config.priority_levels:
            level = priority or config.default_priority
        else:
            raise InvalidInput(
                f"priority {priority} is not a level of this model: use 1 (first) to "
                f"{config.priority_levels}, 0 for the default ({config.default_priority}), "
                "or a name: high, normal, low, batch"
            )
        limit = self._limits[level]
        if self._queued_rows + rows > limit and self._levels and not self._make_room(level, rows):
            self.stats.rejected += 1
            self._count_shed(level)
            if limit < config.max_queue_rows:
                why = f"load shedding: priority {priority_name(config, level)} is refused"
                why += f" while {limit} or more rows are queued"
            else:
                why = "replica queue is full"
            raise Overloaded(
                why, self.retry_after_s(), queued_rows=self._queued_rows, max_queue_rows=limit
            )
        future: asyncio.Future[Columns] = asyncio.get_running_loop().create_future()
        queue = self._levels.get(level)
        if queue is None:
            queue = self._levels[level] = deque()
        deadline = time.monotonic() + timeout_s
        if rows > config.max_batch_size:
            self._split(queue, inputs, rows, deadline, future, level, trace, lengths)
        elif lengths is None:
            queue.append(_Pending(inputs, rows, deadline, future, priority=level, trace=trace))
        else:
            length, tokens = int(lengths.max()), int(lengths.sum())
            queue.append(_Pending(inputs, rows, deadline, future, priority=level, trace=trace,
                                  length=length, tokens=tokens,
                                  bucket=self._bucket(length)))  # fmt: skip
        self._queued_rows += rows
        self._wakeup.set()
        return future

    def _split(
        self,
        queue: deque[_Pending],
        inputs: Columns,
        rows: int,
        deadline: float,
        future: asyncio.Future[Columns],
        level: int,
        trace: BatchTrace | None,
        lengths: np.ndarray | None = None,
    ) -> None:
        """Queue a request larger than ``max_batch_size`` as pieces of that size, so it
        never holds the model for more than one batch while better-priority requests wait
        (a 4096-row batch job request would otherwise compute alone, for as long as 128
        batches). With ``lengths``, rows are sorted by length first, so each piece pads
        little. ``future`` gets the pieces' outputs joined in the request's order, or the
        first failure; cancelling it drops the pieces not yet computed."""
        loop = asyncio.get_running_loop()
        size = self._config.max_batch_size
        order = None if lengths is None else np.argsort(lengths, kind="stable")
        if order is not None:
            inputs = {name: array[order] for name, array in inputs.items()}
            lengths = lengths[order]  # type: ignore[index]
        parts: list[asyncio.Future[Columns]] = []
        for start in range(0, rows, size):
            end = min(rows, start + size)
            part: asyncio.Future[Columns] = loop.create_future()
            piece = {name: array[start:end] for name, array in inputs.items()}
            item = _Pending(piece, end - start, deadline, part, priority=level,
                            trace=trace if start == 0 else None)  # fmt: skip
            if lengths is not None:
                item.length = int(lengths[end - 1])
                item.tokens = int(lengths[start:end].sum())
                item.bucket = self._bucket(item.length)
            queue.append(item)
            parts.append(part)
        _join(future, parts, None if order is None else np.argsort(order))

    def _make_room(self, level: int, rows: int) -> bool:
        """Shed queued requests of levels worse than ``level``, newest first, until
        ``rows`` more fit; False (nothing shed) when they cannot be made to fit."""
        limit = self._limits[level]
        worse = sorted((lv for lv in self._levels if lv > level), reverse=True)
        freeable = sum(p.rows for lv in worse for p in self._levels[lv])
        if self._queued_rows - freeable + rows > limit:
            return False
        retry_after = self.retry_after_s()
        for lv in worse:
            queue = self._levels[lv]
            while queue and self._queued_rows + rows > limit:
                item = queue.pop()
                self._queued_rows -= item.rows
                if item.future.done():
                    continue
                self.stats.shed += 1
                self._count_shed(lv)
                item.future.set_exception(Overloaded(
                    "load shedding: taken out of the queue for a higher-priority request",
                    retry_after,
                ))  # fmt: skip
            if not queue:
                del self._levels[lv]
            if self._queued_rows + rows <= limit:
                break
        return True

    def _count_shed(self, level: int) -> None:
        self.shed_by_level[level] = self.shed_by_level.get(level, 0) + 1

    def shed_counts(self) -> dict[str, int]:
        """Requests refused or shed, by priority name."""
        return {priority_name(self._config, lv): n for lv, n in sorted(self.shed_by_level.items())}

    def retry_after_s(self) -> int:
        """Seconds the queue takes to empty at the throughput measured so far (1 to 60)."""
        stats = self.stats
        if stats.compute_s <= 0 or stats.rows == 0:
            return 1
        wait = self._queued_rows / (stats.rows / stats.compute_s)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait)))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            self.busy = True
            try:
                await self._execute(loop, batch)
            finally:
                self.busy = False

    async def _collect(self) -> list[_Pending]:
        while not self._levels:
            self._wakeup.clear()
            await self._wakeup.wait()
        max_rows = self._config.max_batch_size
        first = min(queue[0].arrived for queue in self._levels.values())
        remaining = first + self._config.max_wait_ms / 1000 - time.monotonic()
        if self._queued_rows < max_rows and remaining > 0:
            # One timer per batch (not per wake-up) ends the wait.
            timer = asyncio.get_running_loop().call_later(remaining, self._flush)
            self._flush_due = False
            while self._queued_rows < max_rows and not self._flush_due:
                self._wakeup.clear()
                await self._wakeup.wait()
            timer.cancel()
        return self._take(max_rows)

    def _take(self, max_rows: int) -> list[_Pending]:
        batch: list[_Pending] = []
        rows = 0
        now = time.monotonic()
        levels = self._levels
        order = sorted(levels) if len(levels) > 1 else list(levels)
        bucket = levels[order[0]][0].bucket  # the oldest best request's
        for level in order:
            queue = levels[level]
            if bucket < 0:
                rows = self._take_level(queue, batch, rows, max_rows, now)
            else:
                rows = self._take_bucket(queue, batch, rows, max_rows, now, bucket)
            if queue:
                break  # the batch is full, or the rest of this level waits for the next
            del levels[level]
        return batch

    def _bucket(self, length: int) -> int:
        """The length bucket of a request: the first bound it fits under (the last bucket
        holds everything longer than every bound); -1 when buckets are off."""
        return bisect.bisect_left(self._bounds, length) if self._bounds else -1

    def _take_bucket(
        self,
        queue: deque[_Pending],
        batch: list[_Pending],
        rows: int,
        max_rows: int,
        now: float,
        bucket: int,
    ) -> int:
        """Like :meth:`_take_level`, but only requests of ``bucket``, oldest first; the
        others keep their places in the queue."""
        kept: deque[_Pending] = deque()
        while queue:
            item = queue.popleft()
            if item.future.done():
                self._queued_rows -= item.rows
                continue
            if (batch and rows + item.rows > max_rows) or item.bucket != bucket:
                kept.append(item)
                if rows >= max_rows:
                    break
                continue
            self._queued_rows -= item.rows
            if self._expired(item, now):
                continue
            batch.append(item)
            rows += item.rows
        kept.extend(queue)
        queue.clear()
        queue.extend(kept)
        return rows

    def _take_level(
        self, queue: deque[_Pending], batch: list[_Pending], rows: int, max_rows: int, now: float
    ) -> int:
        while queue:
            item = queue[0]
            if batch and rows + item.rows > max_rows:
                break
            queue.popleft()
            self._queued_rows -= item.rows
            if item.future.done():
                continue
            if self._expired(item, now):
                continue
            batch.append(item)
            rows += item.rows
        return rows

    def _expired(self, item: _Pending, now: float) -> bool:
        """Fail ``item`` if its deadline passed while it was queued."""
        if now <= item.deadline:
            return False
        self.stats.expired += 1
        item.future.set_exception(RequestTimeout("request expired in the replica queue"))
        return True

    async def _execute(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        if len(batch) == 1:
            inputs = batch[0].inputs
        else:
            names = batch[0].inputs.keys()
            inputs = {n: np.concatenate([p.inputs[n] for p in batch]) for n in names}
        rows = sum(p.rows for p in batch)
        started_ns = time.time_ns()
        started = time.perf_counter()
        error: Exception | None = None
        try:
            outputs = await loop.run_in_executor(self._executor, self._predict, inputs)
            _check_rows(outputs, rows)
        except Exception as exc:
            error = exc
        elapsed = time.perf_counter() - started
        self._account(batch, rows, started_ns, elapsed)
        if batch[0].length:
            self.stats.tokens += sum(p.tokens for p in batch)
            self.stats.padded_tokens += rows * max(p.length for p in batch)
        if error is not None:
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(error)
            else:  # one bad request must not fail the others it was batched with
                await self._one_by_one(loop, batch)
            return
        self.compute.observe(elapsed, len(batch))
        self.batch_rows.observe(rows)
        start = 0
        for p in batch:
            end = start + p.rows
            if not p.future.done():
                p.future.set_result({n: a[start:end] for n, a in outputs.items()})
            start = end

    async def _one_by_one(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        """After a batch failed: each of its requests alone, so each gets its own answer
        (the failure is the bad ones' only). Costs nothing while batches succeed."""
        for p in batch:
            if p.future.done():
                continue
            started_ns, started = time.time_ns(), time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self._predict, p.inputs)
                _check_rows(outputs, p.rows)
            except Exception as exc:
                result: Columns | Exception = exc
            else:
                result = outputs
            self._account([p], p.rows, started_ns, time.perf_counter() - started)
            if p.future.done():
                continue
            if isinstance(result, Exception):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)

    def _account(self, batch: list[_Pending], rows: int, started_ns: int, elapsed: float) -> None:
        stats = self.stats
        stats.compute_s += elapsed
        stats.batches += 1
        stats.rows += rows
        stats.requests += len(batch)
        for p in batch:  # before the futures' callbacks run
            if p.trace is not None:
                trace = p.trace
                trace.started_ns, trace.rows, trace.requests = started_ns, rows, len(batch)
                trace.ended_ns = started_ns + int(elapsed * 1e9)


def _join(
    future: asyncio.Future[Columns],
    parts: list[asyncio.Future[Columns]],
    inverse: np.ndarray | None,
) -> None:
    """``future`` gets the pieces' outputs concatenated (rows put back in the request's
    order by ``inverse``), or the first failure; cancelling it cancels the pieces."""

    def part_done(part: asyncio.Future[Columns]) -> None:
        if future.done():
            return
        if part.cancelled() or part.exception() is not None:
            if part.cancelled():
                future.cancel()
            else:
                future.set_exception(part.exception())  # type: ignore[arg-type]
            for other in parts:
                other.cancel()
        elif all(p.done() for p in parts):
            results = [p.result() for p in parts]
            joined = {n: np.concatenate([r[n] for r in results]) for n in results[0]}
            if inverse is not None:
                joined = {n: array[inverse] for n, array in joined.items()}
            future.set_result(joined)

    def outer_done(_: asyncio.Future[Columns]) -> None:
        if future.cancelled():
            for part in parts:
                part.cancel()

    for part in parts:
        part.add_done_callback(part_done)
    future.add_done_callback(outer_done)


def _admission_limit(config: BatchingConfig, level: int) -> int:
    if level <= config.default_priority:
        return config.max_queue_rows
    share = config.batch_queue_share if level == config.priority_levels else config.low_queue_share
    return max(1, int(config.max_queue_rows * share))


def _check_rows(outputs: Columns, rows: int) -> None:
    for name, array in outputs.items():
        if array.shape[:1] != (rows,):
            raise ValueError(
                f"model output {name!r} has shape {array.shape}; expected {rows} rows first"
            )
