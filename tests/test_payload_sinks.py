"""Payload sinks: the inference log's rows as CloudEvents to HTTP, Redis Streams, Kafka
and Parquet files in S3, off the request path.

Unit tests (no sockets) for the events, redaction, the gateway's sampling and the
runner's bounds; then the real server with an HTTP receiver this test runs, a Redis
stream and moto's S3 server as sinks (one server for all three), and a server whose
sinks are down (a closed port, and a listener that never answers) against one with no
sink, under the same load, side by side. Kafka: against a broker when one is reachable
(``INFERD_TEST_KAFKA_BOOTSTRAP``, default 127.0.0.1:9092), skipped loudly otherwise.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from inferd.bench.connection import encode_request, request_head
from inferd.bench.loadgen import LoadGenerator, LoadSpec
from inferd.bench.stats import summarize
from inferd.config import SINK_SCHEMES, PayloadLogConfig, Settings
from inferd.monitoring.sinks import SINKS, SinkRunner, display_name, open_sink
from inferd.monitoring.sinks.events import BATCH_CONTENT_TYPE, REDACTED, EventEncoder
from inferd.monitoring.sinks.kafka import KafkaSink, record
from inferd.monitoring.sinks.parquet import SCHEMA, table
from inferd.shapes.logs import LogRow, Payload
from inferd.telemetry import log_rows
from inferd.telemetry.log_rows import RowBuffer, user_hash
from tests.conftest import (
    InferdServer,
    arithmetic_model,
    free_port,
    moto_s3,
    push_source,
    reachable_redis_url,
    served,
)

BUCKET = "payload-logs"


def _row(i: int = 0, payload: Payload | None = None, **fields: Any) -> LogRow:
    values: dict[str, Any] = {
        "timestamp": 1_700_000_000.25 + i, "request_id": f"r{i}", "model_name": "calc",
        "version": "v1", "api": "v1", "status_code": 200, "latency_ms": 1.5,
    }  # fmt: skip
    return LogRow(**{**values, **fields}, payload=payload)


# -- units: no sockets ---------------------------------------------------------------------


def test_a_row_is_a_cloudevent_with_its_bodies_redacted() -> None:
    request = orjson.dumps({
        "inputs": [{"x": 1, "ssn": "123-45"}], "params": {"user": "alice"},
        "meta": {"deep": [{"ssn": "999"}]},
    })  # fmt: skip
    v2 = orjson.dumps({"inputs": [{"name": "ssn", "shape": [1], "datatype": "BYTES",
                                   "data": ["123"]}]})  # fmt: skip
    encoder = EventEncoder(["ssn", "user"], host="h1")
    row = _row(3, Payload(request, v2, len(request), len(v2)), user="alice")
    event = orjson.loads(encoder.batch([row]))[0]
    assert {k: v for k, v in event.items() if k != "data"} == {
        "specversion": "1.0", "id": "r3", "source": "inferd/h1/calc",
        "type": "io.inferd.inference.log", "time": "2023-11-14T22:13:23.250000Z",
        "datacontenttype": "application/json",
    }  # fmt: skip
    data = event["data"]
    assert "user" not in data and data["user_hash"] == user_hash("alice")
    assert data["status_code"] == 200 and data["version"] == "v1"
    payload = data["payload"]
    assert payload["request"] == {
        "inputs": [{"x": 1, "ssn": REDACTED}], "params": {"user": REDACTED},
        "meta": {"deep": [{"ssn": REDACTED}]},
    }  # fmt: skip
    assert payload["response"]["inputs"][0] == {  # a V2 tensor named ssn: its data
        "name": "ssn", "shape": [1], "datatype": "BYTES", "data": REDACTED,
    }  # fmt: skip
    assert (payload["request_bytes"], payload["response_bytes"]) == (len(request), len(v2))
    batch = orjson.loads(encoder.batch([row, _row(4)]))
    assert [e["id"] for e in batch] == ["r3", "r4"] and "payload" not in batch[1]["data"]


def test_a_body_that_is_not_json_is_base64_unless_redaction_is_on() -> None:
    binary = b"\x00\x01binary tensor"
    row = _row(payload=Payload(binary, None, len(binary), 0))

    def payload(encoder: EventEncoder) -> dict[str, Any]:
        return dict(orjson.loads(encoder.batch([row]))[0]["data"]["payload"])

    plain = payload(EventEncoder(host="h"))
    assert base64.b64decode(plain["request_base64"]) == binary and plain["request"] is None
    redacting = payload(EventEncoder(["x"], host="h"))
    assert "request_base64" not in redacting and redacting["request"] is None  # left out
    assert redacting["request_bytes"] == len(binary)
    assert EventEncoder(host="h").attributes(_row(request_id=""))["id"]  # never empty


def test_a_json_body_goes_as_it_came_when_nothing_in_it_is_redacted() -> None:
    body = b'{"inputs": [{"x": 1.50, "note": "as written"}]}'
    row = _row(payload=Payload(body, None, len(body), 0))
    for encoder in (EventEncoder(host="h"), EventEncoder(["ssn"], host="h")):
        assert body in encoder.batch([row])  # its bytes, not a re-encoding
    walked = EventEncoder(["note"], host="h").batch([row])
    assert body not in walked and orjson.loads(walked)[0]["data"]["payload"]["request"] == {
        "inputs": [{"x": 1.5, "note": REDACTED}]
    }


def test_kafka_records_are_binary_mode_cloudevents() -> None:
    value, headers = record(EventEncoder(host="h"), _row(1, user="bob"))
    named = dict(headers)
    assert named == {
        "ce_specversion": b"1.0", "ce_id": b"r1", "ce_source": b"inferd/h/calc",
        "ce_type": b"io.inferd.inference.log", "ce_time": b"2023-11-14T22:13:21.250000Z",
        "content-type": b"application/json",
    }  # fmt: skip
    assert orjson.loads(value)["user_hash"] == user_hash("bob")


def test_a_parquet_table_has_a_column_per_row_field_and_the_payload() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    body = b'{"inputs": [{"x": 1}]}'
    rows = [_row(i, Payload(body, None, len(body), 0) if i % 2 else None) for i in range(5)]
    sink = pa.BufferOutputStream()
    pq.write_table(table(EventEncoder(host="h"), rows), sink)
    back = pq.read_table(pa.BufferReader(sink.getvalue()))
    assert back.schema == SCHEMA and back.num_rows == 5
    assert back.column("request_id").to_pylist() == [f"r{i}" for i in range(5)]
    payloads = back.column("payload").to_pylist()
    assert payloads[0] is None and json.loads(payloads[1])["request"] == {"inputs": [{"x": 1}]}
    assert back.column("timestamp")[0].as_py().timestamp() == 1_700_000_000.25


def test_the_gateway_keeps_bodies_by_reference_for_sampled_requests_only() -> None:
    buffer = RowBuffer()
    body, answer = b'{"a": 1}', b'{"b": 2}'
    assert buffer.payload(body, answer) is None  # off by default
    buffer.payload_rate = 1.0
    payload = buffer.payload(body, answer)
    assert payload is not None and payload.request is body and payload.response is answer
    buffer.payload_rate = 0.25
    sampled = sum(buffer.payload(body, None) is not None for _ in range(4000))
    assert 800 < sampled < 1200
    buffer.payload_rate, buffer.max_payload_bytes = 1.0, 8
    skipped = log_rows.COUNTERS["payload_skipped"]
    big = buffer.payload(b"x" * 9, answer)
    assert big == Payload(None, answer, 9, 8)  # too large: left out, its size kept
    assert log_rows.COUNTERS["payload_skipped"] == skipped + 1
    buffer.max_payload_buffer_bytes = 20
    buffer.drain()
    assert buffer.payload(answer, answer) == Payload(answer, answer, 8, 8)
    assert buffer.payload(answer, None) == Payload(None, None, 8, 0)  # past the buffer
    buffer.drain()  # shipped: room again
    assert buffer.payload(answer, None) == Payload(answer, None, 8, 0)


class _Gate:
    """A sink whose sends wait for the test (and fail while ``failures`` lasts)."""

    name = "gate://test"

    def __init__(self, failures: int = 0) -> None:
        self.open = threading.Event()
        self.failures = failures
        self.batches: list[int] = []

    def send(self, rows: Sequence[LogRow]) -> None:
        self.open.wait(10)
        if self.failures:
            self.failures -= 1
            raise OSError("down")
        self.batches.append(len(rows))

    def close(self) -> None:
        pass


def test_a_full_buffer_drops_and_counts_and_never_waits() -> None:
    cfg = PayloadLogConfig(max_buffer_rows=100, batch_rows=10, flush_interval_s=0.05,
                           timeout_s=0.5)  # fmt: skip
    gate = _Gate()
    runner = SinkRunner(gate, cfg)
    runner.start()
    runner.offer([_row(i) for i in range(10)])  # a full batch: the thread takes it at once
    deadline = time.monotonic() + 5
    while runner.depth and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    for i in range(10, 300):
        runner.offer([_row(i)])
    assert time.perf_counter() - started < 0.5  # the stuck sink held nothing up
    assert runner.depth == 100 and runner.dropped == 190  # and 10 in flight
    gate.open.set()
    runner.close()
    assert runner.sent == 110 and runner.dropped == 190 and runner.failed == 0
    assert sum(gate.batches) == 110 and max(gate.batches) == 10


def test_bodies_count_against_the_buffer_too() -> None:
    runner = SinkRunner(_Gate(), PayloadLogConfig(payloads=True, max_buffer_mb=1 / 1024))  # 1 KiB
    body = b"x" * 600
    runner.offer([_row(1, Payload(body, None, 600, 0)), _row(2, Payload(body, None, 600, 0)),
                  _row(3)])  # fmt: skip
    assert (runner.depth, runner.dropped) == (2, 1)


def test_a_failing_batch_is_tried_again_then_given_up() -> None:
    cfg = PayloadLogConfig(batch_rows=5, flush_interval_s=0.05, attempts=2, timeout_s=0.5)
    gate = _Gate(failures=1)
    gate.open.set()
    runner = SinkRunner(gate, cfg)
    runner.start()
    runner.offer([_row(i) for i in range(5)])
    deadline = time.monotonic() + 5
    while runner.sent < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (runner.sent, runner.errors, runner.failed) == (5, 1, 0)  # the second try landed
    gate.failures = 2
    runner.offer([_row(i) for i in range(5, 10)])
    while runner.failed < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.close()
    assert (runner.sent, runner.errors, runner.failed) == (5, 3, 5)


def test_sinks_are_chosen_by_scheme_and_an_unknown_one_is_refused() -> None:
    assert set(SINKS) == set(SINK_SCHEMES)
    with pytest.raises(ValidationError, match="'ftp://x/y' names no known sink"):
        Settings(payload_log={"sinks": ["ftp://x/y"]})
    with pytest.raises(ValidationError, match="'kafka:///topic' names no host"):
        Settings(payload_log={"sinks": ["kafka:///topic"]})
    with pytest.raises(ValidationError, match="lists a sink twice"):
        Settings(payload_log={"sinks": ["s3://b/p", "s3://b/p"]})
    with pytest.raises(ValueError, match="unknown scheme 'ftp'"):
        open_sink("ftp://x/y", PayloadLogConfig(), EventEncoder())
    sink = open_sink("redis://:pw@127.0.0.1:1/2?stream=s&maxlen=10", PayloadLogConfig(),
                     EventEncoder())  # fmt: skip
    assert sink.name == "redis://127.0.0.1:1/2?stream=s"  # no password in labels or logs
    sink.close()


# -- Kafka ----------------------------------------------------------------------------------

KAFKA = os.environ.get("INFERD_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


def _kafka_reachable() -> bool:
    host, _, port = KAFKA.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_kafka_sink_with_no_broker_fails_within_its_timeout() -> None:
    sink = KafkaSink(f"kafka://127.0.0.1:{free_port()}/t", PayloadLogConfig(timeout_s=1),
                     EventEncoder())  # fmt: skip
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 -- aiokafka's connection error or a timeout
        sink.send([_row()])
    assert time.monotonic() - started < 5
    sink.close()


def test_the_kafka_sink_delivers_to_a_broker() -> None:
    if not _kafka_reachable():
        pytest.skip(
            f"NO KAFKA BROKER at {KAFKA}: the Kafka sink was NOT tested against a broker "
            "(its encoding and failure were); set INFERD_TEST_KAFKA_BOOTSTRAP to run this"
        )
    from aiokafka import AIOKafkaConsumer

    topic = f"inferd-test-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(f"kafka://{KAFKA}/{topic}", PayloadLogConfig(timeout_s=20), EventEncoder())
    sink.send([_row(i) for i in range(20)])
    sink.close()

    async def consume() -> list[Any]:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=KAFKA, auto_offset_reset="earliest")
        await consumer.start()
        try:
            got = await consumer.getmany(timeout_ms=10_000, max_records=100)
            return [r for records in got.values() for r in records]
        finally:
            await consumer.stop()

    records = asyncio.run(consume())
    assert sorted(dict(r.headers)["ce_id"].decode() for r in records) == sorted(
        f"r{i}" for i in range(20)
    )


# -- the real server ------------------------------------------------------------------------


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that keeps every CloudEvent POSTed to it."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.content_types: set[str] = set()
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with lock:
                    outer.content_types.add(self.headers["content-type"])
                    outer.events.extend(orjson.loads(body))
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/events"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def ids(self) -> list[str]:
        return [e["id"] for e in list(self.events)]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A listener that accepts connections and never answers: its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(sock.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/events"
    finally:
        sock.close()
        for conn in held:
            conn.close()


def _predicts(server: InferdServer, prefix: str, n: int) -> list[str]:
    """``n`` predicts with known request ids (and a user and a secret to redact)."""
    ids = [f"{prefix}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        body = {"inputs": [{"x": float(i)}], "params": {"user": "alice"},
                "meta": {"secret": "hunter2", "keep": "this"}}  # fmt: skip
        reply = server.client.post(
            "/api/v1/models/calc/predict", json=body, headers={"x-request-id": rid}
        )
        assert reply.status_code == 200, reply.text
    return ids


def _serving(data: Path, env: dict[str, str]) -> contextlib.AbstractContextManager[InferdServer]:
    push_source(data, "calc", arithmetic_model("x * 2"))
    env = {"INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2", "INFERD_GRPC_PORT": "-1", **env}
    return served(data, workers=1, env=env)


def _ready(server: InferdServer) -> None:
    server.wait_all_gateways(
        lambda c: (
            c.post("/api/v1/models/calc/predict", json={"inputs": [{"x": 1}]}).status_code == 200
        ),
        what="calc ready",
    )


@pytest.fixture(scope="module")
def sinks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One server shipping rows with bodies to an HTTP receiver, a Redis stream and S3."""
    import redis

    url = reachable_redis_url()
    stream = f"inferd-test-payloads-{uuid.uuid4().hex[:8]}"
    receiver = Receiver()
    try:
        with moto_s3(BUCKET) as aws:
            sinks = [receiver.url, f"{url}?stream={stream}&maxlen=1000", f"s3://{BUCKET}/logs"]
            env = {
                **aws,
                "INFERD_PAYLOAD_LOG__SINKS": json.dumps(sinks),
                "INFERD_PAYLOAD_LOG__PAYLOADS": "true",
                "INFERD_PAYLOAD_LOG__REDACT": '["user", "secret"]',
                "INFERD_PAYLOAD_LOG__FLUSH_INTERVAL_S": "0.2",
            }
            with _serving(tmp_path_factory.mktemp("sinks"), env) as server:
                _ready(server)
                yield {"server": server, "receiver": receiver, "stream": stream,
                       "redis": redis.from_url(url), "redis_url": url, "aws": aws}  # fmt: skip
    finally:
        receiver.close()
        with contextlib.suppress(Exception):
            redis.from_url(url).delete(stream)


def _until(what: str, check: Any, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_an_http_sink_receives_every_row_as_a_cloudevent(sinks: dict[str, Any]) -> None:
    server, receiver = sinks["server"], sinks["receiver"]
    ids = _predicts(server, "http", 30)
    refused = server.client.post(
        "/api/v1/models/calc/predict", json={"inputs": [{"z": 1}]}, headers={"x-request-id": "bad"}
    )
    assert refused.status_code == 422
    _until("the events", lambda: set(ids) | {"bad"} <= set(receiver.ids()))
    mine = [e for e in receiver.events if e["id"] in {*ids, "bad"}]
    assert sorted(e["id"] for e in mine) == sorted([*ids, "bad"])  # each once
    assert receiver.content_types == {BATCH_CONTENT_TYPE}
    by_id = {e["id"]: e for e in mine}
    event = by_id["http-7"]
    assert event["specversion"] == "1.0" and event["type"] == "io.inferd.inference.log"
    assert event["source"] == f"inferd/{socket.gethostname()}/calc"
    assert event["time"].endswith("Z") and event["datacontenttype"] == "application/json"
    data = event["data"]
    assert (data["status_code"], data["version"], data["api"]) == (200, "v1", "v1")
    assert data["user_hash"] == user_hash("alice")
    request, response = data["payload"]["request"], data["payload"]["response"]
    assert request["inputs"] == [{"x": 7.0}] and request["params"]["user"] == REDACTED
    assert request["meta"] == {"secret": REDACTED, "keep": "this"}
    assert response["outputs"] == [{"y": 14.0}]
    bad = by_id["bad"]["data"]
    assert bad["status_code"] == 422 and "error" in bad["payload"]["response"]


def test_a_redis_stream_gets_the_rows(sinks: dict[str, Any]) -> None:
    ids = _predicts(sinks["server"], "redis", 20)
    client, stream = sinks["redis"], sinks["stream"]

    def entries() -> dict[str, dict[bytes, bytes]]:
        return {f[b"id"].decode(): f for _, f in client.xrange(stream)}

    _until("the stream entries", lambda: set(ids) <= set(entries()))
    fields = entries()["redis-3"]
    assert fields[b"specversion"] == b"1.0" and fields[b"type"] == b"io.inferd.inference.log"
    data = orjson.loads(fields[b"data"])
    assert data["payload"]["request"]["params"]["user"] == REDACTED
    assert data["payload"]["response"]["outputs"] == [{"y": 6.0}]


def test_the_s3_sink_writes_parquet_files_pyarrow_reads(sinks: dict[str, Any]) -> None:
    import pyarrow.parquet as pq
    import s3fs

    aws = sinks["aws"]
    ids = set(_predicts(sinks["server"], "s3", 25))
    fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=aws["AWS_ENDPOINT_URL"])

    def logged() -> list[dict[str, Any]]:
        fs.invalidate_cache()
        files = fs.glob(f"{BUCKET}/logs/dt=*/*.parquet")
        rows = []
        for name in files:
            with fs.open(name, "rb") as f:
                rows += pq.read_table(f).to_pylist()
        return [r for r in rows if r["request_id"] in ids]

    _until("the parquet rows", lambda: {r["request_id"] for r in logged()} == ids)
    rows = logged()
    assert len(rows) == 25  # the right row count: none twice
    files = fs.glob(f"{BUCKET}/logs/dt=*/*.parquet")
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert all(f"/dt={day}/" in name for name in files[-1:])
    row = next(r for r in rows if r["request_id"] == "s3-4")
    assert row["status_code"] == 200 and row["user_hash"] == user_hash("alice")
    payload = json.loads(row["payload"])
    assert payload["request"]["meta"]["secret"] == REDACTED
    assert payload["response"]["outputs"] == [{"y": 8.0}]


def test_metrics_count_what_each_sink_sent(sinks: dict[str, Any]) -> None:
    server, receiver = sinks["server"], sinks["receiver"]
    _predicts(server, "metrics", 5)
    _until("the events", lambda: {f"metrics-{i}" for i in range(5)} <= set(receiver.ids()))

    def counted() -> bool:  # a row counts once its sink answered: after the receiver has it
        sent = _samples(server.client.get("/metrics").text, "inferd_payload_sink_rows_sent_total")
        return sent.get(receiver.url, 0) >= len(receiver.events)

    _until("the rows counted as sent", counted)
    text = server.client.get("/metrics").text
    sent = _samples(text, "inferd_payload_sink_rows_sent_total")
    redis_sink = f"{display_name(sinks['redis_url'])}?stream={sinks['stream']}"
    assert set(sent) == {receiver.url, redis_sink, f"s3://{BUCKET}/logs"}
    for name in ("dropped", "failed"):
        assert set(_samples(text, f"inferd_payload_sink_rows_{name}_total").values()) == {0}


def _samples(text: str, name: str) -> dict[str, float]:
    """A family's samples by their ``sink`` label."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('sink="', 1)[1].split('"', 1)[0]] = float(value)
    return out


# -- a sink that is down --------------------------------------------------------------------


def _throughput(server: InferdServer, seconds: float) -> tuple[float, int, float]:
    """Closed-loop predicts (16 connections) for ``seconds``: answers a second, errors,
    the slowest answer's seconds."""
    body = orjson.dumps({"inputs": [{"x": 1.0}]})
    head = request_head("POST", "/api/v1/models/calc/predict", f"127.0.0.1:{server.port}",
                        {"content-type": "application/json"})  # fmt: skip
    request = encode_request(head, body)
    spec = LoadSpec("127.0.0.1", server.port, lambda: request, concurrency=16,
                    duration_s=seconds, warmup_s=0.1)  # fmt: skip
    result = asyncio.run(LoadGenerator(spec).run())
    summary = summarize(result.samples, result.duration_s)
    return summary.success_rps, summary.errors, (summary.latency["max"] or 0.0) / 1000


def test_a_sink_that_is_down_costs_the_request_path_nothing(tmp_path: Path) -> None:
    """Two servers side by side, one with no sink and one whose sinks are down (a closed
    port and a listener that never answers), driven in turn in short interleaved slices
    so that the machine's other load falls on both alike. No request waits on a sink:
    the slowest answer stays far below the sinks' 1 s timeout (one that waited on the
    silent listener would take it whole). This 2-core machine is shared (an A/A run of
    two identical servers gave 0.87-1.08 over 12 s; a run beside the suite's other
    worker and a package install, 0.90 after 30 slices): the throughput ratio is taken
    over up to five blocks of slices, cumulatively, and must reach 0.95 (0.85 after the
    fifth, well under what a request path that did the sinks' work would give)."""
    closed = f"http://127.0.0.1:{free_port()}/events"  # nothing listens
    with black_hole() as silent:
        env = {
            "INFERD_PAYLOAD_LOG__SINKS": json.dumps([closed, silent]),
            "INFERD_PAYLOAD_LOG__MAX_BUFFER_ROWS": "100",
            "INFERD_PAYLOAD_LOG__TIMEOUT_S": "1",
        }
        with _serving(tmp_path / "none", {}) as none, _serving(tmp_path / "down", env) as down:
            _ready(none)
            _ready(down)
            rates: dict[str, list[float]] = {"none": [], "down": []}
            slowest: dict[str, float] = {"none": 0.0, "down": 0.0}
            for _ in range(5):
                _interleaved({"none": none, "down": down}, rates, slowest, rounds=10)
                ratio = sum(rates["down"]) / sum(rates["none"])
                print(f"sink down / no sink after {len(rates['none'])} slices: {ratio:.3f}")
                if ratio >= 0.95:
                    break
            assert ratio >= 0.85, rates
            assert slowest["down"] < 0.5, slowest
            text = down.client.get("/metrics").text
            dropped = _samples(text, "inferd_payload_sink_rows_dropped_total")
            failed = _samples(text, "inferd_payload_sink_rows_failed_total")
            assert dropped[closed] > 0 and dropped[silent] > 0, text
            assert set(_samples(text, "inferd_payload_sink_rows_sent_total").values()) == {0}
            assert failed[closed] > 0  # batches given up after their tries
            started = time.monotonic()
        assert time.monotonic() - started < 15  # stopping does not wait on the dead sinks


def _interleaved(
    servers: dict[str, InferdServer],
    rates: dict[str, list[float]],
    slowest: dict[str, float],
    rounds: int,
) -> None:
    """``rounds`` slices of 0.4 s per server, in alternating order; no request fails."""
    for round_ in range(rounds):
        order = list(servers.items())
        for name, server in order if round_ % 2 == 0 else order[::-1]:
            rps, errors, longest = _throughput(server, 0.4)
            assert errors == 0
            rates[name].append(rps)
            slowest[name] = max(slowest[name], longest)
