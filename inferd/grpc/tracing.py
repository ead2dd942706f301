"""The gateway's SERVER span for each gRPC call, when tracing is on (see
:mod:`inferd.observability.tracing`): installed first, so it wraps auth and rate limits,
and continues the caller's context from the call's metadata (``traceparent``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace

from inferd.observability import tracing


class TracingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        name = details.method.lstrip("/")
        service, _, method = name.rpartition("/")
        headers = {str(k).lower(): str(v) for k, v in details.invocation_metadata or ()}
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        tracer = self.tracer

        def start() -> Any:
            return tracer.start_as_current_span(
                name,
                context=tracing.context_from(headers),
                kind=trace.SpanKind.SERVER,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            )

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with start() as span:
                    try:
                        return await inner(request, context)
                    finally:
                        _status(span, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream is None:
            return handler
        inner_stream = handler.stream_stream

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with start() as span:
                try:
                    async for response in inner_stream(requests, context):
                        yield response
                finally:
                    _status(span, context)

        return grpc.stream_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )


def _status(span: Any, context: grpc.aio.ServicerContext) -> None:
    code = context.code()
    if code is None:
        code = grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code not in (grpc.StatusCode.OK, None):
        tracing.set_error(span, code.name)
