"""``GET /api/v1/models/{model}/drift`` (the serving version) and
``GET /api/v1/models/{model}/versions/{version}/drift``: a version's input drift, the
features that moved first. The figures are the server process's
(:class:`~inferd.control.drift.DriftMonitor`), asked over the control channel as the
console's are; the ``infer`` scope and the model's allow-list apply, as for its metadata.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.state import gateway_of
from inferd.errors import ModelNotFound
from inferd.shapes.control import ConsoleView

router = APIRouter(prefix="/api/v1", tags=["models"])


@router.get("/models/{model}/drift")
async def serving_drift(model: str, request: Request) -> Response:
    """Input drift of the model's serving version (see the version's route)."""
    return await _drift(request, model, None)


@router.get("/models/{model}/versions/{version}/drift")
async def version_drift(model: str, version: str, request: Request) -> Response:
    """Input drift of one version: its reference (from the sample registered with it, or
    its first requests), its current window, each feature's scores (PSI; KS for numeric
    features, chi-squared for categorical ones), most moved first, and the features at or
    over the PSI threshold. ``status``: ``ok``, ``drifted``, ``collecting`` (no reference
    yet), ``warming`` (too few rows in the window), ``not_running``, ``unsupported``
    (generative models) or ``disabled``."""
    return await _drift(request, model, version)


async def _drift(request: Request, model: str, version: str | None) -> Response:
    body = await gateway_of(request).router.server.console(
        ConsoleView.DRIFT, [model], version=version
    )
    error = orjson.loads(body).get("error")
    if error is not None:
        raise ModelNotFound(error["message"], model=model)
    return Response(body, media_type="application/json")
