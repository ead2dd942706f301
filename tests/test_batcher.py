"""Unit tests of the dynamic batcher: no sockets, no processes."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from inferd.config import BatchingConfig
from inferd.errors import InvalidInput, Overloaded, RequestTimeout
from inferd.serving.batcher import NAMED_PRIORITIES, DynamicBatcher, named_levels
from tests.clocks import FakeClock, settle


class Recorder:
    """A predict function that records batch sizes and can be slowed or failed."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.batch_rows: list[int] = []
        self.delay_s = delay_s
        self.fail = fail
        self.threads: set[str] = set()

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.add(threading.current_thread().name)
        x = inputs["x"]
        self.batch_rows.append(len(x))
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise ValueError("model exploded")
        return {"y": x.sum(axis=1)}


def run(coro):
    return asyncio.run(coro)


async def _with_batcher(predict, config, body):
    executor = ThreadPoolExecutor(1, thread_name_prefix="predict")
    batcher = DynamicBatcher(predict, config, executor)
    batcher.start()
    try:
        return await body(batcher)
    finally:
        await batcher.stop()
        executor.shutdown()


def rows(n: int, value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((n, 3), value, dtype=np.float32)}


def test_concurrent_requests_become_few_batches_and_results_split_correctly():
    rec = Recorder(delay_s=0.01)

    async def body(b):
        futures = [b.submit(rows(1, float(i)), 1, 5.0) for i in range(64)]
        return await asyncio.gather(*futures)

    results = run(_with_batcher(rec, BatchingConfig(max_batch_size=16, max_wait_ms=20), body))
    assert [float(r["y"][0]) for r in results] == [3.0 * i for i in range(64)]
    assert sum(rec.batch_rows) == 64
    assert len(rec.batch_rows) <= 6  # 64 rows in batches of at most 16
    assert max(rec.batch_rows) == 16
    assert rec.threads == {"predict_0"}  # model code never on the event loop thread


def test_max_batch_size_counts_rows_not_requests():
    rec = Recorder()

    async def body(b):
        futures = [b.submit(rows(10), 10, 5.0) for _ in range(4)]
        return await asyncio.gather(*futures)

    results = run(_with_batcher(rec, BatchingConfig(max_batch_size=25, max_wait_ms=50), body))
    assert all(r["y"].shape == (10,) for r in results)
    assert all(n <= 25 for n in rec.batch_rows)
    assert rec.batch_rows[0] == 20


def test_request_larger_than_max_batch_is_computed_in_pieces_joined_in_order():
    rec = Recorder()

    async def body(b):
        x = {"x": np.arange(300, dtype=np.float32).reshape(100, 3)}
        return await b.submit(x, 100, 5.0)

    result = run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=1), body))
    assert result["y"].tolist() == [float(3 * i + 3 * i + 1 + 3 * i + 2) for i in range(100)]
    assert rec.batch_rows == [8] * 12 + [4]


def test_a_better_priority_goes_between_the_pieces_of_a_large_request():
    """A big low-priority request (a batch job's) holds the model for one batch at most:
    a high-priority request arriving meanwhile is computed next, not after all of it."""
    rec = Recorder(delay_s=0.02)
    order: list[str] = []

    async def body(b):
        big = b.submit(rows(80), 80, 5.0, priority=NAMED_PRIORITIES["batch"])
        big.add_done_callback(lambda _: order.append("big"))
        await asyncio.sleep(0.03)  # the first piece is computing
        urgent = b.submit(rows(1, 2.0), 1, 5.0, priority=NAMED_PRIORITIES["high"])
        urgent.add_done_callback(lambda _: order.append("urgent"))
        started = time.monotonic()
        await urgent
        waited = time.monotonic() - started
        await big
        return waited

    waited = run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=1), body))
    assert order == ["urgent", "big"]
    assert waited < 0.1  # one piece (20 ms) in progress, then its own batch; not 10 pieces


def test_a_failing_piece_fails_the_request_and_drops_the_rest():
    rec = Recorder(fail=True)

    async def body(b):
        with pytest.raises(ValueError, match="exploded"):
            await b.submit(rows(40), 40, 5.0)
        await asyncio.sleep(0.05)
        return b.queued_rows

    assert run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=1), body)) == 0
    assert len(rec.batch_rows) <= 2  # at most the next piece started; the rest never


def test_a_bad_request_fails_alone_not_the_batch_it_was_in():
    def predict(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (inputs["x"] < 0).any():
            raise ValueError("negative")
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b):
        futures = [b.submit(rows(1, v), 1, 5.0) for v in (1.0, -1.0, 2.0, 3.0)]
        return await asyncio.gather(*futures, return_exceptions=True), b.stats.batches

    (outcomes, batches) = run(
        _with_batcher(predict, BatchingConfig(max_batch_size=8, max_wait_ms=20), body)
    )
    assert [float(o["y"][0]) if isinstance(o, dict) else str(o) for o in outcomes] == [
        3.0, "negative", 6.0, 9.0,
    ]  # fmt: skip
    assert batches == 5  # the failed batch of four, then each alone


def test_cancelling_a_large_request_drops_its_pieces():
    rec = Recorder(delay_s=0.02)

    async def body(b):
        big = b.submit(rows(80), 80, 5.0)
        await asyncio.sleep(0.01)
        big.cancel()
        await asyncio.sleep(0.1)
        return b.idle()

    assert run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=1), body))
    assert len(rec.batch_rows) <= 2


def test_window_batching_holds_a_lone_request_at_most_max_wait():
    rec = Recorder()

    async def body(b):
        started = time.monotonic()
        await b.submit(rows(1), 1, 5.0)
        return time.monotonic() - started

    config = BatchingConfig(max_batch_size=32, max_wait_ms=30, adaptive=False)
    elapsed = run(_with_batcher(rec, config, body))
    assert 0.025 <= elapsed < 0.5


def test_zero_wait_dispatches_immediately():
    rec = Recorder()

    async def body(b):
        started = time.monotonic()
        await b.submit(rows(1), 1, 5.0)
        return time.monotonic() - started

    elapsed = run(_with_batcher(rec, BatchingConfig(max_batch_size=32, max_wait_ms=0), body))
    assert elapsed < 0.02


def test_failure_is_set_on_every_request_of_the_batch():
    rec = Recorder(fail=True)

    async def body(b):
        futures = [b.submit(rows(1), 1, 5.0) for _ in range(5)]
        return await asyncio.gather(*futures, return_exceptions=True)

    results = run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=20), body))
    assert len(results) == 5
    assert all(isinstance(r, ValueError) for r in results)


def test_expired_request_is_dropped_before_compute():
    rec = Recorder(delay_s=0.2)

    async def body(b):
        slow = b.submit(rows(1), 1, 5.0)
        await asyncio.sleep(0.01)  # the first batch is now computing
        doomed = b.submit(rows(2), 2, 0.05)
        await slow
        with pytest.raises(RequestTimeout):
            await doomed
        return b.stats

    stats = run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=0), body))
    assert rec.batch_rows == [1]
    assert stats.expired == 1


def test_cancelled_request_is_not_computed():
    rec = Recorder(delay_s=0.1)

    async def body(b):
        first = b.submit(rows(1), 1, 5.0)
        await asyncio.sleep(0.01)
        cancelled = b.submit(rows(4), 4, 5.0)
        cancelled.cancel()
        await first
        await b.submit(rows(1), 1, 5.0)

    run(_with_batcher(rec, BatchingConfig(max_batch_size=8, max_wait_ms=0), body))
    assert 4 not in rec.batch_rows and 5 not in rec.batch_rows


def test_queue_bound_rejects_with_overloaded():
    rec = Recorder(delay_s=0.05)

    async def body(b):
        accepted = [b.submit(rows(4), 4, 5.0) for _ in range(2)]
        with pytest.raises(Overloaded) as info:
            b.submit(rows(4), 4, 5.0)
        await asyncio.gather(*accepted)
        return info.value

    err = run(
        _with_batcher(rec, BatchingConfig(max_batch_size=4, max_wait_ms=0, max_queue_rows=8), body)
    )
    assert err.status_code == 503
    assert err.details["max_queue_rows"] == 8


def test_wrong_output_rows_fail_the_batch():
    def bad(inputs):
        return {"y": np.zeros(1)}

    async def body(b):
        return await asyncio.gather(b.submit(rows(3), 3, 5.0), return_exceptions=True)

    (result,) = run(_with_batcher(bad, BatchingConfig(max_wait_ms=0), body))
    assert isinstance(result, ValueError)
    assert "expected 3 rows" in str(result)


def test_priority_levels_are_served_best_first_and_fifo_within_a_level():
    """While one batch computes, requests of levels 3, 2 (default) and 1 queue up; the
    next batches take level 1, then the default level, then level 3."""
    seen: list[float] = []

    def predict(inputs):
        seen.extend(inputs["x"][:, 0].tolist())
        time.sleep(0.05)
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b):
        first = b.submit(rows(1, 0), 1, 5.0)
        await asyncio.sleep(0.01)  # the first batch is computing now
        order = [(3, 31), (0, 21), (1, 11), (3, 32), (2, 22), (1, 12)]
        futures = [b.submit(rows(1, value), 1, 5.0, priority) for priority, value in order]
        await asyncio.gather(first, *futures)

    run(_with_batcher(predict, BatchingConfig(max_batch_size=2, max_wait_ms=0), body))
    assert seen == [0, 11, 12, 21, 22, 31, 32]


def test_priority_outside_the_levels_is_refused():
    async def body(b):
        with pytest.raises(InvalidInput, match="priority 5 is not a level"):
            b.submit(rows(1), 1, 1.0, 5)
        return await b.submit(rows(1), 1, 1.0, 4)

    out = run(_with_batcher(Recorder(), BatchingConfig(max_wait_ms=0), body))
    assert out["y"].tolist() == [3.0]


def test_default_priority_must_be_a_level():
    with pytest.raises(ValueError, match="default_priority 5 is above priority_levels 4"):
        BatchingConfig(default_priority=5)
    assert named_levels(BatchingConfig()) == {"high": 1, "normal": 2, "low": 3, "batch": 4}
    assert named_levels(BatchingConfig(priority_levels=1, default_priority=1)) == dict.fromkeys(
        ("high", "normal", "low", "batch"), 1
    )


class Gate:
    """A model whose first batch blocks until released, so a queue can be filled."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[float] = []

    def __call__(self, inputs):
        self.release.wait(5)
        self.seen.extend(inputs["x"][:, 0].tolist())
        return {"y": inputs["x"].sum(axis=1)}


def test_low_priority_is_refused_past_its_share_of_the_queue():
    gate = Gate()
    config = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_rows=8)

    async def body(b):
        running = b.submit(rows(1, 0), 1, 5.0)
        await asyncio.sleep(0.02)  # computing, blocked: the queue is empty
        low = [b.submit(rows(1, 30 + i), 1, 5.0, NAMED_PRIORITIES["low"]) for i in range(4)]
        with pytest.raises(Overloaded, match="priority low is refused while 4 or more") as info:
            b.submit(rows(1, 39), 1, 5.0, NAMED_PRIORITIES["low"])
        assert info.value.retry_after_s >= 1
        with pytest.raises(Overloaded, match="priority batch is refused while 2 or more"):
            b.submit(rows(1, 40), 1, 5.0, NAMED_PRIORITIES["batch"])
        normal = [b.submit(rows(1, 20 + i), 1, 5.0) for i in range(5)]  # the 5th sheds a low
        gate.release.set()
        return await asyncio.gather(running, *low, *normal, return_exceptions=True)

    out = run(_with_batcher(gate, config, body))
    assert [type(o).__name__ for o in out[1:5]] == ["dict"] * 3 + ["Overloaded"]
    assert gate.seen == [0, 20, 21, 22, 23, 24, 30, 31, 32]


def test_a_high_priority_request_takes_the_place_of_the_newest_worse_ones():
    gate = Gate()
    config = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_rows=4, low_queue_share=1)

    async def body(b):
        running = b.submit(rows(1, 0), 1, 5.0)
        await asyncio.sleep(0.02)
        normal = [b.submit(rows(1, 20 + i), 1, 5.0) for i in range(2)]
        low = [b.submit(rows(1, 30 + i), 1, 5.0, NAMED_PRIORITIES["low"]) for i in range(2)]
        high = [b.submit(rows(1, 10 + i), 1, 5.0, NAMED_PRIORITIES["high"]) for i in range(3)]
        assert b.queued_rows == 4 and b.stats.shed == 3  # both low, then the newest normal
        high.append(b.submit(rows(1, 13), 1, 5.0, NAMED_PRIORITIES["high"]))
        with pytest.raises(Overloaded, match="queue is full"):  # nothing worse is left
            b.submit(rows(1, 14), 1, 5.0, NAMED_PRIORITIES["high"])
        gate.release.set()
        return await asyncio.gather(running, *normal, *low, *high, return_exceptions=True)

    out = run(_with_batcher(gate, config, body))
    assert all(isinstance(o, Overloaded) for o in out[1:5])
    assert "higher-priority" in str(out[1])
    assert gate.seen == [0, 10, 11, 12, 13]


def test_shed_counts_are_kept_by_priority_name():
    gate = Gate()
    config = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_rows=2)

    async def body(b):
        running = b.submit(rows(1, 0), 1, 5.0)
        await asyncio.sleep(0.02)
        queued = [b.submit(rows(1, i), 1, 5.0, NAMED_PRIORITIES["low"]) for i in range(1)]
        for _ in range(2):
            with pytest.raises(Overloaded):
                b.submit(rows(1, 9), 1, 5.0, NAMED_PRIORITIES["batch"])
        queued += [b.submit(rows(1, 5), 1, 5.0, 1) for _ in range(2)]  # sheds the low one
        gate.release.set()
        await asyncio.gather(running, *queued, return_exceptions=True)
        return b.shed_counts()

    assert run(_with_batcher(gate, config, body)) == {"low": 1, "batch": 2}


def _texts(lengths: list[int]) -> dict[str, np.ndarray]:
    """A text-model request: one row per length, each row its length (as a runtime's
    prepared ids would be)."""
    return {"x": np.asarray([[n, 0, 0] for n in lengths], dtype=np.float32)}


def _by_length(delay_s: float = 0.0, scale: int = 1):
    """A predict function recording each batch's row lengths; it answers each row's
    length times ``scale``."""
    batches: list[list[int]] = []

    def predict(inputs):
        batches.append(inputs["x"][:, 0].astype(int).tolist())
        time.sleep(delay_s)
        return {"y": inputs["x"][:, 0] * scale}

    return batches, predict


def test_length_buckets_batch_similar_lengths_and_count_padding():
    """While one batch computes, short (5-token) and long (200-token) texts queue up
    interleaved; every later batch holds one bucket only, oldest request first, and
    the padding counted is what those batches pad."""
    batches, predict = _by_length(0.03)

    async def body(b):
        first = b.submit(_texts([7]), 1, 5.0, lengths=np.asarray([7]))
        await asyncio.sleep(0.01)  # the first batch is computing now
        lengths = [5, 200, 6, 180, 5, 210, 4, 190] * 4
        futures = [b.submit(_texts([n]), 1, 5.0, lengths=np.asarray([n])) for n in lengths]
        results = await asyncio.gather(first, *futures)
        return b.stats, [int(r["y"][0]) for r in results[1:]], lengths

    stats, answered, lengths = run(
        _with_batcher(predict, BatchingConfig(max_batch_size=64, max_wait_ms=0), body)
    )
    assert answered == lengths  # every request got its own row back
    assert batches[0] == [7]
    assert batches[1] == [5, 6, 5, 4] * 4  # the oldest (short) bucket, in arrival order
    assert batches[2] == [200, 180, 210, 190] * 4
    assert stats.tokens == 7 + sum(lengths)
    assert stats.padded_tokens == 7 + 16 * 6 + 16 * 210
    assert stats.as_dict()["padded_tokens"] == stats.padded_tokens


def test_without_length_buckets_texts_of_any_length_share_a_batch():
    batches, predict = _by_length(0.03)

    async def body(b):
        first = b.submit(_texts([7]), 1, 5.0, lengths=np.asarray([7]))
        await asyncio.sleep(0.01)
        lengths = [5, 200, 6, 180]
        await asyncio.gather(
            first, *(b.submit(_texts([n]), 1, 5.0, lengths=np.asarray([n])) for n in lengths)
        )
        return b.stats

    config = BatchingConfig(max_batch_size=64, max_wait_ms=0, length_buckets=[])
    stats = run(_with_batcher(predict, config, body))
    assert batches == [[7], [5, 200, 6, 180]]
    assert stats.padded_tokens == 7 + 4 * 200  # the short texts padded to 200


def test_a_long_request_is_split_into_pieces_of_similar_lengths_and_rejoined_in_order():
    batches, predict = _by_length(scale=10)

    lengths = [50, 3, 40, 4, 60, 2, 30, 5]

    async def body(b):
        return await b.submit(_texts(lengths), len(lengths), 5.0, lengths=np.asarray(lengths))

    result = run(_with_batcher(predict, BatchingConfig(max_batch_size=4, max_wait_ms=0), body))
    assert result["y"].astype(int).tolist() == [10 * n for n in lengths]
    assert batches == [[2, 3, 4, 5], [30, 40, 50, 60]]


def test_the_oldest_request_is_never_passed_over_by_its_bucket_rule():
    """Long texts keep arriving; a lone short one still goes in the next batch."""
    batches, predict = _by_length(0.02)

    async def body(b):
        first = b.submit(_texts([100]), 1, 5.0, lengths=np.asarray([100]))
        await asyncio.sleep(0.005)
        short = b.submit(_texts([3]), 1, 5.0, lengths=np.asarray([3]))
        longs = [b.submit(_texts([100]), 1, 5.0, lengths=np.asarray([100])) for _ in range(8)]
        await asyncio.gather(first, short, *longs)

    run(_with_batcher(predict, BatchingConfig(max_batch_size=64, max_wait_ms=0), body))
    assert batches == [[100], [3], [100] * 8]


# -- on a clock the test moves ------------------------------------------------------------


async def _with_clock(predict, config, body):
    clock = FakeClock()
    executor = ThreadPoolExecutor(1, thread_name_prefix="predict")
    batcher = DynamicBatcher(predict, config, executor, clock)
    batcher.start()
    try:
        return await body(batcher, clock)
    finally:
        await batcher.stop()
        executor.shutdown()


def test_an_idle_replica_computes_a_request_at_once_whatever_max_wait():
    rec = Recorder()

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await asyncio.wait_for(first, 5)  # the clock never moves: no window to wait out
        second = b.submit(rows(2), 2, 5.0)
        await asyncio.wait_for(second, 5)

    run(_with_clock(rec, BatchingConfig(max_batch_size=32, max_wait_ms=10_000), body))
    assert rec.batch_rows == [1, 2]


def test_requests_arriving_in_one_instant_share_the_idle_replicas_batch():
    rec = Recorder()

    async def body(b, clock):
        futures = [b.submit(rows(1), 1, 5.0) for _ in range(5)]  # one socket read's frames
        await asyncio.wait_for(asyncio.gather(*futures), 5)

    run(_with_clock(rec, BatchingConfig(max_batch_size=32, max_wait_ms=10_000), body))
    assert rec.batch_rows == [5]


def test_a_busy_replica_gathers_the_next_batch_while_it_computes():
    release = threading.Event()
    seen: list[int] = []

    def predict(inputs):
        seen.append(len(inputs["x"]))
        if len(seen) == 1:
            release.wait(5)  # the first batch computes until the test lets it go
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await settle()
        while not b.busy:
            await asyncio.sleep(0.001)
        later = [b.submit(rows(2), 2, 5.0) for _ in range(3)]  # arrive during the compute
        await settle()
        assert seen == [1]  # they wait for the batch ahead of them, not for a window
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *later), 5)

    run(_with_clock(predict, BatchingConfig(max_batch_size=32, max_wait_ms=10_000), body))
    assert seen == [1, 6]  # one batch of what gathered; the clock never moved


def test_a_busy_replicas_next_batch_is_bounded_by_max_batch_size_and_priority():
    release = threading.Event()
    seen: list[list[float]] = []

    def predict(inputs):
        seen.append(inputs["x"][:, 0].tolist())
        if len(seen) == 1:
            release.wait(5)
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b, clock):
        first = b.submit(rows(1, 0), 1, 5.0)
        while not b.busy:
            await asyncio.sleep(0.001)
        low = [b.submit(rows(1, 3), 1, 5.0, priority=3) for _ in range(2)]
        normal = [b.submit(rows(1, 2), 1, 5.0) for _ in range(2)]
        high = b.submit(rows(1, 1), 1, 5.0, priority=1)
        await settle()
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *low, *normal, high), 5)

    run(_with_clock(predict, BatchingConfig(max_batch_size=3, max_wait_ms=10_000), body))
    assert seen == [[0.0], [1.0, 2.0, 2.0], [3.0, 3.0]]


def test_a_deadline_that_passes_behind_a_busy_batch_fails_without_computing():
    release = threading.Event()
    seen: list[int] = []

    def predict(inputs):
        seen.append(len(inputs["x"]))
        if len(seen) == 1:
            release.wait(5)
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        while not b.busy:
            await asyncio.sleep(0.001)
        doomed = b.submit(rows(1), 1, 0.05)
        kept = b.submit(rows(2), 2, 5.0)
        await clock.advance(0.1)  # its deadline passes while the first batch computes
        release.set()
        with pytest.raises(RequestTimeout):
            await asyncio.wait_for(doomed, 5)
        await asyncio.wait_for(asyncio.gather(first, kept), 5)
        return b.stats

    stats = run(_with_clock(predict, BatchingConfig(max_batch_size=8), body))
    assert seen == [1, 2] and stats.expired == 1


def test_under_load_adaptive_batching_waits_for_fuller_batches():
    seen: list[int] = []
    clock = FakeClock()

    def predict(inputs):  # a batch of one row takes 8 ms, a fuller one 1 ms (on the clock)
        seen.append(len(inputs["x"]))
        clock.t += 0.008 if len(inputs["x"]) <= 2 else 0.001
        return {"y": inputs["x"].sum(axis=1)}

    async def body(b):
        await asyncio.wait_for(b.submit(rows(1), 1, 5.0), 5)  # idle: at once, 8 ms
        assert b.load() < 1
        futures = []
        for _ in range(600):  # 10,000 requests/s: one by one they would need 80 s a second
            futures.append(b.submit(rows(1), 1, 5.0))
            clock.t += 0.0001
        assert b.load() > 1
        for _ in range(500):  # (the batches compute on the executor thread)
            if len(seen) == 10 and b.idle() is False and not b.busy:
                break
            await asyncio.sleep(0.002)
        await settle()
        assert seen == [1, *[64] * 9]  # full batches go at once
        assert not futures[-1].done()  # the last 24 rows wait for companions (20 ms)
        await clock.advance(0.02)
        await asyncio.wait_for(asyncio.gather(*futures), 5)

    async def main():
        executor = ThreadPoolExecutor(1, thread_name_prefix="predict")
        config = BatchingConfig(max_batch_size=64, max_wait_ms=20)
        batcher = DynamicBatcher(predict, config, executor, clock)
        batcher.start()
        try:
            await body(batcher)
        finally:
            await batcher.stop()
            executor.shutdown()

    run(main())
    assert seen == [1, *[64] * 9, 24]


def test_a_batch_waits_max_wait_on_the_clock_then_goes():
    rec = Recorder()

    async def body(b, clock):
        first = b.submit(rows(1), 1, 5.0)
        await settle()
        await clock.advance(0.029)
        assert rec.batch_rows == [] and not first.done()  # the window is still open
        second = b.submit(rows(2), 2, 5.0)  # joins the open batch
        await clock.advance(0.001)
        await asyncio.wait_for(asyncio.gather(first, second), 5)

    run(_with_clock(rec, BatchingConfig(max_batch_size=32, max_wait_ms=30, adaptive=False), body))
    assert rec.batch_rows == [3]


def test_a_full_batch_does_not_wait_for_the_clock():
    rec = Recorder()

    async def body(b, clock):
        futures = [b.submit(rows(2), 2, 5.0) for _ in range(4)]  # 8 rows: full
        await asyncio.wait_for(asyncio.gather(*futures), 5)  # no advance needed

    run(
        _with_clock(rec, BatchingConfig(max_batch_size=8, max_wait_ms=10_000, adaptive=False), body)
    )
    assert rec.batch_rows == [8]


def test_a_deadline_that_passes_in_the_window_fails_without_computing():
    rec = Recorder()

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
    stats = run(_with_clock(rec, config, body))
    assert rec.batch_rows == [1] and stats.expired == 1
