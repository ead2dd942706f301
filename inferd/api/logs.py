"""``GET /api/v1/logs``: a quick look at the inference log (the rows behind dashboards
and experiment analysis: which version answered which request, for which user hash).

Each route imports its database reader (:mod:`inferd.monitoring.inference_log`,
:mod:`inferd.monitoring.feedback`) when it first runs: they bring SQLAlchemy, which a
gateway process loads only once something reads the database."""

from __future__ import annotations

import asyncio
import functools
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from inferd.api.auth import authorize_model
from inferd.api.http import context_of, json_response, read_json
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InvalidInput

router = APIRouter(prefix="/api/v1", tags=["observability"])
MAX_LIMIT = 1000


def _instant(value: str | None, name: str) -> datetime | None:
    """An ISO 8601 time (naive ones are UTC)."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInput(
            f"{name} must be an ISO 8601 time, e.g. 2026-11-22T10:00:00Z; got {value!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@router.get("/logs")
async def logs(
    request: Request,
    model: str | None = None,
    version: str | None = None,
    status: Annotated[int | None, Query(ge=100, le=599)] = None,
    request_id: str | None = None,
    since: Annotated[str | None, Query(description="ISO 8601, inclusive")] = None,
    until: Annotated[str | None, Query(description="ISO 8601, exclusive")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
) -> Response:
    """Inference log rows matching every filter given, newest first. Rows reach the
    database within ``inference_log.flush_interval_s`` (1 s by default)."""
    if not gateway_of(request).settings.inference_log.enabled:
        raise InvalidInput("the inference log is off (inference_log.enabled: false)")
    from inferd.monitoring import inference_log

    rows = await asyncio.to_thread(
        inference_log.query,
        gateway_of(request).registry.engine,
        model=model,
        version=version,
        status_code=status,
        request_id=request_id,
        since=_instant(since, "since"),
        until=_instant(until, "until"),
        limit=limit,
    )
    return json_response({"logs": rows, "count": len(rows)})


@router.post("/feedback")
async def post_feedback(request: Request) -> Response:
    """Ground truth for a logged prediction: ``{"request_id", "label"}`` for a class,
    ``{"request_id", "value"}`` for a number; answers the stored feedback."""
    body = await read_json(request, 64 * 1024)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise InvalidInput("missing 'request_id': the X-Request-Id of the answered request")
    unknown = sorted(set(body) - {"request_id", "label", "value"})
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}; send request_id and label or value")
    state = gateway_of(request)
    if not state.settings.inference_log.enabled:
        raise InvalidInput("feedback needs the inference log (inference_log.enabled: false)")
    from inferd.monitoring import feedback

    allow = None
    if context_of(request.scope).principal is not None:  # a key may be limited to some models
        allow = functools.partial(authorize_model, request.scope)
    stored = await asyncio.to_thread(
        feedback.record, state.registry.engine, rid, body.get("label"), body.get("value"), allow
    )
    return json_response(stored, status_code=201)
