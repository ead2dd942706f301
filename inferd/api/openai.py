"""OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings``.

Framing follows what the official clients parse: ``text_completion`` and
``chat.completion.chunk`` objects as ``data:`` lines, a final usage chunk with empty
``choices`` when ``stream_options.include_usage``, then ``data: [DONE]``. Errors use
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` shape, before the stream
as an HTTP status, inside it as a ``data:`` error object.
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from inferd.api import structured
from inferd.api.auth import visible_models
from inferd.api.generate import Chunks, cache_header, collect, start, usage
from inferd.api.http import context_of, json_response, read_json
from inferd.api.openai_schema import EMBEDDINGS, chat_messages, check_fields, check_known
from inferd.api.state import gateway_of
from inferd.api.v1 import embed_texts, embedding_reply
from inferd.errors import BadRequest, InferdError, InvalidInput, ModelNotReady
from inferd.runtimes import GENERATIVE

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def models(request: Request) -> Response:
    """Generative, embedding and cross-encoder models being served that the caller may
    use (an adapter with its base model), in OpenAI's list shape."""
    table = gateway_of(request).router.table
    visible = visible_models(request.scope)
    data = []
    for name, route in table.models.items():
        serving = route.versions.get(route.default_version or "")
        if serving is None or not visible(name):
            continue
        if serving.framework not in GENERATIVE:
            outputs = serving.signature.outputs
            if any(o.name in ("embedding", "score") for o in outputs):  # encoders
                data.append({"id": name, "object": "model", "created": 0, "owned_by": "inferd"})
            continue
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "inferd"})
        data += [
            {"id": a, "object": "model", "created": 0, "owned_by": "inferd", "parent": name}
            for a in serving.adapters
        ]
    return json_response({"object": "list", "data": data})


async def _body_and_model(request: Request) -> tuple[dict[str, Any], str]:
    """The JSON object of a request and the ``model`` it names."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise InvalidInput("'model' is required", param="model")
    context_of(request.scope).model = model
    return body, model


async def _complete(request: Request, chat: bool) -> Response:
    body, model = await _body_and_model(request)
    check_fields(body, chat)
    plan, prompt = structured.Plan(), None
    if chat:
        messages = chat_messages(body.get("messages"))
        plan = structured.plan(body)
        prompt = {"messages": messages, **({"tools": plan.tools} if plan.tools else {})}
        if "max_completion_tokens" in body:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
    chunks, _, rid, _ = await start(request, model, body, chat=prompt, guide=plan.guide)
    meta = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": model,
    }
    if body.get("stream"):
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        stream = (
            _chat_stream(chunks, meta, plan, include_usage)
            if chat
            else _text_stream(chunks, meta, include_usage)
        )
        return StreamingResponse(
            stream,
            media_type="text/event-stream",
            headers={"x-request-id": rid, "cache-control": "no-cache", **cache_header(request)},
        )
    text, last = await collect(chunks)
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
    if chat:
        content, calls, reason = structured.answer(text, last.finish_reason, plan)
        choice["message"] = {"role": "assistant", "content": content}
        if calls:
            choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = reason
    else:
        choice["text"] = text
    obj = "chat.completion" if chat else "text_completion"
    return json_response(
        {**meta, "object": obj, "choices": [choice], "usage": usage(last)},
        headers={"x-request-id": rid, **cache_header(request)},
    )


def _event(meta: dict[str, Any], obj: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return b"data: " + orjson.dumps({**meta, "object": obj, "choices": choices, **extra}) + b"\n\n"


def _stream_error(exc: InferdError) -> bytes:
    error = {"error": {"message": exc.message, "type": "server_error", "code": exc.code}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


async def _text_stream(
    chunks: Chunks, meta: dict[str, Any], include_usage: bool
) -> AsyncGenerator[bytes, None]:
    obj = "text_completion"

    def choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                if chunk.text:
                    yield _event(meta, obj, [choice(chunk.text, None)])
                if chunk.finished:
                    yield _event(meta, obj, [choice("", chunk.finish_reason)])
                    if include_usage:
                        yield _event(meta, obj, [], usage=usage(chunk))
        except InferdError as exc:
            yield _stream_error(exc)
        yield b"data: [DONE]\n\n"


async def _chat_stream(
    chunks: Chunks, meta: dict[str, Any], plan: structured.Plan, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """Content deltas as they come; tool calls once complete (a forced call's JSON, or
    from the first ``<tool_call>`` on: held back, parsed at the end, sent as one
    ``tool_calls`` delta with the finish reason ``tool_calls``)."""
    obj = "chat.completion.chunk"

    def choice(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}

    watch = structured.StreamedCalls(plan)
    async with contextlib.aclosing(chunks):
        try:
            yield _event(meta, obj, [choice({"role": "assistant", "content": ""})])
            async for chunk in chunks:
                text = watch.feed(chunk.text) if chunk.text else ""
                if text:
                    yield _event(meta, obj, [choice({"content": text})])
                if chunk.finished:
                    rest, calls, reason = watch.finish(chunk.finish_reason)
                    if rest:
                        yield _event(meta, obj, [choice({"content": rest})])
                    if calls:
                        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
                        yield _event(meta, obj, [choice({"tool_calls": deltas})])
                    yield _event(meta, obj, [choice({}, reason)])
                    if include_usage:
                        yield _event(meta, obj, [], usage=usage(chunk))
        except InferdError as exc:
            yield _stream_error(exc)
        yield b"data: [DONE]\n\n"


@router.post("/embeddings")
async def embeddings(request: Request) -> Response:
    """OpenAI embeddings: ``input`` a string or a list of strings; ``encoding_format``
    float (default) or base64 (little-endian float32, what the official client asks for)."""
    body, model = await _body_and_model(request)
    check_known(body, EMBEDDINGS)
    texts = _embedding_input(body.get("input"))
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidInput("'encoding_format' must be float or base64", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or dimensions < 1):
        raise InvalidInput("'dimensions' must be a positive integer", param="dimensions")
    user = body.get("user")
    params = {"user": user} if isinstance(user, str) else {}
    outcome, rid = await embed_texts(
        request, model, {"inputs": texts, "params": params}, dimensions
    )
    vectors, used, cut = embedding_reply(outcome)
    if fmt == "base64":
        little = vectors.astype("<f4", copy=False)
        encoded = [base64.b64encode(row.tobytes()).decode() for row in little]
        data: list[Any] = [
            {"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)
        ]
    else:
        data = [
            {"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)
        ]
    reply: dict[str, Any] = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }
    if cut:
        reply["truncated"] = cut  # not OpenAI's: which inputs were cut to the model's limit
    return json_response(reply, headers={"x-request-id": rid})


def _embedding_input(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidInput("'input' must be a string or a non-empty list of strings", param="input")
    if any(isinstance(v, int | list) for v in value):
        raise InvalidInput(
            "'input' as token ids is not supported: send the text, the model tokenizes it",
            param="input",
        )
    return value


@router.post("/completions")
async def completions(request: Request) -> Response:
    """OpenAI completions (``stream`` and ``stream_options.include_usage`` supported)."""
    return await _complete(request, chat=False)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions: the messages (checked against the reference,
    :mod:`inferd.api.openai_schema`) rendered with the model's chat template, tools and
    structured outputs as :mod:`inferd.api.structured` says."""
    return await _complete(request, chat=True)


async def _adapter_op(request: Request, load: bool) -> Response:
    """Send a load/unload to every replica of the base model's serving version."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name or ":" in name:
        raise InvalidInput("'lora_name' must be a non-empty string without ':'")
    path = body.get("lora_path")
    if load and not isinstance(path, str):
        raise InvalidInput("'lora_path' must be the folder of a PEFT adapter")
    router = gateway_of(request).router
    base = body.get("base_model") or _only_generative_model(router)
    target = router.target(base)
    clients = router.clients_of(target.model, target.version)
    if not clients:
        raise ModelNotReady(f"no replica of {base!r} is running")
    for client in clients:
        await client.adapter(name, path if load else None)
    verb = "loaded" if load else "unloaded"
    return json_response(
        {verb: name, "base_model": base, "replicas": len(clients), "model": f"{base}:{name}"}
    )


def _only_generative_model(router: Any) -> str:
    names = [
        name for name, route in router.table.models.items()
        if route.default_version and route.versions[route.default_version].framework in GENERATIVE
    ]  # fmt: skip
    if len(names) != 1:
        raise InvalidInput(f"give 'base_model': one of {sorted(names)}")
    return str(names[0])


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """Load a PEFT LoRA adapter into the running replicas; use it as ``base:lora_name``."""
    return await _adapter_op(request, load=True)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Stop serving an adapter; requests already running with it finish."""
    return await _adapter_op(request, load=False)
