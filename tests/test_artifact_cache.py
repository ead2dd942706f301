"""The host's artifact cache (inferd.registry.artifact_cache) on a real folder: an entry
is fetched once however many openers race for it, a failed fetch leaves nothing, the
least recently used entries go first past the bound, and never one a process holds; a
verified open (a pod's fetch step) fetches a changed entry again, and a read-only user
(a replica container on a node's cache) holds an entry without writing anything."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from inferd.registry.artifact_cache import ArtifactCache
from inferd.registry.store import digest_of

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


def _version(folder: Path, expression: str) -> tuple[str, list[str]]:
    """A version's folder, its digest, and a fetch that copies it (recording calls)."""
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(f"y = {expression}\n")
    (folder / "weights").mkdir()
    (folder / "weights" / "w.bin").write_bytes(b"\x01" * 1000)
    return digest_of(folder), []


def _copier(folder: Path, calls: list[str]):
    def fetch(scratch: Path) -> int:
        calls.append(scratch.name)
        shutil.copytree(folder, scratch)
        return sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file())

    return fetch


def test_a_verified_open_fetches_a_changed_entry_again(tmp_path: Path) -> None:
    source = tmp_path / "store" / "calc"
    sha, calls = _version(source, "x * 7")
    fetch = _copier(source, calls)
    cache = ArtifactCache(tmp_path / "cache", 10 * MB)
    entry = cache.open(sha, fetch, hold=False).path
    assert len(calls) == 1

    (entry / "model.py").write_text("y = x * 1000\n")  # what a pod writing it could do
    assert cache.open(sha, fetch, hold=False).fetched_bytes == 0  # trusted: one user's host
    assert (entry / "model.py").read_text() == "y = x * 1000\n"
    again = cache.open(sha, fetch, hold=False, verify=True)
    assert len(calls) == 2 and again.fetched_bytes > 0
    assert (entry / "model.py").read_text() == "y = x * 7\n" and digest_of(entry) == sha

    for tamper in (
        lambda: (entry / "weights" / "extra.pth").write_bytes(b"pickle"),  # a file added
        lambda: (entry / "weights" / "w.bin").unlink(),  # one removed
        lambda: os.symlink("/etc/passwd", entry / "model.py.link"),  # a link out of it
    ):
        tamper()
        cache.open(sha, fetch, hold=False, verify=True)
        assert digest_of(entry) == sha and not (entry / "model.py.link").exists()
    assert len(calls) == 5
    assert cache.open(sha, fetch, hold=False, verify=True).fetched_bytes == 0  # intact: kept
    assert len(calls) == 5
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")
    }


def test_a_read_only_user_holds_an_entry_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "store" / "calc"
    sha, calls = _version(source, "x + 1")
    root = tmp_path / "node-cache"
    ArtifactCache(root, 10 * MB).open(sha, _copier(source, calls), hold=False)  # fetch step
    before = _snapshot(root)

    reader = ArtifactCache(root, 10 * MB)  # the replica container: read-only there
    opened = reader.use(sha)
    assert opened.path == root / sha and opened.fetched_bytes == 0
    assert (opened.path / "model.py").read_text() == "y = x + 1\n"
    assert _snapshot(root) == before  # no lock file made, no mtime touched, nothing evicted
    assert ArtifactCache(root, 1).evict() == []  # held: another pod's fetch step keeps it
    reader.close()
    assert ArtifactCache(root, 1).evict() == [sha]
    with pytest.raises(FileNotFoundError, match=f"has no {sha}"):
        reader.use(sha)  # evicted: the pod fetches into its own folder instead
    with pytest.raises(FileNotFoundError, match="has no"):
        reader.use("f" * 64)  # never fetched
