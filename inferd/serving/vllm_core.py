"""The replica core of a version served by vLLM: vLLM's async engine in this process.

It answers the replica protocol exactly as :class:`~inferd.serving.generation.GenerationCore`
does (``generate`` with a sink of :class:`~inferd.shapes.llm.TokenOutput`, ``cancel``,
``adapter``, ``stats``, ``metrics``), so every API inferd has — v1 generate, V2
generate and gRPC streams, OpenAI completions and chat — drives vLLM unchanged, with
inferd's routing, auth, limits, cache, logs and metrics around it.

- **Requests**: each is one task iterating ``AsyncLLM.generate`` with delta outputs;
  cancelling the task (the client went away) aborts the request in vLLM. inferd's
  sampling fields map onto vLLM's (``priority`` onto its priority scheduler, ``guide``
  onto its structured outputs, ``logprobs`` onto the sampled token's logprob).
- **Chat**: rendered here with the model's template (:mod:`inferd.llm.chat`), the same
  rendering inferd's own engine uses, and sent as text without added special tokens.
- **Admission**: vLLM queues without bound; here at most ``llm.max_waiting`` requests
  wait for their first token (more get 503) and one that waits longer than
  ``llm.queue_timeout_s`` leaves with 503, as with inferd's engine.
- **Adapters**: LoRA adapters registered with the version load at start; inferd's
  adapter API loads and unloads more at run time (vLLM ``LoRARequest``s).
- **Metrics**: TTFT, ITL, end-to-end, token counts and finish reasons are measured on
  the stream from the gateway's arrival time (as for inferd's engine); queue time,
  KV-cache use, prefix-cache hits and running/waiting counts come from vLLM's own stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec

from inferd.errors import InferdError, InvalidInput, ModelNotFound, Overloaded
from inferd.errors import PromptTooLong as PromptTooLongError
from inferd.llm.chat import ChatTemplate
from inferd.llm.metrics import GenerationMetrics
from inferd.serving.core import EngineLoad, Sink, load_off_loop, mark_ready, rss_bytes
from inferd.serving.generation import checked
from inferd.serving.vllm_plugin import RESUMED_DRAWS
from inferd.shapes.llm import SamplingParams, TokenOutput
from inferd.shapes.replica import ReplicaState, ReplicaStats
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)
CPU_KV_MIN_GIB = 1


def engine_args(spec: ReplicaSpec) -> dict[str, Any]:
    """vLLM engine arguments for a replica: its folder and ``llm`` settings (the
    version's ``speculative``, else ``llm.speculative``, as ``speculative_config``),
    then the settings' and the version's ``vllm_args``."""
    llm = spec.llm
    args: dict[str, Any] = {
        "model": spec.artifact_dir,
        "tokenizer": spec.artifact_dir,
        "served_model_name": spec.model,
        # float32, bfloat16, float16: vLLM's names too; auto: float32 on a CPU (as
        # inferd's engine), vLLM's own choice on a GPU
        "dtype": "float32" if llm.dtype == "auto" and not spec.gpus else llm.dtype,
        "max_num_seqs": llm.max_num_seqs,
        "scheduling_policy": "priority",
        "enable_prefix_caching": llm.prefix_caching,
        "disable_log_stats": False,
        "enforce_eager": True,
        "seed": 0,
        # compact JSON: a grammar that allows any whitespace lets a model pad with it up
        # to max_tokens (seen: a random-weight model wrote 60 spaces after "{")
        "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
    }
    if spec.adapters or spec.metadata.get("lora"):
        args.update(enable_lora=True, max_loras=max(1, llm.max_adapters),
                    max_lora_rank=llm.max_lora_rank)  # fmt: skip
    speculative = spec.metadata.get("speculative") or llm.speculative
    if speculative:
        args["speculative_config"] = speculative
    args.update(llm.vllm_args)
    args.update(spec.metadata.get("vllm_args") or {})
    return args


def engine_env(spec: ReplicaSpec) -> dict[str, str]:
    """Environment a vLLM replica needs set before vLLM is imported: on a CPU, its
    KV-cache size (``llm.kv_cache_mb``, at least 1 GiB: vLLM's unit) and the cores its
    OpenMP threads bind to (all of them; vLLM would otherwise keep one for itself)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(CPU_KV_MIN_GIB, -(-spec.llm.kv_cache_mb // 1024)))}
    cores = sorted(os.sched_getaffinity(0))
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}" if cores else "all"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["VLLM_DO_NOT_TRACK"] = "1"
    return env


class VLLMCore:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.state = ReplicaState.LOADING
        self.message = ""
        self.started = time.monotonic()
        self.queue_timeout_s = spec.llm.queue_timeout_s
        self.engine: Any = None
        self.chat = ChatTemplate(None)
        self.metrics_ = GenerationMetrics()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pending = 0  # requests waiting for their first token
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest
        self._recent: OrderedDict[str, None] = OrderedDict()
        """The adapters last used, at most ``max_adapters`` (what vLLM's cache holds)."""
        self._running_adapters: dict[str, str] = {}  # request id -> adapter
        self._next_adapter_id = 1
        self._stats: dict[str, float] = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
        self._prefix = [0, 0]  # queried, hit tokens
        self._spec = [0, 0]  # speculative decoding: draft, accepted tokens
        self._busy_s = 0.0
        self._busy_mark = time.monotonic()
        self._client_error: type[Exception] = ValueError
        """vLLM's errors caused by the request (set at load): answered as 4xx."""

    async def load(self) -> None:
        self.engine = await load_off_loop(self, self._build)
        for at, (name, relative) in enumerate(self.spec.adapters.items()):
            # vLLM keeps max_adapters loaded and loads the rest from their folders on demand
            path = str(Path(self.spec.artifact_dir) / relative)
            await self._load_adapter(name, path, now=at < self.spec.llm.max_adapters)
        await self._warm_up()
        mark_ready(self)

    def _build(self) -> Any:
        for key, value in engine_env(self.spec).items():
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.async_llm import AsyncLLM

        self._client_error = VLLMClientError

        self.chat = ChatTemplate.load(Path(self.spec.artifact_dir))
        args = AsyncEngineArgs(**engine_args(self.spec))
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger()])

    async def _warm_up(self) -> None:
        from vllm import SamplingParams as VSampling

        params = VSampling(max_tokens=2, temperature=0)
        async for _ in self.engine.generate("Hello", params, "warm-up"):
            pass
        self.metrics_ = GenerationMetrics()

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
        prompt, sampling = checked(self, prompt, params)
        resumed = 0
        if resume:
            prompt, sampling = self._resumed(prompt, sampling, resume)
            resumed = len(resume)
        if adapter is not None and adapter not in self._adapters:
            raise ModelNotFound(f"adapter {adapter!r} is not loaded")
        if self._pending >= self.spec.llm.max_waiting:
            raise Overloaded(f"{self._pending} requests are waiting in this replica "
                             f"(llm.max_waiting); retry later")  # fmt: skip
        accepted: Future[None] = Future()
        task = asyncio.get_running_loop().create_task(
            self._run(request_id, prompt, sampling, adapter, sink, accepted,
                      arrived if arrived is not None else time.monotonic(), resumed)
        )  # fmt: skip
        self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._done(request_id))
        return accepted

    def _resumed(
        self, prompt: str | list[int], sampling: SamplingParams, resume: list[int]
    ) -> tuple[list[int], SamplingParams]:
        """A generation to go on after ``resume`` (the tokens another replica generated
        before it was lost): vLLM takes them as the end of the prompt and generates the
        rest. Greedy output goes on exactly, and so does a seeded one (its generator
        draws past the resumed tokens' draws first: :mod:`inferd.serving.vllm_plugin`);
        an unseeded one draws afresh, and output-only penalties (presence, frequency) do
        not count the resumed tokens. Its text is the new tokens' only (``replayed`` 0; the
        plugin's :func:`~inferd.serving.vllm_plugin.prime` sees to it where the resumed
        tokens end inside a character)."""
        if len(resume) >= sampling.max_tokens:
            raise InvalidInput("the tokens to resume from end the generation")
        if isinstance(prompt, str):
            tokenizer = self.engine.get_tokenizer()
            ids = tokenizer.encode(prompt, add_special_tokens=not self.chat.templated)
        else:
            ids = list(prompt)
        rest = msgspec.structs.replace(
            sampling,
            max_tokens=sampling.max_tokens - len(resume),
            min_tokens=max(0, sampling.min_tokens - len(resume)),
        )
        return [*ids, *resume], rest

    def _done(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        self._running_adapters.pop(request_id, None)

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidInput(f"model {self.spec.model!r} generates text; use generate")

    def explain(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidInput(f"model {self.spec.model!r} generates text; it has no explanations")

    def cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def adapter(self, name: str, path: str | None) -> Future[dict[str, Any]]:
        done: Future[dict[str, Any]] = Future()

        async def apply() -> None:
            try:
                if path is not None:
                    done.set_result(await self._load_adapter(name, path))
                elif name in self._adapters:
                    request = self._adapters.pop(name)
                    await self.engine.remove_lora(request.lora_int_id)
                    done.set_result({"unloaded": name})
                else:
                    raise ModelNotFound(f"adapter {name!r} is not loaded")
            except InferdError as exc:
                done.set_exception(exc)
            except Exception as exc:
                done.set_exception(InvalidInput(f"cannot load adapter {name!r}: {exc}"))

        asyncio.get_running_loop().create_task(apply())
        return done

    async def _load_adapter(self, name: str, path: str, now: bool = True) -> dict[str, Any]:
        """Register adapter ``name`` (a ``LoRARequest`` with its folder: vLLM loads it
        on demand, least recently used out) and, ``now``, load it at once."""
        from vllm.lora.request import LoRARequest

        if not (Path(path) / "adapter_config.json").is_file():
            raise InvalidInput(f"cannot load adapter {name!r}: no adapter_config.json in {path}")
        previous = self._adapters.get(name)
        request = LoRARequest(name, self._next_adapter_id, path)
        self._next_adapter_id += 1
        if now and not await self.engine.add_lora(request):
            raise InvalidInput(f"vLLM did not load adapter {name!r} from {path}")
        self._adapters[name] = request
        if now:
            self._touch(name)
        if previous is not None:
            await self.engine.remove_lora(previous.lora_int_id)
        return {"loaded": name, "path": path}

    def _sampling(self, params: SamplingParams, resumed: int = 0) -> Any:
        """vLLM's sampling parameters for ``params``; ``resumed``: tokens another replica
        sampled before this request (a seeded one's generator draws past them:
        :mod:`inferd.serving.vllm_plugin`)."""
        from vllm import SamplingParams as VSampling
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if params.guide is not None:
            guide = params.guide
            structured = (
                StructuredOutputsParams(json_object=True)
                if guide.get("json_object")
                else StructuredOutputsParams(json=guide["json"])
            )
        return VSampling(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            min_p=params.min_p,
            min_tokens=params.min_tokens,
            stop_token_ids=list(params.stop_token_ids) or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            logprobs=0 if params.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured,
            extra_args=(
                {RESUMED_DRAWS: resumed}
                if resumed and params.seed is not None and params.temperature > 0
                else None
            ),
        )

    async def _run(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None,
        sink: Sink,
        accepted: Future[None],
        arrived: float,
        resumed: int = 0,
    ) -> None:
        if isinstance(prompt, str):
            engine_prompt: Any = prompt
            tokenization = {"add_special_tokens": not self.chat.templated}
        else:
            engine_prompt, tokenization = {"prompt_token_ids": list(prompt)}, None
        self.metrics_.requests_by_adapter.inc(adapter or "")
        if adapter is not None:
            self._touch(adapter)
            self._running_adapters[request_id] = adapter
        try:
            sampling = self._sampling(params, resumed)
        except ValueError as exc:
            accepted.set_exception(InvalidInput(str(exc)))
            return
        stream = self.engine.generate(
            engine_prompt, sampling, request_id, tokenization_kwargs=tokenization,
            lora_request=self._adapters.get(adapter) if adapter is not None else None,
            priority=params.priority,
        )  # fmt: skip
        try:
            first = await self._admit(stream, accepted)
            if first is not None:
                await self._stream(request_id, first, stream, sink, arrived, resumed)
        except asyncio.CancelledError:
            self.metrics_.finished.inc("abort")
            raise
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _admit(self, stream: Any, accepted: Future[None]) -> Any:
        """The first output, once vLLM took the request (``accepted`` then resolves);
        None when it did not: its checks refused it (400), or it waited longer than the
        queue timeout (503), and ``accepted`` holds why."""
        self._pending += 1
        try:
            first = await asyncio.wait_for(anext(stream), self.queue_timeout_s)
        except TimeoutError:
            accepted.set_exception(Overloaded(
                f"no free sequence slot within the queue timeout "
                f"({self.queue_timeout_s:g}s); retry later"))  # fmt: skip
            self.metrics_.finished.inc("queue_timeout")
            return None
        except (ValueError, self._client_error) as exc:  # vLLM's input checks
            accepted.set_exception(_refusal(str(exc)))
            return None
        except Exception as exc:
            logger.exception("vLLM could not start a request")
            accepted.set_exception(exc)
            return None
        finally:
            self._pending -= 1
        accepted.set_result(None)
        return first

    async def _stream(
        self, request_id: str, output: Any, stream: Any, sink: Sink, arrived: float,
        resumed: int = 0,
    ) -> None:  # fmt: skip
        """``resumed``: output tokens generated elsewhere, at the end of its prompt."""
        metrics = self.metrics_
        completion, last = resumed, arrived
        while True:
            now = time.monotonic()
            piece = output.outputs[0]
            new = len(piece.token_ids)
            if new:
                if completion == resumed:
                    metrics.ttft_s.observe(now - arrived)
                    metrics.ttft_sketch.observe(now - arrived)
                else:
                    metrics.itl_s.observe((now - last) / new)
                completion += new
                last = now
            logprobs = None
            if piece.logprobs:
                pairs = zip(piece.logprobs, piece.token_ids, strict=True)
                logprobs = [float(step[token].logprob) for step, token in pairs]
            reason = piece.finish_reason if output.finished else None
            prompt_tokens = len(output.prompt_token_ids or ()) - resumed
            # vLLM hands a slow reader several steps' tokens at once: all of their ids
            sink(TokenOutput(
                request_id, piece.text, piece.token_ids[-1] if new else None,
                output.finished, reason, prompt_tokens, completion,
                logprobs[-1] if logprobs else None, output.num_cached_tokens or 0,
                token_ids=list(piece.token_ids) if new > 1 else None,
                logprobs=logprobs if new > 1 else None,
            ))  # fmt: skip
            if output.finished:
                metrics.finished.inc(reason or "stop")
                metrics.prompt_tokens.observe(prompt_tokens)
                metrics.generation_tokens.observe(completion)
                metrics.e2e_s.observe(now - arrived)
                return
            try:
                output = await anext(stream)
            except Exception:
                logger.exception("vLLM request %s failed", request_id)
                metrics.finished.inc("error")
                sink(TokenOutput(request_id, "", None, True, "error", prompt_tokens, completion))
                return

    # -- vLLM's stats ---------------------------------------------------------------
    def _stat_logger(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        core = self

        class InferdStats(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:  # fmt: skip
                core._record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return InferdStats

    def _record(self, scheduler: Any, iteration: Any) -> None:
        now = time.monotonic()
        # the time since the last record, weighted by how full the engine was in it
        occupancy = self._stats["running"] / max(1, self.spec.llm.max_num_seqs)
        self._busy_s += (now - self._busy_mark) * occupancy
        self._busy_mark = now
        if scheduler is not None:
            self._stats["running"] = scheduler.num_running_reqs
            self._stats["waiting"] = scheduler.num_waiting_reqs
            self._stats["kv_cache_usage"] = float(scheduler.kv_cache_usage)
            prefix = scheduler.prefix_cache_stats
            if prefix is not None:
                self._prefix[0] += prefix.queries
                self._prefix[1] += prefix.hits
            spec = getattr(scheduler, "spec_decoding_stats", None)  # with speculative_config
            if spec is not None:
                self._spec[0] += spec.num_draft_tokens
                self._spec[1] += spec.num_accepted_tokens
        if iteration is not None:
            for done in iteration.finished_requests:
                self.metrics_.queue_time_s.observe(done.queued_time)

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            uptime_s=time.monotonic() - self.started,
            inflight=len(self._tasks),
            busy_s=round(self._busy_s, 6),
            running=self._stats["running"],
            waiting=self._stats["waiting"] + self._pending,
            kv_cache_usage=self._stats["kv_cache_usage"],
            prefix_cache_queries=self._prefix[0],
            prefix_cache_hits=self._prefix[1],
            spec_draft_tokens=self._spec[0],
            spec_accepted_tokens=self._spec[1],
            rss_bytes=rss_bytes(),
        )

    def _touch(self, adapter: str) -> None:
        self._recent[adapter] = None
        self._recent.move_to_end(adapter)
        while len(self._recent) > max(1, self.spec.llm.max_adapters):
            self._recent.popitem(last=False)

    def engine_load(self) -> EngineLoad | None:
        """vLLM's last step's counts (its stat logger), or the requests this replica
        holds beyond those running where vLLM has not counted them yet; the adapters
        last used (vLLM's cache of them) and the slots no running request's adapter
        takes."""
        running = int(self._stats["running"])
        waiting = max(int(self._stats["waiting"]), len(self._tasks) - running, 0)
        live = {a for rid, a in self._running_adapters.items() if rid in self._tasks}
        room = max(0, self.spec.llm.max_adapters - len(live))
        kv_used = round(float(self._stats["kv_cache_usage"]), 3)
        return running, waiting, kv_used, tuple(self._recent), room

    def metrics(self) -> dict[str, Any]:
        return self.metrics_.snapshot()

    def shadow_outcome(self, outputs: Any, message: Any) -> None:
        """Never called: gateways mirror predict requests only."""

    def idle(self) -> bool:
        return not self._tasks

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self.engine is not None:
            self.engine.shutdown()


def _refusal(message: str) -> InferdError:
    lowered = message.lower()
    if any(says in lowered for says in ("maximum model length", "maximum context length")):
        return PromptTooLongError(message)
    return InvalidInput(message)
