"""The gateway ASGI app: routes, and the one place errors become JSON responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import inferd
from inferd.api import health, v1
from inferd.api.http import json_response, request_id_of
from inferd.api.status import StatusView
from inferd.config import Settings
from inferd.errors import InferdError
from inferd.registry import Registry
from inferd.routing.dataplane import DataPlane
from inferd.routing.router import Router

logger = logging.getLogger(__name__)


def create_app(settings: Settings, router: Router, registry: Registry) -> FastAPI:
    app = FastAPI(
        title="inferd",
        version=inferd.__version__,
        description="Model serving: predict, registry and health APIs.",
    )
    app.state.settings = settings
    app.state.router = router
    app.state.registry = registry
    app.state.dataplane = DataPlane(router, settings.request_timeout_s)
    app.state.status = StatusView(router)
    app.include_router(health.router)
    app.include_router(v1.router)
    _install_error_handlers(app)
    return app


def _error(request: Request, status: int, code: str, message: str, **extra: object) -> Response:
    rid = request_id_of(request)
    body = {"error": {"code": code, "message": message, **extra, "request_id": rid}}
    return json_response(body, status_code=status, headers={"x-request-id": rid})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InferdError)
    async def inferd_error(request: Request, exc: InferdError) -> Response:
        if exc.status_code >= 500:
            logger.warning("%s %s -> %d %s: %s", request.method, request.url.path,
                           exc.status_code, exc.code, exc.message)
        response = _error(request, exc.status_code, exc.code, exc.message, **exc.details)
        response.headers.update(exc.headers())
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()
        ]
        return _error(request, 422, "invalid_input", "request does not match the API schema",
                      errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return _error(request, exc.status_code, code, message)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(request, 500, "internal_error",
                      "internal server error; the server log has the details")
