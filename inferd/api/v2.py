"""The Open Inference Protocol (KServe V2) over REST: health, metadata and JSON inference.

Same models, routing and replicas as ``/api/v1``; only the wire format differs. Tensors
arrive as ``{"name", "shape", "datatype", "data"}`` (data flat or nested, row-major) or
as binary data after the JSON header, decoded and checked by :mod:`inferd.protocols.v2`
(shared with gRPC), and go to the data plane as columns. Errors use the protocol's
body, ``{"error": "..."}``: bad input 400, unknown model or version 404, not ready 503.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd import __version__
from inferd.api.http import (
    context_of,
    header,
    json_response,
    outcome_headers,
    parse_json,
    read_body,
    request_id_of,
    request_timeout,
)
from inferd.api.policy import admit
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, ModelNotReady
from inferd.protocols.v2 import (
    EXTENSIONS,
    decode_inputs,
    encode_outputs,
    is_server_ready,
    metadata_of,
    parameters_of,
    requested_outputs,
    schedule_policy,
    user_of,
)
from inferd.routing.dataplane import DataPlane
from inferd.routing.targets import Target
from inferd.telemetry.logging import request_id_var

router = APIRouter(prefix="/v2", tags=["open inference protocol"])
HEADER_LENGTH = "inference-header-content-length"
HEADER_LENGTH_KEY = HEADER_LENGTH.encode()
"""Binary tensor extension: the body is this many bytes of JSON, then the tensors' bytes."""


# -- server -------------------------------------------------------------------------------


@router.get("")
async def server_metadata() -> Response:
    return json_response({"name": "inferd", "version": __version__, "extensions": EXTENSIONS})


@router.get("/health/live")
async def server_live() -> Response:
    return json_response({"live": True})


@router.get("/health/ready")
async def server_ready(request: Request) -> Response:
    ready = is_server_ready(gateway_of(request).router)
    return json_response({"ready": ready}, status_code=200 if ready else 503)


# -- models -------------------------------------------------------------------------------


def _target(request: Request, model: str, version: str | None) -> Target:
    return gateway_of(request).router.target(model, version)


@router.get("/models/{model}")
@router.get("/models/{model}/versions/{version}")
async def model_metadata(request: Request, model: str, version: str | None = None) -> Response:
    return json_response(metadata_of(gateway_of(request).router, model, version))


@router.get("/models/{model}/ready")
@router.get("/models/{model}/versions/{version}/ready")
async def model_ready(request: Request, model: str, version: str | None = None) -> Response:
    try:
        _target(request, model, version)
    except ModelNotReady:
        return json_response({"name": model, "ready": False}, status_code=503)
    return json_response({"name": model, "ready": True})


# -- inference -----------------------------------------------------------------------------


@router.post("/models/{model}/infer")
@router.post("/models/{model}/versions/{version}/infer")
async def infer(request: Request, model: str, version: str | None = None) -> Response:
    started = time.perf_counter()
    rid = request_id_of(request)
    request_id_var.set(rid)
    raw = await read_body(request, gateway_of(request).settings.max_body_bytes)
    body, binary = _split_body(raw, header(request, HEADER_LENGTH_KEY))
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    plane: DataPlane = gateway_of(request).dataplane
    params = parameters_of(body)
    user = user_of(params) or header(request, b"x-user-id")
    context = context_of(request.scope)
    context.user = user  # for the inference log
    target = await plane.resolve(
        model,
        version,
        started=started,
        timeout_s=lambda: request_timeout(request, schedule_policy(params)[1]),
        user=user,
    )  # admitted below, once its inputs are read (the path's model: the gates)
    columns, rows = decode_inputs(
        body.get("inputs"), target.signature, binary, target.allow_non_finite
    )
    wanted = requested_outputs(body.get("outputs"), target.signature)
    binary_default = bool(params.get("binary_data_output", False))
    priority, timeout_s = schedule_policy(params)
    timeout_s = request_timeout(request, timeout_s)
    policy = await admit(request, target)  # a graph's nodes (the path's model: the gates)
    infer = plane.request(rid, started, timeout_s, priority, version is not None, policy)
    outcome = await plane.infer(target, columns, rows, infer)
    context.outcome = outcome  # for the inference log and the trace
    target = outcome.target  # the fallback version, if the chosen one failed
    outputs, blobs = encode_outputs(outcome.outputs, wanted, binary_default)
    reply: dict[str, Any] = {
        "model_name": target.model,
        "model_version": target.version,
        "outputs": outputs,
    }
    if isinstance(body.get("id"), str):
        reply["id"] = body["id"]
    headers = outcome_headers(outcome, rid)
    if outcome.degraded_from is not None:  # model_name says which model answered
        reply["parameters"] = {"degraded_from": outcome.degraded_from}
    if not blobs:
        return json_response(reply, headers=headers)
    head = orjson.dumps(reply)
    return Response(
        b"".join([head, *blobs]),
        media_type="application/octet-stream",
        headers={**headers, HEADER_LENGTH: str(len(head))},
    )


def _split_body(raw: bytes, header: str | None) -> tuple[Any, memoryview]:
    if header is None:
        return parse_json(raw, non_finite=True), memoryview(b"")
    if not header.isdigit() or int(header) > len(raw):
        raise BadRequest(
            f"Inference-Header-Content-Length {header!r} must be a byte count within the "
            f"body's {len(raw)} bytes"
        )
    size = int(header)
    return parse_json(raw[:size], non_finite=True), memoryview(raw)[size:]
