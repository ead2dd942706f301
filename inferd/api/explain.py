"""Explanations: each feature's share of a prediction (``POST
/api/v1/models/{model}/explain``, and KServe V1's ``POST /v1/models/{model}:explain``).

The rows are a predict's; the replica computes the attributions
(:mod:`inferd.runtimes.explain`: exact TreeSHAP for tree models, KernelSHAP against the
version's background rows for the rest) and this route shapes them: for each row and
each explained output, ``value`` and a feature -> attribution map whose values add up
to ``value - expected_value``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api import docs
from inferd.api.http import context_of, json_response, outcome_headers, read_json
from inferd.api.state import gateway_of
from inferd.api.v1 import prepare
from inferd.errors import InvalidInput
from inferd.shapes import replica as p

router = APIRouter(tags=["inference"])

DIGITS = 9
"""Significant digits kept of each attribution (float64 noise beyond)."""


@router.post("/api/v1/models/{model}/explain", openapi_extra=docs.EXPLAIN)
@router.post("/api/v1/models/{model}/versions/{version}/explain", openapi_extra=docs.EXPLAIN)
async def explain(model: str, request: Request, version: str | None = None) -> Response:
    """Per-feature attributions of a batch of rows' predictions (the serving version,
    unless the path or ``params.version`` pins one)."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes, non_finite=True)
    if isinstance(body, dict) and "inputs" not in body:
        raise InvalidInput("missing 'inputs': a list of rows, as for predict")
    return await _explained(request, model, body, "inputs", version)


@router.post("/v1/models/{model}:explain", openapi_extra=docs.EXPLAIN_V1)
async def explain_v1(model: str, request: Request) -> Response:
    """KServe's V1 explain: ``{"instances": [...]}``, rows as for predict."""
    body = await read_json(request, gateway_of(request).settings.max_body_bytes, non_finite=True)
    if isinstance(body, dict) and "instances" not in body:
        raise InvalidInput("missing 'instances': a list of rows")
    return await _explained(request, model, body, "instances", None)


async def _explained(
    request: Request, model: str, body: Any, rows_key: str, version: str | None
) -> Response:
    ready = await prepare(request, model, body, rows_key, version=version)
    plane = gateway_of(request).dataplane
    explained, outcome = await plane.explain(ready.target, ready.columns, ready.rows, ready.infer)
    context_of(request.scope).outcome = outcome  # the inference log's row
    result = {
        "model": model,
        "version": ready.target.version,
        **shaped(explained),
        "latency_ms": round(outcome.latency_ms, 3),
        "request_id": ready.request_id,
    }
    return json_response(result, headers=outcome_headers(outcome, ready.request_id))


def shaped(e: p.Explained) -> dict[str, Any]:
    """The answer's JSON: what was explained, how, and a row per input row."""
    attributions = p.from_tensor(e.attributions).tolist()  # (rows, features, outputs)
    values = p.from_tensor(e.values).tolist()
    expected = p.from_tensor(e.expected).tolist()
    rows = [
        {
            "value": {o: _round(values[i][k]) for k, o in enumerate(e.outputs)},
            "attributions": {
                o: {f: _round(attributions[i][j][k]) for j, f in enumerate(e.features)}
                for k, o in enumerate(e.outputs)
            },
        }
        for i in range(len(values))
    ]
    return {
        "method": e.method,
        "space": e.space,
        "features": e.features,
        "outputs": e.outputs,
        "expected_value": {o: _round(expected[k]) for k, o in enumerate(e.outputs)},
        "explanations": rows,
    }


def _round(x: float) -> float:
    return float(f"{x:.{DIGITS}g}")
