"""Kubernetes-style probes: live = the process answers; ready = every loaded model
serves (a model unloaded on purpose is not waited for)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.http import json_response
from inferd.observability.exposition import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get("/health/live")
async def live() -> Response:
    return json_response({"status": "live"})


@router.get("/health/ready")
async def ready(request: Request) -> Response:
    table = request.app.state.router.table
    models = {name: route.default_version for name, route in table.models.items()}
    not_ready = request.app.state.router.waiting_for()
    if table.generation == 0 or not_ready:
        return json_response(
            {"status": "not_ready", "models": models, "waiting_for": not_ready},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    return json_response({"status": "ready", "models": models})


@router.get("/metrics", tags=["observability"])
async def metrics(request: Request) -> Response:
    """Prometheus text format: every gateway process and replica (see
    :mod:`inferd.observability.exposition`); no credential needed, like the probes."""
    text = await request.app.state.router.server_metrics()
    return Response(text, media_type=CONTENT_TYPE)
