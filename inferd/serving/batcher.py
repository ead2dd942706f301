"""Dynamic batching: many concurrent requests, few ``predict_batch`` calls.

Callers ``await batcher.submit(inputs, rows)`` with one request's columnar inputs. A
single loop takes queued requests into a batch of at most ``max_batch_size`` rows,
concatenates them, runs one ``predict_batch``, and splits the outputs back by row
ranges. Every batch computes on the replica's compute thread
(:class:`~inferd.serving.compute.ComputeThread`), never on the event loop, however light
the model: in a shared process that loop serves every neighbour and their time budget,
so model code there would stall them all for as long as it runs (or hangs). The thread
path is kept cheap instead: a batch is posted to the thread, its outputs come back in
one callback on the loop, and that callback sends the next batch when one may go at
once (before it hands the outputs out), so consecutive batches do not wait for the
batching task to wake.

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
import functools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from inferd.clock import SYSTEM, Clock
from inferd.errors import InvalidInput, Overloaded
from inferd.priority import NAMED_PRIORITIES, named_levels
from inferd.replica_config import BatchingConfig
from inferd.serving.compute import ComputeThread, Delivery
from inferd.serving.request_queue import (
    BatchStats,
    BatchTrace,
    Pending,
    RequestQueue,
    priority_name,
)
from inferd.shapes.replica import Columns
from inferd.telemetry.metrics import Histogram, Sketch

PredictFn = Callable[[Columns], Columns]

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


class DynamicBatcher:
    def __init__(
        self,
        predict: PredictFn,
        config: BatchingConfig,
        thread: ComputeThread,
        clock: Clock = SYSTEM,
    ) -> None:
        """``thread``: where ``predict`` runs (the replica's compute thread)."""
        self._predict = predict
        self._config = config
        self._thread = thread
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
        self._chain: asyncio.Future[list[Pending]] | None = None
        """Resolved when the batches computing one after another end: with [] (nothing
        may go at once), or with a batch of many that failed (computed again alone)."""
        self._stopped = False
        self._flush_due = False
        self._rate = 0.0
        self._rate_at = clock.monotonic()
        self._singles: deque[float] = deque(maxlen=LONE_WINDOW)
        self._batches: deque[float] = deque(maxlen=LONE_WINDOW)
        self._single_s = 0.0
        """What a lone request's batch takes to compute (seconds): :meth:`_lone_cost`."""
        named = named_levels(config)
        self._named = {code: named[name] for name, code in NAMED_PRIORITIES.items()}

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
        """Stop batching; a batch still computing is left to its thread (its outputs,
        should they come, go nowhere)."""
        self._stopped = True
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
            self._chain = loop.create_future()
            try:
                self._start(loop, batch)
                failed = await self._chain
                if failed:  # one bad request must not fail the others it was batched with
                    await self._one_by_one(loop, failed)
            finally:
                self.busy, self._chain = False, None

    def _wait_s(self) -> float:
        """How long the queued requests wait yet before they go as a batch (0: now)."""
        config, queue = self._config, self.queue
        if config.adaptive and self.load() < LOADED:  # what is queued goes now
            return 0.0
        if queue.rows >= config.max_batch_size:
            return 0.0
        due = queue.oldest_arrival() + config.max_wait_ms / 1000
        return max(0.0, due - self._clock.monotonic())

    async def _collect(self) -> list[Pending]:
        queue = self.queue
        while not queue.levels:
            self._wakeup.clear()
            await self._wakeup.wait()
        max_rows = self._config.max_batch_size
        if (remaining := self._wait_s()) > 0:
            # One timer per batch (not per wake-up) ends the wait.
            timer = self._clock.call_later(remaining, self._flush)
            self._flush_due = False
            while queue.rows < max_rows and not self._flush_due:
                self._wakeup.clear()
                await self._wakeup.wait()
            timer.cancel()
        return queue.take(max_rows, self._clock.monotonic())

    def abandon(self, error: Exception) -> None:
        """Fail every request here, the batch computing and all that wait, with
        ``error`` (the replica is cut off: whatever its thread does now, nobody waits)."""
        waiting = [p for queue in self.queue.levels.values() for p in queue]
        for pending in [*self._computing, *waiting]:
            if not pending.future.done():
                pending.future.set_exception(error)

    def _start(self, loop: asyncio.AbstractEventLoop, batch: list[Pending]) -> None:
        """Post ``batch`` to the compute thread; :meth:`_computed` gets its outputs."""
        try:
            if len(batch) == 1:
                inputs = batch[0].inputs
            else:
                names = batch[0].inputs.keys()
                inputs = {n: np.concatenate([p.inputs[n] for p in batch]) for n in names}
        except Exception:  # requests whose columns do not stack: each goes alone
            self._end_chain(batch)
            return
        rows = sum(p.rows for p in batch)
        self.busy_since = began = self._clock.monotonic()
        self._computing = batch
        done = functools.partial(
            self._computed, loop, batch, rows, time.time_ns(), time.perf_counter(), began
        )
        self._post(loop, inputs, rows, done)

    def _computed(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[Pending],
        rows: int,
        started_ns: int,
        started: float,
        began: float,
        done: Computed | None,
        error: BaseException | None,
    ) -> None:
        """On the loop, once ``batch`` computed: the next batch goes first, when one may
        go at once (the thread computes it while these outputs go out), then the
        outputs are split over the batch's requests."""
        if self._stopped:
            return
        self.busy_since, self._computing = None, []
        if done is None:  # failed: timed from here, hand-offs included
            done = Computed({}, self._clock.monotonic() - began, time.perf_counter() - started)
        elapsed = done.seconds
        self._lone_cost(rows, done.took)
        self._account(batch, rows, started_ns, elapsed)
        if batch[0].length:
            self.stats.tokens += sum(p.tokens for p in batch)
            self.stats.padded_tokens += rows * max(p.length for p in batch)
        if error is not None and len(batch) > 1:
            self._end_chain(batch)
            return
        queue = self.queue
        following = []
        if queue.levels and self._wait_s() == 0:
            following = queue.take(self._config.max_batch_size, self._clock.monotonic())
        if following:
            self._start(loop, following)
        if error is not None:
            if not batch[0].future.done():
                batch[0].future.set_exception(error)
        else:
            self.compute.observe(elapsed, len(batch))
            self.batch_rows.observe(rows)
            start = 0
            for p in batch:
                end = start + p.rows
                if not p.future.done():
                    p.future.set_result({n: a[start:end] for n, a in done.outputs.items()})
                start = end
        if not following:
            self._end_chain([])

    def _end_chain(self, failed: list[Pending]) -> None:
        if not failed:  # idle from now, for a caller woken by the outputs just set
            self.busy = False
        if self._chain is not None and not self._chain.done():
            self._chain.set_result(failed)

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

    async def _one_by_one(self, loop: asyncio.AbstractEventLoop, batch: list[Pending]) -> None:
        """After a batch failed: each of its requests alone, so each gets its own answer
        (the failure is the bad ones' only). Costs nothing while batches succeed."""
        self._computing = batch  # what a cut-off fails
        try:
            for p in batch:
                if p.future.done():
                    continue
                started_ns, started = time.time_ns(), time.perf_counter()
                self.busy_since = self._clock.monotonic()
                done, error = await self._alone(loop, p.inputs, p.rows)
                self.busy_since = None
                seconds = time.perf_counter() - started if done is None else done.seconds
                self._account([p], p.rows, started_ns, seconds)
                if p.future.done():
                    continue
                if done is None:
                    p.future.set_exception(error or RuntimeError("no outputs"))
                else:
                    p.future.set_result(done.outputs)
        finally:
            self._computing = []

    def _alone(
        self, loop: asyncio.AbstractEventLoop, inputs: Columns, rows: int
    ) -> asyncio.Future[tuple[Computed | None, BaseException | None]]:
        """One request's compute on the thread: its outputs or its error."""
        future: asyncio.Future[tuple[Computed | None, BaseException | None]]
        future = loop.create_future()

        def deliver(done: Computed | None, error: BaseException | None) -> None:
            if not future.done():
                future.set_result((done, error))

        self._post(loop, inputs, rows, deliver)
        return future

    def _post(
        self, loop: asyncio.AbstractEventLoop, inputs: Columns, rows: int, deliver: Delivery
    ) -> None:
        compute = functools.partial(_compute, self._predict, self._clock, rows)
        self._thread.post(loop, compute, inputs, deliver)

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


@dataclass(slots=True)
class Computed:
    """A batch's outputs, and how long the model took: ``took`` on the batcher's clock
    (what :meth:`DynamicBatcher.load` counts), ``seconds`` of ``time.perf_counter``."""

    outputs: Columns
    took: float
    seconds: float


def _compute(predict: PredictFn, clock: Clock, rows: int, inputs: Columns) -> Computed:
    """On the compute thread: ``predict(inputs)``, timed there (the model's own time,
    without the hand-offs: on a busy machine those make a light model look loaded, and
    batches wait for companions that a few clients never send), and checked to hold
    ``rows`` rows in each output (the loop then only slices them)."""
    began, started = clock.monotonic(), time.perf_counter()
    outputs = predict(inputs)
    done = Computed(outputs, clock.monotonic() - began, time.perf_counter() - started)
    for name, array in outputs.items():
        if array.shape[:1] != (rows,):
            raise ValueError(
                f"model output {name!r} has shape {array.shape}; expected {rows} rows first"
            )
    return done
