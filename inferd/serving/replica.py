"""The core of a replica serving a runtime (one OS process per model version; its
entry point and socket server are :mod:`inferd.serving.replica_server`).

Design rule: no call into the runtime runs on the event loop. Its load, signature,
warm-up rows, batches, a Python model's explanations and its unload run on the
replica's compute thread (:class:`~inferd.serving.compute.ComputeThread`); other
explanations on a thread of their own; ``prepare`` (tokenizing, decoding images) on the
preparing threads. The loop decodes frames, queues, and encodes answers.

Lifecycle: listen at once (state ``loading``, so the controller can watch), load the
runtime on the compute thread, warm it up through the batcher (``warmup_requests``
one-row requests, then a full batch, all before any request is routed here), then
``ready``. SIGTERM
switches to ``draining``: requests already routed here are still served, and the
process exits once nothing is queued or computing, or when the grace period ends.
The controller learns the state through ``StatusQuery``; readiness is "loaded and
warmed up", never just "process started".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from inferd.errors import (
    InferdError,
    InvalidInput,
    ModelError,
    ModelNotReady,
    Overloaded,
    RequestTimeout,
)
from inferd.replica_config import ExplainConfig
from inferd.runtimes import load_runtime
from inferd.runtimes.base import Runtime, RuntimeConfig
from inferd.runtimes.explain import Explanation, check_rows
from inferd.serving.batcher import BatchTrace, Columns, DynamicBatcher
from inferd.serving.compute import BusyMark, ComputeThread
from inferd.serving.core import SERVING, EngineLoad, load_off_loop, mark_ready, rss_bytes
from inferd.shapes.replica import (
    DriftCounts,
    DriftQuery,
    ReplicaState,
    ReplicaStats,
    from_tensor,
)
from inferd.shapes.replica_spec import ReplicaSpec
from inferd.shapes.tensors import Signature
from inferd.telemetry.drift import DriftCounter
from inferd.telemetry.metrics import REQUEST_BUCKETS_S, Histogram, Sketch

logger = logging.getLogger(__name__)

MAX_WARMUP_BATCH = 1024
"""Rows of the warm-up's full batch at most (``max_batch_size`` may be far larger)."""
WARMUP_TIMEOUT_S = 600.0
"""A warm-up request's deadline in the queue (the replica's start timeout bounds it)."""
UNLOAD_WAIT_S = 5.0
"""How long closing waits for the runtime's unload on its thread before going on."""


class ReplicaCore:
    """Runtime + batcher + state; the socket server and in-process tests both drive it."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.state = ReplicaState.LOADING
        self.message = ""
        self.runtime: Runtime | None = None
        self.signature: Signature | None = None
        mark = BusyMark(Path(spec.busy_file)) if spec.busy_file else None
        self._thread = ComputeThread("predict", mark)
        self._explainer: ThreadPoolExecutor | None = None
        self._preparer: ThreadPoolExecutor | None = None
        """Where ``prepare`` runs, for a runtime that prepares requests (its decoding
        threads for images, else one thread)."""
        self.batcher: DynamicBatcher | None = None
        self.started = time.monotonic()
        self.inflight = 0
        self.explaining = 0
        """Explanations computing or waiting their turn (bounded: explain.max_waiting)."""
        self.preparing = 0
        """Requests waiting for the preparing threads or prepared there now (bounded:
        images.max_queued)."""
        self._queue_timeout_s = math.inf
        """The version's cap on queue time (``batching.queue_timeout_ms``; inf: none)."""
        self._request_s = Histogram(REQUEST_BUCKETS_S)
        self._latency = Sketch()
        self._failed = 0
        self._shadow = {"compared": 0, "agreed": 0, "failed": 0}
        self._prepares = False
        """The runtime does per-request work before batching (tokenizing)."""
        self.load_s: float | None = None
        """Seconds from the core's start to its model loaded."""
        self.warmup_s: float | None = None
        """Seconds its warm-up took (None: none ran)."""
        self.warmup_requests = 0
        self.model_bytes = 0
        """What loading and warming the model up added to the process's memory."""
        self.drift: DriftCounter | None = None
        """Its inputs counted on the version's reference profile, once the server asks."""

    async def load(self) -> None:
        before = rss_bytes()
        if self.spec.shared_process:  # its own allocations, apart from its neighbours'
            tracemalloc.start()
        try:
            runtime, signature = await load_off_loop(self, self._load, self._thread)
        except BaseException:
            tracemalloc.stop()  # a no-op when not tracing
            raise
        self.runtime = runtime
        self.signature = signature
        self._prepares = type(runtime).prepare is not Runtime.prepare
        if self._prepares:
            threads = self.spec.images.decode_threads if runtime.prepares_off_loop else 1
            self._preparer = ThreadPoolExecutor(threads, thread_name_prefix="prepare")
        config = self.spec.batching
        if config.queue_timeout_ms is not None:
            self._queue_timeout_s = config.queue_timeout_ms / 1000
        predict = runtime.predict_batch
        if self.spec.metadata.get("allow_non_finite") is not True:
            predict = functools.partial(finite_outputs, predict)
        self.drift = DriftCounter(signature, dict(self.spec.metadata))
        if not self._prepares:  # a batch at a time; a text model's raw texts in _prepare
            predict = functools.partial(counted, self.drift, predict)
        elif self.drift.outputs:  # a text embedding model's embeddings
            predict = functools.partial(counted_outputs, self.drift, predict)
        self.batcher = DynamicBatcher(predict, config, self._thread)
        self.batcher.start()
        self.load_s = time.monotonic() - self.started
        await self._warm_up(runtime, self.batcher)
        self.model_bytes = self._own_bytes(before)
        mark_ready(self)

    def _own_bytes(self, rss_before: int) -> int:
        """What loading and warming the model up took: the process's growth, or, in a
        shared process, where freed neighbours' memory is reused without growing it, at
        least what the load allocated and kept (traced: Python objects and numpy arrays;
        a library's own C++ heap only shows in the growth)."""
        grown = max(0, rss_bytes() - rss_before)
        if not tracemalloc.is_tracing():
            return grown
        kept = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return max(grown, kept)

    def _load(self) -> tuple[Runtime, Signature]:
        """The runtime, loaded, and its signature (a user's class may compute it)."""
        declared = self.spec.signature
        config = RuntimeConfig(
            self.spec.threads, dict(self.spec.metadata), declared, self.spec.images,
            self.spec.explain,
        )  # fmt: skip
        runtime = load_runtime(self.spec.framework, Path(self.spec.artifact_dir), config)
        return runtime, runtime.signature

    async def _warm_up(self, runtime: Runtime, batcher: DynamicBatcher) -> None:
        """``batching.warmup_requests`` one-row requests one at a time, then a full
        batch, through the batcher as traffic goes (see the setting). A failure is
        logged, not fatal: generated rows may be ones the model refuses, and a version's
        own samples ran at its push."""
        count = self.spec.batching.warmup_requests
        if count == 0:
            return
        began = time.monotonic()
        sizes = [1] * count + [min(self.spec.batching.max_batch_size, MAX_WARMUP_BATCH)]
        first = 0
        try:
            for rows in sizes:
                inputs = await asyncio.get_running_loop().run_in_executor(
                    self._thread, runtime.warmup_inputs, rows, first
                )
                first += rows
                await self._queue(inputs, rows, WARMUP_TIMEOUT_S, 0, None)
        except Exception as exc:
            logger.warning(
                "warming %s:%s up failed (%s); serving it anyway",
                self.spec.model, self.spec.version, exc,
            )  # fmt: skip
        batcher.forget_counts()
        self.warmup_s = time.monotonic() - began
        self.warmup_requests = len(sizes)
        logger.info("warm-up: %d requests in %.3fs", len(sizes), self.warmup_s)

    def submit(
        self,
        inputs: Columns,
        rows: int,
        timeout_s: float,
        priority: int = 0,
        trace: BatchTrace | None = None,
    ) -> asyncio.Future[Columns]:
        if self.batcher is None or self.state not in SERVING:
            raise ModelNotReady(f"replica is {self.state}")
        self._check_inputs(inputs, rows)
        future = self._queue(inputs, rows, min(timeout_s, self._queue_timeout_s), priority, trace)
        self.inflight += 1
        future.add_done_callback(functools.partial(self._done, time.perf_counter()))
        return future

    def explain(self, inputs: Columns, rows: int, timeout_s: float) -> asyncio.Future[Explanation]:
        """Attributions of ``inputs``' predictions (``Runtime.explain``), computed off the
        batcher: on a thread of their own beside the batches, or on the model's thread
        between them where the runtime's model takes one thread at a time."""
        if self.runtime is None or self.state not in SERVING:
            raise ModelNotReady(f"replica is {self.state}")
        self._check_inputs(inputs, rows)
        limits = self.spec.explain
        check_rows(rows, limits)
        self._admit_explanation(limits)
        runtime = self.runtime
        executor: Executor = self._thread
        if runtime.explains_beside_batches:
            if self._explainer is None:
                self._explainer = ThreadPoolExecutor(1, thread_name_prefix="explain")
            executor = self._explainer
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(executor, runtime.explain, inputs, deadline)
        self.inflight += 1
        self.explaining += 1
        future.add_done_callback(self._explained)
        return future

    def _admit_explanation(self, limits: ExplainConfig) -> None:
        """Refuse an explanation (503, Retry-After) when ``explain.max_waiting`` wait
        already, or while predictions queue (their batch queue holds
        ``low_queue_share`` of ``max_queue_rows``): explanations are costly, and come
        after predictions."""
        assert self.batcher is not None
        config = self.spec.batching
        retry = self.batcher.retry_after_s()
        if self.explaining > limits.max_waiting:
            raise Overloaded(
                f"{self.explaining} explanations are in progress or waiting on this replica "
                f"(explain.max_waiting: {limits.max_waiting})",
                retry,
            )
        if self.batcher.queued_rows >= config.low_queue_share * config.max_queue_rows:
            raise Overloaded(
                f"predictions queue on this replica ({self.batcher.queued_rows} rows): "
                "explanations wait for them (batching.low_queue_share)",
                retry,
                queued_rows=self.batcher.queued_rows,
            )

    def _explained(self, future: asyncio.Future[Explanation]) -> None:
        self.inflight -= 1
        self.explaining -= 1

    def _queue(
        self, inputs: Columns, rows: int, timeout_s: float, priority: int, trace: BatchTrace | None
    ) -> asyncio.Future[Columns]:
        assert self.batcher is not None
        if self._prepares:  # tokenizing, decoding: a runtime's code, off the loop
            return asyncio.ensure_future(self._prepared(inputs, rows, timeout_s, priority, trace))
        return self.batcher.submit(inputs, rows, timeout_s, priority, trace)

    async def _prepared(
        self, inputs: Columns, rows: int, timeout_s: float, priority: int, trace: BatchTrace | None
    ) -> Columns:
        """A request prepared on the preparing threads, then batched: its failure is its
        own, and (images, ``Runtime.prepares_off_loop``) requests prepare in parallel."""
        assert self.batcher is not None
        began = time.monotonic()
        most = self.spec.images.max_queued
        if self.preparing >= most:
            raise Overloaded(
                f"{self.preparing} requests wait to be prepared (decoded) on this replica "
                f"(images.max_queued: {most})",
                self.batcher.retry_after_s(),
            )
        loop = asyncio.get_running_loop()
        self.preparing += 1
        try:
            inputs, lengths = await loop.run_in_executor(
                self._preparer, self._prepare, inputs, began + timeout_s
            )
        finally:
            self.preparing -= 1
        left = timeout_s - (time.monotonic() - began)
        if left <= 0:
            raise RequestTimeout(f"preparing the request took its {timeout_s:g}s")
        return await self.batcher.submit(inputs, rows, left, priority, trace, lengths)

    def _prepare(self, inputs: Columns, deadline: float) -> tuple[Columns, Any]:
        """A request prepared, unless its deadline passed while it waited its turn."""
        assert self.runtime is not None and self.drift is not None
        if time.monotonic() > deadline:
            raise RequestTimeout("the request's deadline passed before it was prepared")
        if not self.runtime.prepares_off_loop:
            self.drift.observe(inputs)  # the texts, before they become token ids
        return self.runtime.prepare(inputs)

    def _done(self, started: float, future: asyncio.Future[Columns]) -> None:
        self.inflight -= 1
        if future.cancelled():
            return
        if future.exception() is None:
            elapsed = time.perf_counter() - started
            self._request_s.observe(elapsed)
            self._latency.observe(elapsed)
        else:
            self._failed += 1

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidInput(f"model {self.spec.model!r} does not generate text; use predict")

    def cancel(self, request_id: str) -> None:
        pass

    def adapter(self, name: str, path: str | None) -> Any:
        raise InvalidInput(f"model {self.spec.model!r} takes no adapters")

    def _check_inputs(self, inputs: Columns, rows: int) -> None:
        assert self.signature is not None
        for spec in self.signature.inputs:
            array = inputs.get(spec.name)
            if array is None:
                raise InvalidInput(f"missing input {spec.name!r}")
            if array.shape[:1] != (rows,):
                raise InvalidInput(f"input {spec.name!r} has {array.shape[0]} rows, not {rows}")

    def stats(self) -> ReplicaStats:
        stats: dict[str, float] = {
            "inflight": self.inflight,
            "explaining": self.explaining,
            "preparing": self.preparing,
            "uptime_s": time.monotonic() - self.started,
        }
        if self.batcher is not None:
            stats.update(self.batcher.stats.as_dict())
            stats["queued_rows"] = self.batcher.queued_rows
        if self.load_s is not None:
            stats["load_s"] = round(self.load_s, 6)
        if self.warmup_s is not None:
            stats["warmup_s"] = round(self.warmup_s, 6)
            stats["warmup_requests"] = self.warmup_requests
        stats["rss_bytes"] = rss_bytes()
        if self.spec.shared_process:
            stats["model_bytes"] = self.model_bytes
        return ReplicaStats(**stats)

    def engine_load(self) -> EngineLoad | None:
        return None  # predict replicas are chosen by the gateways' outstanding requests

    def metrics(self) -> dict[str, Any]:
        """Histograms and counters for the status frame: the time answered requests spent
        here (queue + compute; Prometheus buckets, and a fine sketch), the time their
        batches computed (sketch), and how many failed (the model raised, or expired)."""
        metrics: dict[str, Any] = {
            "request_s": self._request_s.snapshot(),
            "latency_sketch": self._latency.snapshot(),
            "requests_failed": self._failed,
        }
        if self.batcher is not None:
            metrics["compute_sketch"] = self.batcher.compute.snapshot()
            metrics["shed"] = self.batcher.shed_counts()
            metrics["batch_rows"] = self.batcher.batch_rows.snapshot()
        if any(self._shadow.values()):
            metrics["shadow"] = dict(self._shadow)
        return metrics

    def shadow_outcome(self, outputs: Columns | None, message: Any) -> None:
        """Count a mirrored request: it failed here (``outputs`` None), or its answer
        agreed with the live version's (``message.reference``), or not."""
        if outputs is None:
            self._shadow["failed"] += 1
            return
        self._shadow["compared"] += 1
        if agrees(outputs, message.reference, message.tolerance):
            self._shadow["agreed"] += 1

    def drift_counts(self, query: DriftQuery) -> DriftCounts:
        """Its input counts for the server (the first query starts the counting)."""
        if self.drift is None:
            raise ModelNotReady(f"replica is {self.state}")
        self.drift.configure(
            query.reference, query.reference_rows, query.max_categories, query.max_rows_per_s
        )
        return DriftCounts(query.id, **self.drift.report())

    def idle(self) -> bool:
        return self.inflight == 0 and (self.batcher is None or self.batcher.idle())

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        if self.runtime is not None:
            await self._unload(self.runtime)
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self._thread.mark is not None:
            self._thread.mark.remove()
        for pool in (self._explainer, self._preparer):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def _unload(self, runtime: Runtime) -> None:
        """``runtime.unload()`` on its thread, for at most ``UNLOAD_WAIT_S``; none while
        a batch is left computing there (cut off: the model is still in use, and the
        thread may never be free again)."""
        if self.batcher is not None and self.batcher.busy_since is not None:
            logger.warning("%s:%s not unloaded: a batch still computes", *self._named())
            return
        unloading = asyncio.get_running_loop().run_in_executor(self._thread, runtime.unload)
        try:
            async with asyncio.timeout(UNLOAD_WAIT_S):
                await asyncio.shield(unloading)
        except TimeoutError:
            logger.warning("%s:%s: unload still runs after %gs", *self._named(), UNLOAD_WAIT_S)
        except Exception:
            logger.exception("unloading %s:%s failed", *self._named())

    def _named(self) -> tuple[str, str]:
        return self.spec.model, self.spec.version


def agrees(outputs: Columns, reference: dict[str, Any], tolerance: float) -> bool:
    """The same outputs as ``reference`` (protocol tensors): same names and shapes, numbers
    within ``tolerance`` (absolute, plus relative to the reference), the rest equal."""
    if set(outputs) != set(reference):
        return False
    for name, mine in outputs.items():
        theirs = from_tensor(reference[name])
        if mine.shape != theirs.shape:
            return False
        if mine.dtype.kind in "fc" or theirs.dtype.kind in "fc":
            try:
                same = np.allclose(mine, theirs, rtol=tolerance, atol=tolerance, equal_nan=True)
            except TypeError:
                return False
        else:
            same = np.array_equal(mine, theirs)
        if not same:
            return False
    return True


def counted(drift: DriftCounter, predict: Callable[[Columns], Columns], inputs: Columns) -> Columns:
    """``predict(inputs)``, its inputs then counted for drift: only a batch that computed
    (a failed one is computed again request by request, each counted once then)."""
    outputs = predict(inputs)
    drift.observe(inputs)
    drift.observe_outputs(outputs)
    return outputs


def counted_outputs(
    drift: DriftCounter, predict: Callable[[Columns], Columns], inputs: Columns
) -> Columns:
    """``predict(inputs)``, its outputs then counted for drift (a model whose inputs are
    counted before they are prepared: :meth:`DriftCounter.observe_outputs`)."""
    outputs = predict(inputs)
    drift.observe_outputs(outputs)
    return outputs


def finite_outputs(predict: Callable[[Columns], Columns], inputs: Columns) -> Columns:
    """``predict(inputs)``, refused with :class:`ModelError` when a float output holds NaN
    or ±Infinity: a client must never get them as an answer (JSON writes them as null),
    unless the version's metadata says ``allow_non_finite: true``. A batch refused so is
    computed again request by request (the batcher's rule), so only the requests whose
    rows came out non-finite fail."""
    outputs = predict(inputs)
    for name, array in outputs.items():
        if array.dtype.kind != "f":
            continue
        finite = np.isfinite(array)
        if finite.all():
            continue
        index = int(np.flatnonzero(~finite.reshape(-1))[0])
        value = array.reshape(-1)[index]
        literal = "NaN" if np.isnan(value) else "Infinity" if value > 0 else "-Infinity"
        row = index // (array.size // len(array)) if array.ndim and array.size else 0
        raise ModelError(
            f"the model returned {literal} in output {name!r} (row {row}); it must return "
            "finite numbers (or its version sets metadata allow_non_finite: true)"
        )
    return outputs


def error_status(exc: BaseException) -> tuple[str, str, int, int]:
    """The fields of a protocol ``Error`` for ``exc``: code, message, status, retry-after."""
    if isinstance(exc, ModelNotReady):
        return exc.code, exc.message, exc.status_code, exc.retry_after_s
    if isinstance(exc, InferdError):
        return exc.code, exc.message, exc.status_code, 0
    return "model_error", f"{type(exc).__name__}: {exc}", 500, 0
