"""The transport-agnostic inference handler shared by every API family.

REST (/api/v1), the Open Inference Protocol (over REST and gRPC) and the graph runner
all find their target with :meth:`DataPlane.resolve`, decode their own wire format into
columnar numpy inputs, call :meth:`DataPlane.infer`, and encode the result.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from inferd.errors import ModelError, ModelNotFound, ModelNotReady, Overloaded, RequestTimeout
from inferd.graphs.runner import Graphs
from inferd.routing.cache import ResultCache, cache_key, fetches, version_ttl
from inferd.routing.holds import COLD_START
from inferd.routing.router import Router
from inferd.routing.targets import Shadow, Target
from inferd.shapes import replica as p
from inferd.shapes.graph import GRAPH_FRAMEWORK as GRAPH
from inferd.shapes.replica import Columns, InferRequest, ModelPolicy
from inferd.telemetry.log_rows import COUNTERS

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timing:
    """Where a predict spent its time, for ``Server-Timing`` and the inference log (ms)."""

    cache_ms: float = 0.0
    """Looking the answer up in the result cache (and storing it, after a miss)."""
    replica_ms: float = 0.0
    """The round trip to the replica that answered (0: the cache answered)."""
    queue_ms: float = 0.0
    """In the replica's queue, waiting for its batch to start."""
    compute_ms: float = 0.0
    """Its batch's compute."""
    batch_rows: int = 0
    """Rows in its batch."""

    @property
    def batch_ms(self) -> float:
        """The rest of the round trip: the frames to and from the replica, assembling
        and splitting the batch."""
        return max(0.0, self.replica_ms - self.queue_ms - self.compute_ms)


def _timing(answer: p.Answer, cache_ms: float = 0.0) -> Timing:
    return Timing(
        cache_ms, answer.replica_ms, answer.queue_ms, answer.compute_ms, answer.batch_rows
    )


@dataclass(frozen=True, slots=True)
class InferOutcome:
    target: Target
    """The version that answered (the fallback one, after a fallback)."""
    outputs: Columns
    latency_ms: float
    fallback_from: str | None = None
    """The version that failed first, when the serving version answered instead."""
    cache_hit: bool | None = None
    """True: answered from the result cache; False: computed and cached; None: the
    cache is off, or this version is not cached."""
    degraded_from: str | None = None
    """The model asked for, when it was saturated and its lightweight overflow model
    (``target.model``) answered instead."""
    cold_start_ms: float | None = None
    """How long the request waited for its version, scaled to zero, to start a replica
    and answer (None: it did not wait for one)."""
    timing: Timing | None = None


def to_tensors(columns: dict[str, np.ndarray]) -> dict[str, p.Tensor]:
    """Arrays by name as the frames to a replica carry them (bytes, not lists)."""
    return {name: p.to_tensor(array) for name, array in columns.items()}


def prediction_of(outcome: InferOutcome) -> str | None:
    """What a single-row answer predicted, as the inference log keeps it for accuracy
    feedback: its ``label`` (a class name when the signature has them), else its
    ``prediction``, else its first output, when that is one value; else None."""
    outputs = outcome.outputs
    array = outputs.get("label")
    if array is None:
        array = outputs.get("prediction")
    if array is None and outputs:
        array = next(iter(outputs.values()))
    if array is None or array.size != 1 or array.shape[:1] != (1,):
        return None
    value = array.reshape(-1)[0]
    labels = outcome.target.signature.labels
    if array is outputs.get("label") and labels is not None and array.dtype.kind in "iu":
        return labels[int(value)] if 0 <= int(value) < len(labels) else str(int(value))
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")[:256]
    if array.dtype.kind == "f":
        return repr(float(value))
    return str(value)[:256]


FALLBACK_ON = (ModelNotReady, Overloaded, ModelError)
"""Failures of a version that its fallback retries: no ready replica (or it went away),
a full queue, the model raised. Not bad input, and not timeouts (no time is left)."""
OVERFLOW_ON = (ModelNotReady,)
"""Failures that send a request to the model's lightweight overflow model: saturated
(queue full, shed: ``Overloaded``) or no ready replica. Not a model error: the overflow
model is for capacity, not for bugs."""


MAX_SHADOW_INFLIGHT = 64
"""Mirrored requests a gateway process keeps in flight; more are not mirrored (a slow
shadow must never hold memory or sockets the live traffic needs)."""


class DataPlane:
    def __init__(
        self,
        router: Router,
        request_timeout_s: float,
        cache: ResultCache | None = None,
        cache_ttl_s: float = 3600.0,
    ) -> None:
        self.router = router
        self.request_timeout_s = request_timeout_s
        self.cache = cache
        self.cache_ttl_s = cache_ttl_s
        self._mirrored: set[asyncio.Task[None]] = set()
        self.shadow_skipped = 0
        """Requests not mirrored because ``MAX_SHADOW_INFLIGHT`` were in flight."""
        self.overflowed = 0
        """Requests a saturated model's overflow model answered."""
        self.graphs = Graphs(self)
        """The inference graphs this gateway runs (a target whose framework is ``graph``)."""

    def target(self, model: str, version: str | None, user: str | None = None) -> Target:
        """``version`` if pinned, else the model's traffic split decides (sticky per
        ``user`` when given)."""
        return self.router.target(model, version, user)

    async def resolve(
        self,
        model: str,
        version: str | None,
        *,
        started: float,
        timeout_s: float | Callable[[], float | None] | None = None,
        user: str | None = None,
        policy: ModelPolicy | None = None,
    ) -> Target:
        """The version a request for ``model`` goes to, the way every transport and the
        graph runner find it: :meth:`target`; when the table has no such model or
        pinned version, waiting for it if it was just registered or deployed
        (:meth:`Holds.arriving <inferd.routing.holds.Holds.arriving>`) until ``started``
        + ``timeout_s`` (None: the server's request timeout; a callable: called only
        then, for a timeout read from a request that may be refused), else the 404;
        then, given a ``policy``, admitted (:meth:`ModelPolicy.admit
        <inferd.shapes.replica.ModelPolicy.admit>`: the 403 or 429)."""
        try:
            target = self.target(model, version, user)
        except ModelNotFound as missing:  # deployed a moment ago (else 404 at once)
            waited = timeout_s() if callable(timeout_s) else timeout_s
            until = started + (waited or self.request_timeout_s)
            target = await self.router.holds.arriving(model, version, until, missing)
        if policy is not None:
            await policy.admit(target, self.graphs)
        return target

    def request(
        self,
        request_id: str = "",
        started: float | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        pinned: bool = False,
        policy: ModelPolicy | None = None,
    ) -> InferRequest:
        """A request's :class:`InferRequest`: ``started`` defaults to now, ``timeout_s``
        (from ``started``) to the server's request timeout."""
        return InferRequest(
            request_id=request_id,
            started=time.perf_counter() if started is None else started,
            timeout_s=timeout_s or self.request_timeout_s,
            priority=priority,
            pinned=pinned,
            policy=policy,
        )

    async def infer(
        self, target: Target, inputs: dict[str, np.ndarray], rows: int, request: InferRequest
    ) -> InferOutcome:
        """Run one request within its deadline, at its priority. Unless the request
        ``pinned`` its version, a failure of a version split traffic chose is retried
        once on the serving version (the deployment's ``fallback``), and a saturated
        model sends it to its overflow model, when it has one."""
        if request.left_s() <= 0:
            raise RequestTimeout(
                f"the request's deadline ({request.timeout_s:g}s) passed before it ran"
            )
        if target.framework == GRAPH:  # no replica: its nodes come back through here
            try:
                return await self.graphs.run(target, inputs, rows, request)
            except FALLBACK_ON as exc:
                if request.pinned:
                    raise
                return await self._fall_back(exc, target, inputs, None, rows, request)
        tensors = to_tensors(inputs)
        key, ttl, cache_ms = None, 0.0, 0.0
        if self.cache is not None:
            route = self.router.version_route(target.model, target.version)
            ttl = version_ttl(route, self.cache_ttl_s)
            if ttl > 0 and not fetches(target.signature, tensors):
                looked = time.perf_counter()
                digest = "" if route is None else route.digest
                key = cache_key(target.model, f"{target.version}\0{digest}", tensors)
                cached = await self.cache.get(key)
                now = time.perf_counter()
                cache_ms = (now - looked) * 1000
                if cached is not None:
                    elapsed = (now - request.started) * 1000
                    timing = Timing(cache_ms)
                    return InferOutcome(target, cached, elapsed, cache_hit=True, timing=timing)
        COLD_START.set(None)
        try:
            answer = await self.router.infer(target, tensors, rows, request)
        except FALLBACK_ON as exc:
            if request.pinned:
                raise
            return await self._fall_back(exc, target, inputs, tensors, rows, request)
        outputs = answer.outputs
        cold = COLD_START.get()
        if key is not None and self.cache is not None:  # a copy: not a view of a batch
            storing = time.perf_counter()
            await self.cache.put(key, {n: np.array(a) for n, a in outputs.items()}, ttl)
            cache_ms += (time.perf_counter() - storing) * 1000
        if not request.pinned and (shadow := self.router.shadow_of(target.model)) is not None:
            self._mirror(shadow, target, tensors, rows, outputs, request)
        now = time.perf_counter()
        elapsed = (now - request.started) * 1000
        return InferOutcome(
            target,
            outputs,
            elapsed,
            cache_hit=False if key else None,
            cold_start_ms=None if cold is None else (now - cold) * 1000,
            timing=_timing(answer, cache_ms),
        )

    async def explain(
        self, target: Target, inputs: dict[str, np.ndarray], rows: int, request: InferRequest
    ) -> tuple[p.Explained, InferOutcome]:
        """Attributions of one request's predictions by ``target`` (never from the result
        cache, never mirrored or sent to a fallback: an explanation is of one version),
        and an outcome (no outputs) for the inference log."""
        if request.left_s() <= 0:
            raise RequestTimeout(
                f"the request's deadline ({request.timeout_s:g}s) passed before it ran"
            )
        tensors = to_tensors(inputs)
        COLD_START.set(None)
        sent = time.perf_counter()
        explained = await self.router.explain(target, tensors, rows, request)
        now = time.perf_counter()
        cold = COLD_START.get()
        timing = Timing(0.0, (now - sent) * 1000, 0.0, explained.compute_ms, rows)
        outcome = InferOutcome(
            target, {}, (now - request.started) * 1000,
            cold_start_ms=None if cold is None else (now - cold) * 1000, timing=timing,
        )  # fmt: skip
        return explained, outcome

    async def _fall_back(
        self,
        exc: Exception,
        target: Target,
        inputs: dict[str, np.ndarray],
        tensors: dict[str, p.Tensor] | None,
        rows: int,
        request: InferRequest,
    ) -> InferOutcome:
        """After ``target`` failed with ``exc``: its deployment's fallback (the serving
        version, an inference graph or not) answers; or, when the model is saturated,
        its overflow model; or the error stands."""
        fallback = self.router.fallback_for(target)
        if fallback is not None and request.left_s() > 0:
            logger.info(
                "%s:%s failed (%s); retrying on %s", target.model, target.version,
                getattr(exc, "code", exc), fallback.version,
            )  # fmt: skip
            try:
                if fallback.framework == GRAPH:
                    ran = await self.graphs.run(fallback, inputs, rows, request)
                    outputs, timing = ran.outputs, None
                else:
                    if tensors is None:
                        tensors = to_tensors(inputs)
                    answer = await self.router.infer(fallback, tensors, rows, request)
                    outputs, timing = answer.outputs, _timing(answer)
                elapsed = (time.perf_counter() - request.started) * 1000
            except OVERFLOW_ON as again:
                exc = again
            else:
                return InferOutcome(
                    fallback, outputs, elapsed, fallback_from=target.version, timing=timing
                )
        overflow = self.router.overflow_for(target) if isinstance(exc, OVERFLOW_ON) else None
        if overflow is None or request.left_s() <= 0:
            raise exc
        if tensors is None:
            tensors = to_tensors(inputs)
        self.overflowed += 1
        answer = await self.router.infer(overflow, tensors, rows, request)
        elapsed = (time.perf_counter() - request.started) * 1000
        return InferOutcome(
            overflow, answer.outputs, elapsed, degraded_from=target.model, timing=_timing(answer)
        )

    def _mirror(
        self,
        shadow: Shadow,
        live: Target,
        tensors: dict[str, p.Tensor],
        rows: int,
        outputs: Columns,
        request: InferRequest,
    ) -> None:
        """Send a share of the requests to the shadow version with the live answer, in
        the background: the live reply never waits for it, and its outcome (latency,
        errors, agreement) is counted by the shadow's replicas."""
        if shadow.target.version == live.version or random.random() >= shadow.fraction:
            return
        if len(self._mirrored) >= MAX_SHADOW_INFLIGHT:
            self.shadow_skipped += 1
            COUNTERS["shadow_skipped"] += 1
            return
        # The shadow gets the whole timeout again, at the default priority.
        mirrored = self.request(request.request_id, timeout_s=request.timeout_s, pinned=True)

        async def send() -> None:
            reference = to_tensors(outputs)
            try:
                await self.router.infer(
                    shadow.target, tensors, rows, mirrored, reference, shadow.tolerance
                )
            except Exception as exc:  # the shadow's failure is the shadow's (its replicas count it)
                logger.debug("shadow %s:%s: %s", live.model, shadow.target.version, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._mirrored.add(task)
        task.add_done_callback(self._mirrored.discard)
