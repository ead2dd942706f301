"""The HTTP port as an attacker tries it: a real ``inferd serve`` with auth on, one gateway
process, raw sockets that dribble, stall, oversize, garble and pipeline. Each test
asserts the bound (the gateway's open files and resident memory, an honest client's
latency, the time a slow client is given), not only the status code. Timeouts are a
second here (``connections.*``)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import InferdServer, arithmetic_model, create_key, push_source
from tests.test_abuse_grpc import Guarded, PeakRss, _wait, p99

MiB = 1 << 20
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    data: Path = tmp_path_factory.mktemp("abuse-http")
    push_source(data, "echo", arithmetic_model("x"))
    keys = {"echo": create_key(data, "echo", "infer", models=["echo"])}
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_CONNECTIONS__HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "INFERD_CONNECTIONS__BODY_TIMEOUT_S": str(TIMEOUT_S),
        "INFERD_CONNECTIONS__IDLE_S": "2",
        "INFERD_CONNECTIONS__MAX_PER_PROCESS": "600",
    }
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        yield Guarded(server, keys)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _connect(guarded: Guarded) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _answer(sock: socket.socket, timeout_s: float = 10) -> tuple[int, dict[str, object], float]:
    """(status, JSON body, seconds waited) of the response on ``sock`` (0 when it was
    closed without one)."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    waited = time.monotonic() - started
    if not data:
        return 0, {}, waited
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}"), waited


class Honest:
    """A client predicting in a loop on its own keep-alive connection."""

    def __init__(self, guarded: Guarded) -> None:
        self.client = httpx.Client(
            base_url=guarded.server.url,
            headers={"authorization": f"Bearer {guarded.keys['echo']}"},
            timeout=10,
        )
        self.latencies: list[float] = []
        self.failures: list[int] = []
        self._stop = threading.Event()

    def call(self) -> None:
        started = time.perf_counter()
        answer = self.client.post("/api/v1/models/echo/predict", json={"inputs": [{"x": 1.0}]})
        if answer.status_code != 200:
            self.failures.append(answer.status_code)
        self.latencies.append(time.perf_counter() - started)

    def measure(self, calls: int) -> list[float]:
        self.latencies = []
        for _ in range(calls):
            self.call()
        return list(self.latencies)

    def __enter__(self) -> Honest:
        self.latencies = []

        def loop() -> None:
            while not self._stop.is_set():
                self.call()
                time.sleep(0.005)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
        self.client.close()


def test_slowloris_headers_are_cut_off_and_their_connections_closed(guarded: Guarded) -> None:
    honest = Honest(guarded)
    idle = honest.measure(50)
    fds = guarded.fds()  # with the honest client's connection, and the replica's
    slow = [_connect(guarded) for _ in range(300)]
    try:
        with honest:
            started = time.monotonic()
            for at in range(8):  # a byte each 0.2 s per connection: never a whole head
                for sock in slow:
                    with contextlib.suppress(OSError):
                        sock.send(b"POST /api/v1/models/echo/predict HTTP/1.1\r\nX: "[at : at + 1])
                time.sleep(0.2)
            answers = [_answer(sock, 5) for sock in slow]
            took = time.monotonic() - started
        during = honest.latencies
    finally:
        for sock in slow:
            sock.close()
    assert {status for status, _, _ in answers} == {408}, answers[:3]
    assert answers[0][1]["error"]["code"] == "client_too_slow"  # type: ignore[index]
    assert "header_timeout_s" in answers[0][1]["error"]["message"]  # type: ignore[index]
    assert took < TIMEOUT_S + 2.5, took
    assert _wait(lambda: guarded.fds() <= fds, 5), (fds, guarded.fds())
    assert not honest.failures
    assert p99(during) < max(5 * p99(idle), 0.1), (p99(idle), p99(during))


def test_a_connection_that_sends_nothing_is_closed(guarded: Guarded) -> None:
    with _connect(guarded) as sock:
        status, _, waited = _answer(sock, 5)
    assert status == 0 and TIMEOUT_S * 0.9 < waited < TIMEOUT_S + 1.5, waited


def test_a_body_that_stops_arriving_is_answered_408(guarded: Guarded) -> None:
    with _connect(guarded) as sock:
        sock.sendall(
            b"POST /api/v1/models/echo/predict HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer " + guarded.keys["echo"].encode() + b"\r\n"
            b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"inputs"'
        )
        status, body, waited = _answer(sock, 5)
    assert status == 408, (status, body)
    assert "body_timeout_s" in body["error"]["message"]  # type: ignore[index]
    assert TIMEOUT_S * 0.9 < waited < TIMEOUT_S + 1.5, waited


def test_oversized_and_endless_headers_are_refused_431(guarded: Guarded) -> None:
    with PeakRss(guarded) as rss, _connect(guarded) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: x\r\n")
        try:
            for _ in range(2000):  # 2,000 x 8 KiB of headers, if the server kept reading
                sock.sendall(b"X-Pad: " + b"a" * 8192 + b"\r\n")
        except OSError:
            pass  # closed: refused
        status, body, _ = _answer(sock, 5)
    assert status == 431, status
    assert body["error"]["code"] == "headers_too_large"  # type: ignore[index]
    assert rss.growth < 8 * MiB, rss.growth / MiB


def test_a_malformed_request_is_a_json_400(guarded: Guarded) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost x\r\n\r\n")
        status, body, _ = _answer(sock, 5)
    assert status == 400 and body["error"]["code"] == "bad_request", (status, body)


def test_a_pipelining_flood_is_answered_in_order_within_bounded_memory(guarded: Guarded) -> None:
    request = b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n"
    with PeakRss(guarded) as rss, _connect(guarded) as sock:
        sock.sendall(request * 20_000)
        sock.settimeout(10)
        received = b""
        deadline = time.monotonic() + 20
        while received.count(b"HTTP/1.1 200") < 20_000 and time.monotonic() < deadline:
            received += sock.recv(1 << 20)
    assert received.count(b"HTTP/1.1 200") == 20_000
    assert rss.growth < 64 * MiB, rss.growth / MiB


def test_connections_past_the_limit_are_closed_and_the_port_goes_on(guarded: Guarded) -> None:
    fds = guarded.fds()
    held = [_connect(guarded) for _ in range(650)]
    try:
        assert _wait(lambda: guarded.fds() <= fds + 600 + 2, 5)
        closed = 0
        for sock in held[-50:]:
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                closed += sock.recv(1) == b""
        assert closed >= 40, closed
    finally:
        for sock in held:
            sock.close()
    assert _wait(lambda: guarded.fds() <= fds + 2, 5)
    honest = Honest(guarded)
    honest.measure(3)
    honest.client.close()
    assert not honest.failures


def test_made_up_keys_cost_the_registry_a_bounded_number_of_reads(guarded: Guarded) -> None:
    """200 requests with made-up (well-formed) API keys at once: the gateway reads at most
    ``auth.lookups_per_s`` (50 a second, as many at once) of them from the registry; the
    rest are answered 503 with Retry-After, and a known key is not held up."""
    import secrets

    def made_up() -> str:
        return f"ik_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)[:43]}"

    honest = Honest(guarded)
    honest.measure(2)  # its key is cached now
    statuses: list[int] = []
    with httpx.Client(base_url=guarded.server.url, timeout=30) as client:
        started = time.monotonic()
        for _ in range(200):
            answer = client.get("/api/v1/models", headers={"authorization": f"Bearer {made_up()}"})
            statuses.append(answer.status_code)
            if answer.status_code == 503:
                assert answer.headers["retry-after"] == "1"
                assert "auth.lookups_per_s" in answer.json()["error"]["message"]
        took = time.monotonic() - started
    honest.measure(5)
    honest.client.close()
    read = statuses.count(401)
    assert read <= 50 + 50 * took + 1, (read, took)  # the burst, and what refilled
    assert statuses.count(503) >= 200 - read - 1
    assert not honest.failures
