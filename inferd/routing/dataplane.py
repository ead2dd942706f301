"""The transport-agnostic inference handler shared by every API family.

REST (/api/v1), the Open Inference Protocol and later gRPC all decode their own wire
format into columnar numpy inputs, call :meth:`DataPlane.infer`, and encode the result.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from inferd.errors import ModelError, ModelNotReady, Overloaded
from inferd.routing.router import Router, Target
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


FALLBACK_ON = (ModelNotReady, Overloaded, ModelError)
"""Failures of a version that its fallback retries: no ready replica (or it went away),
a full queue, the model raised. Not bad input, and not timeouts (no time is left)."""


class DataPlane:
    def __init__(self, router: Router, request_timeout_s: float) -> None:
        self.router = router
        self.request_timeout_s = request_timeout_s

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
        return InferOutcome(target, outputs, (time.perf_counter() - started) * 1000)
