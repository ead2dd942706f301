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
(receive windows opened for a message once its bytes are reserved, and the peer held to
them; sends held back by the peer's windows and released by its WINDOW_UPDATE); PING;
RST_STREAM (the call is cancelled); GOAWAY both ways
(:meth:`GrpcServer.stop` lets running calls finish within a grace period); the grpc-timeout
deadline (the call is cancelled and answers DEADLINE_EXCEEDED); length-prefixed messages,
gzip or deflate compressed ones included; trailers-only answers for calls that fail before
a message; TLS with ALPN ``h2``.

Every door bounded (:mod:`inferd.grpc.bounds`): a call is admitted (``Service.admit``:
authenticated) at its HEADERS, before any DATA of it is kept; its messages' bytes are
reserved against the connection's and the process's budgets before its window opens;
``max_streams`` calls a connection, ``max_connections`` connections; the preface and
each header block within ``header_timeout_s``, a message's bytes no more than
``body_timeout_s`` apart, a connection with no call closed after ``idle_s``, one
that does not read its answers after ``body_timeout_s``; floods of resets, pings,
settings and empty frames end the connection (GOAWAY ENHANCE_YOUR_CALM).

Calls go to a :class:`Service`: ``unary(call, request)`` returns the response,
``stream(call, requests)`` yields them; both raise :class:`Abort` to end the call with a
status. ``admit(call)``, when the service has it, runs at the call's HEADERS: it returns
None (admitted), raises :class:`Abort` (refused at once), or returns an awaitable that
decides (the connection reads nothing more meanwhile); what it learns of the caller it
may keep in ``call.user``. Messages are protobuf classes (``FromString`` / ``SerializeToString``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import functools
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
from inferd.grpc.bounds import PEER_PENALTY, Bounds, Buffers, Calm, Peers
from inferd.telemetry.log_rows import COUNTERS

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

_WINDOW = f.DEFAULT_WINDOW
"""A stream's receive window before its message's bytes are reserved, and the
connection's for bytes not reserved (HTTP/2's defaults, 64 KiB): a message that fits is
reserved once it is here, a larger one at its prefix, its window then opened for it."""
_CREDIT_AT = _WINDOW // 4
"""Connection window credit for bytes not needed at once is sent in steps this large."""
_MAX_FRAME = f.DEFAULT_MAX_FRAME
"""The largest frame a client may send (16 KiB, the default): what a connection can
hold of a frame still arriving."""
_TURN_S = 0.001
"""A connection's frames are handled at most this long in one turn of the event loop
(then the rest in the next, after what the other connections and calls wait to do): a
burst of hundreds of calls, refused or not, does not hold the loop for its neighbours
for more than that."""
_UNTRUSTED_TURN_S = 0.0002
"""The turn of a connection none of whose calls has been admitted yet (no credential, a
key for another model, nothing but refusals): a fifth, so that a flood of refused calls
delays an honest client's call by a fifth of a millisecond a turn, not a millisecond."""
_DROPPED_BYTES_A_STRIKE = 4096
"""DATA on a call already ended (refused at its HEADERS, reset, answered) costs a token
of the flood bucket per this many bytes: the 64 KiB a client may have had in flight when
the call ended cost 16; an upload that goes on regardless ends the connection within a
few MiB (and no more than ~400 KB/s goes on after that)."""
_BLOCKS = 64
_BLOCK_BYTES = 1024
"""Header blocks kept decoded per connection, each at most this long."""


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
        "admitting",
        "blocked_at",
        "conn",
        "covered",
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
        "need",
        "pending",
        "queue",
        "read_at",
        "recv_window",
        "remote_closed",
        "reserved",
        "send_window",
        "task",
        "timer",
        "trailing",
        "unreserved",
        "user",
        "waiting_since",
        "wanted",
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
        self.user: Any = None
        """What the service's ``admit`` learnt of the caller (its principal)."""
        self.admitting = False
        self.data = bytearray()  # received, not yet a whole message
        self.message: bytes | None = None  # a unary call's request
        self.queue: asyncio.Queue[tuple[bytes, int] | None] | None = None  # a stream's
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.send_window = window
        self.pending: deque[memoryview] = deque()  # DATA held back by flow control
        self.end_frame: bytes | None = None  # the trailers, once the pending DATA is out
        self.headers_sent = False
        self.remote_closed = False
        self.done = False
        self.trailing: list[tuple[str, str]] = []
        self.writable: asyncio.Future[None] | None = None
        self.blocked_at = 0.0  # when its answer began to wait for the client's window
        # receiving (see inferd.grpc.bounds)
        self.recv_window = _WINDOW  # what the client may still send on this stream
        self.need = 0  # the length of the message arriving (prefix included), once known
        self.reserved = 0  # bytes of the budgets this call holds
        self.wanted = 0  # bytes it waits to reserve
        self.covered = 0  # reserved bytes credited to the client, not yet received
        self.unreserved = 0  # received bytes no reservation covers (the connection's own)
        self.read_at = conn.now  # when its request last made progress
        self.waiting_since = 0.0

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
        self.bounds = server.bounds
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.buf = bytearray()
        self.preface = False
        self.calls: dict[int, Call] = {}
        self.last_id = 0
        self.decoder = hpack.Decoder(max_header_list_size=self.bounds.max_header_list)
        self.blocks: dict[bytes, _Head] = {}
        self.continuing: tuple[int, int, bytearray] | None = None
        self.send_window = f.DEFAULT_WINDOW
        self.peer_window = f.DEFAULT_WINDOW
        self.peer_frame = f.DEFAULT_MAX_FRAME
        self.blocked: dict[int, Call] = {}
        self.paused = False
        self.closing = False
        self.refused = False
        # receiving: windows, budgets, admission (see inferd.grpc.bounds)
        self.recv_window = _WINDOW  # what the client may still send on the connection
        self.credit = 0  # window to give back to the client (sent in steps)
        self.urgent = False  # a client waits for the credit: send it now
        self.advance = 0  # credited for calls that ended before their bytes came
        self.held = 0  # this connection's share of the process's budget
        self.admitting = 0  # calls whose admission is being decided (reading waits)
        self.reading = True
        self.more = False  # frames wait for the loop's next turn
        self.turn_s = _UNTRUSTED_TURN_S  # until a call is admitted
        self.resuming: asyncio.Handle | None = None
        # timeouts and floods
        self.now = self.opened_at = self.active_at = time.monotonic()
        self.partial_since: float | None = None  # a frame has been arriving since
        self.block_since = 0.0  # a header block in CONTINUATION frames began
        self.paused_since = 0.0
        self.calm = Calm(self.now)
        self.peer_calm: Calm | None = None  # its address's, once connected
        self.sent = False  # HEADERS or DATA written since the client's last PING
        self.settings_seen = False
        self.out: list[bytes | memoryview] | None = None  # writes held: one a turn

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer_calm = self.server.peers.of(self.peer, self.now)
        if self.peer_calm is not None and self.peer_calm.empty(self.now):
            self.refused = True  # its address floods: closed before a byte is read
            COUNTERS["connections_refused:grpc:flood"] += 1
            self._close_now()
            return
        if len(self.server.connections) >= self.bounds.max_connections:
            self.refused = True
            COUNTERS["connections_refused:grpc:limit"] += 1
            self._write(self.server.opening + f.goaway(0, f.NO_ERROR, b"too many connections"))
            self._close_now()
            return
        self.server.connections.add(self)
        self._write(self.server.opening)
        if self.server.stopping:
            self.shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.resuming is not None:
            self.resuming.cancel()
            self.resuming = None
        for call in list(self.calls.values()):
            self._drop(call)
        self.paused = False
        self._wake_writers()

    def pause_writing(self) -> None:
        """The client does not read its answers: read no more of its requests."""
        self.paused = True
        self.paused_since = time.monotonic()
        self._read_or_not()

    def resume_writing(self) -> None:
        self.paused = False
        self._read_or_not()
        self._wake_writers()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.resuming is None:
            self._frames()
        else:  # its turn is over: the rest after the others' (see _each_frame)
            self._read_or_not()

    def _resume(self) -> None:
        self.resuming = None
        self._frames()
        self._read_or_not()

    def _read_or_not(self) -> None:
        """Read from the socket unless answers back up, or frames wait for their turn
        (an admission being decided, or the loop's other connections) with a read's
        worth already here."""
        waiting = self.admitting or self.resuming is not None
        want = not self.paused and not (waiting and len(self.buf) >= _WINDOW)
        if want != self.reading and self.transport is not None:
            self.reading = want
            if want:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def _frames(self) -> None:
        """Handle the whole frames received (all but while an admission is decided);
        what they answer goes out in one write."""
        if self.out is not None:
            self._handle_frames()
            return
        self.out = []
        try:
            self._handle_frames()
        finally:
            self._uncork()

    def _handle_frames(self) -> None:
        buf = self.buf
        self.now = now = time.monotonic()
        if self.admitting:
            self._read_or_not()
            return
        pos = 0
        if not self.preface:
            pos = self._preface()
            if pos <= 0:
                return
        try:
            pos = self._each_frame(pos)
        except _ConnectionError as exc:
            self._fail(exc.code, exc.reason)
            return
        if self.transport is None:
            return
        if pos:
            del buf[:pos]
            self.partial_since = now if buf else None
        elif buf and self.partial_since is None:
            self.partial_since = now
        self._give_credit()
        if self.more:
            self.more = False
            self.resuming = asyncio.get_running_loop().call_soon(self._resume)
        if self.admitting or self.resuming is not None:
            self._read_or_not()

    def _each_frame(self, pos: int) -> int:
        """Handle the frames from ``pos``: where the first not yet whole one begins."""
        buf = self.buf
        end = len(buf)
        unpack = f.HEAD.unpack_from
        began, count = time.perf_counter(), 0
        while end - pos >= 9 and not self.admitting:
            count += 1
            if not count & 15 and time.perf_counter() - began > self.turn_s:
                self.more = True  # the rest in the loop's next turn: others go first
                break
            high, low, kind, flags, stream = unpack(buf, pos)
            size = (high << 16) | low
            if size > _MAX_FRAME:
                raise _ConnectionError(f.FRAME_SIZE_ERROR, "frame too large")
            if kind == f.DATA and size > self.recv_window:
                raise _ConnectionError(f.FLOW_CONTROL_ERROR, "DATA beyond the window")
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
                break
        return pos

    def _give_credit(self) -> None:
        credit = self.credit
        if credit and (self.urgent or credit >= _CREDIT_AT):
            self.credit, self.urgent = 0, False
            self.recv_window += credit
            self._write(f.window_update(0, credit))

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

    def _strike(self, what: str, cost: float = 1.0) -> None:
        """A cheap-frame event; too many (on this connection, or from its address) end
        the connection."""
        calm, now = self.calm.spend(self.now, cost), self.now
        if self.peer_calm is not None and not self.peer_calm.spend(now, cost):
            self.peer_calm.punish(PEER_PENALTY)
            raise _ConnectionError(f.ENHANCE_YOUR_CALM, f"too many {what} from {self.peer}")
        if not calm:
            raise _ConnectionError(f.ENHANCE_YOUR_CALM, f"too many {what}")

    # -- frames in -----------------------------------------------------------------------

    def _on_headers(self, flags: int, stream: int, payload: bytes) -> None:
        if flags & f.PADDED:
            payload = _unpad(payload)
        if flags & f.PRIORITY_FLAG:
            payload = payload[5:]
        if not flags & f.END_HEADERS:
            if not payload:
                self._strike("empty header frames")
            self.continuing = (stream, flags, bytearray(payload))
            self.block_since = self.now
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
        if self.closing or len(self.calls) >= self.bounds.max_streams:
            self._strike("streams over the limit")
            self._write(f.rst_stream(stream, f.REFUSED_STREAM))
            return
        if head.error is not None:
            http, code, message = head.error
            self._refuse(stream, flags, code, message, (), http)
            return
        call = Call(self, stream, head, self.peer_window)
        admit = self.server.admit
        if admit is not None:
            try:
                deciding = admit(call)
            except Abort as exc:
                self._strike("refused calls")
                self._refuse(stream, flags, exc.code, exc.message, exc.trailers)
                return
            if deciding is not None:
                self._admit(call, deciding, flags)
                return
        self._open(call, flags)

    def _refuse(
        self,
        stream: int,
        flags: int,
        code: StatusCode,
        message: str,
        trailers: Iterable[tuple[str, str]],
        http: int = 200,
    ) -> None:
        """A call refused at its HEADERS: answered at once, its upload stopped."""
        self._write(self._trailers_only(stream, code, message, trailers, http))
        if not flags & f.END_STREAM:
            self._write(f.rst_stream(stream, f.NO_ERROR))

    def _open(self, call: Call, flags: int) -> None:
        self.calls[call.id] = call
        self.turn_s = _TURN_S
        if call.method.streaming:
            call.queue = asyncio.Queue()
            self._start(call, self.server.run_stream(call))
        if flags & f.END_STREAM:
            self._remote_end(call)

    def _admit(self, call: Call, deciding: Awaitable[None], flags: int) -> None:
        """Decide the call's admission before reading on (its DATA stays unread)."""
        call.admitting = True
        self.calls[call.id] = call
        self.admitting += 1
        task = asyncio.ensure_future(deciding)
        task.add_done_callback(functools.partial(self._admitted, call, flags))

    def _admitted(self, call: Call, flags: int, task: asyncio.Future[None]) -> None:
        self.admitting -= 1
        call.admitting = False
        refusal = None if task.cancelled() else task.exception()
        if self.transport is None or call.done:
            return
        if refusal is not None or task.cancelled():
            try:
                self.now = time.monotonic()
                self._strike("refused calls")
            except _ConnectionError as exc:
                self._fail(exc.code, exc.reason)
                return
            if not isinstance(refusal, Abort):
                if refusal is not None:
                    logger.error("admitting a gRPC call failed", exc_info=refusal)
                refusal = Abort(StatusCode.UNAVAILABLE, "the call could not be admitted")
            del self.calls[call.id]
            self._refuse(call.id, flags, refusal.code, refusal.message, refusal.trailers)
            call.done = True
        else:
            del self.calls[call.id]
            self._open(call, flags)
        if not self.admitting:
            self._frames()
            self._read_or_not()

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
        elif len(self.blocks) < _BLOCKS and len(block) <= _BLOCK_BYTES:
            self.blocks[block] = head
        return head

    def _on_data(self, flags: int, stream: int, payload: bytes) -> None:
        size = len(payload)
        self.recv_window -= size
        if flags & f.PADDED:
            payload = _unpad(payload)
        call = self.calls.get(stream)
        if call is None or call.remote_closed or call.done:
            if stream == 0 or stream > self.last_id:
                raise _ConnectionError(f.PROTOCOL_ERROR, f"DATA on idle stream {stream}")
            absorbed = min(self.advance, size)  # a call answered (or reset): dropped
            self.advance -= absorbed
            self.credit += size - absorbed
            if size:  # what was in flight when it ended costs little; a stream of it, a lot
                self._strike("DATA on ended calls", size / _DROPPED_BYTES_A_STRIKE)
            return
        call.recv_window -= size
        if call.recv_window < 0:
            self.credit += size
            self._write(f.rst_stream(stream, f.FLOW_CONTROL_ERROR))
            self._drop(call)
            return
        n = len(payload)
        self.credit += size - n  # padding is not kept
        if not n and not flags & f.END_STREAM:
            self._strike("empty DATA frames")
        covered = call.covered
        if covered >= n:
            call.covered = covered - n
        else:
            call.covered = 0
            call.unreserved += n - covered
        call.read_at = self.now
        call.data += payload
        self._messages(call)
        if call.done:
            return
        if flags & f.END_STREAM:
            self._remote_end(call)

    def _messages(self, call: Call) -> None:
        """Hand on each whole message received (length-prefixed, perhaps compressed),
        once its bytes are reserved."""
        data = call.data
        while len(data) >= 5 and not call.wanted:
            need = call.need
            if not need:
                length = int.from_bytes(data[1:5], "big")
                if length > self.server.max_message_bytes:
                    self._refuse_large(call, length)
                    return
                need = call.need = length + 5
                if not self.server.buffers.take(call, need):
                    call.waiting_since = self.now
                    return
                self._cover(call, need)
            if len(data) < need:
                return
            message: bytes | None = bytes(data[5:need])
            compressed = data[0]
            del data[:need]
            call.need = 0
            if compressed:
                message = self._inflate(call, message)  # type: ignore[arg-type]
                if message is None:
                    return
            self._deliver(call, message, need)  # type: ignore[arg-type]
            if call.done:
                return

    def _cover(self, call: Call, need: int) -> None:
        """The message's bytes are reserved: what of it is here is no longer the
        connection's own, and the client may send the rest (its windows opened)."""
        here = min(len(call.data), need)
        moved = min(here, call.unreserved)
        call.unreserved -= moved
        rest = need - here
        call.covered += rest
        self.credit += moved + rest
        if rest:  # the client waits for the window of the rest
            self.urgent = True
        extra = _WINDOW if call.queue is not None else 0  # a stream's next message
        if call.recv_window < rest + extra // 2:
            increment = rest + extra - call.recv_window
            call.recv_window += increment
            self._write(f.window_update(call.id, increment))

    def granted(self, call: Call) -> None:
        """A reservation the call waited for is made (by another call's end)."""
        if call.done or self.transport is None:
            self.server.buffers.release(call, call.reserved)
            return
        self.now = call.read_at = time.monotonic()  # its client may go on from now
        self._cover(call, call.need)
        self.urgent = True
        self._messages(call)
        if not call.done and call.remote_closed and not call.wanted:
            self._ended(call)
        self._give_credit()

    def consumed(self, call: Call, size: int) -> None:
        """A stream's handler took a message: its bytes leave the budgets."""
        self.server.buffers.release(call, size)

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

    def _deliver(self, call: Call, message: bytes, size: int) -> None:
        if call.queue is not None:
            call.queue.put_nowait((message, size))
        elif call.message is not None:
            self.end(call, Abort(StatusCode.UNIMPLEMENTED, "a unary call takes one message"))
        else:
            call.message = message

    def _remote_end(self, call: Call) -> None:
        call.remote_closed = True
        if not call.wanted:  # else once its last message is reserved (granted)
            self._ended(call)

    def _ended(self, call: Call) -> None:
        """The client's side of the call closed, its messages all handed on."""
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
        if handle is not None:
            handle(self, flags, stream, payload)
        else:  # PRIORITY and unknown frame types: nothing to do, and a cost
            self._strike("PRIORITY or unknown frames")

    def _on_window_update(self, flags: int, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(f.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not increment:
            raise _ConnectionError(f.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
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
            if self.settings_seen:
                self._strike("SETTINGS frames")
            self.settings_seen = True
            self._on_settings(payload)
            self._write(f.frame(f.SETTINGS, f.ACK, 0))

    def _on_ping(self, flags: int, stream: int, payload: bytes) -> None:
        if not flags & f.ACK:
            if not self.sent:  # pings with answers between them are the client's business
                self._strike("PING frames")
            self.sent = False
            self._write(f.frame(f.PING, f.ACK, 0, payload))

    def _on_rst_stream(self, flags: int, stream: int, payload: bytes) -> None:
        call = self.calls.get(stream)
        if call is not None:
            self._strike("reset calls")  # the rapid-reset class: a call begun for nothing
            self._drop(call)

    def _on_goaway(self, flags: int, stream: int, payload: bytes) -> None:
        self.shutdown()

    def _on_continuation(self, flags: int, stream: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != stream:
            raise _ConnectionError(f.PROTOCOL_ERROR, "CONTINUATION out of place")
        _, first, block = self.continuing
        if not payload and not flags & f.END_HEADERS:
            self._strike("empty header frames")
        block += payload
        if len(block) > self.bounds.max_header_list:
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

    # -- timeouts ------------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """End what waited past its time (:meth:`GrpcServer.sweep`, every ``sweep_s``)."""
        bounds = self.bounds
        if self.transport is None:
            return
        if not self.preface and now - self.opened_at > bounds.header_timeout_s:
            COUNTERS["connections_refused:grpc:timeout"] += 1
            self._close_now()
        elif self.continuing is not None and now - self.block_since > bounds.header_timeout_s:
            self._fail(f.ENHANCE_YOUR_CALM, "a header block took too long", "timeout")
        elif self.partial_since is not None and now - self.partial_since > self._frame_time():
            self._fail(f.ENHANCE_YOUR_CALM, "a frame took too long", "timeout")
        elif self.paused and now - self.paused_since > bounds.body_timeout_s:
            logger.info("closing a gRPC connection from %s: it reads no answers", self.peer)
            self._close_now()
        elif not self.calls:
            if now - self.active_at > bounds.idle_s:
                self.shutdown()
        else:
            for call in list(self.calls.values()):
                self._sweep_call(call, now)

    def _frame_time(self) -> float:
        """How long the frame at the buffer's head may take to arrive whole."""
        kind = self.buf[3] if len(self.buf) > 3 else f.HEADERS
        if kind in (f.HEADERS, f.CONTINUATION):
            return self.bounds.header_timeout_s
        return self.bounds.body_timeout_s

    def _sweep_call(self, call: Call, now: float) -> None:
        timeout_s = self.bounds.body_timeout_s
        if call.id in self.blocked and now - call.blocked_at > timeout_s:
            logger.info("resetting a gRPC call from %s: it reads no answer", self.peer)
            self._write(f.rst_stream(call.id, f.CANCEL))
            self._drop(call)
            return
        if call.wanted:
            if now - call.waiting_since > timeout_s:
                self.end(call, _buffers_full(timeout_s))
            return
        receiving = call.need or call.data or (call.queue is None and call.task is None)
        if not receiving or call.admitting or now - call.read_at <= timeout_s:
            return
        if self.recv_window < _CREDIT_AT and self.server.buffers.waiting:
            self.end(call, _buffers_full(timeout_s))  # its client had no window to send
        else:
            why = f"the request message stopped arriving for {timeout_s:g}s"
            self.end(call, Abort(StatusCode.DEADLINE_EXCEEDED, why + " (body_timeout_s)"))
        if call.task is not None:
            call.task.cancel()

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
        self.sent = True
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
        self.sent = True
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
        self.sent = True
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
        """Send what the windows allow of the call's held-back DATA, then its trailers
        (in one write)."""
        if self.out is not None:
            self._send_pending(call)
            return
        self.out = []
        try:
            self._send_pending(call)
        finally:
            self._uncork()

    def _send_pending(self, call: Call) -> None:
        pending = call.pending
        moved = False
        while pending and self.transport is not None:
            room = min(self.send_window, call.send_window, self.peer_frame)
            if room <= 0:
                if moved or call.id not in self.blocked:  # its wait starts (again)
                    call.blocked_at = time.monotonic()
                    self.blocked[call.id] = call
                return
            moved = True
            chunk = pending[0]
            if len(chunk) <= room:
                piece = pending.popleft()
            else:
                piece, pending[0] = chunk[:room], chunk[room:]
            self.send_window -= len(piece)
            call.send_window -= len(piece)
            self._write(f.head(len(piece), f.DATA, 0, call.id))
            self._write(piece)
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
        task = call.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()  # ended from outside its handler (a limit, a timeout)
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
        """What the ended call held goes back: its reservation, its unreserved bytes
        (credited), what was credited for bytes it will not get (``advance``)."""
        if call.writable is not None and not call.writable.done():
            call.writable.set_result(None)
        call.wanted = 0
        self.advance += call.covered
        self.credit += call.unreserved
        call.covered = call.unreserved = 0
        call.data.clear()
        self.active_at = time.monotonic()
        if call.reserved:
            self.server.buffers.release(call, call.reserved)
        self._give_credit()
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
        if extra:
            first = f.STATUS_200 if http == 200 else f.literal(8, str(http))
            block = first + self.server.content_type + _status_block(code, message, extra)
        else:
            block = self.server.refusal(code, message, http)
        return f.header_frames(block, f.END_STREAM, stream, self.peer_frame)

    def _write(self, data: bytes | memoryview) -> None:
        out = self.out
        if out is not None:
            out.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def _uncork(self) -> None:
        """Write what was held (one system call for a turn's answers: a burst of
        hundreds of refused calls costs one write, not two a call)."""
        out, self.out = self.out, None
        if out and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

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

    def _fail(self, code: int, reason: str, why: str = "") -> None:
        """End the connection with GOAWAY ``code``; ``why`` (or ``flood`` for
        ENHANCE_YOUR_CALM, ``protocol`` for the rest) counts it."""
        why = why or ("flood" if code == f.ENHANCE_YOUR_CALM else "protocol")
        COUNTERS[f"connections_refused:grpc:{why}"] += 1
        logger.debug("closing a gRPC connection from %s: %s", self.peer, reason)
        self._write(f.goaway(self.last_id, code, reason.encode()[:256]))
        for call in list(self.calls.values()):
            self._drop(call)
        self._close_now()

    def _close_now(self) -> None:
        if self.out is not None:
            self._uncork()
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


def _buffers_full(timeout_s: float) -> Abort:
    why = f"the gateway's gRPC request buffers stayed full for {timeout_s:g}s"
    return Abort(StatusCode.RESOURCE_EXHAUSTED, why + " (connections.grpc_buffer_mb)")


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
        self,
        service: Service,
        methods: dict[str, Method],
        max_message_bytes: int,
        bounds: Bounds | None = None,
    ) -> None:
        self.service = service
        self.methods = methods
        self.max_message_bytes = max_message_bytes
        self.bounds = (bounds or Bounds()).fitted(max_message_bytes)
        self.buffers = Buffers(self.bounds.process_buffer, self.bounds.connection_buffer)
        self.peers = Peers()
        self.admit: Callable[[Call], Awaitable[None] | None] | None = getattr(
            service, "admit", None
        )
        self.connections: set[Connection] = set()
        self.stopping = False
        self._listener: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.opening = f.settings({
            f.ENABLE_PUSH: 0,
            f.MAX_CONCURRENT_STREAMS: self.bounds.max_streams,
            f.INITIAL_WINDOW_SIZE: _WINDOW,
            f.MAX_FRAME_SIZE: _MAX_FRAME,
            f.MAX_HEADER_LIST_SIZE: self.bounds.max_header_list,
        })  # fmt: skip
        self.content_type = f.literal(f.CONTENT_TYPE, "application/grpc")
        self._headers = (
            f.STATUS_200 + self.content_type + f.literal("grpc-accept-encoding", ACCEPT_ENCODING)
        )
        self._ok = f.literal("grpc-status", "0")
        self._refusals: dict[tuple[StatusCode, str, int], bytes] = {}

    def refusal(self, code: StatusCode, message: str, http: int) -> bytes:
        """A trailers-only answer's header block, kept for the next identical one (a
        flood of refused calls is answered from here)."""
        key = (code, message, http)
        block = self._refusals.get(key)
        if block is None:
            first = f.STATUS_200 if http == 200 else f.literal(8, str(http))
            block = first + self.content_type + _status_block(code, message, ())
            if len(self._refusals) >= _BLOCKS:
                self._refusals.clear()
            self._refusals[key] = block
        return block

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
        while (item := await call.queue.get()) is not None:
            message, size = item
            call.conn.consumed(call, size)
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
        self._sweeper = loop.create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        """Timeouts, looked at every ``bounds.sweep_s`` (no timer per request)."""
        while True:
            await asyncio.sleep(self.bounds.sweep_s)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.sweep(now)

    async def stop(self, grace_s: float) -> None:
        """Take no new connections or calls (GOAWAY); running calls have ``grace_s`` to
        end, then are cancelled."""
        self.stopping = True
        if self._listener is not None:
            self._listener.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort_all()
        await asyncio.sleep(0)
