"""Kubernetes-style probes, all public (no credential, no rate limit).

- ``/health/live``: the gateway process answers (its event loop turns). A liveness
  probe failing means restart the pod.
- ``/health/ready``: this gateway has the controller's routing table and every loaded
  model has a serving version with a ready replica (a model unloaded on purpose is
  not waited for); else 503 with ``Retry-After`` and what it waits for. A readiness
  probe failing means take the pod out of the Service, not restart it. A gateway on
  another host than its controller that has not heard from it for
  ``cluster.lost_control_after_s`` stays ready (it serves its last routing table) and
  says so under ``control``.
  With ``?models=none`` only the routing table counts: the readiness of a gateway
  Deployment behind a Service (Kubernetes), which must not leave the Service, API and
  all, because one model has no replica yet (a GPU pod that cannot be scheduled).
- ``/health``: the same as ``/health/ready`` (same status codes), its body also
  saying ``live`` and ``ready``.
- ``/health/ready/{model}``: the same for one model: 200 when it can answer now, 503
  when it cannot yet (loading, no ready replica, unloaded), 404 when it is unknown.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.http import json_response
from inferd.api.state import gateway_of
from inferd.monitoring.exposition import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get("/health/live")
async def live() -> Response:
    return json_response({"status": "live"})


@router.get("/health/ready")
async def ready(request: Request, models: str = "all") -> Response:
    if models not in ("all", "none"):
        return json_response(
            {"error": {"code": "invalid_input", "message": "models must be all or none"}},
            status_code=422,
        )
    return _readiness(request, spelled_out=False, models=models == "all")


@router.get("/health")
async def health(request: Request) -> Response:
    """``/health/ready`` with ``live`` and ``ready`` spelled out: the endpoint the design
    documents name, for load balancers and people."""
    return _readiness(request, spelled_out=True)


def _readiness(request: Request, spelled_out: bool, models: bool = True) -> Response:
    table = gateway_of(request).router.table
    not_ready = gateway_of(request).router.waiting_for() if models else []
    ready = table.generation > 0 and not not_ready
    body: dict[str, object] = {"status": "ready" if ready else "not_ready"}
    if spelled_out:
        body |= {"live": True, "ready": ready}
    body["models"] = {name: route.default_version for name, route in table.models.items()}
    link = gateway_of(request).router.server
    silent = link.silent_for()
    if link.reconnect and silent > gateway_of(request).settings.cluster.lost_control_after_s:
        # still ready: the data plane serves on without the control plane
        body["control"] = {
            "status": "unreachable",
            "address": link.address,
            "silent_s": round(silent, 1),
            "detail": f"the controller has not been heard from for {silent:.0f} s; serving "
            f"with the last routing table (generation {table.generation})",
        }
    if ready:
        return json_response(body)
    body["waiting_for"] = not_ready
    return json_response(body, status_code=503, headers={"Retry-After": "1"})


@router.get("/health/ready/{model}")
async def model_ready(model: str, request: Request) -> Response:
    router = gateway_of(request).router
    route = router.model(model)  # 404 for an unknown model
    version = route.default_version
    if version is None:
        reason = "unloaded" if not route.loaded else "no ready replica yet"
        return json_response(
            {"status": "not_ready", "model": model, "reason": reason},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    return json_response({"status": "ready", "model": model, "version": version})


@router.get("/metrics", tags=["observability"])
async def metrics(request: Request) -> Response:
    """Prometheus text format: every gateway process and replica (see
    :mod:`inferd.monitoring.exposition`); no credential needed, like the probes."""
    text = await gateway_of(request).router.server.metrics()
    return Response(text, media_type=CONTENT_TYPE)
