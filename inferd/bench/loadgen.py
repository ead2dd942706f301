"""The load loop: closed loop (N connections, back to back) or open loop (Poisson arrivals).

Every request sent yields exactly one :class:`Sample` -- a response, a timeout, or a
lost connection -- so ``requests == successes + errors`` always holds. In the open
loop, latency is measured from the *scheduled* arrival time, not from when a
connection was free to send it, so queueing in the client shows up as latency instead
of silently lowering the offered load (coordinated omission).
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.bench.connection import Connection, open_connection
from inferd.bench.stats import Sample

_perf = time.perf_counter


@dataclass
class LoadSpec:
    host: str
    port: int
    next_request: Callable[[], bytes]
    """Returns the full bytes of the next request (head + body)."""
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = 10.0
    requests: int | None = None
    warmup_s: float = 0.0
    timeout_s: float = 30.0
    max_connections: int = 2048
    seed: int | None = None
    ssl: ssl.SSLContext | None = None
    """TLS (an ``https://`` URL); None: plain TCP."""


@dataclass
class LoadResult:
    samples: list[Sample]
    duration_s: float
    unsent_arrivals: int = 0
    connect_errors: int = 0
    interrupted: bool = False
    cpu_s: float = 0.0
    """CPU time (user + system) the load generator itself used while the load ran."""
    wall_s: float = 0.0
    """Wall time over which ``cpu_s`` was measured."""


@dataclass
class _State:
    spec: LoadSpec
    measure_from: float = 0.0
    stop_sending: bool = False
    sent: int = 0
    samples: list[Sample] = field(default_factory=list)
    plain: list[tuple[float, float, int]] = field(default_factory=list)
    """Plain 2xx responses as (start, finished, status): a Sample each after the run."""
    idle: deque[Connection] = field(default_factory=deque)
    conns: set[Connection] = field(default_factory=set)
    backlog: deque[float] = field(default_factory=deque)
    connect_errors: int = 0
    opening: int = 0


class LoadGenerator:
    def __init__(self, spec: LoadSpec) -> None:
        if (spec.concurrency is None) == (spec.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if spec.duration_s is None and spec.requests is None:
            raise ValueError("give a duration or a number of requests")
        self.spec = spec
        self.s = _State(spec)
        self._rng = random.Random(spec.seed)

    @property
    def completed(self) -> int:
        """Requests answered so far in the measured window."""
        return len(self.s.samples) + len(self.s.plain)

    # -- connection callbacks ---------------------------------------------------
    def _factory(self) -> Connection:
        return Connection(self._on_done, self._on_lost, self.spec.timeout_s, self._on_ok)

    def _on_ok(self, conn: Connection, started: float, finished: float, status: int) -> None:
        """The hot path: a plain 2xx answer in the closed loop sends the next request at once."""
        s = self.s
        if started >= s.measure_from:
            s.plain.append((started, finished, status))
        if s.stop_sending or s.backlog or self.spec.concurrency is None:
            self._next(conn)
        elif self.spec.requests is None or s.sent < self.spec.requests:
            s.sent += 1
            conn.send(self.spec.next_request(), finished)
        else:
            self._next(conn)

    def _on_done(self, conn: Connection, sample: Sample) -> None:
        s = self.s
        if sample.start >= s.measure_from:
            s.samples.append(sample)
        self._next(conn)

    def _next(self, conn: Connection) -> None:
        """Give a connection that just finished a request its next one, or park it."""
        s = self.s
        if conn.transport is None:
            return
        if s.backlog and not s.stop_sending:
            self._send(conn, s.backlog.popleft())
        elif self.spec.concurrency is not None and self._may_send():
            self._send(conn, _perf())
        else:
            s.idle.append(conn)

    def _on_lost(self, conn: Connection) -> None:
        self.s.conns.discard(conn)
        if conn in self.s.idle:
            self.s.idle.remove(conn)

    def _may_send(self) -> bool:
        s = self.s
        if s.stop_sending:
            return False
        if self.spec.requests is not None and s.sent >= self.spec.requests:
            s.stop_sending = True
            return False
        return True

    def _send(self, conn: Connection, started: float) -> None:
        self.s.sent += 1
        conn.send(self.spec.next_request(), started)

    async def _open(self) -> Connection | None:
        s = self.s
        s.opening += 1
        try:
            conn = await open_connection(
                self.spec.host, self.spec.port, self._factory, min(self.spec.timeout_s, 10.0),
                self.spec.ssl,
            )  # fmt: skip
        except (OSError, TimeoutError):
            s.connect_errors += 1
            return None
        finally:
            s.opening -= 1
        s.conns.add(conn)
        return conn

    # -- the loops ----------------------------------------------------------------
    async def run(self) -> LoadResult:
        spec, s = self.spec, self.s
        cpu_start = time.process_time()
        start = _perf()
        s.measure_from = start + spec.warmup_s
        sweeper = asyncio.get_running_loop().create_task(self._sweep_timeouts())
        interrupted = False
        try:
            if spec.concurrency is not None:
                await self._closed_loop(spec.concurrency)
            else:
                await self._open_loop(spec.rate or 1.0)
        except asyncio.CancelledError:
            interrupted = True
        stopped = _perf()
        s.stop_sending = True
        if not interrupted:
            await self._drain(stopped + spec.timeout_s)
        cpu_s, wall_s = time.process_time() - cpu_start, _perf() - start
        sweeper.cancel()
        for conn in list(s.conns):
            conn.abandon("interrupted" if interrupted else "timeout")
        for conn in list(s.conns):
            if conn.transport is not None:
                conn.transport.close()
        # The measured window runs until the last answer came back, so slow requests
        # (long generations) count their whole time, not just the sending window.
        s.samples.extend(Sample(t, end - t, status) for t, end, status in s.plain)
        s.plain.clear()
        last_done = max((x.start + x.latency for x in s.samples), default=stopped)
        window = max(max(stopped, last_done) - s.measure_from, 1e-9)
        return LoadResult(
            s.samples, window, len(s.backlog), s.connect_errors, interrupted, cpu_s, wall_s
        )

    def _time_left(self) -> bool:
        spec = self.spec
        if spec.duration_s is not None and _perf() >= self.s.measure_from + spec.duration_s:
            return False
        return not (spec.requests is not None and self.s.sent >= spec.requests)

    async def _closed_loop(self, concurrency: int) -> None:
        opened = await asyncio.gather(*(self._open() for _ in range(concurrency)))
        for conn in opened:
            if conn is not None and self._may_send():
                self._send(conn, _perf())
        if not any(opened):
            raise ConnectionError(f"cannot connect to {self.spec.host}:{self.spec.port}")
        while self._time_left():
            await asyncio.sleep(0.01)
            self._reopen(concurrency)

    def _reopen(self, concurrency: int) -> None:
        """Replace connections the server closed, so the concurrency holds."""
        missing = concurrency - len(self.s.conns) - self.s.opening
        for _ in range(missing):
            asyncio.get_running_loop().create_task(self._open_and_send())

    async def _open_and_send(self) -> None:
        conn = await self._open()
        if conn is None:
            await asyncio.sleep(0.1)  # back off instead of hammering a refusing port
        elif self._may_send():
            self._send(conn, _perf())
        else:
            self.s.idle.append(conn)

    async def _open_loop(self, rate: float) -> None:
        s = self.s
        next_at = _perf()
        while self._time_left():
            now = _perf()
            while next_at <= now and self._may_send_arrival():
                self._arrive(next_at)
                next_at += self._rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(next_at - _perf(), 0.002)))
        s.stop_sending = True

    def _may_send_arrival(self) -> bool:
        spec = self.spec
        return spec.requests is None or self.s.sent + len(self.s.backlog) < spec.requests

    def _arrive(self, scheduled: float) -> None:
        s = self.s
        while s.idle:
            conn = s.idle.popleft()
            if conn.transport is not None:
                self._send(conn, scheduled)
                return
        s.backlog.append(scheduled)
        if len(s.conns) + s.opening < self.spec.max_connections:
            asyncio.get_running_loop().create_task(self._open_for_backlog())

    async def _open_for_backlog(self) -> None:
        conn = await self._open()
        if conn is None:
            return
        if self.s.backlog:
            self._send(conn, self.s.backlog.popleft())
        else:
            self.s.idle.append(conn)

    async def _drain(self, deadline: float) -> None:
        while any(c.busy for c in self.s.conns) and _perf() < deadline:
            await asyncio.sleep(0.01)

    async def _sweep_timeouts(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = _perf()
            for conn in list(self.s.conns):
                if conn.busy and now > conn.deadline:
                    conn.abandon()
