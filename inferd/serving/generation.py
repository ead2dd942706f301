"""The replica core for generative models: the LLM engine on its own thread.

The engine is not thread-safe and its steps are long (a forward pass), so one engine
thread owns it: it takes commands (add, abort, adapter load/unload) from a queue
between steps, steps while there is work, and hands each step's token outputs to the
event loop in one ``call_soon_threadsafe``. When idle it blocks on the queue, costing
nothing. The event loop only moves frames.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.errors import (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
)
from inferd.errors import PromptTooLong as PromptTooLongError
from inferd.llm.chat import ChatTemplate
from inferd.llm.engine import EngineFull, LLMEngine, PromptOverLimit, PromptTooLong
from inferd.llm.metrics import GenerationMetrics
from inferd.serving.core import (
    SERVING,
    EngineLoad,
    Sink,
    TextCore,
    load_off_loop,
    mark_ready,
    rss_bytes,
)
from inferd.shapes.llm import SamplingParams, TokenOutput
from inferd.shapes.replica import ReplicaState, ReplicaStats
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None
    sink: Sink
    accepted: Future[None]
    arrived: float | None = None
    resume: list[int] | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AdapterOp:
    name: str
    path: str | None
    done: Future[dict[str, Any]]


def checked(
    core: TextCore, prompt: str | list[int] | dict[str, Any], params: SamplingParams
) -> tuple[str | list[int], SamplingParams]:
    """What both engines' cores do first with a generation: refuse it unless the replica
    serves, render a chat with the model's template (its sampling parameters were checked
    when they were made, in the gateway)."""
    if core.state not in SERVING:
        raise ModelNotReady(f"replica is {core.state}")
    if isinstance(prompt, dict):
        return core.chat.render(prompt["messages"], prompt.get("tools")), params
    return prompt, params


class StepTrace:
    """Each engine step's timing as JSON lines, for diagnosis: ``LLM_STEP_TRACE=FILE``
    (off by default; written every 64 steps). A line: when its commands were taken and
    the step began and ended (``time.perf_counter()``), the sequences and tokens it
    scheduled, whether a CUDA graph ran it, the outputs it made, the requests it holds
    and those waiting after it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("LLM_STEP_TRACE")
        return cls(Path(path)) if path else None

    def step(self, engine: LLMEngine, began: float, stepped: float, outputs: int) -> None:
        seqs, tokens, graph = engine.runner.last_step
        self.lines.append(
            f'{{"t0":{began:.6f},"t1":{stepped:.6f},"t2":{time.perf_counter():.6f},'
            f'"seqs":{seqs},"tokens":{tokens},"graph":{int(graph)},"out":{outputs},'
            f'"requests":{len(engine.requests)},"waiting":{len(engine.scheduler.waiting)}}}\n'
        )
        if len(self.lines) >= 64:
            with self.path.open("a") as f:
                f.writelines(self.lines)
            self.lines.clear()


class GenerationCore:
    def __init__(self, spec: ReplicaSpec, build: Callable[[ReplicaSpec], LLMEngine]) -> None:
        self.spec = spec
        self.state = ReplicaState.LOADING
        self.message = ""
        self.started = time.monotonic()
        self._build = build
        self.queue_timeout_s = spec.llm.queue_timeout_s
        self.engine: LLMEngine | None = None
        self.chat = ChatTemplate(None)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._parked: list[_Add] = []
        """Requests for an adapter that is not loaded while every slot is in use by
        running sequences: added after a step frees one (engine thread only)."""
        self._sinks: dict[str, Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    async def load(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine = await load_off_loop(self, self._load_and_warm_up)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        mark_ready(self)

    def _load_and_warm_up(self) -> LLMEngine:
        self.chat = ChatTemplate.load(Path(self.spec.artifact_dir))
        engine = self._build(self.spec)
        engine.add_request("warm-up", "Hello", SamplingParams(max_tokens=2, temperature=0))
        while engine.has_work():
            engine.step()
        engine.metrics = GenerationMetrics()  # the warm-up is not a request to report
        return engine

    # -- called on the event loop ------------------------------------------------------
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
        """Queue a generation; the future resolves once the engine accepted it."""
        prompt, sampling = checked(self, prompt, params)
        if not sampling.spaces_between_special_tokens:
            raise InvalidInput(
                "'spaces_between_special_tokens' false is not supported by inferd's engine "
                "(the GPT-2 family's one special token ends the text): drop it"
            )
        accepted: Future[None] = Future()
        self._sinks[request_id] = sink
        self._commands.put(
            _Add(request_id, prompt, sampling, adapter, sink, accepted, arrived, resume)
        )
        return accepted

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidInput(f"model {self.spec.model!r} generates text; use generate")

    def explain(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidInput(f"model {self.spec.model!r} generates text; it has no explanations")

    def cancel(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    def adapter(self, name: str, path: str | None) -> Future[dict[str, Any]]:
        done: Future[dict[str, Any]] = Future()
        self._commands.put(_AdapterOp(name, path, done))
        return done

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is None:
                continue
            if out.finish_reason == "queue_timeout":
                sink(Overloaded(f"no free sequence slot within the queue timeout "
                                f"({self.queue_timeout_s:g}s); retry later"))  # fmt: skip
            else:
                sink(out)

    # -- the engine thread ---------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        assert engine is not None and self._loop is not None
        trace = StepTrace.from_env()
        while not self._stopping:
            self._apply(self._commands.get())  # idle: sleep until a command comes
            while engine.has_work() and not self._stopping:
                began = time.perf_counter()
                while True:
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                stepped = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception:
                    logger.exception("engine step failed; failing its requests")
                    outputs = self._fail_all(engine)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
                if self._parked:
                    parked, self._parked = self._parked, []
                    for cmd in parked:
                        self._add(cmd)
                if trace is not None:
                    trace.step(engine, began, stepped, len(outputs))

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            assert self.engine is not None
            if not self.engine.abort(cmd.request_id):
                self._parked = [p for p in self._parked if p.request_id != cmd.request_id]
        elif isinstance(cmd, _AdapterOp):
            self._adapter(cmd)
        # None: close() woke the thread up to exit

    def _add(self, cmd: _Add) -> None:
        engine = self.engine
        assert engine is not None
        try:
            slot = engine.adapters.ensure(cmd.adapter)
            if slot is None:  # every slot runs sequences: after the next step
                self._parked.append(cmd)
                return
            engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, slot, cmd.arrived, cmd.adapter,
                cmd.resume,
            )  # fmt: skip
        except KeyError:
            self._refuse(cmd, ModelNotFound(f"adapter {cmd.adapter!r} is not loaded"))
        except EngineFull as exc:
            self._refuse(cmd, Overloaded(str(exc)))
        except (PromptOverLimit, PromptTooLong) as exc:
            self._refuse(cmd, PromptTooLongError(str(exc)))
        except ValueError as exc:
            self._refuse(cmd, InvalidInput(str(exc)))
        else:
            cmd.accepted.set_result(None)

    def _refuse(self, cmd: _Add, error: Exception) -> None:
        """The engine did not take the request: its sink goes (on the loop, which owns
        ``_sinks``), or the replica would count it in flight for ever and a drain would
        wait its whole grace period."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._sinks.pop, cmd.request_id, None)
        cmd.accepted.set_exception(error)

    def _adapter(self, cmd: _AdapterOp) -> None:
        engine = self.engine
        assert engine is not None
        try:
            if cmd.path is not None:
                cmd.done.set_result(engine.adapters.load(cmd.name, Path(cmd.path)))
            elif cmd.name in engine.adapters.known:
                engine.adapters.unload(cmd.name)
                cmd.done.set_result({"unloaded": cmd.name})
            else:
                raise ModelNotFound(f"adapter {cmd.name!r} is not loaded")
        except (FileNotFoundError, ValueError, KeyError) as exc:
            cmd.done.set_exception(InvalidInput(f"cannot load adapter {cmd.name!r}: {exc}"))
        except Exception as exc:
            cmd.done.set_exception(exc)

    def _fail_all(self, engine: LLMEngine) -> list[TokenOutput]:
        outputs = []
        for rid in list(engine.requests):
            engine.abort(rid, "error")
            outputs.append(TokenOutput(rid, "", None, True, "error", 0, 0))
        return outputs

    def stats(self) -> ReplicaStats:
        stats: dict[str, float] = {
            "uptime_s": time.monotonic() - self.started,
            "inflight": len(self._sinks),
        }
        if self.engine is not None:
            stats.update(self.engine.stats())
        stats["rss_bytes"] = rss_bytes()
        return ReplicaStats(**stats)

    def engine_load(self) -> EngineLoad | None:
        engine = self.engine
        if engine is None:
            return None
        # Read from the event loop while the engine thread steps: lengths and a counter,
        # each read whole, at most a step behind.
        s = engine.scheduler
        running = len(s.running)
        blocks = s.allocator.num_blocks
        kv_used = s.allocator.used_count / blocks if blocks else 0.0
        waiting = max(0, len(self._sinks) - running)
        return running, waiting, round(kv_used, 3), engine.adapters.loaded, engine.adapters.room

    def metrics(self) -> dict[str, Any]:
        """The engine's request histograms and counters (read from the event loop while
        the engine thread may be adding to them: a snapshot may be a step behind)."""
        return self.engine.metrics.snapshot() if self.engine is not None else {}

    def shadow_outcome(self, outputs: Any, message: Any) -> None:
        """Never called: gateways mirror predict requests only, and ``submit`` refuses
        them here before any outcome exists."""

    def idle(self) -> bool:
        return not self._sinks

    async def close(self) -> None:
        self._stopping = True
        self._commands.put(None)
