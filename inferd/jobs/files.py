"""Files uploaded through OpenAI's ``/v1/files`` (table ``files``), and the output and
error files of an OpenAI batch, which are not stored but read from its job's results.

An uploaded file is kept whole in the database until it is deleted, so every gateway,
on every host, serves the same bytes; a batch's ``input_file_id`` names one. A batch's
output (``file-{job id}-output``) and error (``file-{job id}-errors``) files are its
result lines, rendered when read: nothing is written twice, and they are there as long
as the job is kept (``jobs.keep_s``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from inferd.jobs.store import JobStore
from inferd.registry.tables import files

_SHOWN = (files.c.id, files.c.purpose, files.c.filename, files.c.bytes, files.c.owner,
          files.c.created_at)  # fmt: skip


def new_file_id() -> str:
    """Time-ordered, as job ids are: ``file-`` then milliseconds and 64 random bits."""
    return f"file-{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


class FileStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(
        self, purpose: str, filename: str, content: bytes, owner: str | None
    ) -> dict[str, Any]:
        row = {
            "id": new_file_id(), "purpose": purpose, "filename": filename,
            "bytes": len(content), "owner": owner, "created_at": datetime.now(UTC),
        }  # fmt: skip
        with self.engine.begin() as conn:
            conn.execute(insert(files).values(**row, content=content))
        return row

    def get(self, file_id: str) -> dict[str, Any] | None:
        """The file's record (not its content)."""
        with self.engine.connect() as conn:
            row = conn.execute(select(*_SHOWN).where(files.c.id == file_id)).mappings().first()
        return None if row is None else dict(row)

    def content(self, file_id: str) -> bytes | None:
        with self.engine.connect() as conn:
            value = conn.execute(select(files.c.content).where(files.c.id == file_id)).scalar()
        return None if value is None else bytes(value)

    def find(
        self, purpose: str | None, owner: str | None, after: str | None, limit: int, newest: bool
    ) -> list[dict[str, Any]]:
        """Files (``owner`` None: everyone's), by id (creation order), after ``after``."""
        query = select(*_SHOWN)
        if purpose is not None:
            query = query.where(files.c.purpose == purpose)
        if owner is not None:
            query = query.where(files.c.owner == owner)
        if after is not None:
            query = query.where(files.c.id < after if newest else files.c.id > after)
        query = query.order_by(files.c.id.desc() if newest else files.c.id).limit(limit)
        with self.engine.connect() as conn:
            return [dict(row) for row in conn.execute(query).mappings()]

    def delete(self, file_id: str) -> bool:
        with self.engine.begin() as conn:
            return bool(conn.execute(delete(files).where(files.c.id == file_id)).rowcount)


def output_lines(store: JobStore, job_id: str, errors: bool, page: int = 2000) -> Iterator[bytes]:
    """A batch's output (answered 200) or error lines, in input order, page by page."""
    after = -1
    while True:
        rows = store.results_page(job_id, after, page)
        if not rows:
            return
        wanted = [out for _, status, out in rows if (status != 200) == errors]
        if wanted:
            yield ("\n".join(wanted) + "\n").encode()
        after = rows[-1][0]
        if len(rows) < page:
            return


def output_size(store: JobStore, job_id: str, errors: bool) -> int:
    return sum(len(part) for part in output_lines(store, job_id, errors))


__all__ = ["FileStore", "new_file_id", "output_lines", "output_size"]
