"""The Open Inference Protocol's generate extension (as Triton defines it): text in, text
out, for the LLMs the other APIs generate with.

``POST /v2/models/{model}[/versions/{version}]/generate`` answers one JSON object,
``{"model_name", "model_version", "text_output", "finish_reason", "usage"}`` (and ``id``
when the request has one). ``.../generate_stream`` answers Server-Sent Events, one such
object per token chunk with the chunk's new text, ``finish_reason`` and ``usage`` on the
last. The request is ``{"text_input", "parameters", "id"}``; Triton also lets parameters
sit at the top level next to ``text_input``, and both are read (``parameters`` wins). The
parameters are those of ``/api/v1`` generate (``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``ignore_eos``, ``adapter``); others are ignored.

Errors are the protocol's ``{"error": "..."}``: before the first token as an HTTP status
(bad input or a model that does not generate text 400, unknown model 404, overloaded
503), after it as a last ``data:`` event of the stream.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.generate import (
    Chunks,
    Events,
    cache_header,
    collect,
    sse_response,
    start,
    usage,
)
from inferd.api.http import json_response, read_json
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InferdError, InvalidInput
from inferd.shapes import replica as p

router = APIRouter(prefix="/v2", tags=["open inference protocol"])
ENVELOPE = ("text_input", "parameters", "id")
"""Top-level request fields that are not generation parameters."""


def generation_body(body: Any) -> dict[str, Any]:
    """A generate request -> the body :func:`inferd.api.generate.start_generation` takes:
    the parameters (top-level ones, overridden by ``parameters``) and ``prompt``."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    text = body.get("text_input")
    if not isinstance(text, str) or not text:
        raise InvalidInput("'text_input' must be a non-empty string")
    params = body.get("parameters")
    if params is None:
        params = {}
    elif not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    if body.get("id") is not None and not isinstance(body["id"], str):
        raise InvalidInput("'id' must be a string")
    top = {k: v for k, v in body.items() if k not in ENVELOPE}
    return {**top, **params, "prompt": text}


async def _start(
    request: Request, model: str, version: str | None
) -> tuple[Chunks, str, dict[str, Any]]:
    """Parse the request and start generating: the chunks, the request id and the fields
    every reply carries."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    options = generation_body(body)
    chunks, target, rid, _ = await start(request, model, options, version)
    head: dict[str, Any] = {"model_name": model, "model_version": target.version}
    if body.get("id") is not None:
        head["id"] = body["id"]
    return chunks, rid, head


def _finish(chunk: p.TokenChunk) -> dict[str, Any]:
    return {"finish_reason": chunk.finish_reason, "usage": usage(chunk)}


@router.post("/models/{model}/generate")
@router.post("/models/{model}/versions/{version}/generate")
async def generate(request: Request, model: str, version: str | None = None) -> Response:
    """Generate text and answer it whole."""
    chunks, rid, head = await _start(request, model, version)
    text, last = await collect(chunks)
    return json_response(
        {**head, "text_output": text, **_finish(last)},
        headers={"x-request-id": rid, **cache_header(request)},
    )


@router.post("/models/{model}/generate_stream")
@router.post("/models/{model}/versions/{version}/generate_stream")
async def generate_stream(request: Request, model: str, version: str | None = None) -> Response:
    """Generate text as Server-Sent Events, one per token chunk."""
    chunks, rid, head = await _start(request, model, version)
    headers = {"x-request-id": rid, **cache_header(request)}
    return sse_response(chunks, stream_events(head), error_event, headers)


def stream_events(head: dict[str, Any]) -> Events:
    """The stream's events: a chunk's new text under ``head``; the last chunk's event also
    carries ``finish_reason`` and ``usage``."""

    def events(chunk: p.TokenChunk) -> list[dict[str, Any]]:
        if not chunk.text and not chunk.finished:
            return []
        event = {**head, "text_output": chunk.text}
        return [{**event, **_finish(chunk)} if chunk.finished else event]

    return events


def error_event(exc: InferdError) -> dict[str, Any]:
    """A failure after the first token, as the stream's last event."""
    return {"error": exc.message}
