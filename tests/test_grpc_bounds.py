"""The gRPC server's budgets and flood bucket (:mod:`inferd.grpc.bounds`), on their own:
no sockets, no loop."""

from __future__ import annotations

from typing import Any

from inferd.grpc.bounds import CALM_BURST, CALM_PER_S, Bounds, Buffers, Calm


class Conn:
    def __init__(self) -> None:
        self.held = 0
        self.granted_calls: list[Any] = []

    def granted(self, call: Any) -> None:
        self.granted_calls.append(call)


class Call:
    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.wanted = 0
        self.reserved = 0
        self.done = False


def test_reservations_wait_in_order_and_are_granted_as_bytes_come_back() -> None:
    buffers = Buffers(limit=100, per_connection=100)
    conn = Conn()
    a, b, c = Call(conn), Call(conn), Call(conn)
    assert buffers.take(a, 60)
    assert not buffers.take(b, 50)  # does not fit: waits
    assert not buffers.take(c, 10)  # would fit, but b came first
    assert (buffers.held, conn.held, a.reserved) == (60, 60, 60)
    buffers.release(a, 60)
    assert conn.granted_calls == [b, c]  # both fit now, in order
    assert (buffers.held, b.reserved, c.reserved, b.wanted, c.wanted) == (60, 50, 10, 0, 0)


def test_a_connection_at_its_own_limit_does_not_hold_the_others_back() -> None:
    buffers = Buffers(limit=100, per_connection=40)
    greedy, other = Conn(), Conn()
    first, second = Call(greedy), Call(greedy)
    assert buffers.take(first, 40)
    assert not buffers.take(second, 30)  # its connection is full
    late = Call(other)
    assert buffers.take(late, 30)  # another connection's call goes past it
    buffers.release(first, 40)
    assert greedy.granted_calls == [second]
    assert (buffers.held, greedy.held, other.held) == (60, 30, 30)


def test_an_ended_call_is_skipped_and_releases_no_more_than_it_holds() -> None:
    buffers = Buffers(limit=10, per_connection=10)
    conn = Conn()
    holder, gone, next_one = Call(conn), Call(conn), Call(conn)
    buffers.take(holder, 10)
    buffers.take(gone, 5)
    buffers.take(next_one, 5)
    gone.done = True
    buffers.release(holder, 1000)
    assert conn.granted_calls == [next_one]
    assert buffers.held == 5 and holder.reserved == 0


def test_bounds_make_room_for_the_largest_message() -> None:
    fitted = Bounds(connection_buffer=1 << 20, process_buffer=1 << 20).fitted(16 << 20)
    assert fitted.connection_buffer == (16 << 20) + 5
    assert fitted.process_buffer == 2 * fitted.connection_buffer
    assert Bounds(header_timeout_s=0.4).sweep_s == 0.1


def test_the_calm_bucket_allows_a_burst_then_its_rate() -> None:
    calm = Calm(now=0.0)
    assert all(calm.spend(0.0) for _ in range(CALM_BURST))
    assert not calm.spend(0.0)  # the burst is spent
    calm = Calm(now=0.0)
    spent = sum(calm.spend(t / 1000) for t in range(10_000))  # 1,000 a second for 10 s
    assert spent <= CALM_BURST + 10 * CALM_PER_S + 1
    steady = Calm(now=0.0)
    assert all(steady.spend(t / CALM_PER_S) for t in range(5000))  # at the rate: forever


def test_an_address_that_ran_out_owes_a_penalty() -> None:
    calm = Calm(now=0.0, burst=10, per_s=100)
    assert all(calm.spend(0.0) for _ in range(10))
    assert not calm.spend(0.0)
    calm.punish(50)
    assert calm.empty(0.4) and not calm.empty(0.6)  # 50 owed at 100 a second
