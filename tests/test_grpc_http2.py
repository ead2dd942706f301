"""inferd's HTTP/2 gRPC server (:mod:`inferd.grpc.http2`) against real clients: grpcio's
(what tritonclient uses) and the ``h2`` library's (a strict HTTP/2 peer, for flow control
and framing). The server runs in a thread's event loop with a small service of its own,
so each protocol rule is tried on its own; the Open Inference Protocol service on it is
tried end to end in test_v2_grpc.py and the others."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import uvloop

from inferd.grpc import frames as f
from inferd.grpc import grpc_service_pb2 as pb
from inferd.grpc import grpc_service_pb2_grpc as pb_grpc
from inferd.grpc.bounds import Bounds
from inferd.grpc.frames import literal
from inferd.grpc.http2 import Abort, Call, Connection, GrpcServer, StatusCode
from inferd.grpc.service import SERVICE, methods

LIMIT = 8 << 20
"""The server's largest request message in these tests."""
BIG = 300_000
"""The size of the "big" answer: several of a small window's worth."""


class Service:
    """Answers by the request's id: echo (the default), sleep, slow, big, fail, boom."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def unary(self, call: Call, request: Any) -> Any:
        if call.method.name != "ModelInfer":
            return pb.ServerLiveResponse(live=True)
        rid = request.id
        if rid == "sleep":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if rid == "slow":
            self.started.set()
            await asyncio.sleep(0.5)
        if rid == "big":
            return pb.ModelInferResponse(id=rid, raw_output_contents=[b"x" * BIG])
        if rid == "fail":
            raise Abort(StatusCode.NOT_FOUND, "no model 'ø' here: 100% sure", [("x-why", "none")])
        if rid == "boom":
            raise RuntimeError("a bug")
        metadata = dict(call.metadata)
        call.set_trailing_metadata([("x-echo", metadata.get("x-in", ""))])
        return pb.ModelInferResponse(
            id=rid,
            model_name=metadata.get("x-bin-bin", ""),
            raw_output_contents=list(request.raw_input_contents),
        )

    async def stream(self, call: Call, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            yield pb.ModelStreamInferResponse(
                infer_response=pb.ModelInferResponse(
                    id=request.id, raw_output_contents=list(request.raw_input_contents)
                )
            )


class Running:
    def __init__(self, service: Service | None = None, bounds: Bounds | None = None) -> None:
        self.service = service or Service()
        self.server = GrpcServer(self.service, methods(), LIMIT, bounds)
        self.loop = uvloop.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self.server.start(sock))

    def run(self, work: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.stop(1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def running() -> Iterator[Running]:
    server = Running()
    yield server
    server.stop()


def channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)]
    )


@pytest.fixture
def stub(running: Running) -> Iterator[Any]:
    with channel(running.port) as ch:
        yield pb_grpc.GRPCInferenceServiceStub(ch)


def test_a_call_round_trips_its_message_metadata_and_trailers(stub: Any) -> None:
    request = pb.ModelInferRequest(id="a", raw_input_contents=[b"\x00\x01", b"two"])
    response, call = stub.ModelInfer.with_call(
        request, metadata=[("x-in", "hello"), ("x-bin-bin", b"bytes")]
    )
    assert response.id == "a"
    assert list(response.raw_output_contents) == [b"\x00\x01", b"two"]
    assert response.model_name == "bytes"  # binary metadata arrives decoded
    assert ("x-echo", "hello") in call.trailing_metadata()
    assert call.code() == grpc.StatusCode.OK


def test_many_calls_on_one_connection_keep_their_own_headers(stub: Any) -> None:
    # grpcio indexes headers in the connection's HPACK table: the blocks the server
    # keeps decoded must not answer a call with another call's metadata
    futures = [
        stub.ModelInfer.future(pb.ModelInferRequest(id=str(i)), metadata=[("x-in", f"v{i % 7}")])
        for i in range(300)
    ]
    for i, future in enumerate(futures):
        assert future.result(timeout=30).id == str(i)
        assert ("x-echo", f"v{i % 7}") in future.trailing_metadata()


def test_a_failure_ends_the_call_with_its_code_message_and_trailers(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(id="fail"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no model 'ø' here: 100% sure"
    assert ("x-why", "none") in info.value.trailing_metadata()


def test_a_bug_is_internal_without_its_traceback(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(id="boom"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error; see the server log"


def test_large_and_compressed_messages_both_ways(stub: Any) -> None:
    # 6 MiB: over the stream's 4 MiB receive window, so the server must give it back
    payload = bytes(range(256)) * (6 * 4096)
    for compression in (grpc.Compression.NoCompression, grpc.Compression.Gzip):
        request = pb.ModelInferRequest(id="z", raw_input_contents=[payload])
        response = stub.ModelInfer(request, compression=compression, timeout=30)
        assert response.raw_output_contents[0] == payload


def test_a_message_over_the_limit_is_refused_and_the_connection_goes_on(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(id="y", raw_input_contents=[b"0" * (LIMIT + 1)]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the server's limit" in info.value.details()
    assert stub.ModelInfer(pb.ModelInferRequest(id="after")).id == "after"


def test_a_message_that_does_not_parse_is_invalid_argument(running: Running) -> None:
    with channel(running.port) as ch:
        call = ch.unary_unary(f"/{SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inference.ModelInferRequest" in info.value.details()


def test_methods_nobody_serves_are_unimplemented(running: Running) -> None:
    with channel(running.port) as ch:
        for path in (f"/{SERVICE}/ModelConfig", "/other.Service/Call"):
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary(path)(b"")
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, path


def test_the_clients_deadline_cancels_the_call(running: Running, stub: Any) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(id="sleep"), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert running.service.cancelled.wait(5), "the handler ran on past the deadline"


def test_a_client_cancelling_cancels_the_handler(running: Running, stub: Any) -> None:
    future = stub.ModelInfer.future(pb.ModelInferRequest(id="sleep"))
    assert running.service.started.wait(10)
    future.cancel()
    assert running.service.cancelled.wait(5)
    assert stub.ModelInfer(pb.ModelInferRequest(id="next")).id == "next"


def test_a_stream_answers_each_request_in_order(stub: Any) -> None:
    requests = (pb.ModelInferRequest(id=str(i), raw_input_contents=[b"r" * i]) for i in range(200))
    responses = list(stub.ModelStreamInfer(requests, timeout=30))
    assert [r.infer_response.id for r in responses] == [str(i) for i in range(200)]
    assert responses[-1].infer_response.raw_output_contents[0] == b"r" * 199


def test_stop_lets_running_calls_finish_and_refuses_new_ones() -> None:
    server = Running()
    try:
        with channel(server.port) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            slow = stub.ModelInfer.future(pb.ModelInferRequest(id="slow"))
            assert server.service.started.wait(10)
            stopping = asyncio.run_coroutine_threadsafe(server.server.stop(10), server.loop)
            assert slow.result(timeout=10).id == "slow"
            stopping.result(10)
        with channel(server.port) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                    pb.ModelInferRequest(id="late"), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(5)


def test_what_is_not_http2_is_closed(running: Running, stub: Any) -> None:
    with socket.create_connection(("127.0.0.1", running.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert b"HTTP/1.1" not in received  # no answer but the server's opening SETTINGS
    assert stub.ServerLive(pb.ServerLiveRequest()).live


def _h2_client(port: int, window: int) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    sock.sendall(conn.data_to_send())
    return sock, conn


def _grpc_request(
    conn: h2.connection.H2Connection, stream: int, message: bytes, *extra: tuple[str, str]
) -> None:
    conn.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/{SERVICE}/ModelInfer"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ],
    )
    conn.send_data(stream, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)


def _trailers(sock: socket.socket, conn: h2.connection.H2Connection) -> dict[bytes, bytes]:
    """Read until a stream ends; its last header block."""
    while True:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        for event in conn.receive_data(data):
            ended = isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived)
            if ended and event.stream_ended is not None:
                return dict(event.headers)
        sock.sendall(conn.data_to_send())


def test_the_server_keeps_the_deadline_a_client_sent(running: Running) -> None:
    # grpcio's client resets a call at its deadline itself; this client does not, so
    # only the server's own timer can end the call
    sock, conn = _h2_client(running.port, window=65535)
    started = time.monotonic()
    _grpc_request(
        conn, 1, pb.ModelInferRequest(id="sleep").SerializeToString(), ("grpc-timeout", "200m")
    )
    sock.sendall(conn.data_to_send())
    trailers = _trailers(sock, conn)
    sock.close()
    assert trailers[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED
    assert 0.15 < time.monotonic() - started < 3
    assert running.service.cancelled.wait(5)


def test_a_kept_header_block_is_forgotten_when_the_table_changes() -> None:
    # the same bytes ("index 62") mean another header once a new entry is inserted
    connection = Connection(GrpcServer(Service(), methods(), LIMIT))
    fixed = b"\x83\x86" + literal(4, f"/{SERVICE}/ModelInfer") + literal(31, "application/grpc")

    def insert(value: str) -> bytes:  # a literal with incremental indexing, new name
        return fixed + b"\x40\x04x-in" + bytes([len(value)]) + value.encode()

    seen = []
    for block in (insert("a"), fixed + b"\xbe", insert("b"), fixed + b"\xbe", fixed + b"\xbe"):
        seen.append(dict(connection._head(block).metadata)["x-in"])
    assert seen == ["a", "a", "b", "b", "b"]


def test_answers_wait_for_the_clients_flow_control_window(running: Running) -> None:
    # a strict peer (h2 raises on any frame over its window) with a 1,000-byte window:
    # the answer comes in pieces, each after the client gave window back
    sock, conn = _h2_client(running.port, window=1000)
    _grpc_request(conn, 1, pb.ModelInferRequest(id="big").SerializeToString())
    sock.sendall(conn.data_to_send())
    body, trailers, pieces = b"", None, 0
    while trailers is None:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                assert len(event.data) <= 1000
                body += event.data
                pieces += 1
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.TrailersReceived):
                trailers = dict(event.headers)
        sock.sendall(conn.data_to_send())
    sock.close()
    assert trailers[b"grpc-status"] == b"0"
    response = pb.ModelInferResponse.FromString(body[5:])
    assert len(response.raw_output_contents[0]) == BIG
    assert pieces >= BIG // 1000


def test_a_block_of_headers_in_continuation_frames(running: Running) -> None:
    # 40 KiB of metadata: more than one 16 KiB frame, so HEADERS then CONTINUATIONs
    sock, conn = _h2_client(running.port, window=65535)
    conn.send_headers(
        1,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/{SERVICE}/ModelInfer"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("x-in", "y" * 40_000),
        ],
    )
    message = pb.ModelInferRequest(id="long").SerializeToString()
    conn.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
    sock.sendall(conn.data_to_send())
    headers: dict[bytes, bytes] = {}
    while b"grpc-status" not in headers:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.TrailersReceived):
                headers.update(event.headers)
    sock.close()
    assert headers[b"grpc-status"] == b"0"
    assert headers[b"x-echo"] == b"y" * 40_000


class _Wire:
    """A transport that keeps what is written to it (one entry a write)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None:
        self.closed = True


def test_a_burst_of_refused_calls_is_answered_in_one_write() -> None:
    # 40 calls to a method that does not exist, in one read: 40 answers and 40 resets,
    # and one system call for them (not 80) -- one per loop turn: on a busy machine the
    # turn's time budget may cut the read in two or three turns
    async def burst() -> _Wire:
        wire = _Wire()
        connection = Connection(GrpcServer(Service(), methods(), LIMIT))
        connection.connection_made(wire)  # type: ignore[arg-type]
        block = b"\x83\x86" + literal(4, "/no.Such/Method") + literal(31, "application/grpc")
        calls = b"".join(
            f.head(len(block), f.HEADERS, f.END_HEADERS, stream) + block
            for stream in range(1, 81, 2)
        )
        wire.writes.clear()
        connection.data_received(f.PREFACE + f.settings({}) + calls)
        for _ in range(20):  # a turn cut short goes on in the next
            await asyncio.sleep(0)
        return wire

    wire = asyncio.run(burst())
    assert 1 <= len(wire.writes) <= 3
    sent = b"".join(wire.writes)
    kinds, pos = [], 0
    while pos < len(sent):
        size = int.from_bytes(sent[pos : pos + 3], "big")
        kinds.append(sent[pos + 3])
        pos += 9 + size
    assert kinds.count(f.HEADERS) == 40 and kinds.count(f.RST_STREAM) == 40
    assert not wire.closed
