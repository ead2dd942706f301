"""The host's artifact cache (inferd.registry.artifact_cache) on a real folder: an entry
is fetched once however many openers race for it, a failed fetch leaves nothing, the
least recently used entries go first past the bound, and never one a process holds."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from inferd.registry.artifact_cache import ArtifactCache

MB = 1 << 20


def filler(size: int, calls: list[str] | None = None, delay_s: float = 0.0):
    def fetch(folder: Path) -> int:
        if calls is not None:
            calls.append(folder.name)
        time.sleep(delay_s)
        folder.mkdir()
        (folder / "model.bin").write_bytes(b"x" * size)
        return size

    return fetch


def test_racing_openers_fetch_an_entry_once(tmp_path: Path) -> None:
    calls: list[str] = []
    opened = []
    caches = []

    def open_it() -> None:
        cache = ArtifactCache(tmp_path, 10 * MB)  # each opener its own, as replicas are
        caches.append(cache)
        opened.append(cache.open("a" * 64, filler(1000, calls, delay_s=0.2)))

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(o.fetched_bytes for o in opened) == [0, 0, 0, 1000]
    assert all((o.path / "model.bin").stat().st_size == 1000 for o in opened)
    assert not list(tmp_path.glob(".fetch-*"))
    for cache in caches:
        cache.close()


def test_a_failed_fetch_leaves_nothing_and_the_next_open_fetches_again(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, 10 * MB)

    def broken(folder: Path) -> int:
        folder.mkdir()
        (folder / "half").write_bytes(b"x")
        raise OSError("the store went away")

    with pytest.raises(OSError, match="went away"):
        cache.open("b" * 64, broken)
    left = [p.name for p in tmp_path.iterdir() if not p.name.endswith((".fetch", ".use"))]
    assert left == []  # no entry, no size record, no scratch folder
    assert cache.open("b" * 64, filler(10), hold=False).fetched_bytes == 10


def test_least_recently_used_entries_go_first_and_held_ones_never(tmp_path: Path) -> None:
    holder = ArtifactCache(tmp_path, 10 * MB)
    old, new = "1" * 64, "2" * 64
    holder.open(old, filler(3 * MB))
    holder.open(new, filler(3 * MB))
    os.utime(tmp_path / old, (1, 1))  # used long ago

    small = ArtifactCache(tmp_path, 5 * MB)  # another process, with a smaller bound
    assert small.evict() == []  # over the bound, but both are in use
    holder.close()  # those replicas stopped
    assert small.evict() == [old]  # the least recently used goes, until it fits
    assert not (tmp_path / old).exists() and (tmp_path / new / "model.bin").exists()
    assert small.size_bytes() == 3 * MB

    third = "3" * 64
    small.open(third, filler(3 * MB))  # held by ``small``: over the bound, the other goes
    assert not (tmp_path / new).exists() and (tmp_path / third).exists()
    small.close()


def test_a_seeded_entry_is_a_hit_without_a_fetch(tmp_path: Path) -> None:
    source = tmp_path / "store" / "calc" / "v1"
    source.mkdir(parents=True)
    (source / "model.py").write_text("print('hi')")
    cache = ArtifactCache(tmp_path / "cache", 10 * MB)
    cache.seed("c" * 64, source)

    def no_fetch(folder: Path) -> int:
        raise AssertionError("fetched a seeded entry")

    opened = cache.open("c" * 64, no_fetch)
    assert opened.fetched_bytes == 0
    assert (opened.path / "model.py").read_text() == "print('hi')"
    assert (opened.path / "model.py").stat().st_ino == (source / "model.py").stat().st_ino
    cache.close()
