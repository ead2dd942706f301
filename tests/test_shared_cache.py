"""The machine's shared result cache (``SQLiteCache``) without a server: what one store
puts another opening the same file gets, entries expire on time, the size bound evicts
the least recently used, a broken or locked file answers misses, two processes writing
at once keep the accounting right, and the server's preparation of the file (fresh at
each start, one file per data folder, a fallback when it cannot be made)."""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import random
import sqlite3
import stat
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from inferd.config import Settings
from inferd.routing.cache import (
    ENTRY_OVERHEAD,
    TOUCH_AFTER_S,
    WAITING_BYTES,
    LocalCache,
    RedisCache,
    SQLiteCache,
    cache_for,
    encode_columns,
    prepare_shared,
    remove_shared,
    shared_file,
)
from tests.clocks import FakeClock

T = TypeVar("T")


def run(test: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """A coroutine test, run on its own loop."""

    @functools.wraps(test)
    def sync(*args: Any, **kwargs: Any) -> T:
        return asyncio.run(test(*args, **kwargs))

    return sync


async def opened(path: Path, max_bytes: int = 4 << 20, **kw: Any) -> SQLiteCache:
    return SQLiteCache(path, max_bytes, **kw)


def answer(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"y": np.random.default_rng(seed).random(n).astype(np.float32)}


def entry_bytes(outputs: dict[str, np.ndarray]) -> int:
    return len(encode_columns(outputs)) + ENTRY_OVERHEAD


@run
async def test_what_one_process_puts_another_gets(tmp_path: Path):
    path = tmp_path / "results.db"
    one, other = await opened(path), await opened(path)
    outputs = {
        "probabilities": np.array([[0.25, 0.75]], dtype=np.float32),
        "label": np.array(["virginica"], dtype=object),
        "count": np.array([3], dtype=np.int64),
    }
    assert await other.get(b"k") is None
    await one.put(b"k", outputs, ttl_s=60)
    assert await one.get(b"k") is not None  # at once here, from memory until written
    await one.settled()  # written by its writer thread: there for every process
    got = await other.get(b"k")
    assert got is not None and got.keys() == outputs.keys()
    for name, array in outputs.items():
        assert got[name].dtype == array.dtype and got[name].tolist() == array.tolist()
    assert (other.hits, other.misses, one.hits, one.misses) == (1, 1, 1, 0)
    large = answer(1 << 16)  # 256 KiB
    await one.put(b"large", large, ttl_s=60)
    await one.settled()
    got = await other.get(b"large")
    assert got is not None and np.array_equal(got["y"], large["y"])
    assert one.bytes == other.bytes == entry_bytes(outputs) + entry_bytes(large)
    for store in (one, other):
        await store.close()


@run
async def test_entries_expire_on_the_clock(tmp_path: Path):
    clock = FakeClock()
    store = await opened(tmp_path / "results.db", clock=clock)
    await store.put(b"short", answer(4), ttl_s=1.0)
    await store.put(b"long", answer(4), ttl_s=100.0)
    await store.settled()
    await clock.advance(0.9)
    assert await store.get(b"short") is not None
    await clock.advance(0.2)
    assert await store.get(b"short") is None
    assert await store.get(b"long") is not None
    await store.close()


@run
async def test_the_size_bound_evicts_the_least_recently_used(tmp_path: Path):
    clock = FakeClock()
    size = entry_bytes(answer(256))
    store = await opened(tmp_path / "results.db", max_bytes=10 * size, clock=clock)
    for i in range(10):
        await store.put(bytes([i]), answer(256, seed=i), ttl_s=600)
        await store.settled()
        await clock.advance(TOUCH_AFTER_S + 0.1)
    assert len(store) == 10 and store.bytes == 10 * size
    assert await store.get(bytes([0])) is not None  # used: now the most recent
    await store.put(b"new", answer(256), ttl_s=600)
    await store.settled()
    assert len(store) == 10 and store.bytes <= 10 * size
    assert await store.get(bytes([1])) is None  # the least recently used went
    assert await store.get(bytes([0])) is not None and await store.get(b"new") is not None
    # One answer over an eighth of the bound is not kept at all.
    await store.put(b"huge", answer(2 * 256), ttl_s=600)
    await store.settled()
    assert await store.get(b"huge") is None and len(store) == 10
    await store.close()


@run
async def test_a_corrupt_file_answers_misses_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    path = tmp_path / "results.db"
    store = await opened(path)
    for i in range(50):  # (900 B each: about four to a page)
        await store.put(bytes([i]), answer(200, seed=i), ttl_s=600)
    await store.close()  # all in the file now
    store = await opened(path)
    assert await store.get(bytes([3])) is not None
    with path.open("r+b") as f:  # broken under the running store
        f.write(b"\xff" * path.stat().st_size)
    with caplog.at_level(logging.WARNING, logger="inferd.routing.cache"):
        assert await store.get(bytes([40])) is None  # a page it has not read yet
        await store.put(b"new", answer(4), ttl_s=600)
        await store.settled()  # (the writer thread failed to write it)
        assert await store.get(b"new") is not None  # this process keeps it in memory
    assert store.errors >= 2 and store.misses == 1
    warnings = [r for r in caplog.records if "result cache" in r.getMessage()]
    assert len(warnings) == 1, "one warning a minute, not one per request"
    await store.close()
    # A gateway process starting on the broken file keeps its own LRU instead.
    settings = Settings(data_dir=tmp_path, cache={"enabled": True, "dir": tmp_path})
    path.rename(shared_file(settings))
    with pytest.raises(sqlite3.DatabaseError):
        await opened(shared_file(settings))
    assert isinstance(cache_for(settings), LocalCache)


@run
async def test_a_stuck_writer_never_makes_the_loop_wait(tmp_path: Path):
    path = tmp_path / "results.db"
    store, other = await opened(path, max_bytes=64 << 20), await opened(path)
    await store.put(b"k", answer(4), ttl_s=60)
    await store.settled()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holding the write lock
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await store.get(b"k") is not None  # readers do not wait for writers
    answers = 2 * WAITING_BYTES // (1 << 16)
    for i in range(answers):  # 64 KiB each: up to WAITING_BYTES wait, the rest are skipped
        await store.put(b"answer %d" % i, answer(1 << 14, seed=i), ttl_s=60)
    assert loop.time() - start < 0.5, "the event loop never waits for the lock"
    assert answers // 3 < store.skipped < answers * 2 // 3
    assert await store.get(b"answer 0") is not None  # this process has them meanwhile,
    assert await other.get(b"answer 0") is None  # the others once they are written:
    holder.execute("COMMIT")
    holder.close()
    await store.settled()
    assert await other.get(b"answer 0") is not None
    assert len(store) == 1 + answers - store.skipped and store.errors == 0
    for s in (store, other):
        await s.close()


BOUND = 256 << 10


def _writer(path: str, seed: int, n: int) -> None:
    async def write() -> int:
        store = SQLiteCache(Path(path), BOUND)
        rng = random.Random(seed)
        for i in range(n):
            key = rng.randbytes(20)
            await store.put(key, answer(rng.randrange(1, 64), seed=i), ttl_s=600)
            await asyncio.sleep(0)  # (a server's loop runs between requests)
            await store.get(key)
        await store.close()
        return store.errors

    sys.exit(asyncio.run(write()))


def test_two_processes_writing_at_once_keep_the_bound(tmp_path: Path):
    path = tmp_path / "results.db"
    asyncio.run(SQLiteCache(path, BOUND).close())
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=_writer, args=(str(path), s, 1500)) for s in (1, 2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0, "a writer had errors"
    db = sqlite3.connect(path)
    ((count, stored, total),) = db.execute(
        "SELECT count(*), sum(size), (SELECT bytes FROM total) FROM entries"
    ).fetchall()
    db.close()
    # About 1 MB written: the bound held for both together, and each process's count
    # of the bytes stayed exact (a trigger, in the writer's transaction).
    assert total == stored and BOUND - 1000 < total <= BOUND
    assert count > 500


def test_the_server_makes_the_file_fresh_per_data_folder(tmp_path: Path):
    one = Settings(data_dir=tmp_path / "one", cache={"enabled": True})
    two = Settings(data_dir=tmp_path / "two", cache={"enabled": True})
    path = prepare_shared(one)
    assert path is not None and one.cache.dir is not None and path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert prepare_shared(two) != path  # another server on this machine: its own file

    async def fill_then_restart() -> None:
        store = cache_for(one)
        assert isinstance(store, SQLiteCache) and store.path == path
        await store.put(b"k", answer(4), ttl_s=600)
        await store.close()
        again = Settings(data_dir=tmp_path / "one", cache={"enabled": True})
        assert prepare_shared(again) == path  # the same file, made fresh:
        fresh = cache_for(again)
        assert await fresh.get(b"k") is None
        await fresh.close()

    asyncio.run(fill_then_restart())
    remove_shared(path)
    remove_shared(shared_file(two))
    assert not path.exists()


def test_without_a_shared_file_each_process_keeps_its_own(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = Settings(data_dir=tmp_path, cache={"enabled": True, "dir": blocker / "cache"})
    assert prepare_shared(settings) is None and settings.cache.dir is None
    assert isinstance(cache_for(settings), LocalCache)
    # The in-process tier before preparing, and Redis: nothing to prepare.
    assert isinstance(cache_for(Settings(data_dir=tmp_path)), LocalCache)
    redis = Settings(data_dir=tmp_path, cache={"enabled": True}, redis_url="redis://127.0.0.1")
    assert prepare_shared(redis) is None
    store = cache_for(redis)
    assert isinstance(store, RedisCache)
    asyncio.run(store.close())
