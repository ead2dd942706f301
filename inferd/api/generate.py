"""inferd's generation API: ``POST /api/v1/models/{model}/generate`` and ``/api/v1/generate``.

``stream: true`` answers Server-Sent Events: ``data: {"token": "..."}`` per token, then
one final ``data: {"finish_reason": ..., "usage": {...}}``. Without ``stream`` the reply is
one JSON object. The client disconnecting cancels the sequence in the replica.

Every transport that generates text starts through
:func:`inferd.routing.generation.start_generation`; :func:`start` is its HTTP side (auth,
the client's token budget, the inference log row).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from inferd.api.http import (
    PRIORITY_HEADER,
    context_of,
    header,
    json_response,
    read_json,
    request_id_of,
)
from inferd.api.limits import budget_of
from inferd.api.policy import policy_of
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InferdError, InvalidInput
from inferd.routing.choice import ROUTED
from inferd.routing.context import RequestContext
from inferd.routing.generation import Chunks, GenerationStart, start_generation
from inferd.routing.targets import Target
from inferd.shapes import replica as p
from inferd.telemetry.log_rows import RowBuffer

router = APIRouter(prefix="/api/v1", tags=["generation"])


Events = Callable[[p.TokenChunk], list[dict[str, Any]]]
"""What a stream sends for one chunk: zero or more ``data:`` objects."""


async def start(
    request: Request,
    name: str,
    body: dict[str, Any],
    version: str | None = None,
    chat: dict[str, Any] | None = None,
    guide: dict[str, Any] | None = None,
) -> tuple[Chunks, Target, str, float]:
    """:func:`start_generation` for an HTTP request: its app's router and settings, and
    its request id (returned too)."""
    rid = request_id_of(request)
    state = gateway_of(request)
    context = context_of(request.scope)
    budget = budget_of(request)
    if "priority" not in body and (priority := header(request, PRIORITY_HEADER)):
        body = {**body, "priority": priority}
    route = None
    if (policy := policy_of(request)) is not None:  # may it use this model, at this rate?
        until = time.perf_counter() + state.settings.request_timeout_s
        route = await state.router.resolve_arriving(name, version, until)
        policy.authorize(route[0].model)
        await policy.charge(route[0].model)
    start = GenerationStart(name, body, version, rid, budget, chat, guide, route)
    log: RowBuffer | None = state.inference_log
    cache = state.dataplane.cache
    if log is None:
        chunks, target, started, hit = await start_generation(
            state.router, state.settings, start, cache
        )
        context.cache_hit = hit
        return chunks, target, rid, started
    path = request.url.path
    api = "v2" if path.startswith("/v2/") else "v1" if path.startswith("/api/") else "openai"
    user = body.get("user") if isinstance(body.get("user"), str) else None
    context.user = user or request.headers.get("x-user-id")
    began = time.perf_counter()
    try:
        chunks, target, started, hit = await start_generation(
            state.router, state.settings, start, cache
        )
    except InferdError as exc:
        ms = (time.perf_counter() - began) * 1000
        payload = log.payload(context.body, None) if log.payload_rate else None
        log.record(context.log_row(api, name, exc.status_code, ms, version, payload=payload))
        raise
    context.cache_hit, context.routed = hit, ROUTED.get()
    return _logged(chunks, log, context, api, target, began), target, rid, started


async def _logged(
    chunks: Chunks, log: RowBuffer, context: RequestContext, api: str, target: Target,
    began: float,
) -> Chunks:  # fmt: skip
    """The stream, logged when it ends: 200 with its token counts once finished, 499
    when the client went away first, the error's status when the replica failed."""
    status, last = 499, None
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                last = chunk
                yield chunk
            status = 200 if last is not None and last.finished else 502
    except InferdError as exc:
        status = exc.status_code
        raise
    finally:
        ms = (time.perf_counter() - began) * 1000
        if last is not None and last.finished:  # a reader may stop at the last chunk
            status = 200
        # The request's body only: the answer streamed away chunk by chunk.
        payload = log.payload(context.body, None) if log.payload_rate else None
        version = target.version
        row = context.log_row(api, target.model, status, ms, version, last=last, payload=payload)
        log.record(row)


def cache_header(request: Request) -> dict[str, str]:
    """``X-Cache: hit|miss`` for a generation :func:`start` looked up in the cache."""
    hit = context_of(request.scope).cache_hit
    return {} if hit is None else {"x-cache": "hit" if hit else "miss"}


async def collect(chunks: Chunks) -> tuple[str, p.TokenChunk]:
    """The whole text of a generation and its last (finished) chunk."""
    text: list[str] = []
    last: p.TokenChunk | None = None
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            text.append(chunk.text)
            last = chunk
    assert last is not None
    return "".join(text), last


def usage(chunk: p.TokenChunk) -> dict[str, Any]:
    """Token counts as OpenAI's ``usage`` (``cached_tokens``: of the prompt, those the
    replica's prefix cache held)."""
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": chunk.cached_tokens},
    }


def sse_response(
    chunks: Chunks,
    events: Events,
    error: Callable[[InferdError], dict[str, Any]],
    headers: dict[str, str],
) -> StreamingResponse:
    """Server-Sent Events of ``events(chunk)`` for each chunk; a failure after the first
    chunk (the status line is long gone) is a last ``data: error(exc)`` event. The client
    going away closes the chunks, which cancels the sequence in the replica."""

    async def body() -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    for event in events(chunk):
                        yield b"data: " + orjson.dumps(event) + b"\n\n"
            except InferdError as exc:
                yield b"data: " + orjson.dumps(error(exc)) + b"\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
    )


def _events(chunk: p.TokenChunk) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"token": chunk.text}] if chunk.text else []
    if chunk.finished:
        events.append({"finish_reason": chunk.finish_reason, "usage": usage(chunk)})
    return events


async def _generate(request: Request, model: str, body: Any) -> Response:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    version = (
        (body.get("params") or {}).get("version") if isinstance(body.get("params"), dict) else None
    )
    chunks, target, rid, started = await start(request, model, body, version)
    headers = {"x-request-id": rid, "x-inferd-model-version": target.version}
    headers.update(cache_header(request))
    if body.get("stream"):
        return sse_response(chunks, _events, InferdError.to_dict, headers)
    text, last = await collect(chunks)
    return json_response({
        "model": model, "version": target.version, "text": text,
        "finish_reason": last.finish_reason, "usage": usage(last),
        "latency_ms": round((time.perf_counter() - started) * 1000, 3), "request_id": rid,
    }, headers=headers)  # fmt: skip


@router.post("/models/{model}/generate")
async def generate(model: str, request: Request) -> Response:
    """Generate text; ``"stream": true`` for Server-Sent Events token by token."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    return await _generate(request, model, body)


@router.post("/generate")
async def generate_any(request: Request) -> Response:
    """Like ``/models/{model}/generate`` with ``"model"`` in the body."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        raise InvalidInput("missing 'model': the name of the model to call")
    return await _generate(request, model, body)
