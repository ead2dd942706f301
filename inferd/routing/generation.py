"""Starting a generation, for every transport that generates text (inferd's API, OpenAI's,
the Open Inference Protocol's generate extension over REST, gRPC's ModelStreamInfer):
resolve the model, check the options, look up the result cache, charge the client's
token budget, and wait for the first chunk. Nothing here knows HTTP or gRPC.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.config import BatchingConfig, Settings
from inferd.errors import InvalidInput
from inferd.priority import NAMED_PRIORITIES, named_levels, priority_code
from inferd.routing.cache import (
    ResultCache,
    chunk_columns,
    columns_chunk,
    deterministic,
    generation_key,
    version_ttl,
)
from inferd.routing.choice import ROUTED
from inferd.routing.router import Router
from inferd.routing.targets import Target
from inferd.runtimes import GENERATIVE
from inferd.shapes import replica as p
from inferd.shapes.llm import SamplingParams
from inferd.telemetry.logging import request_id_var

MAX_STOPS = 4
Chunks = AsyncGenerator[p.TokenChunk, None]


class TokenBudget(Protocol):
    """A client's generation token budget (``inferd.access.limits.TokenBudget``)."""

    async def admit(self, model: str) -> None:
        """Raise ``RateLimited`` when a budget of ``model`` is in debt."""

    def charged(self, chunks: Chunks, model: str) -> Chunks:
        """``chunks``, their tokens charged to ``model``'s budgets once they end."""


def sampling_params(body: dict[str, Any], default_max_tokens: int = 16) -> dict[str, Any]:
    """Checked SamplingParams fields from a request body (inferd and OpenAI names agree)."""
    max_tokens = body.get("max_tokens", default_max_tokens)
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= 65536
    ):
        raise InvalidInput("'max_tokens' must be an integer from 1 to 65536", param="max_tokens")
    params: dict[str, Any] = {"max_tokens": max_tokens}
    for name, (ok, what, neutral) in NUMBERS.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not ok(value):
            raise InvalidInput(f"{name!r} must be {what}", param=name)
        value = max(int(value), 0) if name == "top_k" else float(value)  # top_k -1: vLLM's off
        if value != neutral:
            params[name] = value
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidInput("'seed' must be an integer", param="seed")
        params["seed"] = seed
    params["stop"] = _stops(body.get("stop"))
    if body.get("ignore_eos") is True:
        params["ignore_eos"] = True
    if body.get("logprobs"):
        params["logprobs"] = True
    priority = body.get("priority")
    if priority is not None:
        code = priority_code(priority)
        level = GENERATION_LEVELS.get(code, code)
        if level not in GENERATION_LEVELS.values():
            raise InvalidInput(f"'priority' must be a level from 1 to 4, not {priority!r}")
        params["priority"] = level
    params.update(_flags(body))
    params.update(_token_fields(body, max_tokens))
    return params


NUMBERS: dict[str, tuple[Callable[[float], bool], str, float | None]] = {
    "temperature": (lambda v: 0 <= v <= 2, "a number from 0 to 2", None),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]", None),
    "top_k": (lambda v: v >= -1 and float(v).is_integer(), "an integer >= 0 (-1: off)", 0),
    "repetition_penalty": (lambda v: 0 < v <= 10, "a number in (0, 10]", 1.0),
    "presence_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2", 0.0),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2", 0.0),
    "min_p": (lambda v: 0 <= v <= 1, "a number from 0 to 1", 0.0),
}
"""Number fields: the check, its wording, and the neutral value, left out of the
parameters (a request that sends vLLM's defaults, as its benchmark client does, is the
same request as one that does not; None: kept whenever given)."""
FLAGS = {
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}
"""vLLM's boolean extensions and their neutral values."""


def _flags(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's boolean extensions, checked, when not neutral."""
    params: dict[str, Any] = {}
    for name, neutral in FLAGS.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise InvalidInput(f"{name!r} must be true or false", param=name)
        if value != neutral:
            params[name] = value
    return params


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_fields(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """``min_tokens`` and ``stop_token_ids``, checked, when not neutral."""
    params: dict[str, Any] = {}
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _is_count(min_tokens):
            raise InvalidInput("'min_tokens' must be an integer >= 0", param="min_tokens")
        if min_tokens > max_tokens:
            raise InvalidInput(
                f"'min_tokens' {min_tokens} is above 'max_tokens' {max_tokens}", param="min_tokens"
            )
        if min_tokens:
            params["min_tokens"] = min_tokens
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(map(_is_count, ids)) or len(ids) > 64:
            raise InvalidInput(
                "'stop_token_ids' must be a list of at most 64 token ids", param="stop_token_ids"
            )
        if ids:
            params["stop_token_ids"] = list(ids)
    return params


GENERATION_LEVELS = {
    NAMED_PRIORITIES[name]: level for name, level in named_levels(BatchingConfig()).items()
}
"""Priority codes -> the engine's levels (the default ones: 1 high ... 4 batch); waiting
generations start best first (see inferd.llm.scheduler)."""


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidInput("'stop' must be a string or a list of non-empty strings")
    if len(stops) > MAX_STOPS:
        raise InvalidInput(f"at most {MAX_STOPS} stop strings")
    return tuple(stops)


def prompt_of(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    raise InvalidInput("'prompt' must be a non-empty string (or a list of token ids)")


async def _first_then_rest(stream: Chunks) -> Chunks:
    """Fetch the first chunk before answering, so a refused request gets a real 4xx/5xx
    status instead of an error inside a 200 stream."""
    first = await anext(stream)

    async def rest() -> AsyncGenerator[p.TokenChunk, None]:
        async with contextlib.aclosing(stream):  # closing ``rest`` cancels at once, not at GC
            yield first
            async for chunk in stream:
                yield chunk

    return rest()


@dataclass(frozen=True, slots=True)
class GenerationStart:
    """One generation to start, as a route read it from its request."""

    name: str
    """A model, an adapter, or ``base:adapter``."""
    body: dict[str, Any]
    """The request's ``prompt``, ``adapter`` and sampling fields."""
    version: str | None = None
    request_id: str = ""
    budget: TokenBudget | None = None
    """The client's token budget: the generation starts only if it is not in debt, and
    its tokens are charged to it when the chunks end (a cached answer costs none)."""
    chat: dict[str, Any] | None = None
    """Checked ``messages`` and the ``tools`` to show, rendered by the replica with the
    model's chat template in place of ``prompt``."""
    guide: dict[str, Any] | None = None
    """Constrains the output (see :mod:`inferd.api.structured`)."""
    route: tuple[Target, str | None] | None = None
    """``name`` already resolved to its target and adapter (by a route that checked the
    caller may use the model): not resolved again."""


async def start_generation(
    router: Router, settings: Settings, start: GenerationStart, cache: ResultCache | None = None
) -> tuple[Chunks, Target, float, bool | None]:
    """Resolve ``start.name``, check its body and start streaming; returns the chunks,
    the target, the ``time.perf_counter()`` start once the first chunk is there, and
    whether the result ``cache`` answered (None: not cacheable, or no cache). How its
    replica was chosen is in :data:`ROUTED` once it returns.

    Raises :class:`InferdError`: ``ModelNotFound`` for an unknown name or version,
    ``InvalidInput`` for bad options or a model that does not generate text,
    ``RateLimited`` for a budget in debt, and whatever the replica answers before its
    first token (overloaded, prompt too long, ...)."""
    body, request_id, budget = start.body, start.request_id, start.budget
    started = time.perf_counter()
    arrived_at = time.time()
    request_id_var.set(request_id)
    ROUTED.set(None)
    target, adapter = start.route or await router.resolve_arriving(
        start.name, start.version, started + settings.request_timeout_s
    )
    if target.framework not in GENERATIVE:
        raise InvalidInput(
            f"model {target.model!r} is a {target.framework} model and does not generate "
            "text; call predict (V2: infer) instead"
        )
    request = _request(body, settings, adapter, request_id, arrived_at, start.chat, start.guide)
    if budget is not None:
        await budget.admit(target.model)
    key, ttl = None, 0.0
    if cache is not None:
        key, ttl = _cache_key(router, settings, target, request)
    if key is not None and cache is not None:
        cached = await cache.get(key)
        if cached is not None:
            return _replay(columns_chunk(cached)), target, started, True
    stream = router.generate(target, request)
    if budget is not None:
        stream = budget.charged(stream, target.model)
    if key is not None and cache is not None:
        stream = _kept(stream, cache, key, ttl)
    return await _first_then_rest(stream), target, started, None if key is None else False


def _request(
    body: dict[str, Any],
    settings: Settings,
    adapter: str | None,
    request_id: str,
    arrived_at: float,
    chat: dict[str, Any] | None = None,
    guide: dict[str, Any] | None = None,
) -> p.GenerateRequest:
    """The checked generation ``body`` asks for (its ``adapter`` before the one its
    model name gave), within the server's limits."""
    explicit = body.get("adapter")
    if explicit is not None and not isinstance(explicit, str):
        raise InvalidInput("'adapter' must be a string")
    params = sampling_params(body)
    limit = settings.llm.max_tokens_limit
    if params["max_tokens"] > limit:
        raise InvalidInput(
            f"'max_tokens' {params['max_tokens']} is above this server's limit of {limit} "
            "(llm.max_tokens_limit)"
        )
    if guide is not None:
        params["guide"] = guide
    try:
        sampling = SamplingParams(**params)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"invalid sampling parameters: {exc}") from None
    prompt = chat if chat is not None else prompt_of(body)
    timeout_s = settings.request_timeout_s
    # Before its first token a request may be queued in the replica for up to the LLM
    # queue timeout (the replica answers 503 then); this bound only catches a hung replica.
    first_s = settings.llm.queue_timeout_s + timeout_s
    return p.GenerateRequest(
        prompt=prompt, params=sampling, adapter=explicit or adapter, request_id=request_id,
        arrived_at=arrived_at, idle_timeout_s=timeout_s, first_timeout_s=first_s,
    )  # fmt: skip


def _cache_key(
    router: Router, settings: Settings, target: Target, request: p.GenerateRequest
) -> tuple[bytes | None, float]:
    """The result cache key of a generation and how long to keep it; None when it is
    not cached (sampled, an uncached version, or an adapter loaded at run time)."""
    if not deterministic(request.params):
        return None, 0.0
    route = router.version_route(target.model, target.version)
    ttl = version_ttl(route, settings.cache.ttl_s)
    adapter = request.adapter
    if route is None or ttl <= 0 or (adapter is not None and adapter not in route.adapters):
        return None, 0.0
    key = generation_key(
        target.model, target.version, route.digest, adapter, request.prompt, request.params
    )
    return key, ttl


async def _replay(chunk: p.TokenChunk) -> Chunks:
    yield chunk


CACHED_FINISH = ("stop", "length")
"""Generations that ended by themselves: the only ones worth keeping."""


async def _kept(stream: Chunks, cache: ResultCache, key: bytes, ttl_s: float) -> Chunks:
    """The stream, kept whole in the result cache once it finished by itself."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[float] = []
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            text.append(chunk.text)
            ids += chunk.token_ids
            logprobs += chunk.logprobs or ()
            if chunk.finished and chunk.finish_reason in CACHED_FINISH:
                whole = p.TokenChunk(
                    chunk.id, "".join(text), ids, True, chunk.finish_reason,
                    chunk.prompt_tokens, chunk.completion_tokens,
                    logprobs if chunk.logprobs is not None else None, chunk.cached_tokens,
                )  # fmt: skip
                await cache.put(key, chunk_columns(whole), ttl_s)
            yield chunk
