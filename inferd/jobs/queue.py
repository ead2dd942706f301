"""Durable queues for jobs: one small interface, three backends.

Delivery is at least once: :meth:`JobQueue.take` leases messages to this consumer for
``lease_s``; a message not acknowledged (:meth:`JobQueue.ack`) before its lease ends
is delivered again, to this consumer or another. Consumers therefore make their effects
idempotent (a job's results are keyed by (job, item), so a redelivered chunk never
duplicates one). Messages are opaque bytes; topics are independent queues.

- :class:`SqliteQueue` (default, ``sqlite:///<data_dir>/queue.db``): a WAL-mode table,
  leases as a timestamp column, taken with one ``UPDATE … RETURNING`` per call. Safe for
  several processes on one machine.
- :class:`RedisStreamsQueue` (``redis://…``): one stream per topic and a consumer group;
  new messages with ``XREADGROUP``, stuck ones (idle past the lease) reclaimed with
  ``XAUTOCLAIM``; ack is ``XACK`` + ``XDEL``. For several servers.
- :class:`KafkaQueue` (``kafka://host:9092``, needs ``aiokafka``): one topic per queue
  topic and a consumer group; offsets are committed up to the first unacknowledged
  message, and a message whose lease ends is delivered again by this consumer (and, after
  a crash or a rebalance, by whichever consumer owns its partition from the committed
  offset). No Kafka broker exists on the machine this was written on: this backend is
  not exercised by the test suite.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class Delivery:
    id: str
    """The backend's id of the message (what :meth:`JobQueue.ack` takes)."""
    payload: bytes
    deliveries: int
    """1 the first time; more when a lease ended before an ack."""


def consumer_name() -> str:
    """This process, as queues name their consumers: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class JobQueue(ABC):
    url: str

    @abstractmethod
    async def put(self, topic: str, payloads: Sequence[bytes]) -> None:
        """Append messages; durable when this returns."""

    @abstractmethod
    async def take(self, topic: str, max_messages: int, lease_s: float) -> list[Delivery]:
        """Up to ``max_messages`` messages (oldest first), leased to this consumer for
        ``lease_s``; [] when none is ready (does not wait). Every consumer of a topic uses
        the same ``lease_s`` (``jobs.lease_s``): on Redis a consumer reclaims messages
        idle longer than its own lease."""

    @abstractmethod
    async def extend(self, topic: str, ids: Sequence[str], lease_s: float) -> None:
        """Renew the leases of messages still being worked on."""

    @abstractmethod
    async def ack(self, topic: str, ids: Sequence[str]) -> None:
        """Done: the messages are never delivered again."""

    @abstractmethod
    async def depth(self, topic: str) -> int:
        """Messages not yet acknowledged (waiting or leased)."""

    async def close(self) -> None:  # noqa: B027 -- optional
        pass


def queue_for(url: str, consumer: str | None = None) -> JobQueue:
    """The backend a URL names: ``sqlite:///path``, ``redis://…``, ``kafka://…``."""
    scheme = urlsplit(url).scheme
    consumer = consumer or consumer_name()
    if scheme == "sqlite":
        return SqliteQueue(Path(url.removeprefix("sqlite:///").removeprefix("sqlite://")), consumer)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStreamsQueue(url, consumer)
    if scheme == "kafka":
        return KafkaQueue(url, consumer)
    raise ValueError(
        f"queue URL {url!r}: use sqlite:///path, redis://host:port or kafka://host:port"
    )


# -- SQLite -------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    lease_until REAL NOT NULL DEFAULT 0,
    consumer TEXT,
    deliveries INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_ready ON messages (topic, lease_until);
"""


class SqliteQueue(JobQueue):
    """Messages in a table of a WAL-mode SQLite file; each call one short transaction
    in a worker thread (the event loop never waits on the disk)."""

    def __init__(self, path: Path, consumer: str) -> None:
        self.url = f"sqlite:///{path}"
        self.path = path
        self.consumer = consumer
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = FULL")  # an accepted job survives a power cut
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def _run(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    async def put(self, topic: str, payloads: Sequence[bytes]) -> None:
        def put() -> None:
            with self._tx():
                self._db.executemany(
                    "INSERT INTO messages (topic, payload) VALUES (?, ?)",
                    [(topic, p) for p in payloads],
                )

        await asyncio.to_thread(self._run, put)

    async def take(self, topic: str, max_messages: int, lease_s: float) -> list[Delivery]:
        def take() -> list[Delivery]:
            now = time.time()
            with self._tx():
                rows = self._db.execute(
                    "UPDATE messages SET lease_until = ?, consumer = ?, "
                    "deliveries = deliveries + 1 WHERE id IN (SELECT id FROM messages "
                    "WHERE topic = ? AND lease_until < ? ORDER BY id LIMIT ?) "
                    "RETURNING id, payload, deliveries",
                    (now + lease_s, self.consumer, topic, now, max_messages),
                ).fetchall()
            rows.sort()
            return [Delivery(str(i), bytes(p), d) for i, p, d in rows]

        return await asyncio.to_thread(self._run, take)  # type: ignore[no-any-return]

    async def extend(self, topic: str, ids: Sequence[str], lease_s: float) -> None:
        def extend() -> None:
            until = time.time() + lease_s
            with self._tx():
                self._db.executemany(
                    "UPDATE messages SET lease_until = ? WHERE id = ? AND consumer = ?",
                    [(until, int(i), self.consumer) for i in ids],
                )

        await asyncio.to_thread(self._run, extend)

    async def ack(self, topic: str, ids: Sequence[str]) -> None:
        def ack() -> None:
            with self._tx():
                self._db.executemany("DELETE FROM messages WHERE id = ?", [(int(i),) for i in ids])

        await asyncio.to_thread(self._run, ack)

    async def depth(self, topic: str) -> int:
        def depth() -> int:
            row = self._db.execute("SELECT count(*) FROM messages WHERE topic = ?", (topic,))
            return int(row.fetchone()[0])

        return await asyncio.to_thread(self._run, depth)  # type: ignore[no-any-return]

    def release_dead(self) -> int:
        """Make the messages leased by consumers that died on this host (their process is
        gone) ready now, instead of when their leases end; returns how many."""
        host = socket.gethostname()
        dead = []
        with self._lock:
            for (consumer,) in self._db.execute(
                "SELECT DISTINCT consumer FROM messages WHERE lease_until > ?", (time.time(),)
            ).fetchall():
                name, _, pid = (consumer or "").rpartition(":")
                if name == host and pid.isdigit() and not _alive(int(pid)):
                    dead.append(consumer)
            released = 0
            with self._tx():
                for consumer in dead:
                    released += self._db.execute(
                        "UPDATE messages SET lease_until = 0 "
                        "WHERE consumer = ? AND lease_until > 0",
                        (consumer,),
                    ).rowcount
        return released

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)

    async def close(self) -> None:
        await asyncio.to_thread(self._run, self._db.close)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- Redis Streams --------------------------------------------------------------------------

GROUP = "inferd"


class RedisStreamsQueue(JobQueue):
    """A stream per topic (``inferd:queue:<topic>``) read by the consumer group ``inferd``.
    A message's lease is its idle time in the group's pending list: ``take`` first
    reclaims messages idle longer than the lease (``XAUTOCLAIM``: their consumer died or
    stalled), then reads new ones; ``extend`` resets the idle time (``XCLAIM`` to itself)."""

    def __init__(self, url: str, consumer: str) -> None:
        import redis.asyncio as redis

        self.url = url
        self.consumer = consumer
        # RESP2: redis-py 8's RESP3 parser can spin for ever on a connection whose read
        # was cancelled mid-reply (seen when a runner stops during XAUTOCLAIM).
        self._redis = redis.from_url(url, protocol=2)
        self._groups: set[str] = set()

    @staticmethod
    def key(topic: str) -> str:
        return f"inferd:queue:{topic}"

    async def _group(self, key: str) -> None:
        if key in self._groups:
            return
        from redis.exceptions import ResponseError

        try:
            await self._redis.xgroup_create(key, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(key)

    async def put(self, topic: str, payloads: Sequence[bytes]) -> None:
        key = self.key(topic)
        await self._group(key)
        async with self._redis.pipeline(transaction=False) as pipe:
            for payload in payloads:
                pipe.xadd(key, {b"p": payload})
            await pipe.execute()

    async def take(self, topic: str, max_messages: int, lease_s: float) -> list[Delivery]:
        key = self.key(topic)
        await self._group(key)
        lease_ms = max(1, int(lease_s * 1000))
        found: list[Delivery] = []
        # XAUTOCLAIM: messages idle (un-acked) longer than a lease, from any consumer.
        reclaimed: Any = await self._redis.xautoclaim(
            key, GROUP, self.consumer, min_idle_time=lease_ms, start_id="0-0", count=max_messages
        )
        claimed: list[Any] = reclaimed[1]
        if claimed:
            counts = await self._delivery_counts(key, [mid for mid, _ in claimed])
            for mid, fields in claimed:
                if fields:  # a message deleted while pending comes back empty
                    found.append(Delivery(_s(mid), fields[b"p"], counts.get(_s(mid), 2)))
        if len(found) < max_messages:
            reply: Any = await self._redis.xreadgroup(
                GROUP, self.consumer, {key: ">"}, count=max_messages - len(found)
            )
            for _, messages in reply or ():
                for mid, fields in messages:
                    found.append(Delivery(_s(mid), fields[b"p"], 1))
        return found

    async def _delivery_counts(self, key: str, ids: list[Any]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for mid in ids:
            for entry in await self._redis.xpending_range(key, GROUP, mid, mid, 1):
                counts[_s(entry["message_id"])] = int(entry["times_delivered"])
        return counts

    async def extend(self, topic: str, ids: Sequence[str], lease_s: float) -> None:
        if ids:
            await self._redis.xclaim(
                self.key(topic), GROUP, self.consumer, min_idle_time=0, message_ids=list(ids),
                justid=True,
            )  # fmt: skip

    async def ack(self, topic: str, ids: Sequence[str]) -> None:
        if not ids:
            return
        key = self.key(topic)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(key, GROUP, *ids)
            pipe.xdel(key, *ids)
            await pipe.execute()

    async def depth(self, topic: str) -> int:
        return int(await self._redis.xlen(self.key(topic)))

    async def close(self) -> None:
        await self._redis.aclose()


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- Kafka ----------------------------------------------------------------------------------


class KafkaQueue(JobQueue):
    """A Kafka topic per queue topic (``inferd.<topic>``), consumer group ``inferd``.

    Kafka acknowledges by offset, not by message: this consumer commits, per partition,
    the offset of its first message not yet acknowledged. A message leased here and not
    acknowledged in time is delivered again by this consumer; after a crash or a
    rebalance, the partition's new owner starts from the committed offset, so every
    message not acknowledged is delivered again (and some acknowledged after it, too:
    at least once). ``depth`` is the group's lag."""

    def __init__(self, url: str, consumer: str) -> None:
        parts = urlsplit(url)
        self.url = url
        self.consumer = consumer
        self.bootstrap = parts.netloc or "localhost:9092"
        self._producer: Any = None
        self._consumers: dict[str, Any] = {}
        self._leased: dict[str, dict[str, tuple[float, Any]]] = {}
        """Per topic: message id -> (lease end, record) of messages taken, not acked."""
        self._acked: dict[Any, set[int]] = {}
        self._committed: dict[Any, int] = {}

    @staticmethod
    def topic_name(topic: str) -> str:
        return f"inferd.{topic}"

    async def _producer_started(self) -> Any:
        if self._producer is None:
            from aiokafka import AIOKafkaProducer

            producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer
        return self._producer

    async def _consumer(self, topic: str) -> Any:
        consumer = self._consumers.get(topic)
        if consumer is None:
            from aiokafka import AIOKafkaConsumer

            consumer = AIOKafkaConsumer(
                self.topic_name(topic), bootstrap_servers=self.bootstrap, group_id=GROUP,
                client_id=self.consumer, enable_auto_commit=False, auto_offset_reset="earliest",
            )  # fmt: skip
            try:
                await consumer.start()
            except BaseException:
                await consumer.stop()
                raise
            self._consumers[topic] = consumer
            self._leased[topic] = {}
        return consumer

    async def put(self, topic: str, payloads: Sequence[bytes]) -> None:
        producer = await self._producer_started()
        sent = [await producer.send(self.topic_name(topic), p) for p in payloads]
        await asyncio.gather(*sent)  # each resolves once the broker has it (acks=all)

    async def take(self, topic: str, max_messages: int, lease_s: float) -> list[Delivery]:
        consumer = await self._consumer(topic)
        leased = self._leased[topic]
        now = time.time()
        found: list[Delivery] = []
        for mid, (until, record) in list(leased.items()):  # leases that ended: again
            if until < now and len(found) < max_messages:
                leased[mid] = (now + lease_s, record)
                found.append(Delivery(mid, record.value, 2))
        if len(found) < max_messages:
            batches = await consumer.getmany(timeout_ms=0, max_records=max_messages - len(found))
            for records in batches.values():
                for record in records:
                    mid = f"{record.partition}:{record.offset}"
                    leased[mid] = (now + lease_s, record)
                    found.append(Delivery(mid, record.value, 1))
        return found

    async def extend(self, topic: str, ids: Sequence[str], lease_s: float) -> None:
        leased = self._leased.get(topic, {})
        for mid in ids:
            if mid in leased:
                leased[mid] = (time.time() + lease_s, leased[mid][1])

    async def ack(self, topic: str, ids: Sequence[str]) -> None:
        from aiokafka import TopicPartition
        from aiokafka.structs import OffsetAndMetadata

        consumer = await self._consumer(topic)
        leased = self._leased[topic]
        for mid in ids:
            leased.pop(mid, None)
            partition, _, offset = mid.partition(":")
            tp = TopicPartition(self.topic_name(topic), int(partition))
            self._acked.setdefault(tp, set()).add(int(offset))
        commits = {}
        for tp, acked in self._acked.items():
            pending = [int(m.split(":")[1]) for m in leased if int(m.split(":")[0]) == tp.partition]
            first_open = min(pending) if pending else max(acked) + 1
            if first_open > self._committed.get(tp, -1):
                commits[tp] = OffsetAndMetadata(first_open, "")
                self._committed[tp] = first_open
                acked.difference_update({o for o in acked if o < first_open})
        if commits:
            await consumer.commit(commits)

    async def depth(self, topic: str) -> int:
        consumer = await self._consumer(topic)
        partitions = consumer.assignment()
        if not partitions:
            return len(self._leased.get(topic, {}))
        ends = await consumer.end_offsets(list(partitions))
        lag = 0
        for tp in partitions:
            committed = await consumer.committed(tp) or 0
            lag += max(0, ends[tp] - committed)
        return lag

    async def close(self) -> None:
        for consumer in self._consumers.values():
            await consumer.stop()
        if self._producer is not None:
            await self._producer.stop()
