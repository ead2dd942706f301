"""The registry's database engine: SQLite set up so that several processes share one
file (WAL, a busy timeout, write transactions that take the write lock up front), or
PostgreSQL; and the Alembic configuration its migrations run with."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Keyed by schema, so registries in different schemas of one database do not wait.
PG_MIGRATE_LOCK = text(
    "SELECT pg_advisory_xact_lock("
    "hashtext('inferd.registry.migrate:' || coalesce(current_schema(), '')))"
)
WRITE = "inferd_write"  # execution option marking engines whose transactions write


def create_registry_engine(database_url: str) -> Engine:
    """An engine for ``database_url`` with the SQLite settings the registry relies on."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url)
    else:
        # One shared connection, else every pooled connection gets its own empty db.
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # pysqlite's own transaction handling skips BEGIN before DDL, so migrations would
    # not be atomic; take over and emit BEGIN ourselves (see _sqlite_on_begin).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    _enable_wal(cursor)
    cursor.execute("PRAGMA foreign_keys = ON")  # off by default in SQLite
    cursor.close()


def _enable_wal(cursor: Any) -> None:
    """WAL: readers never block the writer. The mode is stored in the file, so only the
    first connection to a new database switches it; switching needs an exclusive lock and
    SQLite answers "database is locked" at once, without waiting, when processes open a
    new database together -- so retry for as long as the busy timeout allows."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                return
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _sqlite_on_begin(conn: Connection) -> None:
    writes = conn.get_execution_options().get(WRITE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if writes else "BEGIN")


def _alembic_config(connection: Connection) -> Config:
    # Imported here: Alembic (~10 MiB) is for the process that migrates, not gateways.
    from alembic.config import Config

    config = Config()
    # configparser interpolates "%": escape it in the path.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes["connection"] = connection
    return config
