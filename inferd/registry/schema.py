"""The registry's schema revision, and its upgrade, with Alembic only where it runs.

A process that needs the schema current reads its revision with one SELECT
(:func:`revision`) and imports Alembic only when it is behind :data:`HEAD`. The server
goes further (:func:`upgrade_isolated`): it upgrades in a child process
(``python -m inferd.registry.schema``, the URL on stdin: it may hold a password), so
Alembic, the migration scripts and SQLAlchemy's DDL machinery (~9 MiB) are never in the
long-lived server process, whether its data folder is new or not.

:data:`HEAD` moves with every new migration (``migrations/versions``);
``tests/test_registry.py`` checks it against Alembic's own head.
"""

from __future__ import annotations

import subprocess
import sys

from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import make_url

from inferd.registry.engine import (
    PG_MIGRATE_LOCK,
    WRITE,
    _alembic_config,
    create_registry_engine,
)

HEAD = "0014"
"""The newest migration's revision."""


def revision(engine: Engine) -> str | None:
    """The database's schema revision; None before its first migration."""
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        found = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        return None if found is None else str(found)


def upgrade(engine: Engine) -> None:
    """Upgrade to the newest migration; a no-op (one SELECT, no Alembic) when there.

    The whole upgrade runs in one transaction that first takes the write lock (SQLite)
    or an advisory lock per schema (PostgreSQL), so processes starting together upgrade
    once and the others then find nothing to do.
    """
    if revision(engine) == HEAD:
        return
    from alembic import command  # only a process that migrates needs Alembic

    with engine.execution_options(**{WRITE: True}).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(PG_MIGRATE_LOCK)
        command.upgrade(_alembic_config(conn), "head")


def upgrade_isolated(engine: Engine, database_url: str) -> None:
    """:func:`upgrade` in a child process, only if the schema is behind. An in-memory
    SQLite database (this process's own) is upgraded here."""
    if revision(engine) == HEAD:
        return
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        upgrade(engine)
        return
    done = subprocess.run(
        [sys.executable, "-m", "inferd.registry.schema"],
        input=database_url, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"upgrading the registry's schema failed:\n{done.stderr[-4000:]}")


def main() -> None:
    engine = create_registry_engine(sys.stdin.read())
    try:
        upgrade(engine)
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
