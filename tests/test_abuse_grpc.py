"""The gRPC port as an attacker tries it: a real ``inferd serve`` with auth on, one gateway
process, raw HTTP/2 frames (:mod:`tests.h2raw`) sent with no credential, with a key for
another model, oversized, slow, malformed and in floods. Each test asserts the bound it
is about (the gateway's resident memory, its open files, its CPU seconds, a neighbour's
latency, the budgets' bytes), not only the status code. Timeouts are cut to a second
here (``connections.*``) so that the slow attacks end quickly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from inferd.grpc import frames as f
from inferd.grpc import grpc_service_pb2 as pb
from inferd.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import InferdServer, arithmetic_model, create_key, push_source
from tests.h2raw import INDEX, INFER, Raw, attacker_address, message

MiB = 1 << 20
WIDE_MODEL = """
import numpy as np


class Wide:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 524288]}],
    }

    def predict(self, batch):
        return {"y": np.zeros((len(batch["x"]), 524288), dtype=np.float32)}
"""
"""Two MiB of answer a row."""
TIMEOUT_S = 1.0
"""connections.header_timeout_s and body_timeout_s in these tests."""


class Guarded:
    def __init__(self, server: InferdServer, keys: dict[str, str]) -> None:
        self.server = server
        self.keys = keys
        self.port = server.grpc_port
        self.gateway = _gateway(server)

    address = ""
    """Where this test's attacker connects from (a loopback address of its own)."""

    def raw(self, preface: bool = True) -> Raw:
        return Raw(self.port, preface=preface, source=self.address)

    def auth(self, key: str = "echo") -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.keys[key]}")]

    def rss(self) -> int:
        return int(self.gateway.memory_info().rss)

    def fds(self) -> int:
        return int(self.gateway.num_fds())

    def cpu_s(self) -> float:
        times = self.gateway.cpu_times()
        return float(times.user + times.system)

    def settle(self) -> None:
        """Until the gateway is idle (what an earlier test left it doing is done), so
        that a test's CPU seconds are its own."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            before = self.cpu_s()
            time.sleep(0.1)
            if self.cpu_s() - before < 0.01:
                return


def _gateway(server: InferdServer) -> psutil.Process:
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if "inferd.api.worker" in " ".join(child.cmdline()):
            return child
    raise AssertionError("no gateway process")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    data: Path = tmp_path_factory.mktemp("abuse-grpc")
    push_source(data, "echo", arithmetic_model("x"))
    push_source(data, "other", arithmetic_model("x"))
    push_source(data, "wide", WIDE_MODEL)
    keys = {
        "echo": create_key(data, "echo", "infer", models=["echo"]),
        "infer": create_key(data, "app", "infer"),
        "admin": create_key(data, "ops", "admin"),
    }
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_CONNECTIONS__HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "INFERD_CONNECTIONS__BODY_TIMEOUT_S": str(TIMEOUT_S),
        "INFERD_CONNECTIONS__IDLE_S": "3",
        "INFERD_CONNECTIONS__GRPC_CONNECTION_BUFFER_MB": "16",
        "INFERD_CONNECTIONS__GRPC_BUFFER_MB": "48",
        "INFERD_CONNECTIONS__MAX_PER_PROCESS": "400",
    }
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        yield Guarded(server, keys)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(autouse=True)
def _attacker_address(request: pytest.FixtureRequest) -> None:
    """Each test attacks from an address of its own (the server's flood buckets are per
    address: one test's flood must not close the next one's connections)."""
    if "guarded" in request.fixturenames:
        request.getfixturevalue("guarded").address = attacker_address()


def _request(model: str = "echo", values: int = 4) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "x", "FP32"
    tensor.shape.append(values)
    request.raw_input_contents.append(b"\x00\x00\x80?" * values)
    return bytes(request.SerializeToString())


class Neighbour:
    """An honest client calling ModelInfer in a loop on its own connection (grpcio, as
    tritonclient does), recording each call's latency."""

    def __init__(self, guarded: Guarded) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{guarded.port}")
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = guarded.auth()
        self.request = pb.ModelInferRequest.FromString(_request())
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def call(self) -> None:
        started = time.perf_counter()
        try:
            self.stub.ModelInfer(self.request, metadata=self.metadata, timeout=10)
        except grpc.RpcError as exc:
            self.failures.append(str(exc.code()))
        self.latencies.append(time.perf_counter() - started)

    def measure(self, calls: int) -> list[float]:
        self.latencies = []
        for _ in range(calls):
            self.call()
        return self.latencies

    def __enter__(self) -> Neighbour:
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
        assert self._thread is not None
        self._thread.join(15)
        self._stop.clear()

    def close(self) -> None:
        self.channel.close()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


class PeakRss:
    """The gateway's largest resident memory while the block runs (sampled every 10 ms)."""

    def __init__(self, guarded: Guarded) -> None:
        self.guarded = guarded
        self.before = guarded.rss()
        self.peak = self.before
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        def sample() -> None:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self.guarded.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.guarded.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.before


def _wait(condition: Callable[[], bool], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# -- no credential ---------------------------------------------------------------------


def _flood_unauthenticated(
    guarded: Guarded, streams: int, each: int, declared: int
) -> dict[int, Any]:
    """``streams`` ModelInfer calls with no credential on one connection, each sending
    ``each`` bytes of a ``declared``-byte message (never finished)."""
    with guarded.raw() as raw:
        ids = [raw.new_stream() for _ in range(streams)]
        raw.send(b"".join(raw.headers(s) for s in ids))
        start = message(b"", declared)
        sent = 0
        for stream in ids:
            raw.windows[stream] = 1 << 30  # an attacker ignores the stream's window
            sent += raw.upload(stream, start + b"\x00" * (each - len(start)), timeout_s=20)
        raw.until(lambda: all(raw.streams.get(s) and raw.streams[s].status for s in ids), 10)
        return {s: raw.streams.get(s) for s in ids} | {0: raw.goaway, -1: sent}


def test_an_unauthenticated_flood_of_unfinished_messages_holds_nothing(guarded: Guarded) -> None:
    """300 calls with no credential, each sending on with 1 MiB of a 15 MiB message: all
    are refused at their HEADERS, nothing of what follows is kept, and the upload that
    goes on after the refusals ends the connection within a few MiB."""
    neighbour = Neighbour(guarded)
    try:
        idle = neighbour.measure(100)
        with PeakRss(guarded) as rss, neighbour:
            outcome = _flood_unauthenticated(guarded, 300, 1 * MiB, 15 * MiB)
        during = neighbour.latencies
    finally:
        neighbour.close()
    goaway, sent = outcome.pop(0), outcome.pop(-1)
    statuses = {s.status for s in outcome.values() if s is not None}
    assert statuses == {16}, statuses  # UNAUTHENTICATED, every one of the 300
    assert goaway is not None and goaway[0] == f.ENHANCE_YOUR_CALM, goaway
    assert b"DATA on ended calls" in goaway[1]
    assert sent < 4 * MiB, sent / MiB  # of 300 MiB it would have sent
    assert rss.growth < 16 * MiB, rss.growth / MiB  # the old server kept all it was sent
    assert not neighbour.failures
    assert p99(during or [0.0]) < max(5 * p99(idle), 0.1), (p99(idle), p99(during))


def test_a_call_without_the_scope_is_refused_before_its_message(guarded: Guarded) -> None:
    with guarded.raw() as raw:
        stream = raw.new_stream()
        raw.send(raw.headers(stream, INDEX, guarded.auth()))  # no DATA at all
        assert raw.until(lambda: raw.streams.get(stream) and raw.streams[stream].status, 5)
        assert raw.streams[stream].status == 7  # PERMISSION_DENIED
        assert "admin" in raw.streams[stream].message
        other = raw.new_stream()
        raw.send(raw.headers(other, INFER, [("authorization", "Bearer ik_nope_nope")]))
        assert raw.until(lambda: raw.streams.get(other) and raw.streams[other].status, 5)
        assert raw.streams[other].status == 16


def test_a_key_for_another_model_is_refused(guarded: Guarded) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{guarded.port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    try:
        request = pb.ModelInferRequest.FromString(_request("other"))
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, metadata=guarded.auth(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may not use model 'other'" in str(refused.value.details())
        answers = list(stub.ModelStreamInfer(iter([request]), metadata=guarded.auth(), timeout=10))
        assert "may not use model 'other'" in answers[0].error_message
    finally:
        channel.close()


# -- floods of cheap frames ---------------------------------------------------------------


def test_rapid_reset_closes_the_connection_within_a_second(guarded: Guarded) -> None:
    """HEADERS, a whole message and RST_STREAM, 10,000 a second, with a valid key (each
    call's handler starts): GOAWAY ENHANCE_YOUR_CALM, at little CPU."""
    body = message(_request())
    guarded.settle()
    cpu_before = guarded.cpu_s()
    started = time.monotonic()
    sent = 0
    with guarded.raw() as raw:
        while raw.goaway is None and not raw.closed and time.monotonic() - started < 3:
            burst = []
            for _ in range(100):  # 100 every 10 ms
                stream = raw.new_stream()
                burst += (raw.headers(stream, INFER, guarded.auth()), raw.data(stream, body))
                burst.append(raw.rst(stream))
            raw.window = raw.initial = 1 << 30  # the windows are no concern of this attack
            if not raw.send(b"".join(burst)):
                break
            sent += 100
            raw.read(0.01)
        closed_after = time.monotonic() - started
        raw.until(lambda: raw.goaway is not None, 2)
        goaway = raw.goaway
    time.sleep(1.0 - min(closed_after, 1.0))  # the gateway's CPU over the attack's first second
    cpu = guarded.cpu_s() - cpu_before
    assert goaway is not None and goaway[0] == f.ENHANCE_YOUR_CALM, goaway
    assert b"reset calls" in goaway[1]
    assert closed_after < 1.0, (closed_after, sent)
    assert cpu < 0.5, cpu


def test_an_address_that_floods_on_new_connections_is_closed_as_it_connects(
    guarded: Guarded,
) -> None:
    """A flood that reconnects each time its connection is closed: once its address has
    spent its bucket, its connections are closed before a byte of them is read, while
    other addresses (the honest client's) are served."""
    ping_flood = f.frame(f.PING, 0, 0, b"12345678") * 500
    outcomes = []
    neighbour = Neighbour(guarded)
    try:
        with neighbour:
            for _ in range(12):
                with guarded.raw() as raw:
                    raw.send(ping_flood)
                    raw.until(lambda r=raw: r.closed, 5)
                    outcomes.append("settings" if raw.settings else "closed at once")
        assert not neighbour.failures and neighbour.latencies
    finally:
        neighbour.close()
    assert outcomes[0] == "settings"  # the first connections were served, then flooded
    assert outcomes[-3:] == ["closed at once"] * 3, outcomes
    with Raw(guarded.port, source=attacker_address()) as other:  # another address
        assert other.until(lambda: f.MAX_CONCURRENT_STREAMS in other.settings, 5)


@pytest.mark.parametrize(
    ("what", "frame"),
    [
        ("PING frames", lambda raw: f.frame(f.PING, 0, 0, b"12345678")),
        ("SETTINGS frames", lambda raw: f.settings({f.ENABLE_PUSH: 0})),
        ("PRIORITY or unknown frames", lambda raw: f.frame(f.PRIORITY, 0, 1, b"\0\0\0\0\x10")),
        ("PRIORITY or unknown frames", lambda raw: f.frame(0x42, 0, 0, b"hello")),
    ],
    ids=["ping", "settings", "priority", "unknown"],
)
def test_floods_of_cheap_frames_end_the_connection(
    guarded: Guarded, what: str, frame: Callable[[Raw], bytes]
) -> None:
    guarded.settle()
    cpu_before = guarded.cpu_s()
    with guarded.raw() as raw:
        one = frame(raw)
        for _ in range(20):
            if not raw.send(one * 100):
                break
            raw.read(0.005)
        assert raw.until(lambda: raw.goaway is not None, 5), (raw.closed, raw.streams)
        assert raw.goaway[0] == f.ENHANCE_YOUR_CALM, raw.goaway
        assert what.encode() in raw.goaway[1]
        assert raw.until(lambda: raw.closed, 5)
    cpu = guarded.cpu_s() - cpu_before
    assert cpu < 0.5, cpu


def test_empty_data_frames_on_a_call_end_the_connection(guarded: Guarded) -> None:
    with guarded.raw() as raw:
        stream = raw.new_stream()
        raw.send(raw.headers(stream, INFER, guarded.auth()))
        raw.send(f.frame(f.DATA, 0, stream) * 1000)
        assert raw.until(lambda: raw.goaway is not None, 5)
        assert raw.goaway is not None and raw.goaway[0] == f.ENHANCE_YOUR_CALM
        assert b"empty DATA" in raw.goaway[1]


def test_calls_past_the_stream_limit_are_refused(guarded: Guarded) -> None:
    with guarded.raw() as raw:
        ids = [raw.new_stream() for _ in range(101)]
        raw.send(b"".join(raw.headers(s, INFER, guarded.auth()) for s in ids))
        assert raw.until(lambda: f.MAX_CONCURRENT_STREAMS in raw.settings, 5)
        assert raw.settings[f.MAX_CONCURRENT_STREAMS] == 100
        assert raw.until(lambda: raw.streams.get(ids[-1]) and raw.streams[ids[-1]].reset, 5)
        assert raw.streams[ids[-1]].reset == f.REFUSED_STREAM
        assert all(raw.streams.get(s) is None or s == ids[-1] for s in ids)


# -- slow clients ---------------------------------------------------------------------------


def test_slow_headers_and_slow_messages_are_cut_off(guarded: Guarded) -> None:
    fds = guarded.fds()
    slow: list[Raw] = []
    try:
        for _ in range(50):  # a header block that never ends
            raw = guarded.raw()
            raw.send(raw.headers(1, INFER, guarded.auth())[:20])
            slow.append(raw)
        for _ in range(50):  # a preface that never ends
            raw = guarded.raw(preface=False)
            raw.send(f.PREFACE[:10])
            slow.append(raw)
        dribbling = guarded.raw()  # an admitted call whose message stops coming
        stream = dribbling.new_stream()
        dribbling.send(dribbling.headers(stream, INFER, guarded.auth()))
        dribbling.send(dribbling.data(stream, message(b"", 1 * MiB) + b"\x00" * 1000))
        started = time.monotonic()
        assert _wait(lambda: guarded.fds() >= fds + 100, 5)
        assert dribbling.until(
            lambda: stream in dribbling.streams and dribbling.streams[stream].status is not None, 10
        )
        took = time.monotonic() - started
        assert dribbling.streams[stream].status == 4, dribbling.streams[stream]  # DEADLINE
        assert "stopped arriving" in dribbling.streams[stream].message
        assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + 2, took
        for raw in slow:
            raw.until(lambda r=raw: r.closed, 5)
        assert all(raw.closed for raw in slow)
        # every connection is gone from the gateway: its open files are back
        assert _wait(lambda: guarded.fds() <= fds + 1, 5), (fds, guarded.fds())
        dribbling.close()
    finally:
        for raw in slow:
            raw.close()


def test_an_idle_connection_is_told_to_go(guarded: Guarded) -> None:
    with guarded.raw() as raw:
        assert raw.until(lambda: raw.goaway is not None, 8)
        assert raw.goaway is not None and raw.goaway[0] == f.NO_ERROR
        assert raw.until(lambda: raw.closed, 2)


def test_a_client_that_reads_no_answers_is_reset(guarded: Guarded) -> None:
    """Ten calls each answering 2 MiB to a client that grants no window: the gateway
    holds the answers for ``body_timeout_s`` at most, then resets the calls."""
    body = message(_request("wide", 1))
    rss = guarded.rss()
    with guarded.raw() as raw:
        ids = [raw.new_stream() for _ in range(10)]
        for stream in ids:
            raw.send(raw.headers(stream, INFER, guarded.auth("infer")))
            raw.upload(stream, body, end=True)
        assert raw.until(lambda: all(raw.streams.get(s) and raw.streams[s].reset for s in ids), 15)
        assert {raw.streams[s].reset for s in ids} == {f.CANCEL}
        assert raw.goaway is None
    assert _wait(lambda: guarded.rss() < rss + 48 * MiB, 5), (guarded.rss() - rss) / MiB


# -- the request budget -------------------------------------------------------------------


def test_large_unfinished_messages_wait_within_the_connection_budget(guarded: Guarded) -> None:
    """Ten 4 MiB messages on one connection with a 16 MiB budget: three are reserved and
    may come, the others' prefixes get them no window. While the three dribble on, the
    others end once the buffers stayed full for the body timeout; left unfinished, the
    three end at the body timeout."""
    size = 4 * MiB
    with PeakRss(guarded) as rss, guarded.raw() as raw:
        ids = [raw.new_stream() for _ in range(10)]
        raw.send(b"".join(raw.headers(s, INFER, guarded.auth()) for s in ids))
        payload = message(b"", size) + b"\x00" * (size - 100)  # 100 bytes short
        granted, waiting = ids[:3], ids[3:]
        for stream in granted:
            assert raw.upload(stream, payload, timeout_s=2) == len(payload)
        raw.send(b"".join(raw.data(s, message(b"", size) + b"\x00" * 10) for s in waiting))
        raw.read(0.2)
        assert raw.window < 2 * f.DEFAULT_WINDOW  # no more room was granted
        deadline = time.monotonic() + 10
        while not all(raw.streams.get(s) and raw.streams[s].status for s in waiting):
            assert time.monotonic() < deadline
            raw.send(b"".join(raw.data(s, b"\x00") for s in granted))  # alive, slowly
            raw.read(0.25)
        assert {raw.streams[s].status for s in waiting} == {8}  # RESOURCE_EXHAUSTED
        assert "grpc_buffer_mb" in raw.streams[waiting[0]].message
        assert not any(raw.streams.get(s) and raw.streams[s].status for s in granted)
        assert raw.until(lambda: all(raw.streams.get(s) and raw.streams[s].status for s in ids), 10)
    assert {raw.streams[s].status for s in granted} == {4}  # DEADLINE_EXCEEDED
    assert rss.growth < 16 * MiB + 24 * MiB, rss.growth / MiB  # the budget, and the copies
    neighbour = Neighbour(guarded)  # the budget is whole again
    try:
        neighbour.measure(5)
        assert not neighbour.failures
    finally:
        neighbour.close()


def test_connections_past_the_limit_are_closed(guarded: Guarded) -> None:
    fds = guarded.fds()
    many = []
    try:
        for _ in range(420):
            many.append(guarded.raw())
        for raw in many:
            raw.read(0.001)
        assert _wait(lambda: sum(1 for r in many if r.until(lambda r=r: r.closed, 0.01)) >= 20, 5)
        refused = [r for r in many if r.goaway is not None and b"too many" in r.goaway[1]]
        assert len(refused) >= 20
        assert guarded.fds() <= fds + 400 + 5
    finally:
        for raw in many:
            raw.close()
    assert _wait(lambda: guarded.fds() <= fds + 5, 5)
    neighbour = Neighbour(guarded)  # the gateway takes connections again
    try:
        neighbour.measure(5)
        assert not neighbour.failures
    finally:
        neighbour.close()
