"""The job queue's contract on its real backends (a SQLite file, the machine's Redis):
order, leases, redelivery after a lease ends, acknowledgement, several consumers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from inferd.jobs.queue import JobQueue, RedisStreamsQueue, SqliteQueue, queue_for

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def make_queue(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
) -> Callable[[str], JobQueue]:
    """A factory of queues on one backend: each call is another consumer."""
    if request.param == "sqlite":
        return lambda consumer: SqliteQueue(tmp_path / "queue.db", consumer)
    return lambda consumer: RedisStreamsQueue(redis_url, consumer)


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"  # a fresh stream per test on the shared Redis


def run(coro):
    return asyncio.run(coro)


def test_messages_come_in_order_and_once_acknowledged_never_again(make_queue, topic):
    async def scenario() -> None:
        q = make_queue("a")
        await q.put(topic, [b"m0", b"m1", b"m2"])
        assert await q.depth(topic) == 3
        first = await q.take(topic, 2, lease_s=30)
        assert [d.payload for d in first] == [b"m0", b"m1"]
        assert all(d.deliveries == 1 for d in first)
        second = await q.take(topic, 10, lease_s=30)
        assert [d.payload for d in second] == [b"m2"]  # the leased ones are not handed out
        assert await q.take(topic, 10, lease_s=30) == []
        await q.ack(topic, [d.id for d in first + second])
        assert await q.depth(topic) == 0
        await q.close()

    run(scenario())


def test_a_lease_that_ends_delivers_the_message_again_to_another_consumer(make_queue, topic):
    async def scenario() -> None:
        crashed, survivor = make_queue("crashed"), make_queue("survivor")
        await crashed.put(topic, [b"job"])
        taken = await crashed.take(topic, 1, lease_s=0.3)
        assert len(taken) == 1
        assert await survivor.take(topic, 1, lease_s=0.3) == []  # still leased
        await asyncio.sleep(0.5)
        again = await survivor.take(topic, 1, lease_s=0.3)  # consumers share one lease
        assert [d.payload for d in again] == [b"job"]
        assert again[0].deliveries == 2
        await survivor.ack(topic, [again[0].id])
        await asyncio.sleep(0.4)
        assert await crashed.take(topic, 1, lease_s=30) == []  # acknowledged: gone
        assert await survivor.depth(topic) == 0
        await crashed.close()
        await survivor.close()

    run(scenario())


def test_extending_a_lease_keeps_the_message(make_queue, topic):
    async def scenario() -> None:
        worker, other = make_queue("worker"), make_queue("other")
        await worker.put(topic, [b"long"])
        [d] = await worker.take(topic, 1, lease_s=0.4)
        for _ in range(3):
            await asyncio.sleep(0.2)
            await worker.extend(topic, [d.id], lease_s=0.4)
        assert await other.take(topic, 1, lease_s=0.4) == []
        await worker.ack(topic, [d.id])
        await worker.close()
        await other.close()

    run(scenario())


def test_consumers_share_the_messages_without_overlap(make_queue, topic):
    async def scenario() -> None:
        queues = [make_queue(f"c{i}") for i in range(3)]
        await queues[0].put(topic, [f"m{i}".encode() for i in range(60)])
        seen: list[bytes] = []

        async def consume(q: JobQueue) -> None:
            while batch := await q.take(topic, 4, lease_s=30):
                seen.extend(d.payload for d in batch)
                await q.ack(topic, [d.id for d in batch])
                await asyncio.sleep(0)

        await asyncio.gather(*(consume(q) for q in queues))
        assert sorted(seen) == sorted(f"m{i}".encode() for i in range(60))
        for q in queues:
            await q.close()

    run(scenario())


def test_sqlite_takes_up_the_leases_of_a_dead_process_at_once(tmp_path: Path):
    """A server killed with -9 held leases; its successor need not wait for them."""
    path = tmp_path / "queue.db"
    child = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from inferd.jobs.queue import SqliteQueue, consumer_name\n"
        "q = SqliteQueue(Path(sys.argv[1]), consumer_name())\n"
        "async def main():\n"
        "    await q.put('t', [b'a', b'b'])\n"
        "    assert len(await q.take('t', 2, 3600)) == 2\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", child, str(path)], check=True, timeout=60)

    async def scenario() -> None:
        q = SqliteQueue(path, "successor")
        assert await q.take("t", 2, 30) == []  # leased for an hour to a process now gone
        assert q.release_dead() == 2
        assert [d.payload for d in await q.take("t", 2, 30)] == [b"a", b"b"]
        await q.close()

    run(scenario())


def test_queue_urls_name_their_backend(tmp_path: Path):
    assert isinstance(queue_for(f"sqlite:///{tmp_path}/q.db"), SqliteQueue)
    assert isinstance(queue_for(REDIS), RedisStreamsQueue)
    with pytest.raises(ValueError, match="queue URL"):
        queue_for("amqp://localhost")


@pytest.mark.redis
def test_a_runner_polling_redis_stops_promptly(tmp_path: Path, redis_url: str):
    """Stopping lands in the middle of a Redis command now and then: redis-py 8 may
    swallow that cancellation, so the runner stops on its own flag as well."""
    import random
    import time

    from sqlalchemy import create_engine

    from inferd.jobs.runner import JobRunner
    from inferd.jobs.store import JobStore

    async def scenario() -> list[float]:
        took = []
        for i in range(15):
            queue = RedisStreamsQueue(redis_url, f"stopper-{i}")
            store = JobStore(create_engine(f"sqlite:///{tmp_path / 'unused.db'}"))
            runner = JobRunner(store, queue, "http://127.0.0.1:9", "token", poll_s=0.0)
            runner.start()
            await asyncio.sleep(random.uniform(0.01, 0.1))
            started = time.monotonic()
            await asyncio.wait_for(runner.stop(), 10)
            took.append(time.monotonic() - started)
            await asyncio.wait_for(queue.close(), 5)
        return took

    took = run(scenario())
    assert max(took) < 6.0, took
