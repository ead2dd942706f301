"""OpenTelemetry tracing against the real server: spans exported over OTLP/HTTP to a
collector this test runs (decoding the real protobuf requests), for HTTP predict, gRPC
ModelInfer and a generation, continuing the caller's ``traceparent``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp

from inferd.grpc import grpc_service_pb2 as pb
from inferd.grpc import grpc_service_pb2_grpc as pb_grpc
from inferd.telemetry.tracing import requested
from tests.conftest import (
    InferdServer,
    arithmetic_model,
    build_tiny_gpt2,
    push_folder,
    push_source,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
BOOM = arithmetic_model("x").replace(
    "        x = batch",
    "        if (batch['x'] < 0).any():\n            raise ValueError('negative x')\n"
    "        x = batch",
)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[str] = field(default_factory=list)
    status: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Collector:
    """An OTLP/HTTP trace receiver on a free port: ``POST /v1/traces`` with an
    ``ExportTraceServiceRequest``."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = otlp.ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.add(request)
                reply = otlp.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: Any) -> None:
        found = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes}, resource,
                        [e.name for e in s.events], s.status.code,
                    ))  # fmt: skip
        with self.lock:
            self.spans.extend(found)

    def trace(self, trace_id: str, count: int, timeout_s: float = 20) -> list[Span]:
        """The spans of one trace, once ``count`` of them arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if len(spans) >= count:
                time.sleep(0.3)  # any more that should not be there
                with self.lock:
                    return [s for s in self.spans if s.trace_id == trace_id]
            time.sleep(0.05)
        raise AssertionError(f"{len(spans)} span(s) of trace {trace_id}, not {count}: {spans}")


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InferdServer, Collector]]:
    collector = Collector()
    data = tmp_path_factory.mktemp("tracing")
    push_source(data, "calc", arithmetic_model("x * 2"))
    push_source(data, "boom", BOOM)
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_SERVICE_NAME": "inferd-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready(timeout_s=120)
        yield server, collector
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        collector.server.shutdown()
        collector.server.server_close()


def _traceparent(n: int) -> tuple[str, str, str]:
    trace_id = f"{n:08x}" + TRACE_ID[8:]
    parent = f"{n:016x}"
    return trace_id, parent, f"00-{trace_id}-{parent}-01"


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def _check_replica_side(spans: list[Span], client: Span, model: str) -> None:
    replica = _one(spans, "inferd.replica infer")  # the client span is not in ``spans``
    assert replica.parent == client.span_id and replica.kind == 2  # SERVER
    assert replica.resource["inferd.role"] == "replica"
    assert replica.resource["inferd.model"] == model
    assert replica.resource["service.name"] == "inferd-test"
    runtime = _one(spans, "inferd.runtime predict")
    assert runtime.parent == replica.span_id
    assert runtime.attributes["inferd.runtime"] == "python"
    assert runtime.attributes["inferd.batch.rows"] >= 1
    assert runtime.attributes["inferd.batch.requests"] >= 1
    assert replica.start <= runtime.start <= runtime.end <= replica.end
    queue_ms = replica.attributes["inferd.queue_ms"]
    assert queue_ms >= 0 and abs((runtime.start - replica.start) / 1e6 - queue_ms) < 0.01


@pytest.mark.slow
def test_http_predict_is_one_trace_gateway_replica_runtime(traced):
    server, collector = traced
    trace_id, parent, header = _traceparent(1)
    reply = server.client.post(
        "/api/v1/models/calc/predict",
        json={"inputs": [{"x": 1.0}, {"x": 2.0}]},
        headers={"traceparent": header, "x-request-id": "trace-me-1"},
    )
    assert reply.status_code == 200, reply.text
    assert "tracing on" in server.log()
    spans = collector.trace(trace_id, 4)
    assert len(spans) == 4, [s.name for s in spans]
    gateway = _one(spans, "POST /api/v1/models/{model}/predict")
    assert gateway.parent == parent and gateway.kind == 2  # SERVER, the caller's child
    assert gateway.resource["inferd.role"] == "gateway"
    assert gateway.attributes["http.response.status_code"] == 200
    assert gateway.attributes["http.route"] == "/api/v1/models/{model}/predict"
    assert gateway.attributes["inferd.request_id"] == "trace-me-1"
    assert (gateway.attributes["inferd.model"], gateway.attributes["inferd.version"]) == (
        "calc",
        "v1",
    )
    client = next(s for s in spans if s.name == "inferd.replica infer" and s.kind == 3)
    assert client.parent == gateway.span_id and client.attributes["inferd.rows"] == 2
    _check_replica_side([s for s in spans if s is not client], client, "calc")


@pytest.mark.slow
def test_a_request_without_traceparent_starts_a_trace_and_errors_are_marked(traced):
    server, collector = traced
    reply = server.client.post(
        "/api/v1/models/calc/predict",
        json={"inputs": [{"y": 1.0}]},
        headers={"x-request-id": "trace-me-bad"},
    )
    assert reply.status_code == 422
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with collector.lock:
            found = [
                s
                for s in collector.spans
                if s.attributes.get("inferd.request_id") == "trace-me-bad"
            ]
        if found:
            break
        time.sleep(0.05)
    assert len(found) == 1
    assert found[0].parent == "" and found[0].attributes["http.response.status_code"] == 422
    assert found[0].status == 0  # a client error is not the server's: status unset
    missing = server.client.post("/api/v1/models/nope/predict", json={"inputs": [{"x": 1.0}]})
    assert missing.status_code == 404


@pytest.mark.slow
def test_grpc_model_infer_continues_the_callers_trace(traced):
    server, collector = traced
    trace_id, parent, header = _traceparent(2)
    request = pb.ModelInferRequest(model_name="calc", id="g1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3])
    tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, metadata=(("traceparent", header),)
        )
    assert reply.model_name == "calc"
    spans = collector.trace(trace_id, 4)
    gateway = _one(spans, "inference.GRPCInferenceService/ModelInfer")
    assert gateway.parent == parent and gateway.kind == 2
    assert gateway.attributes["rpc.system"] == "grpc"
    assert gateway.attributes["rpc.grpc.status_code"] == 0
    client = next(s for s in spans if s.name == "inferd.replica infer" and s.kind == 3)
    assert client.parent == gateway.span_id and client.attributes["inferd.rows"] == 3
    _check_replica_side([s for s in spans if s is not client], client, "calc")


@pytest.mark.slow
def test_generation_spans_carry_first_token_and_usage(traced):
    server, collector = traced
    trace_id, parent, header = _traceparent(3)
    reply = server.client.post(
        "/api/v1/models/tiny/generate",
        json={"prompt": "The server", "max_tokens": 6, "temperature": 0},
        headers={"traceparent": header},
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    spans = collector.trace(trace_id, 3)
    assert len(spans) == 3, [s.name for s in spans]
    gateway = _one(spans, "POST /api/v1/models/{model}/generate")
    assert gateway.parent == parent and gateway.attributes["http.response.status_code"] == 200
    client = next(s for s in spans if s.name == "inferd.replica generate" and s.kind == 3)
    replica = next(s for s in spans if s.name == "inferd.replica generate" and s.kind == 2)
    assert client.parent == gateway.span_id and replica.parent == client.span_id
    assert replica.resource["inferd.model"] == "tiny"
    assert replica.events == ["first_token"]
    assert replica.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert replica.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert client.start <= replica.start <= replica.end <= client.end


def test_tracing_is_on_only_when_the_standard_variables_ask():
    assert not requested({})
    assert requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert requested({"OTEL_TRACES_EXPORTER": "console"})
    assert not requested({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert not requested({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})


def test_untraced_server_says_nothing_of_tracing(demo_server: InferdServer):
    assert "tracing on" not in demo_server.log()
    assert "OTEL" not in demo_server.log()


@pytest.mark.slow
def test_otlp_over_grpc(tmp_path: Path):
    """``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``: the same spans reach a gRPC collector."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

    collector = Collector()  # its add() decodes; here it is fed by the gRPC servicer
    collector.server.shutdown()
    collector.server.server_close()

    class Servicer(otlp_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:
            collector.add(request)
            return otlp.ExportTraceServiceResponse()

    grpc_collector = grpc.server(futures.ThreadPoolExecutor(2))
    otlp_grpc.add_TraceServiceServicer_to_server(Servicer(), grpc_collector)
    port = grpc_collector.add_insecure_port("127.0.0.1:0")
    grpc_collector.start()
    push_source(tmp_path, "calc", arithmetic_model("x + 1"))
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    server = InferdServer(tmp_path, workers=1, env=env)
    try:
        server.wait_ready(timeout_s=120)
        trace_id, parent, header = _traceparent(4)
        reply = server.client.post(
            "/api/v1/models/calc/predict",
            json={"inputs": [{"x": 1.0}]},
            headers={"traceparent": header},
        )
        assert reply.json()["outputs"] == [{"y": 2.0}]
        spans = collector.trace(trace_id, 4)
        assert _one(spans, "POST /api/v1/models/{model}/predict").parent == parent
        assert {s.resource["service.name"] for s in spans} == {"inferd"}
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        grpc_collector.stop(0)


@pytest.mark.slow
def test_failures_mark_the_spans_server_faults_as_errors(traced):
    server, collector = traced
    trace_id, _, header = _traceparent(5)
    reply = server.client.post(
        "/api/v1/models/boom/predict",
        json={"inputs": [{"x": -1.0}]},
        headers={"traceparent": header},
    )
    assert reply.status_code == 500, reply.text
    spans = collector.trace(trace_id, 4)
    gateway = _one(spans, "POST /api/v1/models/{model}/predict")
    replica = next(s for s in spans if s.name == "inferd.replica infer" and s.kind == 2)
    runtime = _one(spans, "inferd.runtime predict")
    assert gateway.status == replica.status == runtime.status == 2  # ERROR
    assert replica.attributes["inferd.error"] == "model_error"
    # a prompt over the model's context: the replica refuses it (413), not the server's fault
    trace_id, _, header = _traceparent(6)
    reply = server.client.post(
        "/api/v1/models/tiny/generate",
        json={"prompt": "The server answers " * 60, "max_tokens": 4},
        headers={"traceparent": header},
    )
    assert reply.status_code == 413, reply.text
    spans = collector.trace(trace_id, 3)
    replica = next(s for s in spans if s.name == "inferd.replica generate" and s.kind == 2)
    assert replica.attributes["inferd.error"] == reply.json()["error"]["code"]
    assert replica.status == 0
    assert _one(spans, "POST /api/v1/models/{model}/generate").status == 0


@pytest.mark.slow
def test_an_unsampled_request_leaves_no_span_anywhere(traced):
    """The caller decided not to sample (flags 00): the gateway follows it (the default
    parent-based sampler) and the replica is not even told of a trace."""
    server, collector = traced
    unsampled, _, header = _traceparent(7)
    header = header[:-2] + "00"
    assert (
        server.client.post(
            "/api/v1/models/calc/predict",
            json={"inputs": [{"x": 1.0}]},
            headers={"traceparent": header},
        ).status_code
        == 200
    )
    sampled, _, header = _traceparent(8)
    assert (
        server.client.post(
            "/api/v1/models/calc/predict",
            json={"inputs": [{"x": 1.0}]},
            headers={"traceparent": header},
        ).status_code
        == 200
    )
    collector.trace(sampled, 4)
    time.sleep(0.5)
    with collector.lock:
        assert [s for s in collector.spans if s.trace_id == unsampled] == []
