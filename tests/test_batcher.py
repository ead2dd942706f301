"""Unit tests of the dynamic batcher: no sockets, no processes, no real time.

The time the batcher reads is a :class:`~tests.clocks.FakeClock` that a test moves by
hand (windows, deadlines, the arrival rate). A test that needs a batch to be computing
waits for the model to say so (:meth:`Model.computing`), and holds it there until it
sets ``Model.release``: model code runs on the compute thread, so this is the one
thing waited for across threads, on an Event, never on a sleep. Assertions are about
what the batcher did: which rows went in which batch, in which order, which request
failed with what, and its counters.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from inferd.config import BatchingConfig
from inferd.errors import InvalidInput, ModelError, Overloaded, RequestTimeout
from inferd.serving.batcher import NAMED_PRIORITIES, DynamicBatcher, named_levels
from inferd.serving.compute import ComputeThread
from tests.clocks import FakeClock, settle


class Model:
    """A predict function that records each batch (its rows' first column) and the
    threads it runs on. ``held``: every batch waits until the test sets ``release``.
    ``fail``: every batch fails; otherwise a batch with a negative value fails."""

    def __init__(self, *, held: bool = False, fail: bool = False) -> None:
        self.batches: list[list[float]] = []
        self.threads: set[str] = set()
        self.fail = fail
        self.started = threading.Event()
        """Set when the first batch begins (the batcher took it out of the queue)."""
        self.release = threading.Event()
        if not held:
            self.release.set()

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.add(threading.current_thread().name)
        x = inputs["x"]
        self.batches.append(x[:, 0].tolist())
        self.started.set()
        self.release.wait(5)
        if self.fail:
            raise ValueError("model exploded")
        if (x < 0).any():
            raise ValueError("negative")
        return {"y": x.sum(axis=1)}

    @property
    def batch_rows(self) -> list[int]:
        return [len(batch) for batch in self.batches]

    @property
    def values(self) -> list[float]:
        """Every row computed, in the order computed."""
        return [value for batch in self.batches for value in batch]

    async def computing(self) -> None:
        """Return once the first batch is computing (held, if ``held``)."""
        assert await asyncio.to_thread(self.started.wait, 5), "no batch was computed"


def run(coro):
    """Run a test's body; a batcher that never answers fails it instead of hanging it
    (on a clock nobody moves, a batch waiting for a window would wait forever)."""
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _with_clock(predict, config, body, clock: FakeClock | None = None):
    clock = clock or FakeClock()
    thread = ComputeThread("predict")
    batcher = DynamicBatcher(predict, config, thread, clock)
    batcher.start()
    try:
        return await body(batcher, clock)
    finally:
        await batcher.stop()
        thread.shutdown()


def rows(n: int, value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((n, 3), value, dtype=np.float32)}


def test_concurrent_requests_become_few_batches_and_results_split_correctly():
    model = Model()

    async def body(b, clock):
        futures = [b.submit(rows(1, float(i)), 1, 5.0) for i in range(64)]
        return await asyncio.gather(*futures)

    results = run(_with_clock(model, BatchingConfig(max_batch_size=16, max_wait_ms=20), body))
    assert [float(r["y"][0]) for r in results] == [3.0 * i for i in range(64)]
    assert model.batch_rows == [16, 16, 16, 16]  # 64 rows in batches of at most 16
    assert model.values == list(range(64))  # in arrival order
    assert model.threads == {"predict"}  # model code never on the event loop thread


def test_max_batch_size_counts_rows_not_requests():
    model = Model()

    async def body(b, clock):
        futures = [b.submit(rows(10), 10, 5.0) for _ in range(4)]
        return await asyncio.gather(*futures)

    results = run(_with_clock(model, BatchingConfig(max_batch_size=25, max_wait_ms=50), body))
    assert all(r["y"].shape == (10,) for r in results)
    assert model.batch_rows == [20, 20]  # two requests of 10 rows: a third would be 30


def test_request_larger_than_max_batch_is_computed_in_pieces_joined_in_order():
    model = Model()

    async def body(b, clock):
        x = {"x": np.arange(300, dtype=np.float32).reshape(100, 3)}
        return await b.submit(x, 100, 5.0)

    result = run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=1), body))
    assert result["y"].tolist() == [float(3 * i + 3 * i + 1 + 3 * i + 2) for i in range(100)]
    assert model.batch_rows == [8] * 12 + [4]


def test_a_better_priority_goes_between_the_pieces_of_a_large_request():
    """A big low-priority request (a batch job's) holds the model for one batch at most:
    a high-priority request arriving meanwhile is computed next, not after all of it."""
    model = Model(held=True)
    order: list[str] = []

    async def body(b, clock):
        big = b.submit(rows(80), 80, 5.0, priority=NAMED_PRIORITIES["batch"])
        big.add_done_callback(lambda _: order.append("big"))
        await model.computing()  # the first piece
        urgent = b.submit(rows(1, 2.0), 1, 5.0, priority=NAMED_PRIORITIES["high"])
        urgent.add_done_callback(lambda _: order.append("urgent"))
        model.release.set()
        await urgent
        await big

    run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=1), body))
    assert order == ["urgent", "big"]
    # one piece in progress, then its own batch; not after the other 9 pieces
    assert model.batches == [[1.0] * 8, [2.0]] + [[1.0] * 8] * 9


def test_a_failing_piece_fails_the_request_and_drops_the_rest():
    model = Model()

    async def body(b, clock):
        with pytest.raises(ValueError, match="negative"):
            await b.submit(rows(40, -1.0), 40, 5.0)
        await b.submit(rows(1), 1, 5.0)  # queued behind the other pieces, computed after
        return b.queued_rows

    assert run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=1), body)) == 0
    # at most the next piece started (taken before the failure was known); the rest never
    assert model.batch_rows in ([8, 1], [8, 8, 1])


def test_a_bad_request_fails_alone_not_the_batch_it_was_in():
    model = Model()

    async def body(b, clock):
        futures = [b.submit(rows(1, v), 1, 5.0) for v in (1.0, -1.0, 2.0, 3.0)]
        return await asyncio.gather(*futures, return_exceptions=True), b.stats.batches

    (outcomes, batches) = run(
        _with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=20), body)
    )
    assert [float(o["y"][0]) if isinstance(o, dict) else str(o) for o in outcomes] == [
        3.0, "negative", 6.0, 9.0,
    ]  # fmt: skip
    assert batches == 5  # the failed batch of four, then each alone
    assert model.batches == [[1.0, -1.0, 2.0, 3.0], [1.0], [-1.0], [2.0], [3.0]]


def test_cancelling_a_large_request_drops_its_pieces():
    model = Model(held=True)

    async def body(b, clock):
        big = b.submit(rows(80), 80, 5.0)
        await model.computing()  # its first piece
        big.cancel()
        await settle()
        model.release.set()
        await b.submit(rows(1, 2.0), 1, 5.0)  # queued behind the other pieces
        return b.idle()

    assert run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=1), body))
    assert model.batches == [[1.0] * 8, [2.0]]  # the piece in progress; the other 9 dropped


def test_window_batching_holds_a_lone_request_at_most_max_wait():
    model = Model()

    async def body(b, clock):
        future = b.submit(rows(1), 1, 5.0)
        await settle()
        await clock.advance(0.029)
        assert b.queued_rows == 1 and not future.done()  # held for the window
        await clock.advance(0.001)  # the window ends: it goes, with no more time passing
        await future

    config = BatchingConfig(max_batch_size=32, max_wait_ms=30, adaptive=False)
    run(_with_clock(model, config, body))
    assert model.batch_rows == [1]


@pytest.mark.parametrize("adaptive", [True, False])
def test_zero_wait_dispatches_immediately(adaptive: bool):
    model = Model()

    async def body(b, clock):
        future = b.submit(rows(1), 1, 5.0)
        await settle()
        assert b.queued_rows == 0  # taken at once: the clock has not moved
        await future
        return clock.t

    config = BatchingConfig(max_batch_size=32, max_wait_ms=0, adaptive=adaptive)
    assert run(_with_clock(model, config, body)) == 0.0
    assert model.batch_rows == [1]


def test_failure_is_set_on_every_request_of_the_batch():
    model = Model(fail=True)

    async def body(b, clock):
        futures = [b.submit(rows(1), 1, 5.0) for _ in range(5)]
        return await asyncio.gather(*futures, return_exceptions=True)

    results = run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=20), body))
    assert len(results) == 5
    assert all(isinstance(r, ValueError) and str(r) == "model exploded" for r in results)
    assert model.batch_rows == [5, 1, 1, 1, 1, 1]  # the batch, then each alone


def test_expired_request_is_dropped_before_compute():
    model = Model(held=True)

    async def body(b, clock):
        slow = b.submit(rows(1), 1, 5.0)
        await model.computing()
        doomed = b.submit(rows(2), 2, 0.05)
        await clock.advance(0.1)  # its deadline passes while the first batch computes
        model.release.set()
        await slow
        with pytest.raises(RequestTimeout):
            await doomed
        return b.stats

    stats = run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=0), body))
    assert model.batch_rows == [1]
    assert stats.expired == 1


def test_cancelled_request_is_not_computed():
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await model.computing()
        cancelled = b.submit(rows(4, 4.0), 4, 5.0)
        cancelled.cancel()
        model.release.set()
        await first
        await b.submit(rows(1, 2.0), 1, 5.0)

    run(_with_clock(model, BatchingConfig(max_batch_size=8, max_wait_ms=0), body))
    assert model.batches == [[1.0], [2.0]]  # never the cancelled rows


def test_queue_bound_rejects_with_overloaded():
    model = Model()

    async def body(b, clock):
        accepted = [b.submit(rows(4), 4, 5.0) for _ in range(2)]
        with pytest.raises(Overloaded) as info:
            b.submit(rows(4), 4, 5.0)
        await asyncio.gather(*accepted)
        return info.value, b.stats.rejected

    config = BatchingConfig(max_batch_size=4, max_wait_ms=0, max_queue_rows=8)
    err, rejected = run(_with_clock(model, config, body))
    assert err.status_code == 503
    assert err.details["max_queue_rows"] == 8
    assert rejected == 1
    assert model.batch_rows == [4, 4]  # only the accepted requests


def test_wrong_output_rows_fail_the_batch():
    def bad(inputs):
        return {"y": np.zeros(1)}

    async def body(b, clock):
        return await asyncio.gather(b.submit(rows(3), 3, 5.0), return_exceptions=True)

    (result,) = run(_with_clock(bad, BatchingConfig(max_wait_ms=0), body))
    assert isinstance(result, ValueError)
    assert "expected 3 rows" in str(result)


def test_priority_levels_are_served_best_first_and_fifo_within_a_level():
    """While one batch computes, requests of levels 3, 2 (default) and 1 queue up; the
    next batches take level 1, then the default level, then level 3."""
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(rows(1, 0), 1, 5.0)
        await model.computing()
        order = [(3, 31), (0, 21), (1, 11), (3, 32), (2, 22), (1, 12)]
        futures = [b.submit(rows(1, value), 1, 5.0, priority) for priority, value in order]
        model.release.set()
        await asyncio.gather(first, *futures)

    run(_with_clock(model, BatchingConfig(max_batch_size=2, max_wait_ms=0), body))
    assert model.batches == [[0], [11, 12], [21, 22], [31, 32]]


def test_priority_outside_the_levels_is_refused():
    async def body(b, clock):
        with pytest.raises(InvalidInput, match="priority 5 is not a level"):
            b.submit(rows(1), 1, 1.0, 5)
        return await b.submit(rows(1), 1, 1.0, 4)

    out = run(_with_clock(Model(), BatchingConfig(max_wait_ms=0), body))
    assert out["y"].tolist() == [3.0]


def test_default_priority_must_be_a_level():
    with pytest.raises(ValueError, match="default_priority 5 is above priority_levels 4"):
        BatchingConfig(default_priority=5)
    assert named_levels(BatchingConfig()) == {"high": 1, "normal": 2, "low": 3, "batch": 4}
    assert named_levels(BatchingConfig(priority_levels=1, default_priority=1)) == dict.fromkeys(
        ("high", "normal", "low", "batch"), 1
    )


def test_low_priority_is_refused_past_its_share_of_the_queue():
    model = Model(held=True)
    config = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_rows=8)

    async def body(b, clock):
        running = b.submit(rows(1, 0), 1, 5.0)
        await model.computing()  # blocked: the queue is empty
        low = [b.submit(rows(1, 30 + i), 1, 5.0, NAMED_PRIORITIES["low"]) for i in range(4)]
        with pytest.raises(Overloaded, match="priority low is refused while 4 or more") as info:
            b.submit(rows(1, 39), 1, 5.0, NAMED_PRIORITIES["low"])
        assert info.value.retry_after_s >= 1
        with pytest.raises(Overloaded, match="priority batch is refused while 2 or more"):
            b.submit(rows(1, 40), 1, 5.0, NAMED_PRIORITIES["batch"])
        normal = [b.submit(rows(1, 20 + i), 1, 5.0) for i in range(5)]  # the 5th sheds a low
        model.release.set()
        return await asyncio.gather(running, *low, *normal, return_exceptions=True)

    out = run(_with_clock(model, config, body))
    assert [type(o).__name__ for o in out[1:5]] == ["dict"] * 3 + ["Overloaded"]
    assert model.values == [0, 20, 21, 22, 23, 24, 30, 31, 32]


def test_a_high_priority_request_takes_the_place_of_the_newest_worse_ones():
    model = Model(held=True)
    config = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_rows=4, low_queue_share=1)

    async def body(b, clock):
        running = b.submit(rows(1, 0), 1, 5.0)
        await model.computing()
        normal = [b.submit(rows(1, 20 + i), 1, 5.0) for i in range(2)]
        low = [b.submit(rows(1, 30 + i), 1, 5.0, NAMED_PRIORITIES["low"]) for i in range(2)]
        high = [b.submit(rows(1, 10 + i), 1, 5.0, NAMED_PRIORITIES["high"]) for i in range(3)]
        assert b.queued_rows == 4 and b.stats.shed == 3  # both low, then the newest normal
        high.append(b.submit(rows(1, 13), 1, 5.0, NAMED_PRIORITIES["high"]))
        with pytest.raises(Overloaded, match="queue is full"):  # nothing worse is left
            b.submit(rows(1, 14), 1, 5.0, NAMED_PRIORITIES["high"])
        model.release.set()
        return await asyncio.gather(running, *normal, *low, *high, return_exceptions=True)

    out = run(_with_clock(model, config, body))
    assert all(isinstance(o, Overloaded) for o in out[1:5])
    assert "higher-priority" in str(out[1])
    assert model.values == [0, 10, 11, 12, 13]


def test_shed_counts_are_kept_by_priority_name():
    model = Model(held=True)
    config = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_rows=2)

    async def body(b, clock):
        running = b.submit(rows(1, 0), 1, 5.0)
        await model.computing()
        queued = [b.submit(rows(1, i), 1, 5.0, NAMED_PRIORITIES["low"]) for i in range(1)]
        for _ in range(2):
            with pytest.raises(Overloaded):
                b.submit(rows(1, 9), 1, 5.0, NAMED_PRIORITIES["batch"])
        queued += [b.submit(rows(1, 5), 1, 5.0, 1) for _ in range(2)]  # sheds the low one
        model.release.set()
        await asyncio.gather(running, *queued, return_exceptions=True)
        return b.shed_counts()

    assert run(_with_clock(model, config, body)) == {"low": 1, "batch": 2}


def _texts(lengths: list[int]) -> dict[str, np.ndarray]:
    """A text-model request: one row per length, each row its length (as a runtime's
    prepared ids would be); :class:`Model` answers each row's length and records it."""
    return {"x": np.asarray([[n, 0, 0] for n in lengths], dtype=np.float32)}


def test_length_buckets_batch_similar_lengths_and_count_padding():
    """While one batch computes, short (5-token) and long (200-token) texts queue up
    interleaved; every later batch holds one bucket only, oldest request first, and
    the padding counted is what those batches pad."""
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(_texts([7]), 1, 5.0, lengths=np.asarray([7]))
        await model.computing()
        lengths = [5, 200, 6, 180, 5, 210, 4, 190] * 4
        futures = [b.submit(_texts([n]), 1, 5.0, lengths=np.asarray([n])) for n in lengths]
        model.release.set()
        results = await asyncio.gather(first, *futures)
        return b.stats, [int(r["y"][0]) for r in results[1:]], lengths

    stats, answered, lengths = run(
        _with_clock(model, BatchingConfig(max_batch_size=64, max_wait_ms=0), body)
    )
    assert answered == lengths  # every request got its own row back
    assert model.batches[0] == [7]
    assert model.batches[1] == [5, 6, 5, 4] * 4  # the oldest (short) bucket, in arrival order
    assert model.batches[2] == [200, 180, 210, 190] * 4
    assert len(model.batches) == 3
    assert stats.tokens == 7 + sum(lengths)
    assert stats.padded_tokens == 7 + 16 * 6 + 16 * 210
    assert stats.as_dict()["padded_tokens"] == stats.padded_tokens


def test_without_length_buckets_texts_of_any_length_share_a_batch():
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(_texts([7]), 1, 5.0, lengths=np.asarray([7]))
        await model.computing()
        lengths = [5, 200, 6, 180]
        futures = [b.submit(_texts([n]), 1, 5.0, lengths=np.asarray([n])) for n in lengths]
        model.release.set()
        await asyncio.gather(first, *futures)
        return b.stats

    config = BatchingConfig(max_batch_size=64, max_wait_ms=0, length_buckets=[])
    stats = run(_with_clock(model, config, body))
    assert model.batches == [[7], [5, 200, 6, 180]]
    assert stats.padded_tokens == 7 + 4 * 200  # the short texts padded to 200


def test_a_long_request_is_split_into_pieces_of_similar_lengths_and_rejoined_in_order():
    model = Model()
    lengths = [50, 3, 40, 4, 60, 2, 30, 5]

    async def body(b, clock):
        return await b.submit(_texts(lengths), len(lengths), 5.0, lengths=np.asarray(lengths))

    result = run(_with_clock(model, BatchingConfig(max_batch_size=4, max_wait_ms=0), body))
    assert result["y"].astype(int).tolist() == lengths
    assert model.batches == [[2, 3, 4, 5], [30, 40, 50, 60]]


def test_the_oldest_request_is_never_passed_over_by_its_bucket_rule():
    """Long texts keep arriving; a lone short one still goes in the next batch."""
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(_texts([100]), 1, 5.0, lengths=np.asarray([100]))
        await model.computing()
        short = b.submit(_texts([3]), 1, 5.0, lengths=np.asarray([3]))
        longs = [b.submit(_texts([100]), 1, 5.0, lengths=np.asarray([100])) for _ in range(8)]
        model.release.set()
        await asyncio.gather(first, short, *longs)

    run(_with_clock(model, BatchingConfig(max_batch_size=64, max_wait_ms=0), body))
    assert model.batches == [[100], [3], [100] * 8]


# -- when a batch goes: adaptive and window batching --------------------------------------


def test_an_idle_replica_computes_a_request_at_once_whatever_max_wait():
    model = Model()

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await asyncio.wait_for(first, 5)  # the clock never moves: no window to wait out
        second = b.submit(rows(2), 2, 5.0)
        await asyncio.wait_for(second, 5)

    run(_with_clock(model, BatchingConfig(max_batch_size=32, max_wait_ms=10_000), body))
    assert model.batch_rows == [1, 2]


def test_requests_arriving_in_one_instant_share_the_idle_replicas_batch():
    model = Model()

    async def body(b, clock):
        futures = [b.submit(rows(1), 1, 5.0) for _ in range(5)]  # one socket read's frames
        await asyncio.wait_for(asyncio.gather(*futures), 5)

    run(_with_clock(model, BatchingConfig(max_batch_size=32, max_wait_ms=10_000), body))
    assert model.batch_rows == [5]


def test_a_busy_replica_gathers_the_next_batch_while_it_computes():
    model = Model(held=True)  # the first batch computes until the test lets it go

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await model.computing()
        later = [b.submit(rows(2), 2, 5.0) for _ in range(3)]  # arrive during the compute
        await settle()
        assert b.queued_rows == 6  # they wait for the batch ahead of them, not for a window
        assert model.batch_rows == [1]
        model.release.set()
        await asyncio.wait_for(asyncio.gather(first, *later), 5)

    run(_with_clock(model, BatchingConfig(max_batch_size=32, max_wait_ms=10_000), body))
    assert model.batch_rows == [1, 6]  # one batch of what gathered; the clock never moved


def test_a_busy_replicas_next_batch_is_bounded_by_max_batch_size_and_priority():
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(rows(1, 0), 1, 5.0)
        await model.computing()
        low = [b.submit(rows(1, 3), 1, 5.0, priority=3) for _ in range(2)]
        normal = [b.submit(rows(1, 2), 1, 5.0) for _ in range(2)]
        high = b.submit(rows(1, 1), 1, 5.0, priority=1)
        await settle()
        model.release.set()
        await asyncio.wait_for(asyncio.gather(first, *low, *normal, high), 5)

    run(_with_clock(model, BatchingConfig(max_batch_size=3, max_wait_ms=10_000), body))
    assert model.batches == [[0.0], [1.0, 2.0, 2.0], [3.0, 3.0]]


def test_a_deadline_that_passes_behind_a_busy_batch_fails_without_computing():
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await model.computing()
        doomed = b.submit(rows(1), 1, 0.05)
        kept = b.submit(rows(2), 2, 5.0)
        await clock.advance(0.1)  # its deadline passes while the first batch computes
        model.release.set()
        with pytest.raises(RequestTimeout):
            await asyncio.wait_for(doomed, 5)
        await asyncio.wait_for(asyncio.gather(first, kept), 5)
        return b.stats

    stats = run(_with_clock(model, BatchingConfig(max_batch_size=8), body))
    assert model.batch_rows == [1, 2] and stats.expired == 1


def test_under_load_adaptive_batching_waits_for_fuller_batches():
    seen: list[int] = []
    clock = FakeClock()

    def predict(inputs):  # a batch of one row takes 8 ms, a fuller one 1 ms (on the clock)
        seen.append(len(inputs["x"]))
        clock.t += 0.008 if len(inputs["x"]) <= 2 else 0.001
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b, clock):
        await asyncio.wait_for(b.submit(rows(1), 1, 5.0), 5)  # idle: at once, 8 ms
        assert b.load() < 1
        futures = []
        for _ in range(600):  # 10,000 requests/s: one by one they would need 80 s a second
            futures.append(b.submit(rows(1), 1, 5.0))
            clock.t += 0.0001
        assert b.load() > 1
        # full batches go at once: 9 of 64 rows, with no time passing but their compute
        await asyncio.wait_for(asyncio.gather(*futures[: 9 * 64]), 5)
        await settle()
        assert seen == [1, *[64] * 9]
        assert b.queued_rows == 24 and not futures[-1].done()  # they wait for companions
        await clock.advance(0.02)  # until max_wait_ms passed since the first of them came
        await asyncio.wait_for(asyncio.gather(*futures), 5)

    run(_with_clock(predict, BatchingConfig(max_batch_size=64, max_wait_ms=20), body, clock))
    assert seen == [1, *[64] * 9, 24]


def test_lone_batches_timed_on_a_busy_machine_do_not_keep_batches_waiting_after_it():
    """A burst of load, with the lone batches of the moment slow (a busy machine), then a
    steady 1,000 requests/s on a quiet one: once fuller batches show that a request
    computes in far less than those lone batches took, requests go at once again (it
    used to wait out ``max_wait_ms`` for good: no batch was lone to correct the guess)."""
    seen: list[int] = []
    clock = FakeClock()
    lone = [0.002]  # what a batch of one or two rows takes on the clock, now

    def predict(inputs):  # fuller batches: 0.3 ms plus 10 us a row
        n = len(inputs["x"])
        seen.append(n)
        clock.t += lone[0] if n <= 2 else 0.0003 + 0.00001 * n
        return {"y": inputs["x"].sum(axis=1)}

    async def computed(b):
        while b.busy:  # the model computes on the compute thread
            await asyncio.sleep(0)

    async def body(b, clock):
        for _ in range(15):  # idle, one at a time: lone batches, 2 ms each
            await asyncio.wait_for(b.submit(rows(1), 1, 5.0), 5)
        burst = []
        for _ in range(600):  # 10,000 requests/s for 60 ms
            burst.append(b.submit(rows(1), 1, 5.0))
            clock.t += 0.0001
        await asyncio.wait_for(asyncio.gather(*burst[: 9 * 64]), 5)
        await clock.advance(0.005)
        await asyncio.wait_for(asyncio.gather(*burst), 5)
        lone[0] = 0.0002  # the machine is quiet again
        steady = []
        for _ in range(300):  # 1,000 requests/s for 0.3 s
            steady.append(b.submit(rows(1), 1, 5.0))
            await settle()
            await computed(b)
            await clock.advance(0.001)
            await computed(b)
        await clock.advance(0.005)
        await asyncio.wait_for(asyncio.gather(*steady), 5)
        return b.load()

    load = run(_with_clock(predict, BatchingConfig(max_batch_size=64, max_wait_ms=5), body, clock))
    assert seen[15:25] == [64] * 9 + [24]  # the burst waited for full batches
    assert max(seen[25:40]) > 2  # at first the steady requests waited too: a lone one took 2 ms
    assert seen[-100:] == [1] * 100, seen[-100:]  # then each went at once
    assert load < 0.5


def test_a_batch_waits_max_wait_on_the_clock_then_goes():
    model = Model()

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await settle()
        await clock.advance(0.029)
        assert b.queued_rows == 1 and not first.done()  # the window is still open
        second = b.submit(rows(2), 2, 5.0)  # joins the open batch
        await clock.advance(0.001)
        await asyncio.wait_for(asyncio.gather(first, second), 5)

    config = BatchingConfig(max_batch_size=32, max_wait_ms=30, adaptive=False)
    run(_with_clock(model, config, body))
    assert model.batch_rows == [3]


def test_a_full_batch_does_not_wait_for_the_clock():
    model = Model()

    async def body(b, clock):
        futures = [b.submit(rows(2), 2, 5.0) for _ in range(4)]  # 8 rows: full
        await asyncio.wait_for(asyncio.gather(*futures), 5)  # no advance needed

    config = BatchingConfig(max_batch_size=8, max_wait_ms=10_000, adaptive=False)
    run(_with_clock(model, config, body))
    assert model.batch_rows == [8]


def test_a_deadline_that_passes_in_the_window_fails_without_computing():
    model = Model()

    async def body(b, clock):
        doomed = b.submit(rows(1), 1, 0.05)
        kept = b.submit(rows(1), 1, 5.0)
        await settle()
        await clock.advance(0.1)  # the window ends after the first deadline
        with pytest.raises(RequestTimeout):
            await asyncio.wait_for(doomed, 5)
        await asyncio.wait_for(kept, 5)
        return b.stats

    config = BatchingConfig(max_batch_size=8, max_wait_ms=100, adaptive=False)
    stats = run(_with_clock(model, config, body))
    assert model.batch_rows == [1] and stats.expired == 1


# -- where a batch computes: the compute thread, whatever the model ---------------------


class Placed(Model):
    """Records the thread of each batch, in order; ``seconds``: each compute takes that
    long (the model's own work, not a wait of the test)."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.where: list[str] = []
        self.seconds = seconds

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.where.append(threading.current_thread().name)
        if self.seconds:
            threading.Event().wait(self.seconds)
        return super().__call__(inputs)


async def _one_at_a_time(b: DynamicBatcher, n: int, first: int = 0) -> list[float]:
    """``n`` requests of one row, each sent once the one before was answered (one batch
    each); their answers."""
    answers = []
    for i in range(first, first + n):
        out = await asyncio.wait_for(b.submit(rows(1, float(i)), 1, 5.0), 5)
        answers.append(float(out["y"][0]))
    return answers


def test_a_light_model_computes_on_its_thread_however_many_light_batches_it_ran():
    """Hundreds of microsecond batches (the old inline mode moved such a model onto the
    event loop after 64): still the compute thread, every one of them."""
    model = Placed()

    async def body(b, clock):
        answers = await _one_at_a_time(b, 300)
        few = [b.submit(rows(1, 1.0), 1, 5.0) for _ in range(3)]  # a batch of a few
        await asyncio.wait_for(asyncio.gather(*few), 5)
        return answers, threading.current_thread().name

    answers, loop_thread = run(_with_clock(model, BatchingConfig(), body))
    assert answers == [3.0 * i for i in range(300)]
    assert set(model.where) == {"predict"} and loop_thread != "predict"


def test_batches_ready_when_one_ends_go_one_after_another_without_a_wait():
    """While a batch computes, two more batches' worth of requests queue: each goes the
    moment the one before ends, full, in order, and every request gets its own rows."""
    model = Placed()
    model.release.clear()

    async def body(b, clock):
        first = b.submit(rows(1, 0.0), 1, 5.0)
        await model.computing()
        queued = [b.submit(rows(1, float(i)), 1, 5.0) for i in range(1, 9)]
        model.release.set()
        return await asyncio.wait_for(asyncio.gather(first, *queued), 5)

    results = run(_with_clock(model, BatchingConfig(max_batch_size=4), body))
    assert [float(r["y"][0]) for r in results] == [3.0 * i for i in range(9)]
    assert model.batch_rows == [1, 4, 4]


def test_stopping_while_a_batch_computes_leaves_it_to_its_thread():
    """A batch left computing (a hung model whose replica was cut off) may end after
    the batcher stopped: its outputs go nowhere, and nothing fails on the loop."""
    model = Model(held=True)

    async def body():
        thread = ComputeThread("predict")
        b = DynamicBatcher(model, BatchingConfig(), thread, FakeClock())
        b.start()
        future = b.submit(rows(1), 1, 5.0)
        await model.computing()
        b.abandon(ModelError("cut off"))
        await b.stop()
        model.release.set()
        # the thread's next call runs once the batch ended and its delivery was posted
        await asyncio.get_running_loop().run_in_executor(thread, int)
        await settle()
        thread.shutdown()
        with pytest.raises(ModelError, match="cut off"):
            await future
        return b.busy_since

    assert run(body()) is not None  # as far as it knows, its thread is still taken


def test_abandon_fails_the_batch_computing_and_the_requests_waiting():
    model = Model(held=True)

    async def body(b, clock):
        computing = b.submit(rows(1), 1, 5.0)
        await model.computing()
        waiting = [b.submit(rows(1), 1, 5.0) for _ in range(3)]
        b.abandon(ModelError("ran past its time budget"))
        outcomes = await asyncio.gather(computing, *waiting, return_exceptions=True)
        model.release.set()
        return outcomes

    outcomes = run(_with_clock(model, BatchingConfig(), body))
    assert [type(o) for o in outcomes] == [ModelError] * 4


def test_a_model_that_exits_fails_its_batch_only():
    """``sys.exit()`` in a model (BaseException, on its thread) fails its requests; the
    batcher goes on."""

    def predict(inputs):
        if (inputs["x"] < 0).any():
            raise SystemExit(3)
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b, clock):
        with pytest.raises(SystemExit):
            await b.submit(rows(1, -1.0), 1, 5.0)
        return await b.submit(rows(1), 1, 5.0)

    assert float(run(_with_clock(predict, BatchingConfig(), body))["y"][0]) == 3.0


def test_requests_whose_columns_do_not_stack_are_computed_one_by_one():
    model = Model(held=True)

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await model.computing()
        narrow = b.submit({"x": np.ones((1, 3), np.float32)}, 1, 5.0)
        wide = b.submit({"x": np.ones((1, 5), np.float32)}, 1, 5.0)
        model.release.set()
        return await asyncio.wait_for(asyncio.gather(first, narrow, wide), 5)

    results = run(_with_clock(model, BatchingConfig(), body))
    assert [float(r["y"][0]) for r in results] == [3.0, 3.0, 5.0]
    assert model.batch_rows == [1, 1, 1]
