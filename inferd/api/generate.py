"""inferd's generation API: ``POST /api/v1/models/{model}/generate`` and ``/api/v1/generate``.

``stream: true`` answers Server-Sent Events: ``data: {"token": "..."}`` per token, then
one final ``data: {"finish_reason": ..., "usage": {...}}``. Without ``stream`` the reply is
one JSON object. The client disconnecting cancels the sequence in the replica.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from inferd.api.http import json_response, read_json, request_id_of
from inferd.errors import BadRequest, InferdError, InvalidInput
from inferd.observability.logging import request_id_var
from inferd.routing.router import Target
from inferd.serving import protocol as p

router = APIRouter(prefix="/api/v1", tags=["generation"])
MAX_STOPS = 4


def sampling_params(body: dict[str, Any], default_max_tokens: int = 16) -> dict[str, Any]:
    """Checked SamplingParams fields from a request body (inferd and OpenAI names agree)."""
    max_tokens = body.get("max_tokens", default_max_tokens)
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= 65536
    ):
        raise InvalidInput("'max_tokens' must be an integer from 1 to 65536")
    params: dict[str, Any] = {"max_tokens": max_tokens}
    checks = {
        "temperature": (lambda v: 0 <= v <= 2, "a number from 0 to 2"),
        "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": (lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0"),
    }
    for name, (ok, what) in checks.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not ok(value):
            raise InvalidInput(f"{name!r} must be {what}")
        params[name] = int(value) if name == "top_k" else float(value)
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidInput("'seed' must be an integer")
        params["seed"] = seed
    params["stop"] = _stops(body.get("stop"))
    if body.get("ignore_eos") is True:
        params["ignore_eos"] = True
    if body.get("logprobs"):
        params["logprobs"] = True
    return params


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


Chunks = AsyncGenerator[p.TokenChunk, None]


async def _first_then_rest(stream: Chunks) -> Chunks:
    """Fetch the first chunk before answering, so a refused request gets a real 4xx/5xx
    status instead of an error inside a 200 stream."""
    first = await anext(stream)

    async def rest() -> AsyncGenerator[p.TokenChunk, None]:
        yield first
        async for chunk in stream:
            yield chunk

    return rest()


async def start(
    request: Request, name: str, body: dict[str, Any], version: str | None = None
) -> tuple[Chunks, Target, str, float]:
    """Resolve ``name`` (a model, an adapter, or ``base:adapter``), check the body, and
    start streaming; returns once the first chunk is there."""
    started = time.perf_counter()
    arrived_at = time.time()
    rid = request_id_of(request)
    request_id_var.set(rid)
    target, adapter = request.app.state.router.resolve(name, version)
    explicit = body.get("adapter")
    if explicit is not None and not isinstance(explicit, str):
        raise InvalidInput("'adapter' must be a string")
    adapter = explicit or adapter
    params = sampling_params(body)
    settings = request.app.state.settings
    timeout_s = settings.request_timeout_s
    # Before its first token a request may be queued in the replica for up to the LLM
    # queue timeout (the replica answers 503 then); this bound only catches a hung replica.
    first_s = settings.llm.queue_timeout_s + timeout_s
    stream = request.app.state.router.generate(
        target, prompt_of(body), params, adapter, timeout_s, rid, first_s, arrived_at
    )
    return await _first_then_rest(stream), target, rid, started


def usage(chunk: p.TokenChunk) -> dict[str, int]:
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
    }


async def _generate(request: Request, model: str, body: Any) -> Response:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    version = (
        (body.get("params") or {}).get("version") if isinstance(body.get("params"), dict) else None
    )
    chunks, target, rid, started = await start(request, model, body, version)
    headers = {"x-request-id": rid, "x-inferd-model-version": target.version}
    if body.get("stream"):
        return StreamingResponse(
            _sse(chunks),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )
    text: list[str] = []
    last: p.TokenChunk | None = None
    async for chunk in chunks:
        text.append(chunk.text)
        last = chunk
    assert last is not None
    return json_response({
        "model": model, "version": target.version, "text": "".join(text),
        "finish_reason": last.finish_reason, "usage": usage(last),
        "latency_ms": round((time.perf_counter() - started) * 1000, 3), "request_id": rid,
    }, headers=headers)  # fmt: skip


async def _sse(chunks: AsyncGenerator[p.TokenChunk, None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                if chunk.text:
                    yield b"data: " + orjson.dumps({"token": chunk.text}) + b"\n\n"
                if chunk.finished:
                    yield (
                        b"data: "
                        + orjson.dumps(
                            {"finish_reason": chunk.finish_reason, "usage": usage(chunk)}
                        )
                        + b"\n\n"
                    )
        except InferdError as exc:  # mid-stream: the status line is long gone
            yield b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n"


@router.post("/models/{model}/generate")
async def generate(model: str, request: Request) -> Response:
    """Generate text; ``"stream": true`` for Server-Sent Events token by token."""
    body = await read_json(request, request.app.state.settings.max_body_bytes)
    return await _generate(request, model, body)


@router.post("/generate")
async def generate_any(request: Request) -> Response:
    """Like ``/models/{model}/generate`` with ``"model"`` in the body."""
    body = await read_json(request, request.app.state.settings.max_body_bytes)
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        raise InvalidInput("missing 'model': the name of the model to call")
    return await _generate(request, model, body)
