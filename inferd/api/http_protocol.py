"""The gateway's HTTP/1.1 protocol: uvicorn's (httptools), with each response's head and
body in one write.

uvicorn writes a response's status line and headers, then its body, as two writes: two
system calls (and, with Nagle off, two TCP segments) per response, about a fifth of a
gateway's CPU for a one-row prediction. Here the head waits for what follows it in the
same turn of the event loop (the body of every plain response), and goes out with it;
a head whose body does not come in that turn (a stream's first chunk still being made)
is written at the end of the turn. Writes are never reordered.

The hot routes (predict and infer) are answered by the protocol itself when nothing
stands in front of :class:`~inferd.api.app.FastPath` but the asynchronous gate (no auth,
rate limits or tracing; see :func:`~inferd.api.app.direct_path`): their handler runs
with the request cycle's own ``receive``, and its whole response goes out in one write,
without the ASGI app chain, its ``send`` messages, or uvicorn's per-header checks (the
few values a handler can take from outside are checked in one pass). Profiled under 64
connections, that chain and the two sends were about a tenth of a gateway process's CPU.
Everything else about the connection (keep-alive, pipelining, flow control, graceful
shutdown, a client going away) stays uvicorn's: the request keeps its cycle.

Every door bounded (``connections.*``, :class:`HttpBounds`), where uvicorn bounds
nothing: a request's head must arrive within ``header_timeout_s`` of its first byte (a
new connection's first request, of the connection) and be at most ``max_header_bytes``
(408 and 431, JSON, then the connection closes; the bytes are counted per read while a
head is incomplete, so a head may overrun the limit by what its first read held, at
most a read's worth, and the hot path pays no call per header); a body may pause at most
``body_timeout_s`` between reads while the server waits for it (408); at most
``max_connections`` connections per process (more are closed at once). The timeouts
are looked at by one sweep a gateway process (:func:`sweep_forever`), not a timer per
request. A malformed request gets a JSON 400, not uvicorn's text.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import orjson
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import (
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from inferd.api.app import _GONE, FastPath, HotRoute, direct_path
from inferd.api.http import context_of
from inferd.telemetry.log_rows import COUNTERS

_HEAD = b"HTTP/"


class _HeadWithBody:
    """A transport whose writes of a response head wait for the next write, at most
    until the end of the turn; everything else is the transport's."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data[:5] == _HEAD:
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def write_whole(self, data: bytes) -> None:
        """A whole response, head and body: written at once, after any head waiting."""
        self._flush()
        self._transport.write(data)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _CycleWatch:
    """A directly answered request's :class:`~inferd.api.app.Watch`: the connection's
    loss cancels its handler, once the body was read (as a ``DisconnectWatch`` does,
    with no task or timer of its own: the protocol sees the loss first)."""

    __slots__ = ("cycle", "disconnected", "task")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle
        self.task: asyncio.Task[None] | None = None
        self.disconnected = False

    def lost(self) -> None:
        task, scope = self.task, cast(dict[str, Any], self.cycle.scope)
        if task is not None and not task.done() and context_of(scope).body_read:
            self.disconnected = True
            task.cancel()

    def absorb(self) -> bool:
        if not self.disconnected or self.task is None:
            return False
        self.task.uncancel()
        return True

    def stop(self) -> None:
        self.task = None


@dataclass(frozen=True)
class HttpBounds:
    """The HTTP port's limits (``connections.*``)."""

    max_connections: int = 4096
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024

    @property
    def sweep_s(self) -> float:
        return min(1.0, self.header_timeout_s / 4, self.body_timeout_s / 4)


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_WHY = {400: "protocol", 408: "timeout", 431: "too_large"}
"""How ``inferd_connections_refused_total`` counts each refusal."""


def _refusal(status: int, code: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return b"".join((
        b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
        b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n", body,
    ))  # fmt: skip


class HttpProtocol(HttpToolsProtocol):
    bounds: ClassVar[HttpBounds] = HttpBounds()
    _direct: FastPath | None = None
    _watch: _CycleWatch | None = None
    _refused = False
    _in_head = False
    _head_bytes = 0
    _heads = 0  # requests begun on this connection
    _since = 0.0  # the wait for a head began (the connection, or the head's first byte)
    _read_at = 0.0  # the last bytes came

    @classmethod
    def bounded(cls, bounds: HttpBounds) -> type[HttpProtocol]:
        """This protocol with ``bounds`` (uvicorn takes a class)."""
        return type("HttpProtocol", (cls,), {"bounds": bounds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
        self._direct = direct_path(self.app)
        self._since = self._read_at = time.monotonic()
        if len(self.connections) > self.bounds.max_connections:
            self._refused = True
            COUNTERS["connections_refused:http:limit"] += 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._read_at = time.monotonic()
        if self._refused:
            return
        heads, within = self._heads, self._in_head
        super().data_received(data)
        if within and self._in_head and heads == self._heads:  # all of it one unfinished head
            self._head_bytes += len(data)
            if self._head_bytes > self.bounds.max_header_bytes:
                limit = self.bounds.max_header_bytes
                why = f"the request's head is over {limit} bytes (connections.max_header_bytes)"
                self.refuse(431, "headers_too_large", why)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._since = True, 0, self._read_at
        self._heads += 1

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def refuse(self, status: int, code: str, message: str) -> None:
        """Answer ``status`` (JSON) and close, whatever the request was doing."""
        if self._refused:
            return
        self._refused = True
        COUNTERS[f"connections_refused:http:{_WHY[status]}"] += 1
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True  # the app's receive says so; its send is dropped
            cycle.message_event.set()
        if cycle is None or not cycle.response_started or cycle.response_complete:
            self.transport.write(_refusal(status, code, message))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.refuse(400, "bad_request", f"{msg.rstrip('.')}: it does not parse as HTTP/1.1")

    def sweep(self, now: float) -> None:
        """End the wait for a slow head or body (:func:`sweep_forever`)."""
        if self._refused or self.transport.is_closing():
            return
        bounds, cycle = self.bounds, self.cycle
        if self._in_head:
            if now - self._since > bounds.header_timeout_s:
                why = f"the request's head did not arrive within {bounds.header_timeout_s:g}s"
                self.refuse(408, "client_too_slow", why + " (connections.header_timeout_s)")
        elif cycle is None:  # a connection that never sent a request
            if now - self._since > bounds.header_timeout_s:
                self._refused = True
                COUNTERS["connections_refused:http:timeout"] += 1
                self.transport.close()
        elif cycle.more_body and not cycle.response_complete:
            if self.flow.read_paused:  # the app has not read what came: not the client's wait
                self._read_at = now
            elif now - self._read_at > bounds.body_timeout_s:
                why = f"the request's body stopped arriving for {bounds.body_timeout_s:g}s"
                self.refuse(408, "client_too_slow", why + " (connections.body_timeout_s)")

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        fast = self._direct
        hot = None if fast is None else fast.direct(cast(dict[str, Any], cycle.scope))
        if hot is None or fast is None or self.config.reset_contextvars:
            super()._start_asgi_task(cycle, app)
            return
        watch = self._watch = _CycleWatch(cycle)
        task = watch.task = self.loop.create_task(_answer(fast, cycle, hot, watch))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._watch is not None:
            self._watch.lost()


async def sweep_forever(connections: set[Any], bounds: HttpBounds) -> None:
    """The HTTP port's timeouts (:meth:`HttpProtocol.sweep`), every ``bounds.sweep_s``."""
    while True:
        await asyncio.sleep(bounds.sweep_s)
        now = time.monotonic()
        for conn in list(connections):
            if isinstance(conn, HttpProtocol):
                conn.sweep(now)


async def _answer(
    fast: FastPath, cycle: RequestResponseCycle, hot: HotRoute, watch: _CycleWatch
) -> None:
    """A hot route's request, answered in one write (what ``RequestResponseCycle.run_asgi``
    and two ``send`` calls do for a plain response)."""
    scope: Any = cycle.scope
    receive: Any = cycle.receive  # uvicorn's typed ASGI callables, Starlette's plain ones
    send: Any = cycle.send
    try:
        response = await fast.answer(scope, receive, hot, watch)
        if response is not _GONE:
            if type(response) is Response:
                await _send_whole(cycle, response)
            else:  # a streamed or file response: sent as the ASGI app would
                await response(scope, receive, send)
    except BaseException as exc:
        cycle.logger.error("Exception in ASGI application\n", exc_info=exc)
        if not cycle.response_started:
            await cycle.send_500_response()
        else:
            cycle.transport.close()
        return
    fast.record(scope, hot, response)


async def _send_whole(cycle: RequestResponseCycle, response: Response) -> None:
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    raw = response.raw_headers
    # uvicorn's check of each value, in one pass (a tab is allowed in a value)
    if HEADER_VALUE_RE.search(b"\t".join([value for _, value in raw])) is not None:
        raise RuntimeError("Invalid HTTP header value.")
    head = [STATUS_LINE[response.status_code]]
    for name, value in cycle.default_headers:
        head += (name, b": ", value, b"\r\n")
    for name, value in raw:
        if name == b"connection" and b"close" in value.lower():
            cycle.keep_alive = False
        head += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive:
        head.append(b"connection: close\r\n")
    head += (b"\r\n", bytes(response.body))
    transport: Any = cycle.transport  # a _HeadWithBody
    transport.write_whole(b"".join(head))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
