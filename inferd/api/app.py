"""The gateway ASGI app: routes, and the handlers that answer every error with
:func:`~inferd.api.http.error_response`.

Data-plane routes are dispatched by :class:`FastPath` straight to their handlers,
skipping the framework's middleware and dependency stack: profiled under load, that
stack took 35-40 % of a gateway process's CPU against ~12 % for the predict handler
itself. The same handlers stay registered on the FastAPI app, so ``/docs`` and
``/openapi.json`` describe them, and errors go through the same
:func:`~inferd.api.http.error_response`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import inferd
from inferd.access.limits import RateLimits, rate_limits_for
from inferd.api import (
    console,
    deployments,
    drift,
    explain,
    generate,
    health,
    keys,
    logs,
    openai,
    openai_batch,
    registration,
    rerank,
    v1,
    v2,
    v2_generate,
    v2_repository,
    whoami,
)
from inferd.api import jobs as jobs_api
from inferd.api.http import DisconnectWatch, context_of, error_response
from inferd.api.jobs import AsyncGate, wants_async
from inferd.api.limits import RateLimitGate
from inferd.api.state import GatewayState
from inferd.api.status import StatusView
from inferd.config import Settings
from inferd.errors import InferdError
from inferd.jobs import Jobs
from inferd.routing.cache import ResultCache
from inferd.routing.dataplane import DataPlane
from inferd.routing.router import Router
from inferd.telemetry import tracing
from inferd.telemetry.log_rows import RowBuffer

if TYPE_CHECKING:  # opened on first use in a gateway process (api/worker.py)
    from inferd.registry import Registry

logger = logging.getLogger(__name__)
Handler = Callable[..., Awaitable[Response]]


def create_app(
    settings: Settings,
    router: Router,
    registry: Registry,
    inference_log: RowBuffer | None = None,
    result_cache: ResultCache | None = None,
    rate_limits: RateLimits | None = None,
    jobs: Jobs | None = None,
    dataplane: DataPlane | None = None,
) -> ASGIApp:
    """The gateway's ASGI app. ``dataplane``: the process's, when its gRPC service shares
    it (else one is made here, over ``result_cache``)."""
    app = FastAPI(
        title="inferd",
        version=inferd.__version__,
        description="Model serving: predict, registry and health APIs.",
    )
    if dataplane is None:
        ttl_s = settings.cache.ttl_s
        dataplane = DataPlane(router, settings.request_timeout_s, result_cache, ttl_s)
    if inference_log is not None:  # a graph's node calls are log rows of their own
        dataplane.graphs.log = inference_log.record
    # Shared with the gRPC service when given, so both protocols draw from one budget.
    limits = rate_limits if rate_limits is not None else rate_limits_for(settings)
    app.inferd_gateway = GatewayState(  # type: ignore[attr-defined]
        settings=settings,
        router=router,
        registry=registry,
        dataplane=dataplane,
        status=StatusView(router),
        console_registry=console.RegistryCache(),
        inference_log=inference_log,
        jobs=jobs,
        limits=limits,
    )
    app.include_router(health.router)
    app.include_router(console.router)
    app.include_router(drift.router)
    app.include_router(v1.router)
    app.include_router(explain.router)
    app.include_router(generate.router)
    app.include_router(openai.router)
    app.include_router(rerank.router)
    app.include_router(openai_batch.router)
    app.include_router(v2.router)
    app.include_router(v2_repository.router)
    app.include_router(v2_generate.router)
    app.include_router(deployments.router)
    app.include_router(registration.router)
    app.include_router(whoami.router)
    _install_error_handlers(app)
    app.include_router(logs.router)
    app.include_router(keys.router)
    app.include_router(jobs_api.router)
    fast = FastPath(
        app,
        {
            ("POST", "/api/v1/models/{model}/predict"): (v1.predict, "v1"),
            ("POST", "/api/v1/predict"): (v1.predict_one, "v1"),
            ("POST", "/api/v1/graphs/{model}/predict"): (v1.predict_graph, "v1"),
            ("POST", "/api/v1/models/{model}/explain"): (explain.explain, "explain"),
            ("POST", "/api/v1/models/{model}/versions/{version}/explain"): (
                explain.explain,
                "explain",
            ),
            ("POST", "/v1/models/{model}:explain"): (explain.explain_v1, "explain"),
            ("POST", "/v2/models/{model}/infer"): (v2.infer, "v2"),
            ("POST", "/v2/models/{model}/versions/{version}/infer"): (v2.infer, "v2"),
        },
        inference_log,
    )
    app_: ASGIApp = AsyncGate(fast, app)  # async requests are queued, not run here
    if limits is not None and settings.rate_limits.limits_requests:
        app_ = RateLimitGate(app_, limits, settings.auth.internal_token)
    if settings.auth.enabled:  # outermost: limits count per authenticated client
        from inferd.access.authenticator import Authenticator
        from inferd.api.auth import AuthGate

        app_ = AuthGate(app_, Authenticator(settings.auth, registry.keys))
    if tracing.tracer is not None:  # outermost: a refused credential is a traced request too
        from inferd.api.tracing import TracingGate

        app_ = TracingGate(app_, tracing.tracer)
    return app_


class FastPath:
    """ASGI entry point: hot routes go straight to their handler, the rest to FastAPI.
    Each hot request, answered or refused, becomes a row of the inference log, from
    its path's model and what the handler left in its :class:`RequestContext`."""

    def __init__(
        self,
        app: FastAPI,
        routes: dict[tuple[str, str], tuple[Handler, str]],
        inference_log: RowBuffer | None = None,
    ) -> None:
        self.app = app
        self.state = app.state
        self._routes = [
            (method, _pattern(path), handler, api, path)
            for (method, path), (handler, api) in routes.items()
        ]
        self._log = inference_log

    def hot_route(self, scope: Scope) -> HotRoute | None:
        """The hot route an HTTP request's method and path name, if any."""
        for method, pattern, handler, api, route in self._routes:
            if scope["method"] == method and (match := pattern.match(scope["path"])):
                return handler, api, route, match.groupdict()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if (hot := self.hot_route(scope)) is not None:
                response = await self.answer(scope, receive, hot)
                if response is not _GONE:
                    await response(scope, receive, send)
                self.record(scope, hot, response)
                return
            if scope["method"] == "POST" and GENERATION_PATHS.match(scope["path"]):
                await _watched(self.app, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def answer(
        self, scope: Scope, receive: Receive, hot: HotRoute, watch: Watch | None = None
    ) -> Response:
        """The response of a hot route's handler (an error's, or ``_GONE`` when the
        client went away), not sent yet. ``watch``: what cancels the handler when its
        client goes away (by default a :class:`DisconnectWatch` on ``receive``)."""
        handler, _, route, params = hot
        scope["app"] = self.app
        context = context_of(scope)
        context.route, context.started = route, time.perf_counter()
        request = Request(scope, receive)
        if watch is None:
            watch = DisconnectWatch(scope, receive)
        try:
            return await handler(request=request, **params)
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
            return _GONE  # the client went away: nothing to send
        except Exception as exc:
            return error_response(request, exc)
        finally:
            watch.stop()

    def record(self, scope: Scope, hot: HotRoute, response: Response) -> None:
        if self._log is not None:
            _record(self._log, scope, hot[3], response, hot[1], context_of(scope).started)

    def direct(self, scope: Scope) -> HotRoute | None:
        """The hot route of a request the HTTP protocol may answer itself (see
        :mod:`inferd.api.http_protocol`): not an asynchronous one (the gate in front
        queues those)."""
        hot = self.hot_route(scope)
        if hot is None or wants_async(scope):
            return None
        return hot


class Watch(Protocol):
    """What cancels a request's handler when its client goes away."""

    def absorb(self) -> bool:
        """After a CancelledError: True when the watch caused it (and took it back)."""
        ...

    def stop(self) -> None:
        """The answer is ready: the client going away no longer cancels anything."""
        ...


HotRoute = tuple[Handler, str, str, dict[str, str]]
"""A hot route's handler, API family (``v1``, ``v2``), route template and the path's
parameters."""


def direct_path(app: ASGIApp) -> FastPath | None:
    """The app's :class:`FastPath` when nothing but the asynchronous gate stands in front
    of it (no auth, rate limits or tracing): then the HTTP protocol may run a hot
    route's handler without the ASGI cycle. Otherwise None."""
    if type(app) is AsyncGate and isinstance(app.app, FastPath):
        return app.app
    return None


def _pattern(route: str) -> re.Pattern[str]:
    """``/models/{model}/infer`` -> a regex with a named group per parameter."""
    return re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", route) + "$")


GENERATION_PATHS = re.compile(
    r"^/(api/v1/(models/[^/]+/)?generate|v1/(chat/)?completions"
    r"|v2/models/[^/]+(/versions/[^/]+)?/generate(_stream)?)$"
)
"""Routes that may wait long before they answer: their client going away cancels them
(a streamed answer is then cancelled by the stream itself)."""
_GONE = Response(status_code=499)
"""The status logged for a request whose client went away before its answer."""


async def _watched(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """``app`` with a :class:`DisconnectWatch` until its answer starts."""
    watch = DisconnectWatch(scope, receive)

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            watch.stop()
        await send(message)

    try:
        await app(scope, receive, sending)
    except asyncio.CancelledError:
        if not watch.absorb():
            raise
    finally:
        watch.stop()


def _record(
    log: RowBuffer,
    scope: Scope,
    params: dict[str, str],
    response: Response,
    api: str,
    started: float,
) -> None:
    """The request's inference log row, from what its handler left in its context
    (reading the response's headers back cost several times more)."""
    context = context_of(scope)
    model = params.get("model") or context.model
    if model is None:
        return  # refused before it named a model: not an inference on one
    ms = (time.perf_counter() - started) * 1000
    # Payload logging off (the default): one attribute read, no bodies touched.
    payload = None
    if log.payload_rate:
        payload = log.payload(context.body, getattr(response, "body", None))
    keep = log.keep_predictions
    log.record(context.log_row(api, model, response.status_code, ms, None, keep, payload=payload))


def _install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> Response:
        return error_response(request, exc)

    for exc_type in (InferdError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)
