"""The transport-agnostic inference handler shared by every API family.

REST (/api/v1), the Open Inference Protocol and later gRPC all decode their own wire
format into columnar numpy inputs, call :meth:`DataPlane.infer`, and encode the result.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import numpy as np

from inferd.errors import ModelError, ModelNotReady, Overloaded
from inferd.routing.cache import ResultCache, cache_key
from inferd.routing.router import Router, Shadow, Target
from inferd.serving import protocol as p
from inferd.serving.batcher import Columns

logger = logging.getLogger(__name__)


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


FALLBACK_ON = (ModelNotReady, Overloaded, ModelError)
"""Failures of a version that its fallback retries: no ready replica (or it went away),
a full queue, the model raised. Not bad input, and not timeouts (no time is left)."""


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

    def target(self, model: str, version: str | None, user: str | None = None) -> Target:
        """``version`` if pinned, else the model's traffic split decides (sticky per
        ``user`` when given)."""
        return self.router.target(model, version, user)

    async def infer(
        self,
        target: Target,
        inputs: dict[str, np.ndarray],
        rows: int,
        request_id: str = "",
        started: float | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        pinned: bool = False,
    ) -> InferOutcome:
        """Run one request; ``timeout_s`` (default the server's request timeout) bounds it
        from ``started``, ``priority`` is its level in the replica's queue (0: default).
        Unless the request ``pinned`` its version, a failure of a version split traffic
        chose is retried once on the serving version (the deployment's ``fallback``)."""
        started = time.perf_counter() if started is None else started
        timeout_s = timeout_s or self.request_timeout_s
        tensors = {name: p.to_tensor(array) for name, array in inputs.items()}
        key, ttl = None, 0.0
        if self.cache is not None:
            route = self.router.version_route(target.model, target.version)
            ttl = (
                self.cache_ttl_s
                if route is None or route.cache_ttl_s is None
                else route.cache_ttl_s
            )
            if ttl > 0:
                key = cache_key(target.model, target.version, tensors)
                cached = await self.cache.get(key)
                if cached is not None:
                    elapsed = (time.perf_counter() - started) * 1000
                    return InferOutcome(target, cached, elapsed, cache_hit=True)
        try:
            outputs = await self.router.infer(
                target, tensors, rows, timeout_s, request_id, priority
            )
        except FALLBACK_ON as exc:
            fallback = None if pinned else self.router.fallback_for(target)
            left = timeout_s - (time.perf_counter() - started)
            if fallback is None or left <= 0:
                raise
            logger.info(
                "%s:%s failed (%s); retrying on %s", target.model, target.version, exc.code,
                fallback.version,
            )  # fmt: skip
            outputs = await self.router.infer(fallback, tensors, rows, left, request_id, priority)
            elapsed = (time.perf_counter() - started) * 1000
            return InferOutcome(fallback, outputs, elapsed, fallback_from=target.version)
        if key is not None and self.cache is not None:  # a copy: not a view of a batch
            await self.cache.put(key, {n: np.array(a) for n, a in outputs.items()}, ttl)
        if not pinned and (shadow := self.router.shadow_of(target.model)) is not None:
            self._mirror(shadow, target, tensors, rows, outputs, timeout_s, request_id)
        elapsed = (time.perf_counter() - started) * 1000
        return InferOutcome(target, outputs, elapsed, cache_hit=False if key else None)

    def _mirror(
        self,
        shadow: Shadow,
        live: Target,
        tensors: dict[str, p.Tensor],
        rows: int,
        outputs: Columns,
        timeout_s: float,
        request_id: str,
    ) -> None:
        """Send a share of the requests to the shadow version with the live answer, in
        the background: the live reply never waits for it, and its outcome (latency,
        errors, agreement) is counted by the shadow's replicas."""
        if shadow.target.version == live.version or random.random() >= shadow.fraction:
            return
        if len(self._mirrored) >= MAX_SHADOW_INFLIGHT:
            self.shadow_skipped += 1
            return

        async def send() -> None:
            reference = {name: p.to_tensor(array) for name, array in outputs.items()}
            try:
                await self.router.infer(
                    shadow.target, tensors, rows, timeout_s, request_id, 0, reference,
                    shadow.tolerance,
                )  # fmt: skip
            except Exception as exc:  # the shadow's failure is the shadow's (its replicas count it)
                logger.debug("shadow %s:%s: %s", live.model, shadow.target.version, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._mirrored.add(task)
        task.add_done_callback(self._mirrored.discard)
