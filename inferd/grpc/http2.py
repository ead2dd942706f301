"""gRPC over HTTP/2, served on the gateway's own event loop.

Why not grpcio's server: it runs its HTTP/2 in C threads and hands every call to the
event loop and back, about 16 context switches and 140-170 µs of CPU per call on this
machine's kind, with a handler that does nothing. A call here is an :class:`asyncio.Protocol`
reading frames from one buffer, a task running the handler, and one write with the
response's three frames (headers, message, trailers): the same loop, no thread.

What it implements (RFC 9113 as a gRPC server uses it, and the gRPC over HTTP/2
protocol): the connection preface and SETTINGS; header blocks decoded by :mod:`hpack`
(with CONTINUATION, padding and priority fields), a block the client sends again
byte for byte decoded once while the dynamic table is unchanged; flow control both ways
(receive windows credited as data arrives, sends held back by the peer's windows and
released by its WINDOW_UPDATE); PING; RST_STREAM (the call is cancelled); GOAWAY both ways
(:meth:`GrpcServer.stop` lets running calls finish within a grace period); the grpc-timeout
deadline (the call is cancelled and answers DEADLINE_EXCEEDED); length-prefixed messages,
gzip or deflate compressed ones included; trailers-only answers for calls that fail before
a message; TLS with ALPN ``h2``.

Calls go to a :class:`Service`: ``unary(call, request)`` returns the response,
``stream(call, requests)`` yields them; both raise :class:`Abort` to end the call with a
status. Messages are protobuf classes (``FromString`` / ``SerializeToString``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import logging
import socket
import ssl
import struct
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import hpack
from google.protobuf.message import DecodeError

from inferd.grpc import frames as f

logger = logging.getLogger(__name__)


class StatusCode(enum.IntEnum):
    """gRPC status codes (their numbers are the protocol's)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Abort(Exception):
    """Ends a call with ``code``, ``message`` and extra trailing metadata."""

    def __init__(
        self, code: StatusCode, message: str, trailers: Iterable[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = tuple(trailers)


@dataclass(frozen=True)
class Method:
    name: str
    """The method's short name (``ModelInfer``); its path is /<service>/<name>."""
    request: Any
    """The request's protobuf message class."""
    streaming: bool = False
    """A bidirectional stream (else unary)."""


class Service(Protocol):
    async def unary(self, call: Call, request: Any) -> Any: ...

    def stream(self, call: Call, requests: AsyncIterator[Any]) -> AsyncIterator[Any]: ...


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
ACCEPT_ENCODING = "identity,deflate,gzip"

_SETTINGS_WINDOW = 1 << 22
"""Each stream's receive window (4 MiB): a request up to that size needs no round trip."""
_CONNECTION_WINDOW = 1 << 24
_MAX_FRAME = 1 << 20
"""The largest frame the client may send: a big request in few frames."""
_MAX_HEADER_LIST = 1 << 16
_MAX_STREAMS = 4096
_BLOCKS = 256
"""Header blocks kept decoded per connection."""


@dataclass(frozen=True)
class _Head:
    """What a request's header block says, kept per block."""

    method: Method | None
    deadline_s: float | None
    encoding: str
    metadata: tuple[tuple[str, str], ...]
    error: tuple[int, StatusCode, str] | None = None
    """(HTTP status, gRPC status, message) when the call is refused at once."""


class Call:
    """One call (an HTTP/2 stream): what the handler may read and set."""

    __slots__ = (
        "conn",
        "credit",
        "data",
        "deadline",
        "done",
        "encoding",
        "end_frame",
        "headers_sent",
        "id",
        "message",
        "metadata",
        "method",
        "pending",
        "queue",
        "remote_closed",
        "send_window",
        "task",
        "timer",
        "trailing",
        "writable",
    )  # fmt: skip

    def __init__(self, conn: Connection, stream_id: int, head: _Head, window: int) -> None:
        assert head.method is not None
        self.id = stream_id
        self.conn = conn
        self.method: Method = head.method
        self.metadata = head.metadata
        """The client's metadata: (lower-case name, value) pairs, ``-bin`` values decoded."""
        self.deadline = None if head.deadline_s is None else time.monotonic() + head.deadline_s
        self.encoding = head.encoding
        self.data = bytearray()  # received, not yet a whole message
        self.message: bytes | None = None  # a unary call's request
        self.queue: asyncio.Queue[bytes | None] | None = None  # a stream's requests
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.send_window = window
        self.pending: deque[memoryview] = deque()  # DATA held back by flow control
        self.end_frame: bytes | None = None  # the trailers, once the pending DATA is out
        self.headers_sent = False
        self.remote_closed = False
        self.done = False
        self.trailing: list[tuple[str, str]] = []
        self.credit = 0  # bytes received and not yet given back to the stream's window
        self.writable: asyncio.Future[None] | None = None

    @property
    def peer(self) -> str | None:
        """The client's address (None on a Unix socket)."""
        return self.conn.peer

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline (None: it set none)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def set_trailing_metadata(self, pairs: Iterable[tuple[str, str]]) -> None:
        self.trailing.extend(pairs)

    async def send(self, response: Any) -> None:
        """One response of a stream; returns once it is written, or the call ended."""
        self.conn.message(self, response.SerializeToString())
        while (self.pending or self.conn.paused) and not self.done:
            self.writable = asyncio.get_running_loop().create_future()
            await self.writable


def _timeout(value: str) -> float | None:
    """``grpc-timeout``: up to 8 digits and a unit."""
    try:
        return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
    except (KeyError, ValueError, IndexError):
        return None


def _metadata_value(name: str, value: str) -> str:
    if name.endswith("-bin"):  # binary metadata travels base64-encoded
        try:
            return base64.b64decode(value + "=" * (-len(value) % 4)).decode("latin-1")
        except ValueError:
            return value
    return value


def _encode_message(message: str) -> str:
    """grpc-message: percent-encoded UTF-8 (space to ~ kept, but %)."""
    return quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")


class Connection(asyncio.Protocol):
    """One client connection: frames in, calls out."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.buf = bytearray()
        self.preface = False
        self.calls: dict[int, Call] = {}
        self.last_id = 0
        self.decoder = hpack.Decoder(max_header_list_size=_MAX_HEADER_LIST)
        self.blocks: dict[bytes, _Head] = {}
        self.continuing: tuple[int, int, bytearray] | None = None
        self.send_window = f.DEFAULT_WINDOW
        self.peer_window = f.DEFAULT_WINDOW
        self.peer_frame = f.DEFAULT_MAX_FRAME
        self.credit = 0
        self.blocked: dict[int, Call] = {}
        self.paused = False
        self.closing = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self._write(self.server.opening)
        if self.server.stopping:
            self.shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        for call in list(self.calls.values()):
            self._drop(call)
        self.paused = False
        self._wake_writers()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_writers()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        if not self.preface:
            pos = self._preface()
            if pos <= 0:
                return
        end = len(buf)
        unpack = f.HEAD.unpack_from
        try:
            while end - pos >= 9:
                high, low, kind, flags, stream = unpack(buf, pos)
                size = (high << 16) | low
                if size > _MAX_FRAME:
                    raise _ConnectionError(f.FRAME_SIZE_ERROR, "frame too large")
                if end - pos - 9 < size:
                    break
                payload = bytes(buf[pos + 9 : pos + 9 + size])
                pos += 9 + size
                stream &= 0x7FFFFFFF
                if self.continuing is not None and kind != f.CONTINUATION:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "expected CONTINUATION")
                if kind == f.DATA:
                    self._on_data(flags, stream, payload)
                elif kind == f.HEADERS:
                    self._on_headers(flags, stream, payload)
                else:
                    self._on_control(kind, flags, stream, payload)
                if self.transport is None:
                    return
        except _ConnectionError as exc:
            self._fail(exc.code, exc.reason)
            return
        del buf[:pos]
        if self.credit >= _CONNECTION_WINDOW // 2:
            self._write(f.window_update(0, self.credit))
            self.credit = 0

    def _preface(self) -> int:
        """The client's preface read: its length; 0 until it is all here, -1 when the
        client speaks something else (the connection is closed)."""
        buf = self.buf
        if len(buf) < len(f.PREFACE):
            if f.PREFACE.startswith(bytes(buf)):
                return 0
        elif buf.startswith(f.PREFACE):
            self.preface = True
            return len(f.PREFACE)
        self._close_now()
        return -1

    # -- frames in -----------------------------------------------------------------------

    def _on_headers(self, flags: int, stream: int, payload: bytes) -> None:
        if flags & f.PADDED:
            payload = _unpad(payload)
        if flags & f.PRIORITY_FLAG:
            payload = payload[5:]
        if not flags & f.END_HEADERS:
            self.continuing = (stream, flags, bytearray(payload))
            return
        self._on_block(flags, stream, payload)

    def _on_block(self, flags: int, stream: int, block: bytes) -> None:
        head = self._head(block)
        call = self.calls.get(stream)
        if call is not None:  # the client's trailers: only the end of its stream matters
            if flags & f.END_STREAM:
                self._remote_end(call)
            return
        if stream % 2 == 0 or stream == 0:
            raise _ConnectionError(f.PROTOCOL_ERROR, f"a client cannot open stream {stream}")
        if stream <= self.last_id:  # a stream we answered and closed
            self._write(f.rst_stream(stream, f.STREAM_CLOSED))
            return
        self.last_id = stream
        if self.closing or len(self.calls) >= _MAX_STREAMS:
            self._write(f.rst_stream(stream, f.REFUSED_STREAM))
            return
        if head.error is not None:
            http, code, message = head.error
            self._write(self._trailers_only(stream, code, message, (), http))
            if not flags & f.END_STREAM:
                self._write(f.rst_stream(stream, f.NO_ERROR))
            return
        call = Call(self, stream, head, self.peer_window)
        self.calls[stream] = call
        if call.method.streaming:
            call.queue = asyncio.Queue()
            self._start(call, self.server.run_stream(call))
        if flags & f.END_STREAM:
            self._remote_end(call)

    def _head(self, block: bytes) -> _Head:
        head = self.blocks.get(block)
        if head is not None:
            return head
        table = self.decoder.header_table
        before = (len(table.dynamic_entries), table.maxsize, _first(table.dynamic_entries))
        try:
            headers = self.decoder.decode(block)
        except hpack.HPACKError as exc:
            raise _ConnectionError(f.COMPRESSION_ERROR, str(exc)) from None
        head = self.server.parse_head(headers)  # type: ignore[arg-type]
        after = (len(table.dynamic_entries), table.maxsize, _first(table.dynamic_entries))
        if before != after:  # the table changed: a block kept may now decode differently
            self.blocks.clear()
        elif len(self.blocks) < _BLOCKS:
            self.blocks[block] = head
        return head

    def _on_data(self, flags: int, stream: int, payload: bytes) -> None:
        size = len(payload)
        self.credit += size
        if flags & f.PADDED:
            payload = _unpad(payload)
        call = self.calls.get(stream)
        if call is None or call.remote_closed:
            if stream == 0 or stream > self.last_id:
                raise _ConnectionError(f.PROTOCOL_ERROR, f"DATA on idle stream {stream}")
            return  # a call already answered (or reset): its data is dropped
        if call.done:
            return
        call.credit += size
        call.data += payload
        self._messages(call)
        if call.done:
            return
        if flags & f.END_STREAM:
            self._remote_end(call)
        elif call.credit >= _SETTINGS_WINDOW // 2:
            self._write(f.window_update(stream, call.credit))
            call.credit = 0

    def _messages(self, call: Call) -> None:
        """Hand on each whole message received (length-prefixed, perhaps compressed)."""
        data = call.data
        limit = self.server.max_message_bytes
        while len(data) >= 5:
            length = int.from_bytes(data[1:5], "big")
            if length > limit:
                self._refuse_large(call, length)
                return
            if len(data) < 5 + length:
                return
            message: bytes | None = bytes(data[5 : 5 + length])
            compressed = data[0]
            del data[: 5 + length]
            if compressed:
                message = self._inflate(call, message)  # type: ignore[arg-type]
                if message is None:
                    return
            self._deliver(call, message)  # type: ignore[arg-type]
            if call.done:
                return

    def _inflate(self, call: Call, message: bytes) -> bytes | None:
        """A compressed message, decompressed; None when that ended the call."""
        if call.encoding not in ("gzip", "deflate"):
            why = f"a message compressed with {call.encoding!r}; this server takes "
            self.end(call, Abort(StatusCode.UNIMPLEMENTED, why + ACCEPT_ENCODING))
            return None
        limit = self.server.max_message_bytes
        inflater = zlib.decompressobj(wbits=31 if call.encoding == "gzip" else 15)
        try:
            out = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            self.end(call, Abort(StatusCode.INTERNAL, f"could not decompress a message: {exc}"))
            return None
        if len(out) > limit:
            self._refuse_large(call, len(out))
            return None
        return out

    def _deliver(self, call: Call, message: bytes) -> None:
        if call.queue is not None:
            call.queue.put_nowait(message)
        elif call.message is not None:
            self.end(call, Abort(StatusCode.UNIMPLEMENTED, "a unary call takes one message"))
        else:
            call.message = message

    def _remote_end(self, call: Call) -> None:
        call.remote_closed = True
        if call.data:
            self.end(call, Abort(StatusCode.INTERNAL, "the request ended inside a message"))
            return
        if call.queue is not None:
            call.queue.put_nowait(None)
        elif call.task is None and not call.done:
            if call.message is None:
                self.end(call, Abort(StatusCode.UNIMPLEMENTED, "a unary call takes one message"))
                return
            self._start(call, self.server.run_unary(call))

    def _refuse_large(self, call: Call, size: int) -> None:
        self.end(
            call,
            Abort(
                StatusCode.RESOURCE_EXHAUSTED,
                f"the request message is {size} bytes, over the server's limit of "
                f"{self.server.max_message_bytes} (max_body_bytes)",
            ),
        )

    def _on_control(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        handle = _CONTROL.get(kind)
        if handle is not None:  # PRIORITY and unknown frame types: nothing to do
            handle(self, flags, stream, payload)

    def _on_window_update(self, flags: int, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(f.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream == 0:
            self.send_window += increment
            if self.send_window > f.MAX_WINDOW:
                raise _ConnectionError(f.FLOW_CONTROL_ERROR, "window over 2^31-1")
            for blocked in list(self.blocked.values()):
                self._flush(blocked)
        elif (call := self.calls.get(stream)) is not None:
            call.send_window += increment
            self._flush(call)

    def _on_settings_frame(self, flags: int, stream: int, payload: bytes) -> None:
        if stream != 0:
            raise _ConnectionError(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if not flags & f.ACK:
            self._on_settings(payload)
            self._write(f.frame(f.SETTINGS, f.ACK, 0))

    def _on_ping(self, flags: int, stream: int, payload: bytes) -> None:
        if not flags & f.ACK:
            self._write(f.frame(f.PING, f.ACK, 0, payload))

    def _on_rst_stream(self, flags: int, stream: int, payload: bytes) -> None:
        call = self.calls.get(stream)
        if call is not None:
            self._drop(call)

    def _on_goaway(self, flags: int, stream: int, payload: bytes) -> None:
        self.shutdown()

    def _on_continuation(self, flags: int, stream: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != stream:
            raise _ConnectionError(f.PROTOCOL_ERROR, "CONTINUATION out of place")
        _, first, block = self.continuing
        block += payload
        if len(block) > _MAX_HEADER_LIST:
            raise _ConnectionError(f.ENHANCE_YOUR_CALM, "header block too large")
        if flags & f.END_HEADERS:
            self.continuing = None
            self._on_block(first, stream, bytes(block))

    def _on_push_promise(self, flags: int, stream: int, payload: bytes) -> None:
        raise _ConnectionError(f.PROTOCOL_ERROR, "a client cannot push")

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionError(f.FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        for at in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, at)
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise _ConnectionError(f.FLOW_CONTROL_ERROR, "window over 2^31-1")
                delta, self.peer_window = value - self.peer_window, value
                for call in self.calls.values():
                    call.send_window += delta
                for call in list(self.blocked.values()):
                    self._flush(call)
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= 0xFFFFFF:
                    raise _ConnectionError(f.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_frame = value

    # -- calls ---------------------------------------------------------------------------

    def _start(self, call: Call, work: Awaitable[None]) -> None:
        loop = asyncio.get_running_loop()
        call.task = loop.create_task(work)  # type: ignore[arg-type]
        if call.deadline is not None:
            call.timer = loop.call_at(
                loop.time() + (call.deadline - time.monotonic()), self._expire, call
            )

    def _expire(self, call: Call) -> None:
        if call.done:
            return
        self.end(call, Abort(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        if call.task is not None:
            call.task.cancel()

    def respond(self, call: Call, payload: bytes) -> None:
        """A unary call's answer: headers, the message and trailers, in one write when
        the windows allow."""
        if call.done or self.transport is None:
            return
        size = len(payload) + 5
        if size <= self.peer_frame and size <= self.send_window and size <= call.send_window:
            self.send_window -= size
            call.send_window -= size
            self._write(
                b"".join((
                    self.server.response_headers(call.id),
                    f.head(size, f.DATA, 0, call.id),
                    b"\x00", (size - 5).to_bytes(4, "big"),
                    payload,
                    self._trailers(call.id, StatusCode.OK, "", call.trailing),
                ))
            )  # fmt: skip
            self._finish(call)
            return
        self.message(call, payload)
        self.end(call)

    def message(self, call: Call, payload: bytes) -> None:
        """One message of the call's answer (the headers first, with the first)."""
        if call.done or self.transport is None:
            return
        if not call.headers_sent:
            call.headers_sent = True
            self._write(self.server.response_headers(call.id))
        call.pending.append(memoryview(b"\x00" + len(payload).to_bytes(4, "big") + payload))
        self._flush(call)

    def end(self, call: Call, outcome: Abort | None = None) -> None:
        """End a call with OK or ``outcome``: the trailers once the messages held back
        are out, or a trailers-only answer when nothing was sent."""
        if call.done or call.end_frame is not None:
            return
        code, message, extra = StatusCode.OK, "", call.trailing
        if outcome is not None:
            code, message = outcome.code, outcome.message
            extra = [*call.trailing, *outcome.trailers]
        if call.headers_sent:
            call.end_frame = self._trailers(call.id, code, message, extra)
            self._flush(call)
        else:
            self._write(self._trailers_only(call.id, code, message, extra))
            self._finish(call)

    def _flush(self, call: Call) -> None:
        """Send what the windows allow of the call's held-back DATA, then its trailers."""
        pending = call.pending
        while pending and self.transport is not None:
            room = min(self.send_window, call.send_window, self.peer_frame)
            if room <= 0:
                self.blocked[call.id] = call
                return
            chunk = pending[0]
            if len(chunk) <= room:
                piece = pending.popleft()
            else:
                piece, pending[0] = chunk[:room], chunk[room:]
            self.send_window -= len(piece)
            call.send_window -= len(piece)
            self.transport.writelines((f.head(len(piece), f.DATA, 0, call.id), piece))
        self.blocked.pop(call.id, None)
        if call.end_frame is not None:
            self._write(call.end_frame)
            self._finish(call)
        elif call.writable is not None and not call.writable.done() and not self.paused:
            call.writable.set_result(None)

    def _finish(self, call: Call) -> None:
        """The call is answered (our side of the stream closed)."""
        call.done = True
        call.pending.clear()
        if call.timer is not None:
            call.timer.cancel()
        self.blocked.pop(call.id, None)
        if self.calls.pop(call.id, None) is not None and not call.remote_closed:
            self._write(f.rst_stream(call.id, f.NO_ERROR))  # stop the client's upload
        self._release(call)

    def _drop(self, call: Call) -> None:
        """The client reset the call (or left): cancel it, answer nothing."""
        call.done = call.remote_closed = True
        call.pending.clear()
        self.calls.pop(call.id, None)
        self.blocked.pop(call.id, None)
        if call.timer is not None:
            call.timer.cancel()
        if call.task is not None:
            call.task.cancel()
        if call.queue is not None:
            call.queue.put_nowait(None)
        self._release(call)

    def _release(self, call: Call) -> None:
        if call.writable is not None and not call.writable.done():
            call.writable.set_result(None)
        if self.closing and not self.calls:
            self._close_now()

    # -- out -----------------------------------------------------------------------------

    def _trailers(
        self, stream: int, code: StatusCode, message: str, extra: Iterable[tuple[str, str]]
    ) -> bytes:
        if code == StatusCode.OK and not extra:
            return self.server.ok_trailers(stream)
        block = _status_block(code, message, extra)
        return f.header_frames(block, f.END_STREAM, stream, self.peer_frame)

    def _trailers_only(
        self,
        stream: int,
        code: StatusCode,
        message: str,
        extra: Iterable[tuple[str, str]],
        http: int = 200,
    ) -> bytes:
        first = f.STATUS_200 if http == 200 else f.literal(8, str(http))
        block = first + self.server.content_type + _status_block(code, message, extra)
        return f.header_frames(block, f.END_STREAM, stream, self.peer_frame)

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _wake_writers(self) -> None:
        for call in list(self.calls.values()):
            if call.writable is not None and not call.writable.done() and not call.pending:
                call.writable.set_result(None)

    def shutdown(self) -> None:
        """No new calls (GOAWAY); close once the running ones end."""
        if self.closing:
            return
        self.closing = True
        self._write(f.goaway(self.last_id, f.NO_ERROR))
        if not self.calls:
            self._close_now()

    def abort_all(self) -> None:
        for call in list(self.calls.values()):
            self.end(call, Abort(StatusCode.UNAVAILABLE, "the server is shutting down"))
            if call.task is not None:
                call.task.cancel()
        self._close_now()

    def _fail(self, code: int, reason: str) -> None:
        logger.info("closing a gRPC connection from %s: %s", self.peer, reason)
        self._write(f.goaway(self.last_id, code, reason.encode()[:256]))
        for call in list(self.calls.values()):
            self._drop(call)
        self._close_now()

    def _close_now(self) -> None:
        if self.transport is not None:
            self.transport.close()


_CONTROL: dict[int, Callable[[Connection, int, int, bytes], None]] = {
    f.WINDOW_UPDATE: Connection._on_window_update,
    f.SETTINGS: Connection._on_settings_frame,
    f.PING: Connection._on_ping,
    f.RST_STREAM: Connection._on_rst_stream,
    f.GOAWAY: Connection._on_goaway,
    f.CONTINUATION: Connection._on_continuation,
    f.PUSH_PROMISE: Connection._on_push_promise,
}


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _first(entries: Any) -> Any:
    return entries[0] if entries else None


def _parse(method: Method, message: bytes) -> Any:
    try:
        return method.request.FromString(message)
    except DecodeError:
        name = method.request.DESCRIPTOR.full_name
        raise Abort(StatusCode.INVALID_ARGUMENT, f"the request does not parse as {name}") from None


@contextlib.contextmanager
def _ending(call: Call) -> Iterator[None]:
    """A call's handler ending by an exception: the status it answers."""
    try:
        yield
    except Abort as exc:
        call.conn.end(call, exc)
    except asyncio.CancelledError:
        call.conn.end(call, Abort(StatusCode.CANCELLED, "the call was cancelled"))
    except Exception:
        logger.exception("gRPC call %s failed", call.method.name)
        call.conn.end(call, Abort(StatusCode.INTERNAL, "internal error; see the server log"))


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise _ConnectionError(f.PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise _ConnectionError(f.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]


def _status_block(code: StatusCode, message: str, extra: Iterable[tuple[str, str]]) -> bytes:
    parts = [f.literal("grpc-status", str(int(code)))]
    if message:
        parts.append(f.literal("grpc-message", _encode_message(message)))
    for name, value in extra:
        if name.endswith("-bin"):
            value = base64.b64encode(value.encode("latin-1")).decode().rstrip("=")
        parts.append(f.literal(name.lower(), value))
    return b"".join(parts)


class GrpcServer:
    """Serves ``service``'s ``methods`` (by path: ``/<package.Service>/<Method>``) on a
    listening socket, in the running event loop."""

    def __init__(
        self, service: Service, methods: dict[str, Method], max_message_bytes: int
    ) -> None:
        self.service = service
        self.methods = methods
        self.max_message_bytes = max_message_bytes
        self.connections: set[Connection] = set()
        self.stopping = False
        self._listener: asyncio.AbstractServer | None = None
        self.opening = f.settings({
            f.ENABLE_PUSH: 0,
            f.MAX_CONCURRENT_STREAMS: _MAX_STREAMS,
            f.INITIAL_WINDOW_SIZE: _SETTINGS_WINDOW,
            f.MAX_FRAME_SIZE: _MAX_FRAME,
            f.MAX_HEADER_LIST_SIZE: _MAX_HEADER_LIST,
        }) + f.window_update(0, _CONNECTION_WINDOW - f.DEFAULT_WINDOW)  # fmt: skip
        self.content_type = f.literal(f.CONTENT_TYPE, "application/grpc")
        self._headers = (
            f.STATUS_200 + self.content_type + f.literal("grpc-accept-encoding", ACCEPT_ENCODING)
        )
        self._ok = f.literal("grpc-status", "0")

    def response_headers(self, stream: int) -> bytes:
        return f.head(len(self._headers), f.HEADERS, f.END_HEADERS, stream) + self._headers

    def ok_trailers(self, stream: int) -> bytes:
        flags = f.END_STREAM | f.END_HEADERS
        return f.head(len(self._ok), f.HEADERS, flags, stream) + self._ok

    def parse_head(self, headers: Iterable[tuple[str, str]]) -> _Head:
        """A request's decoded headers -> the method, deadline, encoding and metadata,
        or why the call is refused."""
        path = verb = content_type = ""
        deadline_s, encoding = None, "identity"
        metadata = []
        for name, value in headers:
            if name[0] == ":":
                if name == ":path":
                    path = value
                elif name == ":method":
                    verb = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                deadline_s = _timeout(value)
            elif name == "grpc-encoding":
                encoding = value
            elif name != "te" and not name.startswith("grpc-"):
                metadata.append((name, _metadata_value(name, value)))
        method = self.methods.get(path)
        error = None
        if verb != "POST":
            error = (405, StatusCode.UNIMPLEMENTED, f"gRPC calls are POSTs, not {verb}")
        elif not content_type.startswith("application/grpc"):
            error = (415, StatusCode.UNKNOWN, f"content-type {content_type!r} is not gRPC's")
        elif method is None:
            error = (200, StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
        return _Head(method, deadline_s, encoding, tuple(metadata), error)

    async def run_unary(self, call: Call) -> None:
        with _ending(call):
            request = _parse(call.method, call.message)  # type: ignore[arg-type]
            response = await self.service.unary(call, request)
            call.conn.respond(call, response.SerializeToString())

    async def run_stream(self, call: Call) -> None:
        with _ending(call):
            async for response in self.service.stream(call, self._requests(call)):
                await call.send(response)
                if call.done:
                    break
            call.conn.end(call)

    async def _requests(self, call: Call) -> AsyncIterator[Any]:
        assert call.queue is not None
        while (message := await call.queue.get()) is not None:
            try:
                request = _parse(call.method, message)
            except Abort as exc:
                call.conn.end(call, exc)
                return
            yield request

    async def start(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: Connection(self), sock=sock, ssl=tls, backlog=4096
        )

    async def stop(self, grace_s: float) -> None:
        """Take no new connections or calls (GOAWAY); running calls have ``grace_s`` to
        end, then are cancelled."""
        self.stopping = True
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort_all()
        await asyncio.sleep(0)
