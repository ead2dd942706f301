"""Alembic environment of the registry, run programmatically (no alembic.ini).

:meth:`inferd.registry.Registry.migrate` builds the Config in code and hands over an
open connection, already inside the transaction it wants the whole upgrade to run in
(so concurrent migrators serialise and a failed upgrade leaves nothing behind). Without
a connection, as when a developer runs alembic by hand with ``sqlalchemy.url`` set, an
engine is created from that URL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from inferd.registry.tables import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
