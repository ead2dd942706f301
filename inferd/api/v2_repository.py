"""The Open Inference Protocol's model repository extension: index, load and unload.

The routes parse and format; what index, load and unload do, shared with the gRPC
service, is :mod:`inferd.protocols.repository`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.http import json_response, parse_json, read_body
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InvalidInput
from inferd.protocols.repository import load_model, repository_index, unload_model

router = APIRouter(prefix="/v2/repository", tags=["open inference protocol"])


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object; an empty body is an empty object (tritonclient sends one)."""
    raw = await read_body(request, gateway_of(request).settings.max_body_bytes)
    if not raw.strip():
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    return params


@router.post("/index")
async def index(request: Request) -> Response:
    """Every model with its state; ``{"ready": true}`` lists only the serving ones."""
    ready = (await _body(request)).get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput("'ready' must be a boolean")
    state = gateway_of(request)
    entries = await repository_index(state.registry, state.router, ready)
    return json_response([asdict(e) for e in entries])


@router.post("/models/{model}/load")
async def load(request: Request, model: str) -> Response:
    """Load a model and wait until it serves its newest version."""
    params = _parameters(await _body(request))
    if params:
        # Triton's "config" and "file:" overrides: inferd serves registered versions only.
        raise InvalidInput(f"load parameters are not supported: {sorted(params)}")
    state = gateway_of(request)
    await load_model(state.registry, state.router, state.settings, model)
    return json_response({})


@router.post("/models/{model}/unload")
async def unload(request: Request, model: str) -> Response:
    """Unload a model and wait until its replicas have stopped.

    ``parameters.unload_dependents`` is accepted and has nothing to do: inferd has no
    ensembles, so no model depends on another."""
    _parameters(await _body(request))
    state = gateway_of(request)
    await unload_model(state.registry, state.router, state.settings, model)
    return json_response({})
