"""One controller at a time writes desired state.

With a PostgreSQL registry, any number of ``inferd control`` processes can run: the one
holding a session-level advisory lock (keyed by the registry's database and schema)
leads; the others wait, trying the lock every second, and run nothing (no reconcile, no
rollout step, no routing table: a follower never writes desired state), so they are
invisible to gateways and replicas until they lead. The lock goes with its session: a
leader that exits or is killed frees it at once; one cut off from the database frees it
when the server notices its connection dead (TCP keepalives set to 2 s idle, 1 s
apart, 3 probes on that session), and by then it has stopped leading itself: it checks
its session every second and, if the check fails or takes over 2 s, stops and exits.

With SQLite only one controller can be: it holds an exclusive lock on
``<database file>.controller.lock``, and a second one on the same database is refused
with the reason (two controllers need a PostgreSQL registry).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, text

from inferd.config import Settings

if TYPE_CHECKING:
    from inferd.control.lease import LeaseLeadership

logger = logging.getLogger(__name__)
TRY_EVERY_S = 1.0
CHECK_EVERY_S = 1.0
CHECK_TIMEOUT_S = 2.0


class NotLeader(SystemExit):
    """This process cannot lead (another controller holds the SQLite registry)."""


def lock_key(database: str, schema: str) -> int:
    """The advisory lock's key: one per registry (database and schema), signed 64-bit."""
    digest = hashlib.sha256(f"inferd-controller:{database}:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class Leadership:
    """Held while this process leads; :meth:`lost` is set when it must stop leading.

    On Kubernetes (``replica_backend: kubernetes``) a controller first takes the Lease
    (:mod:`inferd.control.lease`), then the registry's lock; losing either stops it."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()
        self.why = ""
        self._connection: Any = None
        self._file: int | None = None
        self._watch: asyncio.Task[None] | None = None
        self._lease: LeaseLeadership | None = None
        self.how = ""
        """How this process leads, in words (the console's health view)."""
        self.since = ""
        """When it started leading (ISO 8601, UTC)."""

    @classmethod
    async def acquire(
        cls, engine: Engine, settings: Settings, progress: Callable[[str], None]
    ) -> Leadership:
        """Wait until this process leads (PostgreSQL, a Lease), or refuse at once (SQLite
        held)."""
        self = cls()
        kube = settings.kubernetes
        if settings.replica_backend == "kubernetes" and kube.leader_election:
            from inferd.control.backends.kubernetes import namespace_of
            from inferd.control.lease import LeaseLeadership

            self._lease = await LeaseLeadership.acquire(kube, namespace_of(kube), progress)
            self._lease.lost_to(self._give_up)
        try:
            await self._lock(engine, settings.data_dir, progress)
        except BaseException:
            await self.release()
            raise
        return self

    def _give_up(self, why: str) -> None:
        self.why = why
        self.lost.set()

    async def _lock(self, engine: Engine, data_dir: Path, progress: Callable[[str], None]) -> None:
        if engine.dialect.name != "postgresql":
            database = engine.url.database
            if database and database != ":memory:":  # beside the file: whichever data folder
                self._lock_file(Path(database).with_name(Path(database).name + ".controller.lock"))
            else:
                self._lock_file(data_dir / "controller.lock")
            return
        connection = await asyncio.to_thread(engine.connect)
        await asyncio.to_thread(_keepalives, connection)
        database, schema = await asyncio.to_thread(
            lambda: connection.execute(text("SELECT current_database(), current_schema()")).one()
        )
        key = lock_key(database, schema)
        said = False
        while not await asyncio.to_thread(_try_lock, connection, key):
            if not said:
                progress(
                    "another controller leads this registry; following, taking over when it goes"
                )
                said = True
            await asyncio.sleep(TRY_EVERY_S)
        if said:
            progress("the leading controller went: this one leads now")
        logger.info("leading (advisory lock %d on %s.%s)", key, database, schema)
        self._led(f"PostgreSQL advisory lock on {database}.{schema}")
        self._connection = connection
        self._watch = asyncio.get_running_loop().create_task(self._check_forever())

    def _lock_file(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NotLeader(
                "error: another controller (inferd serve or inferd control) runs on this "
                f"registry (it holds {path}); more than one controller needs a PostgreSQL "
                "registry (database_url)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._file = fd
        self._led(f"file lock {path}")

    def _led(self, how: str) -> None:
        self.how = how + (" and a Kubernetes Lease" if self._lease is not None else "")
        self.since = datetime.now(UTC).isoformat()

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            try:
                await asyncio.wait_for(asyncio.to_thread(_ping, self._connection), CHECK_TIMEOUT_S)
            except Exception as exc:  # the lock may be gone with the session: stop leading
                self._give_up(f"lost the registry session that holds leadership: {exc!r}")
                logger.critical("%s; stopping", self.why)
                return

    async def release(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._connection is not None:
            try:
                self._connection.close()  # the session ends: the lock is free
            except Exception:
                logger.debug("closing the leadership session failed", exc_info=True)
        if self._file is not None:
            os.close(self._file)
            self._file = None
        if self._lease is not None:
            await self._lease.release()
            self._lease = None


def _keepalives(connection: Any) -> None:
    """The server notices this session dead within seconds, not hours."""
    for setting, value in (
        ("tcp_keepalives_idle", 2),
        ("tcp_keepalives_interval", 1),
        ("tcp_keepalives_count", 3),
    ):
        connection.execute(text(f"SET {setting} = {value}"))
    connection.commit()


def _try_lock(connection: Any, key: int) -> bool:
    got = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar()
    connection.commit()
    return bool(got)


def _ping(connection: Any) -> None:
    connection.execute(text("SELECT 1"))
    connection.commit()
