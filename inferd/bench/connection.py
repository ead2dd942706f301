"""A minimal, fast HTTP/1.1 client connection for load generation.

Why not aiohttp or httpx: the load generator shares the machine's cores with the server
it measures, so every microsecond it spends per request is taken from the server. This
client does no per-request allocation beyond the bytes it must send and one
:class:`Sample`: requests are pre-encoded, responses are parsed with ``bytes.find``
over the header block, and there are no tasks or futures -- a completed response calls
back into the load loop directly. It speaks keep-alive HTTP/1.1 with Content-Length or
chunked bodies, and splits Server-Sent Events to time streamed tokens.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable

from inferd.bench.sse import parse_event
from inferd.bench.stats import Sample

_perf = time.perf_counter


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(
        self,
        on_done: Callable[[Connection, Sample], None],
        on_lost: Callable[[Connection], None],
        timeout_s: float = 30.0,
        on_ok: Callable[[Connection, float, float, int], None] | None = None,
    ) -> None:
        self.on_done = on_done
        self.on_lost = on_lost
        # A plain 2xx response (no stream) skips building a Sample: the load loop gets
        # (connection, started, finished, status) and keeps a tuple -- the hot path.
        self.on_ok = on_ok or self._ok_as_sample
        self.stream = False  # is the current response an event stream
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.started = 0.0
        self.timeout_s = timeout_s
        self._buf = b""
        self._status = 0
        self._left = -1  # body bytes still expected; -1 = reading headers
        self._chunked = False
        self._chunk_left = 0
        self._known: tuple[bytes, bytes, int, int] | None = None
        self._reset_stream()

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def _reset_stream(self) -> None:
        self._sse = b""
        self._ttft: float | None = None
        self._last_token = 0.0
        self._itl: list[float] | None = None
        self._tokens = 0
        self._usage: int | None = None
        self._stream_error = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, started: float) -> None:
        """``started`` may lie before now: open-loop latency counts the queueing."""
        self.busy = True
        self.started = started
        self._status = 0
        self._left = -1
        if self.stream:
            self.stream = False
            self._reset_stream()
        self.transport.write(request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self._left < 0 and not self._buf and not self._chunked and self._whole(data):
            return
        buf: bytes | None = self._buf + data if self._buf else data
        self._buf = b""
        while buf:
            if self._left < 0 and not self._chunked:
                buf = self._headers(buf)
            elif self._chunked:
                buf = self._chunks(buf)
            else:
                take = min(self._left, len(buf))
                if self.stream:
                    self._feed_sse(buf[:take])
                self._left -= take
                buf = buf[take:]
                if self._left == 0:
                    self._complete()

    def _whole(self, data: bytes) -> bool:
        """Fast path: the common case of one complete Content-Length response.

        A load test gets the same kind of answer over and over, so the connection
        remembers the last plain 2xx answer's status line, Content-Length line and
        length; an answer matching all three (only its Date, say, differs) is taken
        with a few byte comparisons and no parsing.
        """
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return False
        known = self._known
        if (
            known is not None
            and len(data) == end + known[2]
            and data.startswith(known[0])
            and data.find(known[1], 0, end + 2) > 0
            and data.find(b"event-stream", 0, end) < 0
        ):
            self.busy = False
            self.on_ok(self, self.started, _perf(), known[3])
            return True
        head = data[:end].lower()
        pos = head.find(b"\r\ncontent-length:")
        if pos < 0 or b"text/event-stream" in head:
            return False
        stop = head.find(b"\r\n", pos + 17)
        if stop < 0:
            stop = end
        try:
            length = int(head[pos + 17 : stop])
            status = int(head[9:12])
        except ValueError:
            return False
        if len(data) != end + 4 + length:
            return False
        self._status = status
        if 200 <= status < 300:
            self._known = (data[:13], data[pos:stop] + b"\r\n", 4 + length, status)
            self.busy = False
            self.on_ok(self, self.started, _perf(), status)
        else:
            self._complete()
        return True

    def _ok_as_sample(self, conn: Connection, started: float, finished: float, status: int) -> None:
        self.on_done(self, Sample(started, finished - started, status))

    def _headers(self, buf: bytes) -> bytes | None:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            self._buf = buf
            return None
        head = buf[:end].lower()
        try:
            self._status = int(head[9:12])
        except ValueError:
            self._fail("malformed_response")
            return None
        self.stream = b"content-type: text/event-stream" in head
        pos = head.find(b"\r\ncontent-length:")
        if pos >= 0:
            stop = head.find(b"\r\n", pos + 17)
            try:
                self._left = int(head[pos + 17 : stop if stop > 0 else len(head)])
            except ValueError:
                self._left = -1
                self._fail("malformed_response")
                return None
        elif b"\r\ntransfer-encoding: chunked" in head:
            self._chunked = True
            self._chunk_left = -1
        else:
            self._left = 0
        rest = buf[end + 4 :]
        if self._left == 0 and not self._chunked:
            self._complete()
        return rest

    def _chunks(self, buf: bytes) -> bytes | None:
        while buf:
            if self._chunk_left < 0:  # at a chunk-size line
                eol = buf.find(b"\r\n")
                if eol < 0:
                    self._buf = buf
                    return None
                try:
                    size = int(buf[:eol].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail("malformed_response")
                    return None
                if size == 0:  # last chunk: "0\r\n\r\n" (no trailers expected)
                    if len(buf) < eol + 4:
                        self._buf = buf  # wait for the final CRLF, size line included
                        return None
                    self._chunked = False
                    self._complete()
                    return buf[eol + 4 :]
                buf = buf[eol + 2 :]
                self._chunk_left = size + 2  # data + CRLF
            take = min(self._chunk_left, len(buf))
            data = buf[:take]
            self._chunk_left -= take
            if self._chunk_left < 2:  # strip the CRLF that ends the chunk
                data = data[: len(data) - (2 - self._chunk_left)]
            if self.stream:
                self._feed_sse(data)
            buf = buf[take:]
            if self._chunk_left == 0:
                self._chunk_left = -1
        return b""

    def _feed_sse(self, data: bytes) -> None:
        sse = self._sse + data if self._sse else data
        while True:
            end = sse.find(b"\n\n")
            if end < 0:
                break
            event, sse = sse[:end], sse[end + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._on_event(line[5:].strip())
        self._sse = sse

    def _on_event(self, data: bytes) -> None:
        tokens, usage, error = parse_event(data)
        if error:
            self._stream_error = True
            return
        if usage is not None:
            self._usage = usage
        if not tokens:
            return
        now = _perf()
        if self._ttft is None:
            self._ttft = now - self.started
            self._itl = []
        else:
            self._itl.append(now - self._last_token)  # type: ignore[union-attr]
        self._last_token = now
        self._tokens += tokens

    def _complete(self) -> None:
        latency = _perf() - self.started
        status = self._status
        error = None
        if not 200 <= status < 300:
            error = f"http_{status}"
        elif self._stream_error:
            error = "stream_error"
        elif self.stream and (self._sse.strip() or self._ttft is None):
            error = "malformed_sse"
        tokens = self._usage if self._usage is not None else self._tokens
        sample = Sample(self.started, latency, status, error, self._ttft, self._itl, tokens)
        self.busy = False
        self.on_done(self, sample)

    def _fail(self, kind: str) -> None:
        """End the request with an error and drop the connection (its state is unknown)."""
        sample = Sample(self.started, _perf() - self.started, self._status, kind)
        self.busy = False
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.abort()
        self.on_done(self, sample)

    def abandon(self, kind: str = "timeout") -> None:
        """End the request in flight, if any, as an error of this kind (deadline passed,
        run interrupted) and drop the connection."""
        if self.busy:
            self._fail(kind)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            self.busy = False
            self.on_done(self, Sample(self.started, _perf() - self.started, self._status, "closed"))
        self.on_lost(self)


async def open_connection(
    host: str,
    port: int,
    factory: Callable[[], Connection],
    timeout_s: float,
    tls: ssl.SSLContext | None = None,
) -> Connection:
    loop = asyncio.get_running_loop()
    connecting = loop.create_connection(factory, host, port, ssl=tls)
    _, protocol = await asyncio.wait_for(connecting, timeout_s)
    return protocol


def request_head(method: str, path: str, host: str, headers: dict[str, str]) -> bytes:
    """Everything of a request up to (not including) its Content-Length line."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


def encode_request(head: bytes, body: bytes) -> bytes:
    return b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
