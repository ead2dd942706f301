"""The result cache: answers of deterministic predict requests, reused.

Key: BLAKE2b over the model, the version that was actually chosen and its artifact's
sha256 (so a new version, another arm of a split, or a version re-registered with other
files never serves an old answer), and the request's input tensors in their wire form
(name, datatype, shape, bytes: the same values sent as JSON or binary give the same
key). Values: the output arrays.

Three stores behind one ``ResultCache`` protocol, chosen by :func:`cache_for`:

- ``SQLiteCache``, embedded (``inferd serve``, ``inferd gateway``): one SQLite file per
  machine and data folder, shared by all the gateway processes there, so an answer one
  process kept is a hit in the others. The server makes it fresh at each start
  (:func:`prepare_shared`) and removes it when it stops: a cache, whose entries expire
  by the machine's monotonic clock, and a file a crashed run may have left half
  written. (Entries of a replaced artifact could not be served anyway: the key has the
  artifact's digest.) It lives on ``/dev/shm`` when that has room, else under the data
  folder (``cache.dir`` chooses). WAL, ``synchronous=OFF``, and the event loop never
  waits for a lock: a get is one read of a few µs (WAL readers do not wait for
  writers; see ``bench/cache.py``); puts are written behind, the answers of 2 ms in one
  transaction (on the loop, tens of µs; large answers, and checkpoints, by the cache's
  writer thread), so other processes see an answer a few ms after its reply (this one
  at once, from memory). Bounded by
  ``cache.max_bytes`` for the machine: over it, the least recently used entries go,
  "used" being refreshed at most once a second per entry. Each process also keeps its
  most recent answers decoded in memory (up to a sixteenth of ``max_bytes``), so a
  repeated hit costs a dict lookup as with ``LocalCache``, not a read and a decode.
- ``LocalCache``: an LRU in this process, bounded in bytes: where no server prepared a
  shared file, or when it cannot be made or opened (then each process keeps its own,
  as before there was a shared one).
- ``RedisCache`` (``redis_url``): shared across machines, entries with Redis TTLs.

The in-process test tier prepares the shared file as ``inferd serve`` does.

A store that fails never fails a request: it logs (at most once a minute) and answers a
miss. Per model version, ``metadata.cache_ttl_s`` overrides the TTL and 0 turns caching
off for it (a model with randomness, or one reading outside state). Only answers are
cached, never errors, and never an answer a fallback version gave. One answer larger
than an eighth of ``max_bytes`` is not kept.

Nor is a request that names what its replica fetches (an ``s3://`` URI in an image
input, :func:`fetches`): its key would be the URI, not the object, which may be
overwritten under it, and a hit would skip the replica's check of
``images.allowed_buckets``. Keying such a request by the object's ETag would cost a HEAD
to the store in the gateway on every request, hit or miss, and still leave the
allow-list to be applied there as well; not caching it is simpler and cannot be stale.

Generations are cached too when they are deterministic (temperature 0, top_k 1, or a
seed), whole (finished by a stop or the length), and on the base model or an adapter
registered with its version (an adapter loaded at run time may change under its name:
never cached). A hit answers the whole text as one chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import sqlite3
import stat
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np

from inferd.clock import SYSTEM, Clock
from inferd.config import Settings
from inferd.shapes import replica as p
from inferd.shapes.control import VersionRoute
from inferd.shapes.llm import SamplingParams
from inferd.shapes.replica import Columns

if TYPE_CHECKING:
    from inferd.shapes.tensors import Signature

logger = logging.getLogger(__name__)

NEAR_SHARE = 16
"""Each gateway process also keeps its most recent answers in memory, up to
``max_bytes`` / this."""
ENTRY_OVERHEAD = 200
"""Bytes an entry counts beyond its arrays (key, bookkeeping) against ``max_bytes``."""


def cache_key(model: str, version: str, inputs: dict[str, p.Tensor]) -> bytes:
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{model}\0{version}\0".encode())
    for name in sorted(inputs):
        tensor = inputs[name]
        digest.update(f"{name}\0{tensor.datatype}\0{tensor.shape}\0".encode())
        data = tensor.data
        digest.update(data if isinstance(data, bytes) else msgspec.msgpack.encode(data))
    return digest.digest()


def fetches(signature: Signature, inputs: dict[str, p.Tensor]) -> bool:
    """Whether a request names data its replica fetches (an ``s3://`` URI among a media
    input's values, where the gateway's codecs leave every other image as bytes): such
    a request is never cached (see the module)."""
    for spec in signature.inputs:
        tensor = inputs.get(spec.name) if spec.media is not None else None
        values = () if tensor is None or isinstance(tensor.data, bytes) else tensor.data
        if any(isinstance(v, str) and v.startswith("s3://") for v in values):
            return True
    return False


def version_ttl(route: VersionRoute | None, default_s: float) -> float:
    """How long a version's answers are kept: its own ``cache_ttl_s``, else the default."""
    return default_s if route is None or route.cache_ttl_s is None else route.cache_ttl_s


def deterministic(params: SamplingParams) -> bool:
    """A generation with these sampling parameters always makes the same text: greedy
    (temperature 0, or top_k 1) or seeded (the sequence's own generator)."""
    return params.greedy or params.seed is not None


def generation_key(
    model: str,
    version: str,
    digest: str,
    adapter: str | None,
    prompt: str | list[int] | dict[str, Any],
    params: SamplingParams,
) -> bytes:
    """The key of a deterministic generation: the version (and its artifact's sha256,
    which covers the adapters registered with it), the adapter, the prompt and every
    sampling parameter (the length, the stops and logprobs change the answer too; the
    priority does not)."""
    hashed = hashlib.blake2b(digest_size=20)
    hashed.update(f"gen\0{model}\0{version}\0{digest}\0{adapter or ''}\0".encode())
    fields = msgspec.structs.asdict(params)
    shaping = sorted((k, v) for k, v in fields.items() if k != "priority")
    hashed.update(msgspec.msgpack.encode([prompt, shaping]))
    return hashed.digest()


def chunk_columns(chunk: p.TokenChunk) -> Columns:
    """A whole generation (one finished chunk) as a cache value."""
    return {"generation": np.frombuffer(msgspec.msgpack.encode(chunk), dtype=np.uint8)}


def columns_chunk(columns: Columns) -> p.TokenChunk:
    return msgspec.msgpack.decode(columns["generation"].tobytes(), type=p.TokenChunk)


class ResultCache(Protocol):
    hits: int
    misses: int

    async def get(self, key: bytes) -> Columns | None: ...

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None: ...

    async def close(self) -> None: ...


def encode_columns(outputs: Columns) -> bytes:
    """A value as bytes, for the stores outside this process."""
    return msgspec.msgpack.encode({n: p.to_tensor(np.asarray(a)) for n, a in outputs.items()})


def decode_columns(body: bytes) -> Columns:
    tensors = msgspec.msgpack.decode(body, type=dict[str, p.Tensor])
    return {name: p.from_tensor(t) for name, t in tensors.items()}


class LocalCache:
    """An LRU of answers in this process, bounded by the bytes of their arrays."""

    def __init__(self, max_bytes: int, clock: Clock = SYSTEM) -> None:
        self.max_bytes = max_bytes
        self.clock = clock
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, tuple[float, Columns, int]] = OrderedDict()

    async def get(self, key: bytes) -> Columns | None:
        return self.lookup(key)

    def lookup(self, key: bytes) -> Columns | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < self.clock.monotonic():
            if entry is not None:
                self._drop(key)
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None:
        size = sum(a.nbytes for a in outputs.values()) + ENTRY_OVERHEAD
        self.keep(key, outputs, self.clock.monotonic() + ttl_s, size)

    def keep(self, key: bytes, outputs: Columns, expires: float, size: int) -> None:
        """Keep ``outputs`` until ``expires`` (the clock's time), counting ``size``."""
        if size > self.max_bytes // 8:
            return  # one answer may not evict an eighth of the cache
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (expires, outputs, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: bytes) -> None:
        _, _, size = self._entries.pop(key)
        self.bytes -= size

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        self._entries.clear()
        self.bytes = 0


SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY, key BLOB NOT NULL, value BLOB NOT NULL, size INTEGER NOT NULL,
    expires REAL NOT NULL, used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_used ON entries (used);
CREATE TABLE IF NOT EXISTS total (one INTEGER PRIMARY KEY CHECK (one = 1), bytes INTEGER);
INSERT OR IGNORE INTO total VALUES (1, 0);
CREATE TRIGGER IF NOT EXISTS entry_in AFTER INSERT ON entries
    BEGIN UPDATE total SET bytes = bytes + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS entry_out AFTER DELETE ON entries
    BEGIN UPDATE total SET bytes = bytes - OLD.size; END;
"""

TOUCH_AFTER_S = 1.0
"""A hit refreshes its entry's place in the LRU order only when older than this: at most
one write a second per entry."""

WRITE_AFTER_S = 0.002
"""A put waits this long for others to share its transaction: one write lock and one
commit for all the answers of those milliseconds."""

WRITE_NOW_BYTES = 256 * 1024
"""Answers written on the event loop at once, at most (about a millisecond's work); more,
and each answer over ``LARGE_BYTES``, go to the writer thread."""

LARGE_BYTES = 64 * 1024
"""An answer larger than this is always written by the writer thread."""

WAITING_BYTES = 8 << 20
"""Answers waiting to be written, at most (beyond one answer); more are not kept."""

CHECKPOINT_BYTES = 1 << 20
"""WAL a process writes (estimated: a write dirties about four pages besides its value)
before its writer thread copies the WAL back into the file (``wal_autocheckpoint`` is
off: a checkpoint costs milliseconds, and no request waits for one)."""

WRITE_PAGES_BYTES = 4 * 4096
"""What a put or a refreshed "used" time adds to the WAL besides the value, about."""

COMPLAIN_EVERY_S = 60.0


def _connect(path: Path, max_bytes: int, busy_timeout_s: float) -> sqlite3.Connection:
    """The shared file, created if need be, in WAL mode."""
    db = sqlite3.connect(
        path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
    )
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = OFF")
        db.execute("PRAGMA journal_size_limit = 16777216")
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.executescript(SCHEMA)
    except sqlite3.Error:
        db.close()
        raise
    return db


def _busy(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _id(key: bytes) -> int:
    """An entry's rowid: 64 bits of its key's hash, so that a lookup is one search of
    the table's integer keys (no index beside it; a large answer's pages are never in
    the way). The row keeps the whole key: two keys sharing an id are a miss, never
    the other's answer."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big", signed=True)


Entry = tuple[bytes, bytes, int, float]
"""An answer to keep: key, encoded value, the size it counts, when it expires."""


class SQLiteCache:
    """Answers in one SQLite file shared by the gateway processes of this machine (see
    the module's docstring). Used from one event loop, which never waits for a lock: a
    get is one read (WAL readers do not wait for writers); puts, and the refreshed
    "used" times of hits, wait ``WRITE_AFTER_S`` for others, then are written in one
    transaction on the loop (or, found locked, a moment later) or, for large answers,
    by the cache's writer thread, which also checkpoints the WAL. Until written, this
    process answers them from memory. An error is a logged miss."""

    def __init__(
        self, path: Path, max_bytes: int, open_timeout_s: float = 5.0, clock: Clock = SYSTEM
    ) -> None:
        self.path = path
        self.clock = clock
        """Its monotonic time is the machine's (one clock for every process)."""
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.skipped = 0
        """Puts not kept because ``WAITING_BYTES`` were already waiting."""
        self.errors = 0
        self._quiet_until = 0.0
        # Opening may wait for another process creating the file; requests never do.
        self._db = _connect(path, max_bytes, open_timeout_s)
        self._db.execute("PRAGMA busy_timeout = 0")
        self._near = LocalCache(max_bytes // NEAR_SHARE, clock)
        """This process's most recent answers, decoded: a hit there is a dict lookup,
        not a read and a decode."""
        self._waiting: dict[bytes, Entry] = {}
        self._waiting_bytes = 0
        self._touched: dict[bytes, float] = {}
        self._soon: asyncio.TimerHandle | None = None
        self._unchecked = 0
        """Bytes written to the WAL (estimated) since this process's last checkpoint."""
        self._writer: sqlite3.Connection | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._writing: asyncio.Future[None] | None = None
        self._in_thread: dict[bytes, Entry] = {}
        """What the writer thread is writing."""

    async def get(self, key: bytes) -> Columns | None:
        near = self._near.lookup(key)
        if near is not None:
            self.hits += 1
            return near
        now = self.clock.monotonic()
        try:
            entry = self._waiting.get(key) or self._in_thread.get(key)
            if entry is not None:
                value, expires, used = entry[1], entry[3], now
            else:
                rows = self._db.execute(
                    "SELECT key, value, expires, used FROM entries WHERE id = ?", (_id(key),)
                ).fetchall()  # all: a statement left unfinished would hold its snapshot
                if not rows or rows[0][0] != key:
                    self.misses += 1
                    return None
                _, value, expires, used = rows[0]
            if expires < now:
                self.misses += 1
                return None
            columns = decode_columns(value)
        except (sqlite3.Error, msgspec.DecodeError) as exc:
            self._failed("get", exc)
            self.misses += 1
            return None
        if now - used > TOUCH_AFTER_S:
            self._touched[key] = now
            self._write_soon(WRITE_PAGES_BYTES)
        self._near.keep(key, columns, expires, len(value) + ENTRY_OVERHEAD)
        self.hits += 1
        return columns

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None:
        value = encode_columns(outputs)
        size = len(value) + ENTRY_OVERHEAD
        if size > self.max_bytes // 8:
            return  # one answer may not evict an eighth of the cache
        if self._waiting and self._waiting_bytes + size > WAITING_BYTES:
            self.skipped += 1
            return
        expires = self.clock.monotonic() + ttl_s
        self._waiting[key] = (key, value, size, expires)
        self._waiting_bytes += size
        self._near.keep(key, outputs, expires, size)
        self._write_soon(size + WRITE_PAGES_BYTES)

    def _write_soon(self, size: int) -> None:
        self._unchecked += size
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_later(WRITE_AFTER_S, self._write)

    def _write(self, _: object = None) -> None:
        """What waits: up to ``WRITE_NOW_BYTES`` of small answers here, in one
        transaction (found locked: again a moment later); the rest, and a checkpoint
        when due, to the writer thread unless it is busy (then this runs again once it
        is done)."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._writing is not None and not self._writing.done():
            return
        self._in_thread = {}
        now, room = [], WRITE_NOW_BYTES
        for entry in self._waiting.values():
            if entry[2] <= min(LARGE_BYTES, room):
                now.append(entry)
                room -= entry[2]
        if now or self._touched:
            try:
                _insert(self._db, now, self._touched, self.clock.monotonic(), self.max_bytes)
            except sqlite3.Error as exc:
                if _busy(exc):  # another process is writing
                    self._soon = asyncio.get_running_loop().call_later(WRITE_AFTER_S, self._write)
                    return
                self._failed("put", exc)
            for key, _, size, _ in now:
                del self._waiting[key]
                self._waiting_bytes -= size
            self._touched = {}
        checkpoint = self._unchecked >= CHECKPOINT_BYTES
        if self._waiting or checkpoint:
            self._hand_over(checkpoint)

    def _hand_over(self, checkpoint: bool) -> None:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="result-cache")
        batch = list(self._waiting.values())
        self._in_thread, self._waiting, self._waiting_bytes = self._waiting, {}, 0
        self._unchecked = 0 if checkpoint else self._unchecked
        loop = asyncio.get_running_loop()
        self._writing = loop.run_in_executor(self._thread, self._write_there, batch, checkpoint)
        self._writing.add_done_callback(self._write)

    def _write_there(self, batch: list[Entry], checkpoint: bool) -> None:
        """On the writer thread, which may wait for the lock."""
        try:
            if self._writer is None:
                self._writer = _connect(self.path, self.max_bytes, busy_timeout_s=1.0)
            if batch:
                _insert(self._writer, batch, {}, self.clock.monotonic(), self.max_bytes)
            if checkpoint:
                self._writer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:
            self._failed("put", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + COMPLAIN_EVERY_S
            logger.warning(
                "result cache: %s on %s failed (%s); answering misses (%d errors so far)",
                what, self.path, exc, self.errors,
            )  # fmt: skip

    @property
    def bytes(self) -> int:
        """What the entries in the file count against ``max_bytes``, all processes
        together."""
        return int(self._db.execute("SELECT bytes FROM total").fetchall()[0][0])

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM entries").fetchall()[0][0])

    async def settled(self) -> None:
        """Once all that waited is written (or failed)."""
        while self._waiting or self._touched or self._in_thread:
            if self._writing is not None and not self._writing.done():
                await asyncio.shield(self._writing)
                continue
            self._write()
            if self._soon is not None:  # locked: again shortly
                await asyncio.sleep(WRITE_AFTER_S)

    async def close(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settled(), 5.0)
        if self._soon is not None:
            self._soon.cancel()
        if self._thread is not None:
            self._thread.shutdown()
        if self._writer is not None:
            self._writer.close()
        self._db.close()


def _insert(
    db: sqlite3.Connection,
    batch: list[Entry],
    touched: dict[bytes, float],
    now: float,
    max_bytes: int,
) -> None:
    """One transaction, the least recently used entries out while over ``max_bytes``;
    rolled back on an error (raised)."""
    try:
        db.execute("BEGIN IMMEDIATE")
        db.executemany("DELETE FROM entries WHERE id = ?", [(_id(e[0]),) for e in batch])
        db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                       [(_id(k), k, value, size, expires, now)
                        for k, value, size, expires in batch])  # fmt: skip
        db.executemany("UPDATE entries SET used = ? WHERE id = ?",
                       [(used, _id(k)) for k, used in touched.items()])  # fmt: skip
        ((total,),) = db.execute("SELECT bytes FROM total").fetchall()
        if total > max_bytes:
            _evict(db, total - max_bytes)
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            if db.in_transaction:
                db.execute("ROLLBACK")
        raise


def _evict(db: sqlite3.Connection, excess: int) -> None:
    """The least recently used entries holding at least ``excess`` bytes, removed."""
    victims: list[tuple[int]] = []
    freed = 0
    with contextlib.closing(db.execute("SELECT id, size FROM entries ORDER BY used")) as oldest:
        for id_, size in oldest:
            victims.append((id_,))
            freed += size
            if freed >= excess:
                break
    db.executemany("DELETE FROM entries WHERE id = ?", victims)


class RedisCache:
    """Answers in Redis (``inferd:rc:<key hex>``), shared by every gateway process."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as redis

        # RESP2 (see inferd.jobs.queue): a request cancelled mid-command (its client went
        # away) must not leave redis-py 8's RESP3 parser spinning on the connection.
        self._redis = redis.from_url(url, protocol=2)
        self.hits = 0
        self.misses = 0

    async def get(self, key: bytes) -> Columns | None:
        try:
            raw = await self._redis.get(b"inferd:rc:" + key.hex().encode())
        except Exception as exc:  # the cache is an optimisation: never fail a request
            logger.warning("result cache: Redis get failed: %s", exc)
            raw = None
        if raw is None:
            self.misses += 1
            return None
        self.hits += 1
        return decode_columns(raw.encode() if isinstance(raw, str) else raw)  # no decode_responses

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None:
        body = encode_columns(outputs)
        try:
            await self._redis.set(b"inferd:rc:" + key.hex().encode(), body, px=int(ttl_s * 1000))
        except Exception as exc:
            logger.warning("result cache: Redis set failed: %s", exc)

    async def close(self) -> None:
        await self._redis.aclose()


def cache_for(settings: Settings) -> ResultCache:
    """The store of a gateway process: Redis with ``redis_url``; the machine's shared
    file once the server prepared it (``cache.dir`` set); else in this process."""
    if settings.redis_url:
        return RedisCache(settings.redis_url)
    if settings.cache.dir is not None:
        path = shared_file(settings)
        try:
            return SQLiteCache(path, settings.cache.max_bytes)
        except sqlite3.Error as exc:
            logger.warning(
                "result cache: cannot open %s (%s); this gateway process keeps its own", path, exc
            )
    return LocalCache(settings.cache.max_bytes)


def shared_file(settings: Settings) -> Path:
    """The shared file in ``cache.dir``: one per data folder (named after its absolute
    path), so two servers on one machine never share answers."""
    assert settings.cache.dir is not None
    named = hashlib.blake2b(str(settings.data_dir.resolve()).encode(), digest_size=8)
    return settings.cache.dir / f"results-{named.hexdigest()}.db"


def prepare_shared(settings: Settings) -> Path | None:
    """Where a server keeps its gateway processes' shared cache, made fresh: chooses
    ``cache.dir`` when unset (and sets it, for the gateway processes' settings), removes
    what a previous run left there and creates the file. None: the cache is off, in
    Redis, or the file cannot be made (logged; ``cache.dir`` unset: each gateway process
    keeps its own)."""
    if not settings.cache.enabled or settings.redis_url:
        return None
    folder = settings.cache.dir or _default_dir(settings)
    settings.cache.dir = folder.resolve()
    path = shared_file(settings)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_shared(path)
        if path.exists():
            raise OSError(f"a previous run's {path} is still there")
        _connect(path, settings.cache.max_bytes, busy_timeout_s=5.0).close()
        path.chmod(0o600)  # answers are the users' data (SQLite's own files follow it)
    except (OSError, sqlite3.Error) as exc:
        logger.warning(
            "result cache: cannot create %s (%s); each gateway process keeps its own", path, exc
        )
        settings.cache.dir = None
        return None
    return path


def remove_shared(path: Path | None) -> None:
    """The shared file and SQLite's files beside it, removed (None: nothing); never
    raises (logs)."""
    if path is None:
        return
    for suffix in ("", "-wal", "-shm", "-journal"):
        try:
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("result cache: cannot remove %s%s: %s", path, suffix, exc)


SHM = Path("/dev/shm")


def _default_dir(settings: Settings) -> Path:
    """A folder of this user's only on ``/dev/shm`` (memory) when it has room for twice
    ``max_bytes`` (pages, the WAL); else ``<data_dir>/cache``."""
    try:
        if shutil.disk_usage(SHM).free >= 2 * settings.cache.max_bytes:
            mine = SHM / f"inferd-{os.getuid()}"
            mine.mkdir(mode=0o700, exist_ok=True)
            seen = mine.lstat()  # not a link, and nobody else's: its answers are served
            if (
                stat.S_ISDIR(seen.st_mode)
                and seen.st_uid == os.getuid()
                and not seen.st_mode & 0o077
            ):
                return mine
            logger.warning("result cache: %s is not this user's own folder; not used", mine)
    except OSError:
        pass
    return (settings.data_dir / "cache").resolve()
