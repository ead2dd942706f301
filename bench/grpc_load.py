"""A minimal gRPC load client: unary calls as pre-encoded HTTP/2 frames, closed loop.

Why not grpcio's client: like :mod:`inferd.bench.connection` for HTTP, a load generator
shares the cores with the server it measures, and grpcio's asyncio client costs about
100 µs of CPU per call here (its C core, a polling thread, a task and a future per call),
four to five times inferd's HTTP client. This one writes each call as two frames encoded
once (HEADERS with a literal, stateless header block, then DATA with the message), only
the stream id filled in per call; reads frames by their 9-byte headers without decoding
header blocks; and calls back when a stream ends. A call succeeded when its response
message arrived before the trailers: a gRPC server answers a failed unary call with
trailers alone (no message), so no HPACK decoding is needed to tell.

It honours the server's flow-control windows for what it sends, acknowledges SETTINGS
and PING, and opens its own receive windows wide (the responses are small).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import deque
from collections.abc import Callable

from inferd.grpc import frames as f

_WIDE = f.MAX_WINDOW
"""Our receive windows: the largest HTTP/2 allows."""


def _head(size: int, kind: int, flags: int) -> bytes:
    """A frame head's first 5 bytes (length, type, flags); the stream id follows."""
    return f.head(size, kind, flags, 0)[:5]


def header_block(authority: str, path: str) -> bytes:
    """A unary gRPC call's request headers (static table: 3 = :method POST, 6 = :scheme
    http, 1 = :authority, 4 = :path, 31 = content-type)."""
    return (
        b"\x83\x86"
        + f.literal(1, authority)
        + f.literal(4, path)
        + f.literal(31, "application/grpc")
        + f.literal("te", "trailers")
    )


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection carrying any number of concurrent unary calls of one
    pre-encoded request; ``on_done(connection, started, ok)`` as each ends."""

    def __init__(
        self, block: bytes, message: bytes, on_done: Callable[[GrpcConnection, float, bool], None]
    ) -> None:
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        self._size = len(body)
        # Each frame's head without its stream id, then what follows that id: the
        # header block, then the message in DATA frames of at most the 16 KiB every
        # HTTP/2 peer takes, the last ending the stream.
        self._parts = [(_head(len(block), f.HEADERS, f.END_HEADERS), block)]
        for at in range(0, len(body), f.DEFAULT_MAX_FRAME):
            chunk = body[at : at + f.DEFAULT_MAX_FRAME]
            last = at + f.DEFAULT_MAX_FRAME >= len(body)
            self._parts.append((_head(len(chunk), f.DATA, f.END_STREAM if last else 0), chunk))
        self.on_done = on_done
        self.transport: asyncio.Transport | None = None
        self._next_id = 1
        self._open: dict[int, list[float | bool]] = {}  # stream -> [started, got message]
        self._buf = bytearray()
        self._send_window = 65535  # the connection's, until the server says more
        self._stream_window = 65535  # each new stream's (the server's SETTINGS)
        self._waiting: deque[int] = deque()  # calls held back by the connection window
        self._received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HI", f.INITIAL_WINDOW_SIZE, _WIDE)
        transport.write(  # type: ignore[attr-defined]
            f.PREFACE
            + f.frame(f.SETTINGS, 0, 0, settings)
            + f.frame(f.WINDOW_UPDATE, 0, 0, struct.pack(">I", _WIDE - 65535))
        )

    def call(self) -> None:
        stream = self._next_id
        self._next_id += 2
        self._open[stream] = [time.perf_counter(), False]
        if self._size > self._stream_window:
            raise ValueError(f"a {self._size}-byte message exceeds the stream window")
        if self._waiting or self._size > self._send_window:
            self._waiting.append(stream)
            return
        self._send(stream)

    def _send(self, stream: int) -> None:
        self._send_window -= self._size
        sid = stream.to_bytes(4, "big")
        frames = [part for head, rest in self._parts for part in (head, sid, rest)]
        self.transport.write(b"".join(frames))  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 9:
            high, low, kind, flags, stream = f.HEAD.unpack_from(buf, pos)
            size = (high << 16) | low
            if end - pos - 9 < size:
                break
            if kind == f.DATA:
                self._on_data(stream, size)
            elif kind == f.HEADERS:
                if flags & f.END_STREAM:  # the trailers
                    self._finish(stream, ok=True)
            else:
                self._on_control(kind, flags, stream, bytes(buf[pos + 9 : pos + 9 + size]))
            pos += 9 + size
        del buf[:pos]

    def _on_control(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        transport = self.transport
        assert transport is not None
        if kind == f.WINDOW_UPDATE and stream == 0:
            self._send_window += int.from_bytes(payload, "big") & _WIDE
            self._flush()
        elif kind == f.SETTINGS and not flags & f.ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == f.INITIAL_WINDOW_SIZE:
                    self._stream_window = value
            transport.write(f.frame(f.SETTINGS, f.ACK, 0, b""))
        elif kind == f.PING and not flags & f.ACK:
            transport.write(f.frame(f.PING, f.ACK, 0, payload))
        elif kind == f.RST_STREAM:
            self._finish(stream, ok=False)
        elif kind == f.GOAWAY:
            transport.close()

    def _on_data(self, stream: int, size: int) -> None:
        call = self._open.get(stream)
        if call is not None and size:
            call[1] = True
        self._received += size
        if self._received > _WIDE // 2:  # give the connection's window back
            update = f.frame(f.WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received))
            self.transport.write(update)  # type: ignore[union-attr]
            self._received = 0

    def _finish(self, stream: int, ok: bool) -> None:
        call = self._open.pop(stream, None)
        if call is not None:
            self.on_done(self, call[0], ok and bool(call[1]))  # type: ignore[arg-type]

    def _flush(self) -> None:
        while self._waiting and self._size <= self._send_window:
            self._send(self._waiting.popleft())

    def connection_lost(self, exc: Exception | None) -> None:
        for stream in list(self._open):
            self._finish(stream, ok=False)


async def closed_loop(
    host: str,
    port: int,
    path: str,
    message: bytes,
    concurrency: int,
    connections: int,
    duration_s: float,
    warmup_s: float = 1.0,
    on_window: Callable[[], object] | None = None,
) -> tuple[list[float], int, float, float]:
    """``concurrency`` calls in flight over ``connections`` connections, each finished
    call followed at once by the next, for ``warmup_s`` (discarded) + ``duration_s``.
    Returns (latencies in seconds, errors, window wall seconds, client CPU seconds in
    the window); ``on_window`` is called as the window starts and again as it ends."""
    loop = asyncio.get_running_loop()
    block = header_block(f"{host}:{port}", path)
    latencies: list[float] = []
    errors = 0
    measuring = stopping = False
    in_flight = 0
    drained = loop.create_future()

    def on_done(connection: GrpcConnection, started: float, ok: bool) -> None:
        nonlocal errors, in_flight
        if measuring:
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1
        if stopping:
            in_flight -= 1
            if not in_flight and not drained.done():
                drained.set_result(None)
        else:
            connection.call()

    conns = []
    for _ in range(connections):
        _, protocol = await loop.create_connection(
            lambda: GrpcConnection(block, message, on_done), host, port
        )
        conns.append(protocol)
    for i in range(concurrency):
        conns[i % connections].call()
    in_flight = concurrency
    await asyncio.sleep(warmup_s)
    measuring = True
    if on_window is not None:
        on_window()
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.sleep(duration_s)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    if on_window is not None:
        on_window()
    measuring, stopping = False, True
    try:
        await asyncio.wait_for(drained, 30)
    finally:
        for protocol in conns:
            if protocol.transport is not None:
                protocol.transport.close()
    return latencies, errors, wall, cpu
