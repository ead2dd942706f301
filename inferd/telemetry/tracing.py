"""Optional OpenTelemetry tracing: gateway -> replica -> runtime spans.

Off unless the OpenTelemetry SDK is installed (``pip install 'inferd[tracing]'``) *and*
its standard environment variables ask for traces: ``OTEL_TRACES_EXPORTER`` (``otlp``,
``console``) or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keep it off. Everything else is the SDK's own reading of
its variables: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``http/protobuf``, the default,
or ``grpc``), headers, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*`` (export batching), ``OTEL_PROPAGATORS``.
They are OpenTelemetry's standard variables, shared with every other traced program,
not inferd settings; that is why this module reads them and :mod:`inferd.config` does not.

Each process (gateway, replica) sets up its own provider when it starts: spans are
exported in batches from a background thread, never on the request path. While tracing
is off, :data:`tracer` is None and the hot paths pay one attribute test.

The spans of one request (one trace, continued from the caller's ``traceparent`` when it
sends one, over HTTP headers or gRPC metadata):

- gateway, SERVER: ``POST /api/v1/models/{model}/predict`` (HTTP route) or
  ``inference.GRPCInferenceService/ModelInfer`` — status code, request id, model, version;
- gateway, CLIENT: ``inferd.replica infer`` / ``generate`` — the call to one replica; its
  context travels in the replica frame (``trace``, a propagator carrier);
- replica, SERVER: ``inferd.replica infer`` — arrival to answer, its wait for a batch as
  ``inferd.queue_ms``, with a child ``inferd.runtime predict`` (the batch's compute:
  rows, requests, framework); generations: ``inferd.replica generate`` with a
  ``first_token`` event and token counts.

Sampling is decided once, by the gateway (``OTEL_TRACES_SAMPLER``, default: follow the
caller's decision, else sample all): the context travels to the replica only when the
gateway's span records, so an unsampled request costs the replica nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger(__name__)

tracer: Tracer | None = None
"""The process's tracer once :func:`configure` turned tracing on; None: off."""
_provider: Any = None


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OpenTelemetry variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure(role: str, attributes: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on in this process when :func:`requested` and the SDK is installed;
    ``role`` (gateway, replica) and ``attributes`` join the resource. True when on."""
    global tracer, _provider
    if tracer is not None or not requested():
        return tracer is not None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning(
            "OTEL_* variables ask for traces but the OpenTelemetry SDK is not installed "
            "(pip install 'inferd[tracing]'): tracing stays off"
        )
        return False
    exporters = []
    for name in _exporter_names():
        exporter = _exporter(name)
        if exporter is not None:
            exporters.append(exporter)
    if not exporters:
        return False
    import inferd

    resource: dict[str, Any] = {"inferd.role": role, "service.version": inferd.__version__}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        resource["service.name"] = "inferd"
    resource.update(attributes or {})
    provider = TracerProvider(resource=Resource.create(resource))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    tracer = provider.get_tracer("inferd", inferd.__version__)
    logger.info("tracing on: %s", ", ".join(type(e).__name__ for e in exporters))
    return True


def _exporter_names() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower()
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]


def _exporter(name: str) -> Any:
    try:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter()
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ).strip()
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )

                return OTLPSpanExporter()
            if protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpExporter,
                )

                return HttpExporter()
            logger.warning("OTLP protocol %r is not supported (http/protobuf, grpc)", protocol)
            return None
    except ImportError as exc:
        logger.warning("trace exporter %r is not installed (%s): not used", name, exc.name)
        return None
    logger.warning("trace exporter %r is not supported (otlp, console): not used", name)
    return None


def shutdown() -> None:
    """Export what is left (at process exit)."""
    global tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    tracer = _provider = None


def carrier(span: Span | None = None) -> dict[str, str]:
    """The context of ``span`` (default: the current span) as propagator headers
    (``traceparent``, ...), to send along to another process."""
    from opentelemetry import trace
    from opentelemetry.propagate import inject

    headers: dict[str, str] = {}
    inject(headers, None if span is None else trace.set_span_in_context(span))
    return headers


def recording() -> bool:
    """Whether the current span records (this request was sampled): an unsampled one
    gets no child spans and its context is not sent on, so it costs nothing further."""
    from opentelemetry import trace

    return bool(trace.get_current_span().is_recording())


def client_span(name: str, replica: str) -> Span:
    """A CLIENT span, child of the current one, for a call to ``replica`` that outlives
    the current context (a stream): the caller ends it."""
    from opentelemetry.trace import SpanKind

    assert tracer is not None
    return tracer.start_span(name, kind=SpanKind.CLIENT, attributes={"inferd.replica": replica})


def context_from(headers: Mapping[str, str] | None) -> Any:
    """The context a caller sent (``traceparent``, ...); None (a new trace) otherwise."""
    if not headers:
        return None
    from opentelemetry.propagate import extract

    return extract(headers)


PROPAGATION_HEADERS = (b"traceparent", b"tracestate", b"baggage")


def asgi_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The propagation headers of an ASGI request (the others are not read)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k in PROPAGATION_HEADERS}


def failed(span: Span, code: str, message: str, status: int) -> None:
    """Mark what ended a request: its error code always; an error status only when it
    was the server's fault (5xx), not for bad input, as HTTP server spans do."""
    span.set_attribute("inferd.error", code)
    if status >= 500:
        set_error(span, message)


def set_error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))


def record_replica_infer(
    carrier: Mapping[str, str],
    arrived_ns: int,
    batch: Any,
    request_id: str,
    framework: str,
    error: tuple[str, str, int] | None,
    cancelled: bool = False,
) -> None:
    """A replica's spans for one answered predict, after the fact: ``inferd.replica
    infer`` from arrival to now (its wait for a batch as ``inferd.queue_ms``) and the
    ``inferd.runtime predict`` of its batch (``batch``: a filled
    :class:`inferd.serving.batcher.BatchTrace`; not filled when the request never reached
    a batch). ``error``: (code, message, status) of its failure."""
    from opentelemetry import trace

    if tracer is None:
        return
    attributes = {"inferd.request_id": request_id} if request_id else {}
    span = tracer.start_span(
        "inferd.replica infer",
        context=context_from(carrier),
        kind=trace.SpanKind.SERVER,
        start_time=arrived_ns,
        attributes=attributes,
    )
    if batch.started_ns:
        span.set_attribute("inferd.queue_ms", (batch.started_ns - arrived_ns) / 1e6)
        compute = tracer.start_span(
            "inferd.runtime predict",
            trace.set_span_in_context(span),
            start_time=batch.started_ns,
            attributes={
                "inferd.runtime": framework,
                "inferd.batch.rows": batch.rows,
                "inferd.batch.requests": batch.requests,
            },
        )
        if error is not None:
            failed(compute, *error)
        compute.end(batch.ended_ns)
    if error is not None:
        failed(span, *error)
    if cancelled:
        span.set_attribute("inferd.cancelled", True)
    span.end()


class GenerationSpan:
    """A replica's ``inferd.replica generate`` span: from the request's arrival to its
    last token, a ``first_token`` event (TTFT), token counts and the finish reason."""

    def __init__(self, carrier: Mapping[str, str], request_id: str) -> None:
        from opentelemetry import trace

        assert tracer is not None
        attributes = {"inferd.request_id": request_id} if request_id else {}
        self.span = tracer.start_span(
            "inferd.replica generate",
            context=context_from(carrier),
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
        )
        self.tokens = 0
        self.ended = False

    def update(self, out: Any) -> None:
        """Called with each output of the engine (or the error that ended it)."""
        if self.ended:
            return
        span = self.span
        if isinstance(out, BaseException):
            code = str(getattr(out, "code", type(out).__name__))
            failed(span, code, f"{type(out).__name__}: {out}", getattr(out, "status_code", 500))
            self._end()
            return
        if self.tokens == 0:
            span.add_event("first_token")
        self.tokens += 1
        if out.finished:
            span.set_attribute("gen_ai.usage.input_tokens", out.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", out.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason or ""])
            self._end()

    def cancelled(self) -> None:
        if not self.ended:
            self.span.set_attribute("inferd.cancelled", True)
            self._end()

    def _end(self) -> None:
        self.ended = True
        self.span.end()
