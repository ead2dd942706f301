"""The gateway's SERVER span for each HTTP request, when tracing is on (see
:mod:`inferd.telemetry.tracing`); the app is not wrapped at all when it is off."""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.api.http import context_of
from inferd.telemetry import tracing


class TracingGate:
    """Outermost ASGI layer: the request's span (continuing the caller's ``traceparent``)
    is the current one while the app runs, so replica calls become its children. Named
    ``METHOD route`` (the route template, low cardinality), with the status code, request
    id, and the model and version that answered when the request reached one. A request
    the sampler drops costs the sampling decision only (the app runs unwrapped)."""

    def __init__(self, app: ASGIApp, tracer: Any) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        parent = tracing.context_from(tracing.asgi_headers(scope["headers"]))
        span = self.tracer.start_span(method, context=parent, kind=trace.SpanKind.SERVER)
        if not span.is_recording():  # not sampled: nothing more to do, nothing to pass on
            await self.app(scope, receive, send)
            return
        span.set_attribute("http.request.method", method)
        span.set_attribute("url.path", scope["path"])
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            span.record_exception(exc)
            tracing.set_error(span, type(exc).__name__)
            raise
        finally:
            otel_context.detach(token)
            _finish(span, scope, method, status)


def _finish(span: Any, scope: Scope, method: str, status: int) -> None:
    context = context_of(scope)
    route = context.route
    if route is None and (found := scope.get("route")) is not None:
        route = getattr(found, "path", None)
    if route:
        span.update_name(f"{method} {route}")
        span.set_attribute("http.route", route)
    if (rid := context.request_id) is not None:
        span.set_attribute("inferd.request_id", rid)
    outcome = context.outcome
    if outcome is not None:
        span.set_attribute("inferd.model", outcome.target.model)
        span.set_attribute("inferd.version", outcome.target.version)
    elif (model := context.model) is not None:
        span.set_attribute("inferd.model", model)
    if status >= 500 or status == 0:
        tracing.set_error(span, f"HTTP {status}" if status else "no response")
    span.end()
