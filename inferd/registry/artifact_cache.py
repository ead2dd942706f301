"""A host's cache of artifacts fetched from an object store, by content (sha256).

Every replica on a host whose version's files live in an S3-compatible store opens its
files here (``artifact_cache.dir``: by default ``<data_dir>/artifact-cache``; one folder
several servers, joined replicas or pods of a node share — a hostPath in the Helm
chart — makes them share one download). Layout::

    <sha256>/            the version's files, exactly those of its registered digest
    <sha256>.json        their total size, for the bound
    <sha256>.fetch       flock: one process fetches an entry, the others wait for it
    <sha256>.use         flock: held shared by every process that uses the entry
    .fetch-<hex>/        a download in progress (renamed into place once checked)

Rules: an entry appears whole (checked file by file and as a whole against the
registered digest before its rename) and is never changed by inferd; an entry's mtime is
its last use (least recently used first out); the total is kept under ``max_bytes`` by
removing the least recently used entries that no process holds (``.use`` taken
exclusively without waiting), never one in use.

Who may write it is who it trusts. Processes of one user on one host (``inferd serve``'s
replicas, joined replicas) trust a hit without hashing it again: any of them could
change the data folder anyway. Where the writers are not one trust domain — the replica
pods of a Kubernetes node, each running its own version's code — the cache is mounted
read-only into the replicas (:meth:`ArtifactCache.use`: nothing fetched, touched or
evicted there) and written only by each pod's fetch step, which opens with ``verify``:
a cached entry is hashed again against its name, and one that does not match (changed
since its fetch) is replaced by a fresh download.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from inferd.registry.store import digest_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Opened:
    """An entry in use by this process (held until :meth:`ArtifactCache.close`)."""

    path: Path
    fetched_bytes: int
    """Bytes downloaded to open it (0: it was cached)."""
    seconds: float


class ArtifactCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._held: list[IO[bytes]] = []

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def open(
        self, sha256: str, fetch: Callable[[Path], int], hold: bool = True, verify: bool = False
    ) -> Opened:
        """The entry for ``sha256``, fetched unless the host has it: ``fetch(folder)``
        fills a new folder with the checked files and returns their size. With ``hold``
        the entry is never evicted until :meth:`close` or the process ends (a replica
        runs from it); without, it may be once this returns (a download reads it at
        once: an eviction meanwhile renames it aside whole, and open files stay
        readable). With ``verify`` a cached entry is hashed again first, and fetched
        anew when its files are not those of ``sha256`` (see the module)."""
        began = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        entry = self.path(sha256)
        use = self._lock(sha256, "use", fcntl.LOCK_SH)  # waits out an eviction under way
        fetched = 0
        with self._locked(sha256, "fetch"):
            if verify and entry.is_dir() and not intact(entry, sha256):
                logger.warning(
                    "artifact cache: %s no longer holds the files of its digest (changed "
                    "since it was fetched); fetching them again", entry,
                )  # fmt: skip
                self._remove(sha256)
            if not entry.is_dir():
                scratch = self.root / f".fetch-{uuid.uuid4().hex}"
                meta = self.root / f"{sha256}.json"
                try:
                    fetched = fetch(scratch)
                    meta.write_text(json.dumps({"size_bytes": fetched}))
                    os.rename(scratch, entry)
                except BaseException:
                    meta.unlink(missing_ok=True)
                    use.close()
                    raise
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
            os.utime(entry)
        if hold:
            self._held.append(use)
        else:
            use.close()
        self.evict()
        return Opened(entry, fetched, time.monotonic() - began)

    def use(self, sha256: str) -> Opened:
        """The entry for ``sha256``, held as :meth:`open` holds it, from a cache this
        process may not write (a replica pod's read-only view of its node's cache, which
        the pod's fetch step filled): nothing is fetched, touched or evicted, and the
        lock files are opened for reading. FileNotFoundError when the entry is not there
        (never fetched, or evicted since)."""
        began = time.monotonic()
        try:
            use = open(self.root / f"{sha256}.use", "rb")  # noqa: SIM115 -- held open
        except FileNotFoundError:
            raise FileNotFoundError(f"the artifact cache {self.root} has no {sha256}") from None
        try:
            fcntl.flock(use, fcntl.LOCK_SH)  # waits out an eviction under way
            if not self.path(sha256).is_dir():
                raise FileNotFoundError(f"the artifact cache {self.root} has no {sha256}")
        except BaseException:
            use.close()
            raise
        self._held.append(use)
        return Opened(self.path(sha256), 0, time.monotonic() - began)

    def seed(self, sha256: str, folder: Path) -> None:
        """Put a folder whose files are known to hash to ``sha256`` (a version this host
        just registered) in the cache, as hard links where the filesystem allows."""

        def link(scratch: Path) -> int:
            shutil.copytree(folder, scratch, copy_function=_link_or_copy)
            return sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file())

        try:
            self.open(sha256, link, hold=False)
        except OSError as exc:  # a cache that cannot take it costs a download later
            logger.warning("artifact cache: cannot seed %s: %s", sha256[:12], exc)

    def evict(self) -> list[str]:
        """Remove least recently used entries no process holds until the cache fits its
        bound; the digests removed."""
        entries = []
        for meta in self.root.glob("*.json"):
            sha = meta.name.removesuffix(".json")
            with contextlib.suppress(OSError, ValueError):
                size = int(json.loads(meta.read_text())["size_bytes"])
                entries.append((self.path(sha).stat().st_mtime, sha, size))
        total = sum(size for _, _, size in entries)
        removed = []
        for _, sha, size in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                use = self._lock(sha, "use", fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a replica runs from it
            try:
                self._remove(sha)
            finally:
                use.close()
            total -= size
            removed.append(sha)
            logger.info("artifact cache: evicted %s (%d bytes)", sha[:12], size)
        return removed

    def size_bytes(self) -> int:
        total = 0
        for meta in self.root.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                total += int(json.loads(meta.read_text())["size_bytes"])
        return total

    def _remove(self, sha256: str) -> None:
        """The entry renamed aside whole (a process reading it keeps its open files),
        then deleted."""
        trash = self.root / f".trash-{uuid.uuid4().hex}"
        os.rename(self.path(sha256), trash)
        (self.root / f"{sha256}.json").unlink(missing_ok=True)
        shutil.rmtree(trash, ignore_errors=True)

    def close(self) -> None:
        """Let go of every entry this process holds."""
        for handle in self._held:
            handle.close()
        self._held.clear()

    def _lock(self, sha256: str, kind: str, how: int) -> IO[bytes]:
        handle = open(self.root / f"{sha256}.{kind}", "ab")  # noqa: SIM115 -- held open
        try:
            fcntl.flock(handle, how)
        except BaseException:
            handle.close()
            raise
        return handle

    @contextlib.contextmanager
    def _locked(self, sha256: str, kind: str) -> Iterator[None]:
        handle = self._lock(sha256, kind, fcntl.LOCK_EX)
        try:
            yield
        finally:
            handle.close()


def intact(entry: Path, sha256: str) -> bool:
    """Whether ``entry`` holds exactly the files whose artifact digest is ``sha256``:
    plain files and folders only (a link could lead outside it), hashed again."""
    for folder, dirs, files in os.walk(entry):
        for name in dirs + files:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                return False
    return digest_of(entry) == sha256


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
