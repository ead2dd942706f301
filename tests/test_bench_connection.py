"""The load generator's HTTP/1.1 response parser, fed every way a socket can split bytes."""

from __future__ import annotations

import random
import time

import pytest

from inferd.bench.connection import Connection, encode_request, request_head
from inferd.bench.sse import parse_event
from inferd.bench.stats import Sample


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


def connection() -> tuple[Connection, list[Sample]]:
    samples: list[Sample] = []
    conn = Connection(lambda c, s: samples.append(s), lambda c: None)
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    return conn, samples


PLAIN = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
)
ERROR = b"HTTP/1.1 503 Unavailable\r\ncontent-length: 2\r\n\r\n{}"
EMPTY = b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n"


def sse(events: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    )


STREAM = sse(
    [
        b'data: {"token": "a"}\n\n',
        b'data: {"token": "b"}\n\ndata: {"tok',
        b'en": "c"}\n\n',
        b'data: {"finish_reason": "stop", "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n',
    ]
)


def feed_split(conn: Connection, data: bytes, rng: random.Random) -> None:
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 9)
        conn.data_received(data[pos : pos + step])
        pos += step


@pytest.mark.parametrize("seed", range(20))
def test_back_to_back_responses_split_anywhere(seed: int):
    conn, samples = connection()
    rng = random.Random(seed)
    responses = [PLAIN, ERROR, EMPTY, STREAM, PLAIN]
    for response in responses:
        conn.send(b"GET / HTTP/1.1\r\n\r\n", time.perf_counter())
        feed_split(conn, response, rng)
    assert [s.status for s in samples] == [200, 503, 204, 200, 200]
    assert [s.error for s in samples] == [None, "http_503", None, None, None]
    stream = samples[3]
    assert stream.output_tokens == 3 and stream.ttft is not None and len(stream.itl or []) == 2
    assert samples[4].ttft is None  # stream state does not leak into the next response


def test_whole_response_in_one_read_takes_the_fast_path():
    conn, samples = connection()
    conn.send(b"x", time.perf_counter())
    conn.data_received(PLAIN)
    assert samples[0].status == 200 and samples[0].error is None and not conn.busy


def test_fast_path_remembers_the_answer_but_never_misreads_a_different_one():
    """After a plain 200, answers of the same length are taken by byte comparison; one
    that differs in status, Content-Length or content type must still be read right."""
    conn, samples = connection()
    same_length_503 = PLAIN.replace(b"200 OK", b"503 OK")
    other_length = PLAIN.replace(b"Length: 11", b"Length: 12") + b" "
    # Same total length, but the body length moved into the headers.
    shifted = PLAIN.replace(b"Content-Length: 11", b"Content-Length: 10X").replace(b"e}", b"}")
    as_stream = PLAIN.replace(b"application/json", b"text/event-stream")
    for response in (PLAIN, PLAIN, same_length_503, other_length, PLAIN, as_stream):
        conn.send(b"x", time.perf_counter())
        conn.data_received(response)
    assert [s.status for s in samples[:5]] == [200, 200, 503, 200, 200]
    assert [s.error for s in samples[:5]] == [None, None, "http_503", None, None]
    assert samples[5].error == "malformed_sse"  # a stream with no events is not a success
    conn.send(b"x", time.perf_counter())
    conn.data_received(shifted)  # never taken for the cached answer
    assert samples[6].error == "malformed_response" and conn.transport is None


def test_malformed_and_error_streams():
    conn, samples = connection()
    conn.send(b"x", time.perf_counter())
    conn.data_received(sse([b'data: {"token": "unterminated']))
    conn.send(b"x", time.perf_counter())
    conn.data_received(sse([b'data: {"token": "a"}\n\n', b'data: {"error": {"message": "x"}}\n\n']))
    assert [s.error for s in samples] == ["malformed_sse", "stream_error"]


def test_garbage_status_line_fails_and_drops_the_connection():
    conn, samples = connection()
    transport = conn.transport
    conn.send(b"x", time.perf_counter())
    conn.data_received(b"HTTP/1.1 abc nope\r\n\r\n")
    assert samples[0].error == "malformed_response"
    assert transport.aborted and conn.transport is None  # type: ignore[union-attr]


def test_request_encoding():
    head = request_head("POST", "/p", "h:1", {"Content-Type": "application/json"})
    assert encode_request(head, b"{}") == (
        b"POST /p HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )


@pytest.mark.parametrize(
    ("data", "event"),
    [
        (b"[DONE]", (0, None, False)),
        (b'{"token": "x"}', (1, None, False)),
        (b'{"choices": [{"text": "hi"}]}', (1, None, False)),
        (b'{"choices": [{"delta": {"content": "hi"}}]}', (1, None, False)),
        (b'{"choices": [{"delta": {"role": "assistant"}}]}', (0, None, False)),
        (b'{"choices": [], "usage": {"completion_tokens": 7}}', (0, 7, False)),
        (b'{"finish_reason": "stop", "usage": {"completion_tokens": 4}}', (0, 4, False)),
        (b'{"error": {"message": "boom"}}', (0, None, True)),
        (b"plain text", (1, None, False)),
    ],
)
def test_sse_events(data: bytes, event: tuple[int, int | None, bool]):
    assert parse_event(data) == event
