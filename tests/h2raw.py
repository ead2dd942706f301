"""A raw HTTP/2 client for attacking the gRPC server: it sends exactly the frames it is
told to (an attacker ignores what a client should do) and parses what comes back,
keeping track of the windows the server grants. Used by the abuse tests and
bench/abuse.py; traffic stays on 127.0.0.1."""

from __future__ import annotations

import itertools
import select
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import hpack

from inferd.grpc import frames as f

INFER = "/inference.GRPCInferenceService/ModelInfer"
INDEX = "/inference.GRPCInferenceService/RepositoryIndex"


@dataclass
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes


@dataclass
class Stream:
    """What the server said on one stream."""

    headers: list[dict[str, str]] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    reset: int | None = None
    ended: bool = False

    @property
    def status(self) -> int | None:
        """The call's grpc-status, once its trailers came."""
        for block in self.headers:
            if "grpc-status" in block:
                return int(block["grpc-status"])
        return None

    @property
    def message(self) -> str:
        for block in self.headers:
            if "grpc-message" in block:
                return block["grpc-message"]
        return ""


def message(body: bytes, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message (``length``: what the prefix claims)."""
    return b"\x00" + struct.pack(">I", len(body) if length is None else length) + body


_ADDRESSES = itertools.count(1)


def attacker_address() -> str:
    """A loopback address of its own (127.66.x.y): the server keeps flood buckets per
    client address, so each attack test comes from a new one."""
    n = next(_ADDRESSES)
    return f"127.66.{n // 250}.{n % 250 + 1}"


class Raw:
    """One raw HTTP/2 connection to ``port`` (from ``source``, a local address)."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", preface: bool = True, source: str = ""
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.window = f.DEFAULT_WINDOW  # what the server lets us send on the connection
        self.initial = f.DEFAULT_WINDOW
        self.windows: dict[int, int] = {}  # and on each stream, once it sent an update
        self.streams: dict[int, Stream] = {}
        self.settings: dict[int, int] = {}
        self.goaway: tuple[int, bytes] | None = None  # (error code, debug data)
        self.closed = False
        self.next_id = 1
        if preface:
            self.send(f.PREFACE + f.settings({}))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- out -------------------------------------------------------------------------

    def send(self, data: bytes) -> bool:
        """False once the server closed the connection."""
        try:
            self.sock.sendall(data)
        except OSError:
            self.closed = True
            return False
        return True

    def new_stream(self) -> int:
        stream, self.next_id = self.next_id, self.next_id + 2
        return stream

    def headers(
        self,
        stream: int,
        path: str = INFER,
        metadata: Iterable[tuple[str, str]] = (),
        end: bool = False,
    ) -> bytes:
        """A request's HEADERS frame."""
        block = self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers"),
            *metadata,
        ])  # fmt: skip
        flags = f.END_HEADERS | (f.END_STREAM if end else 0)
        return f.frame(f.HEADERS, flags, stream, block)

    def data(self, stream: int, payload: bytes, end: bool = False) -> bytes:
        """DATA frames of at most 16 KiB carrying ``payload`` (counted against the
        windows we track, whether or not the server granted them)."""
        out = []
        for at in range(0, max(len(payload), 1), f.DEFAULT_MAX_FRAME):
            piece = payload[at : at + f.DEFAULT_MAX_FRAME]
            last = at + f.DEFAULT_MAX_FRAME >= len(payload)
            out.append(f.frame(f.DATA, f.END_STREAM if end and last else 0, stream, piece))
        self.window -= len(payload)
        self.windows[stream] = self.stream_window(stream) - len(payload)
        return b"".join(out)

    def stream_window(self, stream: int) -> int:
        return self.windows.get(stream, self.initial)

    def upload(self, stream: int, payload: bytes, end: bool = False, timeout_s: float = 10) -> int:
        """Send ``payload`` on ``stream`` as the windows allow (reading the server's
        updates while they are shut); the bytes sent before ``timeout_s`` or the end."""
        sent = 0
        deadline = time.monotonic() + timeout_s
        while sent < len(payload) and not self.closed and time.monotonic() < deadline:
            room = min(self.window, self.stream_window(stream), len(payload) - sent)
            if room <= 0:
                self.read(0.05)
                continue
            piece = payload[sent : sent + room]
            last = sent + room == len(payload)
            if not self.send(self.data(stream, piece, end and last)):
                break
            sent += room
        return sent

    def rst(self, stream: int, code: int = f.CANCEL) -> bytes:
        return f.rst_stream(stream, code)

    # -- in --------------------------------------------------------------------------

    def read(self, timeout_s: float) -> list[Frame]:
        """The frames that arrive within ``timeout_s``: it returns once some came and
        nothing more is waiting (or the server closed)."""
        frames: list[Frame] = []
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            left = 0.0 if frames else deadline - time.monotonic()
            ready, _, _ = select.select([self.sock], [], [], max(left, 0.0))
            if not ready:
                break
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self.buf += chunk
            frames += self._parse()
        return frames

    def until(self, done: object, timeout_s: float = 10) -> bool:
        """Read until ``done()`` holds or the connection closes; whether it held."""
        deadline = time.monotonic() + timeout_s
        while not done() and not self.closed and time.monotonic() < deadline:  # type: ignore[operator]
            self.read(min(0.05, max(0.0, deadline - time.monotonic())))
        return bool(done())  # type: ignore[operator]

    def _parse(self) -> list[Frame]:
        frames = []
        buf = self.buf
        while len(buf) >= 9:
            high, low, kind, flags, stream = f.HEAD.unpack_from(buf)
            size = (high << 16) | low
            if len(buf) < 9 + size:
                break
            frame = Frame(kind, flags, stream & 0x7FFFFFFF, bytes(buf[9 : 9 + size]))
            del buf[: 9 + size]
            self._on(frame)
            frames.append(frame)
        return frames

    def _on(self, frame: Frame) -> None:
        stream = self.streams.setdefault(frame.stream, Stream()) if frame.stream else None
        if frame.kind == f.SETTINGS and not frame.flags & f.ACK:
            for at in range(0, len(frame.payload), 6):
                key, value = struct.unpack_from(">HI", frame.payload, at)
                self.settings[key] = value
                if key == f.INITIAL_WINDOW_SIZE:
                    self.initial = value
            self.send(f.frame(f.SETTINGS, f.ACK, 0))
        elif frame.kind == f.WINDOW_UPDATE:
            increment = int.from_bytes(frame.payload, "big")
            if frame.stream == 0:
                self.window += increment
            else:
                self.windows[frame.stream] = self.stream_window(frame.stream) + increment
        elif frame.kind == f.GOAWAY:
            code = int.from_bytes(frame.payload[4:8], "big")
            self.goaway = (code, frame.payload[8:])
        elif frame.kind == f.HEADERS and stream is not None:
            block = dict(self.decoder.decode(frame.payload))  # type: ignore[arg-type]
            stream.headers.append({str(k): str(v) for k, v in block.items()})
            stream.ended = stream.ended or bool(frame.flags & f.END_STREAM)
        elif frame.kind == f.DATA and stream is not None:
            stream.data += frame.payload
            stream.ended = stream.ended or bool(frame.flags & f.END_STREAM)
        elif frame.kind == f.RST_STREAM and stream is not None:
            stream.reset = int.from_bytes(frame.payload, "big")
        elif frame.kind == f.PING and not frame.flags & f.ACK:
            self.send(f.frame(f.PING, f.ACK, 0, frame.payload))
