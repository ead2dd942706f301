"""HTTP/2 frames and HPACK header blocks as bytes (RFC 9113, RFC 7541), for the gRPC
server (:mod:`inferd.grpc.http2`) and the benchmark's load client (``bench/grpc_load.py``).

Header blocks are written only as literals without indexing: a block never touches the
peer's dynamic table, so a block encoded once can be sent on any connection, any number
of times. Decoding is :mod:`hpack`'s (the peer may index, and Huffman-code, whatever it
likes).
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = struct.Struct(">BHBBI")
"""A frame's 9-byte head: 24-bit length as (high byte, low 16 bits), type, flags, stream."""

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE = 0, 1, 2, 3, 4, 5
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 6, 7, 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20

# SETTINGS parameters
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def head(size: int, kind: int, flags: int, stream: int) -> bytes:
    """A frame's head alone (its payload written after it)."""
    return HEAD.pack(size >> 16, size & 0xFFFF, kind, flags, stream)


def header_frames(block: bytes, flags: int, stream: int, max_frame: int) -> bytes:
    """A header block as HEADERS (with ``flags``), then CONTINUATION frames when it is
    larger than the peer's largest frame."""
    if len(block) <= max_frame:
        return head(len(block), HEADERS, flags | END_HEADERS, stream) + block
    parts = [head(max_frame, HEADERS, flags, stream), block[:max_frame]]
    for at in range(max_frame, len(block), max_frame):
        piece = block[at : at + max_frame]
        last = at + max_frame >= len(block)
        parts += (head(len(piece), CONTINUATION, END_HEADERS if last else 0, stream), piece)
    return b"".join(parts)


def settings(pairs: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs.items()))


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">I", code))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream, code) + debug)


def integer(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541, 5.1)."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out, value = [first | top], value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def literal(name: int | str, value: str | bytes) -> bytes:
    """A header as a literal without indexing, its name from the static table (an
    index) or literal (a lower-case string)."""
    raw = value.encode() if isinstance(value, str) else value
    if isinstance(name, int):
        start = integer(name, 4, 0x00)
    else:
        start = b"\x00" + integer(len(name), 7, 0) + name.encode()
    return start + integer(len(raw), 7, 0) + raw


STATUS_200 = b"\x88"
"""``:status: 200``, static table entry 8."""
CONTENT_TYPE = 31
"""The static table's index of ``content-type``."""
