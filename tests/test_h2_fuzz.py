"""The HTTP/2 server fed frame sequences hypothesis makes up: well-formed calls mixed with
every frame type, random flags, streams, lengths and payloads, on connections that may
stop at any point. After each sequence the server must have crashed nowhere (no error
reached its event loop), still answer (its loop turns within a second), and hold nothing
(no connection, no reserved byte, no waiting call). The suite runs a few hundred
sequences; ``make fuzz-h2`` runs thousands (``INFERD_FUZZ_EXAMPLES``)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import grpc
import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd.grpc import frames as f
from inferd.grpc import grpc_service_pb2 as pb
from inferd.grpc import grpc_service_pb2_grpc as pb_grpc
from inferd.grpc.bounds import Bounds
from inferd.grpc.http2 import Abort, Call, GrpcServer, StatusCode
from tests.test_grpc_http2 import Running, Service

EXAMPLES = int(os.environ.get("INFERD_FUZZ_EXAMPLES", "200"))
PATHS = [
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/ModelStreamInfer",
    "/inference.GRPCInferenceService/ServerLive",
    "/nope/Nope",
]


class Guarded(Service):
    """The protocol tests' service, with an admission: ``x-deny`` refused at once,
    ``x-slow`` decided a moment later."""

    def admit(self, call: Call) -> Any:
        metadata = dict(call.metadata)
        if "x-deny" in metadata:
            raise Abort(StatusCode.UNAUTHENTICATED, "denied")
        if "x-slow" in metadata:
            return asyncio.sleep(0.005)
        return None


class Fuzzed(Running):
    def __init__(self) -> None:
        self.errors: list[Any] = []
        super().__init__(Guarded(), Bounds(header_timeout_s=0.5, body_timeout_s=0.5))
        self.loop.call_soon_threadsafe(
            self.loop.set_exception_handler, lambda loop, context: self.errors.append(context)
        )


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    server = Fuzzed()
    yield server
    server.stop()


def _block(path: str, extra: list[tuple[str, str]]) -> bytes:
    return hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":path", path),
        (":authority", "x"), ("content-type", "application/grpc"), *extra,
    ])  # fmt: skip


streams = st.sampled_from([0, 1, 3, 5, 7, 2, 0x7FFFFFFF]) | st.integers(0, 1 << 31)
flags = st.sampled_from(
    [0, f.END_STREAM, f.END_HEADERS, f.END_STREAM | f.END_HEADERS]
) | st.integers(0, 255)
metadata = st.lists(
    st.sampled_from(
        [("x-deny", "1"), ("x-slow", "1"), ("grpc-timeout", "1m"), ("grpc-encoding", "gzip")]
    ),
    max_size=2,
)


@st.composite
def frame(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9]) | st.integers(0, 255))
    stream = draw(streams)
    flag = draw(flags)
    if kind == f.HEADERS and draw(st.booleans()):
        payload = _block(draw(st.sampled_from(PATHS)), draw(metadata))
    elif kind == f.DATA and draw(st.booleans()):
        body = draw(st.binary(max_size=64))
        length = draw(st.sampled_from([len(body), len(body) + 10, 1 << 20, (1 << 20) + 1, 0]))
        payload = b"\x00" + struct.pack(">I", length) + body
    elif kind == f.WINDOW_UPDATE:
        payload = struct.pack(">I", draw(st.integers(0, (1 << 32) - 1)))
    elif kind == f.SETTINGS and draw(st.booleans()):
        pairs = draw(
            st.lists(st.tuples(st.integers(0, 8), st.integers(0, (1 << 32) - 1)), max_size=3)
        )
        payload = b"".join(struct.pack(">HI", k, v) for k, v in pairs)
    else:
        payload = draw(st.binary(max_size=40))
    if draw(st.integers(0, 20)) == 0:  # a head whose length lies
        size = draw(st.integers(0, 1 << 24 - 1))
        return f.HEAD.pack(size >> 16, size & 0xFFFF, kind, flag, stream & 0xFFFFFFFF) + payload
    return f.frame(kind, flag, stream & 0xFFFFFFFF, payload)


@st.composite
def call_frames(draw: st.DrawFn) -> bytes:
    """A frame of a well-formed call on one of a few streams (what makes calls start,
    wait, answer and end), sometimes with a twist."""
    stream = draw(st.sampled_from([1, 3, 5, 7]))
    kind = draw(st.sampled_from(["headers", "split", "data", "data", "rst", "window"]))
    end = f.END_STREAM if draw(st.booleans()) else 0
    if kind == "headers":
        block = _block(draw(st.sampled_from(PATHS)), draw(metadata))
        return f.frame(f.HEADERS, f.END_HEADERS | end, stream, block)
    if kind == "split":  # HEADERS and CONTINUATION
        block = _block(draw(st.sampled_from(PATHS)), draw(metadata))
        cut = draw(st.integers(0, len(block)))
        return f.frame(f.HEADERS, end, stream, block[:cut]) + f.frame(
            f.CONTINUATION, f.END_HEADERS, stream, block[cut:]
        )
    if kind == "data":
        request = pb.ModelInferRequest(
            id=draw(st.sampled_from(["", "big", "fail", "boom", "slow"]))
        )
        body = request.SerializeToString() + draw(st.binary(max_size=8))
        gzip = draw(st.booleans())
        wire = (b"\x01" if gzip else b"\x00") + struct.pack(">I", len(body)) + body
        cut = draw(st.integers(0, len(wire)))
        return f.frame(f.DATA, end, stream, wire[:cut]) + f.frame(f.DATA, end, stream, wire[cut:])
    if kind == "rst":
        return f.rst_stream(stream, draw(st.integers(0, 15)))
    return f.window_update(draw(st.sampled_from([0, stream])), draw(st.integers(1, 1 << 20)))


sequences = st.tuples(
    st.sampled_from(
        [f.PREFACE + f.settings({})] * 6 + [f.PREFACE, f.PREFACE[:7], b"GET / \r\n\r\n"]
    ),
    st.lists(call_frames() | call_frames() | call_frames() | frame(), max_size=25),
    st.sampled_from(["close", "read", "read", "reset"]),
)


def _held(server: GrpcServer) -> tuple[int, int, int]:
    waiting = sum(1 for call in server.buffers.waiting if not call.done)
    return len(server.connections), server.buffers.held, waiting


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=sequences)
def test_any_frame_sequence_leaves_the_server_whole(fuzzed: Fuzzed, sequence: Any) -> None:
    opening, frames, ending = sequence
    sock = socket.create_connection(("127.0.0.1", fuzzed.port), timeout=5)
    try:
        sock.sendall(opening + b"".join(frames))
        if ending == "read":
            sock.settimeout(0.05)
            try:
                while sock.recv(1 << 16):
                    pass
            except (TimeoutError, OSError):
                pass
    except OSError:
        pass  # the server closed the connection first: fine
    finally:
        if ending == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    assert fuzzed.run(asyncio.sleep(0, result=True), timeout=1)  # the loop turns
    deadline = time.monotonic() + 5
    while _held(fuzzed.server) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _held(fuzzed.server) == (0, 0, 0)
    assert not fuzzed.errors, fuzzed.errors


def test_after_the_fuzzing_a_call_still_goes_through(fuzzed: Fuzzed) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{fuzzed.port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(
            pb.ModelInferRequest(id="a", raw_input_contents=[b"xy"]), timeout=5
        )
        assert answer.raw_output_contents == [b"xy"]
