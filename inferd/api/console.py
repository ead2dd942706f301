"""The web console (``/ui``) and the JSON it draws from beside the rest of the API.

- ``GET /``: a browser (``Accept: text/html``) is sent to ``/ui/``; an API client gets
  a small JSON index of where things are, and whether a credential is needed (so the
  console asks for one before it calls anything that would refuse it).
- ``GET /ui/...``: the console's files (:mod:`inferd.console`), public like the probes:
  they hold no data. Every figure comes from the API with the person's credential.
- ``GET /api/v1/console/overview``: every model the caller may see with its versions,
  traffic split, replicas (ready, desired, where) and its figures over the last
  minutes; alerts firing; the control plane's health. One request for the whole page,
  so 200 models cost one round trip.
- ``GET /api/v1/console/series``: recent time series per version (requests/s,
  latency, errors, batch size, queue, and for LLMs TTFT, inter-token latency, tokens/s,
  KV-cache use), polled with ``since`` so each poll carries only the new points.

The figures are the server process's (:mod:`inferd.control.console`): every gateway
answers the same.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import RedirectResponse, Response

import inferd
from inferd.api.http import context_of, json_response
from inferd.api.state import gateway_of
from inferd.console import SECURITY_HEADERS, assets
from inferd.errors import InvalidInput, NotFound
from inferd.registry import ModelRecord
from inferd.runtimes import GENERATIVE
from inferd.shapes.control import ConsoleView, ModelRoute, VersionRoute

if TYPE_CHECKING:
    from inferd.registry import Registry

router = APIRouter(tags=["console"])
REGISTRY_TTL_S = 2.0
"""How long a gateway reuses its read of the registry's models for the overview (a
console polls every few seconds; 200 models need not be read for each)."""


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    if "text/html" in request.headers.get("accept", "") and _console_on(request):
        return RedirectResponse("/ui/", status_code=302)
    return json_response(
        {
            "name": "inferd",
            "version": inferd.__version__,
            "console": "/ui/" if _console_on(request) else None,
            "auth": bool(gateway_of(request).settings.auth.enabled),
            "api": "/api/v1/models",
            "openai": "/v1/models",
            "open_inference_protocol": "/v2",
            "docs": "/docs",
            "health": "/health",
            "metrics": "/metrics",
        }
    )


def _console_on(request: Request) -> bool:
    return bool(gateway_of(request).settings.console.enabled)


@router.get("/ui", include_in_schema=False)
async def console_root() -> Response:
    return RedirectResponse("/ui/", status_code=302)


@router.get("/ui/{path:path}", include_in_schema=False)
async def console_file(path: str, request: Request) -> Response:
    """The page (any path without a file is the page: the console routes in the
    fragment) and its files, with an ETag, gzip, and the console's security headers."""
    if not _console_on(request):
        raise NotFound("the console is off on this server (console.enabled: false)")
    files = assets()
    asset = files.get(path)
    if asset is None:
        if "." in path.rsplit("/", 1)[-1]:
            raise NotFound(f"no console file {path!r}")
        asset = files.get("")
        if asset is None:
            raise NotFound("the console's files are missing from this installation")
    headers = {**SECURITY_HEADERS, "etag": asset.etag, "cache-control": "no-cache"}
    headers["vary"] = "accept-encoding"
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    body = asset.body
    if asset.gzipped is not None and "gzip" in request.headers.get("accept-encoding", ""):
        body = asset.gzipped
        headers["content-encoding"] = "gzip"
    return Response(body, media_type=asset.media_type, headers=headers)


# -- figures ---------------------------------------------------------------------------------


def visible_models(request: Request) -> frozenset[str] | None:
    """The models the caller may see: None for all (auth off, an admin, a key not
    limited to some models)."""
    principal = context_of(request.scope).principal
    return None if principal is None else principal.limited_to()


class RegistryCache:
    """The registry's models as last read, for ``REGISTRY_TTL_S``."""

    def __init__(self) -> None:
        self.records: list[ModelRecord] = []
        self.read_at = -1e9
        self.lock = asyncio.Lock()

    async def models(self, registry: Registry) -> list[ModelRecord]:
        async with self.lock:
            if time.monotonic() - self.read_at > REGISTRY_TTL_S:
                self.records = await asyncio.to_thread(registry.list_models)
                self.read_at = time.monotonic()
            return self.records


def _window(window_s: float) -> float:
    if not 10 <= window_s <= 86400:
        raise InvalidInput("'window_s' must be 10 to 86400 seconds")
    return window_s


@router.get("/api/v1/console/overview")
async def overview(
    request: Request,
    window_s: Annotated[float, Query(description="The figures' window, seconds.")] = 300.0,
) -> Response:
    """Every model the caller may see, with what runs and its figures over the last
    ``window_s``; alerts firing or pending; the control plane's health."""
    state = gateway_of(request)
    visible = visible_models(request)
    cache: RegistryCache = state.console_registry
    records, server = await asyncio.gather(
        cache.models(state.registry),
        state.router.server.console(
            ConsoleView.OVERVIEW,
            None if visible is None else sorted(visible),
            None,
            _window(window_s),
        ),
    )
    found = orjson.loads(server)
    figures = found.get("figures", {}).get("models", {})
    table = state.router.table
    models = [
        _model_entry(record, table.models.get(record.name), figures.get(record.name))
        for record in records
        if visible is None or record.name in visible
    ]
    principal = context_of(request.scope).principal
    return json_response(
        {
            "models": models,
            "window_s": found.get("figures", {}).get("window_s", window_s),
            "alerts": found.get("alerts", []),
            "alerts_evaluated_at": found.get("alerts_evaluated_at"),
            # the hosts and gateways of the control plane are an operator's business
            "health": found.get("health") if visible is None else None,
            "routing_generation": table.generation,
            "admin": principal is None or principal.admin,
        }
    )


def _model_entry(
    record: ModelRecord, route: ModelRoute | None, figures: dict[str, Any] | None
) -> dict[str, Any]:
    versions = route.versions if route is not None else {}
    traffic = dict(route.traffic) if route is not None and route.traffic else {}
    if not traffic and route is not None and route.default_version is not None:
        traffic = {route.default_version: 100}
    where: dict[str, int] = {}
    for vroute in versions.values():
        for replica in vroute.replicas:
            where[replica.placement] = where.get(replica.placement, 0) + 1
    return {
        "name": record.name,
        "description": record.description,
        "framework": record.framework,
        "kind": _kind(record.framework, versions),
        "tags": record.tags,
        "loaded": record.loaded,
        "registered_versions": len(record.versions),
        "serving_version": route.default_version if route is not None else None,
        "traffic": traffic,
        "versions": [_version_entry(v) for v in versions.values()],
        "replicas_ready": sum(r.state == "ready" for v in versions.values() for r in v.replicas),
        "replicas_desired": sum(v.desired_replicas for v in versions.values()),
        "where": where,
        "figures": figures,
    }


def _version_entry(vroute: VersionRoute) -> dict[str, Any]:
    states: dict[str, int] = {}
    for replica in vroute.replicas:
        state = replica.state.value  # orjson takes str keys, not enum members
        states[state] = states.get(state, 0) + 1
    return {
        "version": vroute.version,
        "framework": vroute.framework,
        "replicas": states,
        "replicas_desired": vroute.desired_replicas,
        "mirror_pct": vroute.mirror_pct,
    }


def _kind(framework: str, versions: dict[str, VersionRoute]) -> str:
    """generate | embed | predict: which playground fits."""
    if framework in GENERATIVE:
        return "generate"
    for vroute in versions.values():
        if any(o.name == "embedding" for o in vroute.signature.outputs):
            return "embed"
    return "predict"


@router.get("/api/v1/console/series")
async def series(
    request: Request,
    models: Annotated[str | None, Query(description="Comma-separated model names.")] = None,
    since: Annotated[float | None, Query(description="The `until` of the last answer.")] = None,
    window_s: float = 300.0,
) -> Response:
    """Time series per version of ``models`` (all the caller may see when omitted),
    one point per ``console.slot_s``: after ``since``, or over the last ``window_s``."""
    visible = visible_models(request)
    wanted = None if models is None else [m for m in models.split(",") if m]
    if wanted is not None and visible is not None:
        wanted = [m for m in wanted if m in visible]
    elif wanted is None and visible is not None:
        wanted = sorted(visible)
    body = await gateway_of(request).router.server.console(
        ConsoleView.SERIES, wanted, since, _window(window_s)
    )
    return Response(body, media_type="application/json")
