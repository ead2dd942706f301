"""The transport-agnostic inference handler shared by every API family.

REST (/api/v1), the Open Inference Protocol and later gRPC all decode their own wire
format into columnar numpy inputs, call :meth:`DataPlane.infer`, and encode the result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from inferd.routing.router import Router, Target
from inferd.serving import protocol as p
from inferd.serving.batcher import Columns


@dataclass(frozen=True, slots=True)
class InferOutcome:
    target: Target
    outputs: Columns
    latency_ms: float


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
    ) -> InferOutcome:
        """Run one request; ``timeout_s`` (default the server's request timeout) bounds it
        from ``started``, ``priority`` is its level in the replica's queue (0: default)."""
        started = time.perf_counter() if started is None else started
        tensors = {name: p.to_tensor(array) for name, array in inputs.items()}
        outputs = await self.router.infer(
            target, tensors, rows, timeout_s or self.request_timeout_s, request_id, priority
        )
        return InferOutcome(target, outputs, (time.perf_counter() - started) * 1000)
