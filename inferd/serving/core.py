"""What a replica serves from: its core, and what every core shares.

A replica process holds one core: :class:`~inferd.serving.replica.ReplicaCore` (a
runtime behind the dynamic batcher) or, for a generative model, one of the two
:class:`TextCore` implementations — inferd's own engine
(:class:`~inferd.serving.generation.GenerationCore`) or vLLM's
(:class:`~inferd.serving.vllm_core.VLLMCore`). The replica's socket server
(:mod:`inferd.serving.replica_server`) and the in-process tests drive any of them
through :class:`Core`; a core answers the calls that are not its kind with
``InvalidInput`` (a predict on a generative model, a generation on a classifier).

The lifecycle helpers all cores use live here, so the cores import nothing from each
other and ``serving/`` has no import cycle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from inferd.process import freeze_heap
from inferd.shapes.replica import ReplicaState, ReplicaStats
from inferd.shapes.replica_spec import ReplicaSpec

if TYPE_CHECKING:
    from inferd.errors import InferdError
    from inferd.shapes.llm import SamplingParams, TokenOutput

logger = logging.getLogger(__name__)

Sink = Callable[["TokenOutput | InferdError"], None]
"""Receives a generation's token outputs, or the error that ended it before any token."""


EngineLoad = tuple[int, int, float, tuple[str, ...], int]
"""A generation engine's running and waiting sequences, the share of its KV cache in use,
the LoRA adapters it has loaded, and how many adapter slots a new one could take."""


SERVING = (ReplicaState.READY, ReplicaState.DRAINING)
"""The states in which a core answers requests (a draining one finishes what it has)."""


class Core(Protocol):
    """What the replica server calls on any core."""

    spec: ReplicaSpec
    state: ReplicaState
    """``loading``, ``ready``, ``draining`` or ``failed``."""
    message: str
    """Why, when ``failed``."""
    started: float
    """``time.monotonic()`` when the core was made."""

    async def load(self) -> None:
        """Load the model and warm it up, then mark the core ready (see :func:`mark_ready`);
        a failure marks it failed (see :func:`load_off_loop`) and raises."""

    def submit(
        self, inputs: Any, rows: int, timeout_s: float, priority: int = 0, trace: Any = None
    ) -> asyncio.Future[Any]:
        """A prediction: the future of its output columns."""

    def explain(self, inputs: Any, rows: int, timeout_s: float) -> asyncio.Future[Any]:
        """Attributions of a prediction: the future of its
        :class:`~inferd.runtimes.explain.Explanation`."""

    def generate(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        adapter: str | None,
        sink: Sink,
        arrived: float | None = None,
        resume: list[int] | None = None,
    ) -> Future[None]:
        """Start a generation whose outputs go to ``sink``; the future resolves once the
        engine accepted it (or fails with why it was refused). ``resume``: output tokens
        generated elsewhere before that replica was lost, to go on after."""

    def cancel(self, request_id: str) -> None:
        """Stop a generation (its client went away): free what it holds."""

    def adapter(self, name: str, path: str | None) -> Future[dict[str, Any]]:
        """Load (``path``) or unload (None) a LoRA adapter; the future: what is loaded."""

    def stats(self) -> ReplicaStats: ...

    def engine_load(self) -> EngineLoad | None:
        """A generation engine's state, cheap enough to read every few milliseconds;
        None for a core that has no engine (predict replicas)."""

    def metrics(self) -> dict[str, Any]: ...

    def shadow_outcome(self, outputs: Any, message: Any) -> None:
        """Count a mirrored request's outcome against the live version's answer."""

    def idle(self) -> bool:
        """Nothing queued or computing (a draining replica may exit)."""

    async def close(self) -> None: ...


class TextCore(Core, Protocol):
    """A text-generation core: both engines' cores implement it the same way."""

    queue_timeout_s: float
    """Longest a generation waits for the engine to admit it (``llm.queue_timeout_s``)."""
    chat: Any
    """The model's chat template (:class:`~inferd.llm.chat.ChatTemplate`)."""


T = TypeVar("T")


async def load_off_loop(core: Core, load: Callable[[], T], executor: Executor | None = None) -> T:
    """Run a core's load and warm-up in a thread; a failure marks the core failed."""
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, load)
    except Exception as exc:
        core.state, core.message = ReplicaState.FAILED, f"{type(exc).__name__}: {exc}"
        logger.exception("loading %s:%s failed", core.spec.model, core.spec.version)
        raise


def mark_ready(core: Core) -> None:
    if not core.spec.address.startswith("inproc:"):  # a process of its own
        freeze_heap()  # the model's objects too: a full collection must not walk them
    core.state = ReplicaState.READY
    spec = core.spec
    logger.info(
        "replica %s ready: %s:%s (%s) in %.2fs",
        spec.replica_id,
        spec.model,
        spec.version,
        spec.framework,
        time.monotonic() - core.started,
    )


def rss_bytes() -> int:
    """Resident memory of this process, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
