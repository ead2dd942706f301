"""Dynamic batching: many concurrent requests, few ``predict_batch`` calls.

Callers ``await batcher.submit(inputs, rows)`` with one request's columnar inputs. A
single loop takes queued requests into a batch of at most ``max_batch_size`` rows,
concatenates them, runs one ``predict_batch``, and splits the outputs back by row
ranges. The batch computes in the executor thread, except for light models: while the
last ``INLINE_WINDOW`` batches took at most ``inline_max_ms`` (all but ``INLINE_SLOW``
of them), a batch of at most ``INLINE_REQUESTS`` requests computes on the event loop
itself, which saves the two thread hand-offs (and the GIL changing hands) of every
batch; slower batches send the next ones back to the thread. A model bound to the
thread it was loaded on (its inline call fails where the thread's succeeds) stays there.

When a batch goes (adaptive batching, the default): at low load, as soon as the
replica is free. A request that finds the replica idle is computed at once, with
whatever arrived in the same instant; while a batch computes, the next one fills, and it
goes the moment the compute ends: nobody waits for companions that are not coming.
Under load, batching pays: once computing the arriving requests one by one would keep
the replica busy all its time (:meth:`DynamicBatcher.load`: the arrival rate
over the last quarter second times what a batch of one or two rows takes), a queue
forms, and a batch waits, as window batching does, until it holds ``max_batch_size``
rows or ``max_wait_ms`` passed since its first request arrived: fewer, fuller batches,
the compute they save going to the requests that wait anyway. With ``adaptive: false``
(window batching) every batch waits that way, idle or not.

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

The queue itself (levels, buckets, admission, shedding) is
:mod:`inferd.serving.request_queue`; this module is the loop that fills batches from it
and runs them. Time comes from a :class:`~inferd.clock.Clock`, so tests move it by hand.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from inferd.clock import SYSTEM, Clock
from inferd.errors import InvalidInput, Overloaded
from inferd.observability.metrics import Histogram, Sketch
from inferd.priority import NAMED_PRIORITIES, named_levels
from inferd.replica_config import BatchingConfig
from inferd.serving.protocol import Columns
from inferd.serving.request_queue import (
    BatchStats,
    BatchTrace,
    Pending,
    RequestQueue,
    priority_name,
)

PredictFn = Callable[[Columns], Columns]
logger = logging.getLogger(__name__)

BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LOADED = 1.0
"""Adaptive batching waits for fuller batches (as window batching does) once computing
the arriving requests one by one would keep the replica busy this share of its time, all
of it (:meth:`DynamicBatcher.load`): there a queue forms, and batches save compute that
the requests wait for anyway; below it, nothing is gained by waiting. (At 0.5 a
scikit-learn pipeline at 1,000 requests/s already waited, p50 3.9 ms instead of 1.4.)"""
LONE_WINDOW = 15
"""Batches a lone request's cost is the median of (:meth:`DynamicBatcher._lone_cost`)."""
RATE_TAU_S = 0.25
"""The arrival rate's memory (seconds)."""
INLINE_WINDOW = 64
"""Batches computed inline while, of the last this many, at most ``INLINE_SLOW`` took
longer than ``inline_max_ms`` (with the XGBoost demo model at 64 rows per request,
inline batches served 1.6-1.9x the requests of threaded ones, side by side)."""
INLINE_REQUESTS = 4
"""Inline only for batches of at most this many requests (or pieces of one). While a
batch computes on the thread the loop reads the next requests' frames; under load with
one-row requests that is ~a batch's worth of requests, work that overlaps the compute
and that inline compute would serialise (XGBoost, one row per request, 64 connections:
``bench/tabular.py --compare`` fell from 1.00x to 0.96x with every light batch inline);
a batch of a few big requests leaves the loop little to overlap, and there the
hand-offs are what costs."""
INLINE_SLOW = 3
"""Slow batches tolerated in the window: on a busy machine the OS preempts a light
compute now and then (wall time), which says nothing of the model; a model that waits
on I/O or computes for long is slow every time."""


class DynamicBatcher:
    def __init__(
        self,
        predict: PredictFn,
        config: BatchingConfig,
        executor: Executor,
        clock: Clock = SYSTEM,
    ) -> None:
        self._predict = predict
        self._config = config
        self._executor = executor
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.stats = BatchStats()
        self.queue = RequestQueue(config, self.stats)
        self.batch_rows = Histogram(BATCH_ROWS_BUCKETS)
        """Rows of each computed batch (how full batches are)."""
        self.compute = Sketch()
        """Seconds each answered request's batch computed (a canary analysis compares it:
        unlike queue time, it does not depend on how much traffic a version gets)."""
        self.busy = False
        self.busy_since: float | None = None
        """When the batch computing now started (``Clock.monotonic``); None: none is."""
        self._computing: list[Pending] = []
        self._flush_due = False
        self._rate = 0.0
        self._rate_at = clock.monotonic()
        self._singles: deque[float] = deque(maxlen=LONE_WINDOW)
        self._batches: deque[float] = deque(maxlen=LONE_WINDOW)
        self._single_s = 0.0
        """What a lone request's batch takes to compute (seconds): :meth:`_lone_cost`."""
        named = named_levels(config)
        self._named = {code: named[name] for name, code in NAMED_PRIORITIES.items()}
        self._inline_max_s = config.inline_max_ms / 1000
        self._slow: deque[bool] = deque(maxlen=INLINE_WINDOW)
        """Whether each of the last batches took longer than ``inline_max_ms``."""

    @property
    def queued_rows(self) -> int:
        return self.queue.rows

    def shed_counts(self) -> dict[str, int]:
        """Requests refused or shed, by priority name."""
        return self.queue.shed_counts()

    def retry_after_s(self) -> int:
        """Seconds the queue takes to empty at the throughput measured so far (1 to 60)."""
        return self.queue.retry_after_s()

    def forget_counts(self) -> None:
        """Start the counters, sketches and arrival rate afresh (after the replica's
        warm-up, which is not traffic); what was learnt of compute times stays."""
        self.stats.reset()
        self.batch_rows = Histogram(BATCH_ROWS_BUCKETS)
        self.compute = Sketch()
        self._rate = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _flush(self) -> None:
        self._flush_due = True
        self._wakeup.set()

    def load(self) -> float:
        """The share of its time this replica would compute if every request went alone:
        the arrival rate (requests/s, weighted over the last ``RATE_TAU_S``) times what
        a batch of one or two rows takes."""
        elapsed = self._clock.monotonic() - self._rate_at
        return self._rate * math.exp(-elapsed / RATE_TAU_S) * self._single_s

    def _arrived(self, now: float) -> None:
        self._rate = self._rate * math.exp((self._rate_at - now) / RATE_TAU_S) + 1 / RATE_TAU_S
        self._rate_at = now

    def idle(self) -> bool:
        return not self.queue.levels and not self.busy

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
        queued = self.queue
        limit = queued.limits[level]
        if queued.rows + rows > limit and queued.levels and not queued.make_room(level, rows):
            self.stats.rejected += 1
            queued.count_shed(level)
            if limit < config.max_queue_rows:
                why = f"load shedding: priority {priority_name(config, level)} is refused"
                why += f" while {limit} or more rows are queued"
            else:
                why = "replica queue is full"
            raise Overloaded(
                why, queued.retry_after_s(), queued_rows=queued.rows, max_queue_rows=limit
            )
        future: asyncio.Future[Columns] = asyncio.get_running_loop().create_future()
        queue = queued.queue_of(level)
        now = self._clock.monotonic()
        self._arrived(now)
        deadline = now + timeout_s
        if rows > config.max_batch_size:
            self._split(queue, inputs, rows, now, deadline, future, level, trace, lengths)
        elif lengths is None:
            queue.append(Pending(inputs, rows, deadline, future, now, level, trace))
        else:
            length, tokens = int(lengths.max()), int(lengths.sum())
            queue.append(Pending(inputs, rows, deadline, future, now, level, trace,
                                 length, tokens, queued.bucket(length)))  # fmt: skip
        queued.rows += rows
        self._wakeup.set()
        return future

    def _split(
        self,
        queue: deque[Pending],
        inputs: Columns,
        rows: int,
        arrived: float,
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
            item = Pending(piece, end - start, deadline, part, arrived, level,
                           trace if start == 0 else None)  # fmt: skip
            if lengths is not None:
                item.length = int(lengths[end - 1])
                item.tokens = int(lengths[start:end].sum())
                item.bucket = self.queue.bucket(item.length)
            queue.append(item)
            parts.append(part)
        _join(future, parts, None if order is None else np.argsort(order))

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

    async def _collect(self) -> list[Pending]:
        queue = self.queue
        while not queue.levels:
            self._wakeup.clear()
            await self._wakeup.wait()
        config = self._config
        max_rows = config.max_batch_size
        if config.adaptive and self.load() < LOADED:  # what is queued goes now
            return queue.take(max_rows, self._clock.monotonic())
        remaining = queue.oldest_arrival() + config.max_wait_ms / 1000
        remaining -= self._clock.monotonic()
        if queue.rows < max_rows and remaining > 0:
            # One timer per batch (not per wake-up) ends the wait.
            timer = self._clock.call_later(remaining, self._flush)
            self._flush_due = False
            while queue.rows < max_rows and not self._flush_due:
                self._wakeup.clear()
                await self._wakeup.wait()
            timer.cancel()
        return queue.take(max_rows, self._clock.monotonic())

    async def _execute(self, loop: asyncio.AbstractEventLoop, batch: list[Pending]) -> None:
        self.busy_since = self._clock.monotonic()
        self._computing = batch
        try:
            await self._compute(loop, batch)
        finally:
            self.busy_since, self._computing = None, []

    def abandon(self, error: Exception) -> None:
        """Fail every request here, the batch computing and all that wait, with
        ``error`` (the replica is cut off: whatever its thread does now, nobody waits)."""
        waiting = [p for queue in self.queue.levels.values() for p in queue]
        for pending in [*self._computing, *waiting]:
            if not pending.future.done():
                pending.future.set_exception(error)

    async def _compute(self, loop: asyncio.AbstractEventLoop, batch: list[Pending]) -> None:
        if len(batch) == 1:
            inputs = batch[0].inputs
        else:
            names = batch[0].inputs.keys()
            inputs = {n: np.concatenate([p.inputs[n] for p in batch]) for n in names}
        rows = sum(p.rows for p in batch)
        started_ns = time.time_ns()
        started = time.perf_counter()
        began = self._clock.monotonic()
        error: Exception | None = None
        try:
            if len(batch) <= INLINE_REQUESTS and self.inline:
                outputs = await self._predict_inline(loop, inputs)
            else:
                outputs = await loop.run_in_executor(self._executor, self._predict, inputs)
            _check_rows(outputs, rows)
        except Exception as exc:
            error = exc
        elapsed = time.perf_counter() - started
        self._timed(elapsed)
        self._lone_cost(rows, self._clock.monotonic() - began)
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

    def _lone_cost(self, rows: int, took: float) -> None:
        """What computing a request alone takes, from the batch just computed: the median
        of the last ``LONE_WINDOW`` batches of one or two rows (a median, because a compute
        the OS preempted is no guide), but never more than the median of the last batches
        of any size: a batch costs at least what one of its rows would alone, so fuller
        batches that computed faster say the lone estimate is stale. Without that bound,
        the few lone batches of a closed loop at 64 connections (timed while the machine
        was busiest) kept :meth:`load` high once the load went down to what one-by-one
        compute would keep up with: batches kept waiting ``max_wait_ms``, so none was
        lone again to correct the guess, and the replica never left waiting mode."""
        self._batches.append(took)
        if rows <= 2:
            self._singles.append(took)
        lone = _median(self._batches)
        self._single_s = min(lone, _median(self._singles)) if self._singles else lone

    @property
    def inline(self) -> bool:
        """The next batch computes on the event loop: the last ``INLINE_WINDOW`` took
        ``inline_max_ms`` at most, all but ``INLINE_SLOW``."""
        return len(self._slow) == INLINE_WINDOW and sum(self._slow) <= INLINE_SLOW

    def _timed(self, elapsed: float) -> None:
        if self._inline_max_s > 0:
            self._slow.append(elapsed > self._inline_max_s)

    async def _predict_inline(self, loop: asyncio.AbstractEventLoop, inputs: Columns) -> Columns:
        """``predict_batch`` on the event loop; where it fails, again on the thread: a
        failure there too is the batch's own, a success means the model only works on
        the thread it was loaded on, and it stays there."""
        try:
            return self._predict(inputs)
        except Exception:
            outputs = await loop.run_in_executor(self._executor, self._predict, inputs)
        logger.warning("this model fails outside its compute thread: batches stay there")
        self._inline_max_s = 0.0
        self._slow.clear()
        return outputs

    async def _one_by_one(self, loop: asyncio.AbstractEventLoop, batch: list[Pending]) -> None:
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

    def _account(self, batch: list[Pending], rows: int, started_ns: int, elapsed: float) -> None:
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


def _median(values: deque[float]) -> float:
    return sorted(values)[len(values) // 2]


def _check_rows(outputs: Columns, rows: int) -> None:
    for name, array in outputs.items():
        if array.shape[:1] != (rows,):
            raise ValueError(
                f"model output {name!r} has shape {array.shape}; expected {rows} rows first"
            )
