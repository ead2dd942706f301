"""The inferd REST API (``/api/v1``): thin routes over the data plane and registry."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api import docs
from inferd.api.auth import visible_models
from inferd.api.http import (
    PRIORITY_HEADER,
    context_of,
    header,
    json_response,
    outcome_headers,
    read_json,
    request_id_of,
    request_timeout,
)
from inferd.api.multipart import form_body, is_multipart
from inferd.api.policy import policy_of
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InvalidInput, ModelNotFound, PayloadTooLarge
from inferd.priority import priority_code
from inferd.protocols.codec import columns_to_rows, rows_to_columns
from inferd.routing.dataplane import DataPlane, InferOutcome
from inferd.routing.targets import Target
from inferd.shapes.graph import GRAPH_FRAMEWORK
from inferd.shapes.replica import InferRequest
from inferd.shapes.tensors import Signature
from inferd.telemetry.logging import request_id_var

router = APIRouter(prefix="/api/v1", tags=["inference"])


def _plane(request: Request) -> DataPlane:
    return gateway_of(request).dataplane


def _params(
    request: Request, body: dict[str, Any]
) -> tuple[str | None, float | None, str | None, int]:
    """``params``: the pinned version, the timeout in seconds, the user (for sticky
    traffic splits; the ``X-User-Id`` header does the same), the priority (high, normal,
    low, batch or a level number; its code), else the ``X-Inferd-Priority`` header's (how
    the job runner runs an OpenAI batch's embeddings and scores, whose bodies have no
    such field)."""
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'params' must be an object")
    version = params.get("version")
    if version is not None and not isinstance(version, str):
        raise InvalidInput("'params.version' must be a string")
    user = params.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidInput("'params.user' must be a string")
    timeout_ms = params.get("timeout_ms")
    if timeout_ms is not None and (
        not isinstance(timeout_ms, int | float)
        or isinstance(timeout_ms, bool)
        or not 0 < timeout_ms < math.inf
    ):
        raise InvalidInput("'params.timeout_ms' must be a positive number")
    if "priority" in params:
        priority = priority_code(params["priority"], "'params.priority'")
    elif (named := header(request, PRIORITY_HEADER)) is not None:
        priority = priority_code(named, "the X-Inferd-Priority header")
    else:
        priority = 0
    return version, timeout_ms / 1000 if timeout_ms else None, user, priority


@dataclass(frozen=True, slots=True)
class Prepared:
    """A predict-shaped request, routed, authorised and checked, not run yet."""

    target: Target
    columns: dict[str, np.ndarray]
    rows: int
    infer: InferRequest
    request_id: str


async def prepare(
    request: Request,
    model: str,
    body: Any,
    rows_key: str,
    check: Callable[[Target, list[Any]], None] | None = None,
    version: str | None = None,
) -> Prepared:
    """Route, authorise and check one predict-shaped request; ``check`` sees the target
    version and the rows before they are sent (to refuse what this route cannot serve);
    ``version``: pinned by the path (else ``params.version`` may pin it)."""
    started = time.perf_counter()
    rid = request_id_of(request)
    request_id_var.set(rid)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    asked, timeout_s, user, priority = _params(request, body)
    version = version or asked
    timeout_s = request_timeout(request, timeout_s)
    plane = _plane(request)
    user = user or header(request, b"x-user-id")
    context = context_of(request.scope)
    context.user = user  # for the inference log
    policy = policy_of(request)  # a model named in the body, a graph's nodes
    target = await plane.resolve(
        model, version, started=started, timeout_s=timeout_s, user=user, policy=policy
    )
    rows = body.get(rows_key)
    if rows_key == "input":
        if rows is None:
            raise InvalidInput("missing 'input'")
        rows = [rows]
    limit = gateway_of(request).settings.max_rows_per_request
    if isinstance(rows, list) and len(rows) > limit:
        raise PayloadTooLarge(f"{len(rows)} rows exceed the limit of {limit} per request")
    if check is not None:
        check(target, rows if isinstance(rows, list) else [])
    columns, n = rows_to_columns(rows, target.signature, target.allow_non_finite)
    infer = plane.request(rid, started, timeout_s, priority, version is not None, policy)
    return Prepared(target, columns, n, infer, rid)


async def _run(
    request: Request,
    model: str,
    body: Any,
    rows_key: str,
    check: Callable[[Target, list[Any]], None] | None = None,
) -> tuple[InferOutcome, str]:
    """:func:`prepare` and run one predict-shaped request."""
    ready = await prepare(request, model, body, rows_key, check)
    outcome = await _plane(request).infer(ready.target, ready.columns, ready.rows, ready.infer)
    context_of(request.scope).outcome = outcome  # for the inference log and the trace
    return outcome, ready.request_id


def _answered_by(outcome: InferOutcome, model: str) -> dict[str, Any]:
    """``model`` and ``version`` of a reply: the model asked for, unless its overflow
    model answered (then that one, and ``degraded_from`` the one asked for)."""
    if outcome.degraded_from is None:
        return {"model": model, "version": outcome.target.version}
    return {
        "model": outcome.target.model,
        "version": outcome.target.version,
        "degraded_from": outcome.degraded_from,
    }


@router.post("/models/{model}/predict", openapi_extra=docs.PREDICT)
async def predict(model: str, request: Request) -> Response:
    """Predict a batch of rows with a model (default version unless ``params.version``);
    a JSON body, or a multipart form whose fields are the inputs (images as files)."""
    return await _predict(model, request)


def _graph_check(target: Target, rows: list[Any]) -> None:
    if target.framework != GRAPH_FRAMEWORK:
        raise ModelNotFound(f"{target.model!r} is a model, not a graph", model=target.model)


@router.post("/graphs/{model}/predict", openapi_extra=docs.PREDICT, tags=["graphs"])
async def predict_graph(model: str, request: Request) -> Response:
    """Predict a batch of rows with an inference graph (a model whose framework is
    ``graph``): the same body and reply as ``/api/v1/models/{model}/predict``."""
    return await _predict(model, request, _graph_check)


@router.get("/graphs", tags=["graphs"])
async def list_graphs(request: Request) -> Response:
    """The inference graphs served now (their serving version), from the routing table."""
    table, visible = gateway_of(request).router.table, visible_models(request.scope)
    graphs = [
        {"name": name, "version": route.default_version, "versions": sorted(route.versions)}
        for name, route in sorted(table.models.items())
        if visible(name) and any(v.framework == GRAPH_FRAMEWORK for v in route.versions.values())
    ]
    return json_response({"graphs": graphs})


async def _predict(
    model: str, request: Request, check: Callable[[Target, list[Any]], None] | None = None
) -> Response:
    """Read a JSON body, or a multipart form whose fields are the inputs (images as
    files); run it on ``model``, after ``check``; the reply."""
    limit = gateway_of(request).settings.max_body_bytes
    if is_multipart(request):

        def signature() -> Signature:
            return _plane(request).target(model, None).signature

        body = await form_body(request, limit, signature)
    else:
        body = await read_json(request, limit, non_finite=True)
    if isinstance(body, dict) and "inputs" not in body:
        raise InvalidInput("missing 'inputs': a list of rows, e.g. [{\"features\": [...]}]")
    outcome, rid = await _run(request, model, body, "inputs", check)
    return json_response(
        {
            **_answered_by(outcome, model),
            "outputs": columns_to_rows(outcome.outputs, outcome.target.signature),
            "latency_ms": round(outcome.latency_ms, 3),
            "request_id": rid,
        },
        headers=outcome_headers(outcome, rid),
    )


def _model_of(request: Request, body: Any, what: str) -> str:
    """The ``model`` a body names (a JSON object's string field)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise InvalidInput(f"missing 'model': the name of the {what}")
    context_of(request.scope).model = model
    return model


@router.post("/predict", openapi_extra=docs.PREDICT_ONE)
async def predict_one(request: Request) -> Response:
    """Predict one input: ``{"model", "input"}`` -> ``{"prediction", "confidence"}``."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes, non_finite=True)
    model = _model_of(request, body, "model to call")
    outcome, rid = await _run(request, model, body, "input")
    row = columns_to_rows(outcome.outputs, outcome.target.signature)[0]
    result: dict[str, Any] = _answered_by(outcome, model)
    truncated = bool(row.pop("truncated", False))  # text models: the text was cut
    tokens = row.pop("tokens", None)
    if "label" in row and "probabilities" in row:
        result["prediction"] = row["label"]
        result["confidence"] = round(float(np.max(row["probabilities"])), 6)
    elif len(row) == 1:
        result["prediction"] = next(iter(row.values()))
    else:
        result["outputs"] = row
    if truncated:
        result["truncated"] = True
        result["tokens"] = int(tokens)
    result["latency_ms"] = round(outcome.latency_ms, 3)
    result["request_id"] = rid
    return json_response(result, headers=outcome_headers(outcome, rid))


def _embedding_check(target: Target, rows: list[Any]) -> None:
    """An embedding model, and texts it can embed."""
    if not any(spec.name == "embedding" for spec in target.signature.outputs):
        raise InvalidInput(
            f"model {target.model!r} ({target.framework}) does not make embeddings; "
            "use /api/v1/predict"
        )
    check_texts(rows, "inputs")


def check_texts(texts: list[Any], field: str) -> None:
    """Non-empty strings (the list itself was checked non-empty and within limits)."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInput(
                f"'{field}[{i}]' must be a string, got {type(text).__name__}", field=field
            )
        if not text:
            raise InvalidInput(f"'{field}[{i}]' is an empty string", field=field)


async def embed_texts(
    request: Request, model: str, body: dict[str, Any], dimensions: int | None = None
) -> tuple[InferOutcome, str]:
    """Embed ``body["inputs"]`` (a non-empty list) with ``model``; ``params`` as for
    predict. ``dimensions``: refuse unless the model makes embeddings that wide."""

    def check(target: Target, rows: list[Any]) -> None:
        _embedding_check(target, rows)
        if dimensions is not None:
            width = next(s for s in target.signature.outputs if s.name == "embedding").shape[-1]
            if dimensions != width:
                raise InvalidInput(
                    f"model {target.model!r} makes embeddings of {width} dimensions, not "
                    f"{dimensions}", field="dimensions",
                )  # fmt: skip

    return await _run(request, model, body, "inputs", check)


def _score_check(target: Target, rows: list[Any]) -> None:
    """A cross-encoder (a model scoring text pairs)."""
    if not any(spec.name == "score" for spec in target.signature.outputs):
        raise InvalidInput(
            f"model {target.model!r} ({target.framework}) does not score text pairs: a "
            "cross-encoder does (a one-label text classifier pushed with --meta task=score)"
        )


async def score_pairs(
    request: Request, model: str, queries: list[str], documents: list[str]
) -> tuple[np.ndarray, int, InferOutcome, str]:
    """Score each (query, document) pair with the cross-encoder ``model``: the scores
    (FP32, in pair order), the tokens scored, the outcome and the request id."""
    rows = [{"text": q, "text_pair": d} for q, d in zip(queries, documents, strict=True)]
    outcome, rid = await _run(request, model, {"pairs": rows}, "pairs", _score_check)
    tokens = outcome.outputs.get("tokens")
    used = int(tokens.sum()) if tokens is not None else 0
    return outcome.outputs["score"], used, outcome, rid


def embedding_reply(outcome: InferOutcome) -> tuple[np.ndarray, int, list[int]]:
    """The embeddings (rows x dimensions, FP32), the tokens embedded, the indices of
    the texts that were truncated to the model's maximum length."""
    outputs = outcome.outputs
    tokens = outputs.get("tokens")
    truncated = outputs.get("truncated")
    used = int(tokens.sum()) if tokens is not None else 0
    cut = np.flatnonzero(truncated).tolist() if truncated is not None else []
    return outputs["embedding"], used, cut


@router.post("/embed", openapi_extra=docs.EMBED)
async def embed(request: Request) -> Response:
    """Embed texts: ``{"model", "inputs": [...]}`` -> ``{"embeddings", "dimensions"}``."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    model = _model_of(request, body, "embedding model")
    inputs = body.get("inputs")
    if isinstance(inputs, str):
        body = {**body, "inputs": [inputs]}
    elif not isinstance(inputs, list) or not inputs:
        raise InvalidInput("'inputs' must be a non-empty list of strings", field="inputs")
    outcome, rid = await embed_texts(request, model, body)
    embeddings, used, cut = embedding_reply(outcome)
    result: dict[str, Any] = {
        **_answered_by(outcome, model),
        "embeddings": embeddings,
        "dimensions": int(embeddings.shape[1]),
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }
    if cut:
        result["truncated"] = cut
    result["latency_ms"] = round(outcome.latency_ms, 3)
    result["request_id"] = rid
    return json_response(result, headers=outcome_headers(outcome, rid))


@router.get("/models", tags=["registry"])
async def list_models(request: Request) -> Response:
    """Registered models the caller may use, their versions and what is serving now;
    ``versions``: how many are registered and how many loaded (with replicas)."""
    records = await asyncio.to_thread(gateway_of(request).registry.list_models)
    status, visible = gateway_of(request).status, visible_models(request.scope)
    shown = [r for r in records if visible(r.name)]
    return json_response(
        {"models": [status.model_summary(r) for r in shown], "versions": status.counts(shown)}
    )


@router.get("/models/{model}", tags=["registry"])
async def get_model(model: str, request: Request) -> Response:
    """One model: each version with its signature, metadata, status and replicas."""
    record = await asyncio.to_thread(gateway_of(request).registry.get_model, model)
    return json_response(await gateway_of(request).status.model_detail(record))


@router.get("/models/{model}/versions/{version}", tags=["registry"])
async def get_version(model: str, version: str, request: Request) -> Response:
    """One registered version with its signature, metadata, status and replicas."""
    record = await asyncio.to_thread(gateway_of(request).registry.get_version, model, version)
    return json_response(await gateway_of(request).status.version_detail(record))
