"""What one gRPC connection, and all of a gateway process's, may hold and do: the limits
the HTTP/2 server (:mod:`inferd.grpc.http2`) enforces, the request-bytes budget its calls
share, and the token bucket that closes a connection flooding cheap frames.

Design rule: **refuse before you buffer**. A call is admitted (authenticated) at its
HEADERS, before any of its DATA is kept; a message's bytes are reserved against the
connection's and the process's budgets (:class:`Buffers`) at its 5-byte prefix, and only
then does the stream's flow-control window open for it, so what a client sends beyond
its reservation is bounded by the HTTP/2 default windows (64 KiB a stream, 64 KiB for
the connection's unreserved bytes). When the budget is spent, uploads wait under flow
control, first come first served, until calls end (a unary call's reservation is held
until it is answered; a stream's message, until the handler takes it).

Cheap frames that cost the server work and the client nothing (the rapid-reset class,
CVE-2023-44487, and the 2019 HTTP/2 denial-of-service list: pings, settings, resets,
empty frames; and DATA sent on for calls already refused or ended) each take tokens
from the connection's :class:`Calm` bucket; an empty bucket ends the connection with
GOAWAY ENHANCE_YOUR_CALM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferd.grpc.http2 import Call

MiB = 1 << 20

CALM_BURST = 400
"""Cheap-frame events a connection may spend at once: four times what cancelling all its
calls (``max_streams``, 100) costs."""
CALM_PER_S = 100.0
"""Events refilled each second: a client cancelling a hundred calls a second, or pinging
without traffic ten times a second, goes on; a rapid-reset flood (thousands of resets a
second) empties the bucket within a tenth of a second."""


@dataclass(frozen=True)
class Bounds:
    """The limits of one gRPC server (a gateway process), from ``connections.*``."""

    max_connections: int = 4096
    max_streams: int = 100
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    idle_s: float = 30.0
    max_header_list: int = 64 * 1024
    connection_buffer: int = 64 * MiB
    process_buffer: int = 256 * MiB

    def fitted(self, max_message: int) -> Bounds:
        """These bounds with buffers that can hold the largest message (one per
        connection, two per process): a smaller budget would leave such a call waiting
        for room that can never be."""
        connection = max(self.connection_buffer, max_message + 5)
        process = max(self.process_buffer, 2 * connection)
        return Bounds(
            self.max_connections, self.max_streams, self.header_timeout_s,
            self.body_timeout_s, self.idle_s, self.max_header_list,
            connection, process,
        )  # fmt: skip

    @property
    def sweep_s(self) -> float:
        """How often timeouts are looked at: a quarter of the shortest, at most 1 s."""
        return min(1.0, self.header_timeout_s / 4, self.body_timeout_s / 4, self.idle_s / 4)


class Buffers:
    """The request bytes all of a process's gRPC calls hold, against ``limit`` (and each
    connection's against ``per_connection``). A reservation that does not fit waits in
    arrival order; :meth:`release` grants what then fits, in that order (one connection
    at its own limit does not hold the others back)."""

    def __init__(self, limit: int, per_connection: int) -> None:
        self.limit = limit
        self.per_connection = per_connection
        self.held = 0
        self.waiting: deque[Call] = deque()

    def take(self, call: Call, size: int) -> bool:
        """Reserve ``size`` bytes for ``call``: True when they are reserved now; False
        when it waits (its connection's ``granted`` is called once they are)."""
        call.wanted = size
        self.waiting.append(call)
        self._grant(call)
        return not call.wanted

    def release(self, call: Call, size: int) -> None:
        size = min(size, call.reserved)
        if size <= 0:
            return
        call.reserved -= size
        call.conn.held -= size
        self.held -= size
        if self.waiting:
            self._grant()

    def _hold(self, call: Call, size: int) -> None:
        call.reserved += size
        call.conn.held += size
        self.held += size

    def _grant(self, taking: Call | None = None) -> None:
        kept: deque[Call] = deque()
        waiting = self.waiting
        while waiting:
            call = waiting.popleft()
            if call.done or not call.wanted:
                continue
            size = call.wanted
            if self.held + size > self.limit:
                waiting.appendleft(call)
                break
            if call.conn.held + size > self.per_connection:
                kept.append(call)  # its connection is full; others may go on
                continue
            call.wanted = 0
            self._hold(call, size)
            if call is not taking:
                call.conn.granted(call)
        waiting.extendleft(reversed(kept))


class Calm:
    """A token bucket of cheap-frame events: a connection's (:data:`CALM_BURST`), or a
    peer address's (:data:`PEER_BURST`)."""

    __slots__ = ("at", "burst", "per_s", "tokens")

    def __init__(self, now: float, burst: float = CALM_BURST, per_s: float = CALM_PER_S) -> None:
        self.burst, self.per_s = burst, per_s
        self.tokens = float(burst)
        self.at = now

    def spend(self, now: float, cost: float = 1.0) -> bool:
        """Take ``cost``; False once the bucket is empty (the connection must end)."""
        tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s) - cost
        self.tokens, self.at = tokens, now
        return tokens >= 0

    def empty(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.per_s < 0

    def punish(self, owed: float) -> None:
        """Empty past a spend that failed: ``owed`` more before it holds tokens again."""
        self.tokens = min(self.tokens, -owed)


PEER_BURST = 2000
"""Cheap-frame events one client address may spend at once over all its connections: a
flood that reconnects each time a connection is closed goes on only while its address's
bucket holds tokens; then its new connections are closed as they are accepted."""
PEER_PER_S = 200.0
PEER_PENALTY = 500.0
"""An address whose bucket ran out owes this much more (2.5 s of refills): meanwhile its
new connections are closed as they are accepted, however fast it reconnects."""
PEERS = 10_000
"""Addresses whose buckets are kept (the oldest forgotten first)."""


class Peers:
    """The flood buckets of client addresses. Only refused or abusive frames spend
    them, never answered calls: a proxy in front of the gateway drains its address's
    bucket only if it forwards a flood (then bound unauthenticated traffic there)."""

    def __init__(self) -> None:
        self._buckets: dict[str, Calm] = {}

    def of(self, address: str | None, now: float) -> Calm | None:
        if address is None:  # a Unix socket: local, trusted as a whole
            return None
        bucket = self._buckets.pop(address, None)
        if bucket is None:
            bucket = Calm(now, PEER_BURST, PEER_PER_S)
            if len(self._buckets) >= PEERS:
                del self._buckets[next(iter(self._buckets))]
        self._buckets[address] = bucket  # the most recent last
        return bucket
