"""The gateway's SERVER span for each gRPC call, when tracing is on (see
:mod:`inferd.telemetry.tracing`): it covers auth and limits, and continues the
caller's context from the call's metadata (``traceparent``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

from inferd.grpc.http2 import Abort, Call, StatusCode
from inferd.telemetry import tracing


@contextlib.contextmanager
def server_span(tracer: Any, call: Call, service: str) -> Iterator[None]:
    """The call's span, its status the code the call ends with."""
    method = call.method.name
    with tracer.start_as_current_span(
        f"{service}/{method}",
        context=tracing.context_from(dict(call.metadata)),
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        code = StatusCode.OK
        try:
            yield
        except Abort as exc:
            code = exc.code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = StatusCode.CANCELLED
            raise
        except Exception:
            code = StatusCode.INTERNAL
            raise
        finally:
            span.set_attribute("rpc.grpc.status_code", int(code))
            if code != StatusCode.OK:
                tracing.set_error(span, code.name)
