"""Files uploaded through OpenAI's ``/v1/files`` (table ``files``, their bytes in the file
store), and the output and error files of an OpenAI batch, which are not stored but read
from its job's results.

Rules this module keeps:
- An upload is never whole in memory: its multipart body is parsed as it arrives
  (:func:`receive`), the file part written to a scratch file under the data folder,
  counted and hashed. Past what it may hold (``jobs.max_file_bytes``, or what is left of
  its owner's quota) it is refused at once, the rest unread.
- The bytes live in the file store, where the artifacts do: ``<data_dir>/files/<id>``
  (every gateway of the machine reads them), or ``<artifact_store>/_files/<id>`` with an
  S3 store (every host; no model is named ``_files``). The row says what they are
  (``bytes``, ``sha256``) and where (``location``). Rows of older servers keep their
  bytes in ``content`` (``location`` null) and stay readable.
- A row is written before its bytes are stored (``status`` ``uploading``, expiring
  within ``PENDING_S``) and made ``processed`` after, in one write transaction that
  checks its owner's quota: at most ``jobs.max_files_per_owner`` files and
  ``jobs.max_file_bytes_per_owner`` bytes not expired nor deleted. An upload cut short
  anywhere leaves a row that expires, and the server's upkeep removes what it stored.
- An expired or deleted file is gone at once (never read, listed nor used by a batch);
  :meth:`FileStore.purge` (the server's upkeep) deletes its bytes, then its row.

A batch's output (``file-{job id}-output``) and error (``file-{job id}-errors``) files
are its result lines, rendered when read: nothing is written twice, and they are there
as long as the job is kept (``jobs.keep_s``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from sqlalchemy import Connection, Engine, delete, func, insert, or_, select, text, update

from inferd.config import JobsConfig, Settings
from inferd.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge, StoreUnavailable
from inferd.jobs.store import JobStore
from inferd.registry.engine import WRITE
from inferd.registry.tables import files

logger = logging.getLogger(__name__)

FILES = "files"
"""The file store's folder under the data folder."""
REMOTE_PREFIX = "_files"
"""The file store's prefix under an S3 ``artifact_store`` (a model name starts with a
letter or digit, so no version's files share it)."""
PENDING_S = 3600.0
"""How long the row of an upload being stored lives unless it is made ``processed``."""
FORM_BYTES = 64 * 1024
"""What a multipart body may hold beside its file: boundaries, part headers, fields."""
FIELD_BYTES = 1024
MAX_FIELDS = 8
READ_BYTES = 1 << 20
PART_BYTES = 8 << 20

_SHOWN = (files.c.id, files.c.purpose, files.c.filename, files.c.bytes, files.c.owner,
          files.c.created_at, files.c.expires_at)  # fmt: skip


class FileTooLarge(PayloadTooLarge):
    """A file larger than ``jobs.max_file_bytes``."""

    code = "file_too_large"


class FileQuotaExceeded(PayloadTooLarge):
    """A file that would take its owner's files past ``jobs.max_file_bytes_per_owner``."""

    code = "file_quota_exceeded"


class TooManyFiles(Conflict):
    """An owner who keeps ``jobs.max_files_per_owner`` files already."""

    code = "too_many_files"

    def headers(self) -> dict[str, str]:
        # OpenAI's clients retry a 409 (a lock timeout, to them) unless told not to:
        # the same upload would be refused again until a file is deleted or expires.
        return {"x-should-retry": "false"}


def new_file_id() -> str:
    """Time-ordered, as job ids are: ``file-`` then milliseconds and 64 random bits."""
    return f"file-{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


def files_root(settings: Settings) -> str:
    """Where new files' bytes go (a URI): the S3 store's ``_files`` prefix, or
    ``<data_dir>/files``."""
    if settings.artifact_store:
        return f"{settings.artifact_store.rstrip('/')}/{REMOTE_PREFIX}"
    return (Path(settings.data_dir) / FILES).resolve().as_uri()


# -- room: what an owner may still upload ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Room:
    """The bytes one upload may bring, and the limit that sets them."""

    limit_bytes: int
    quota_bytes: int | None = None
    """The owner's quota (``jobs.max_file_bytes_per_owner``) when what is left of it
    binds; None: ``jobs.max_file_bytes`` does."""
    used_bytes: int = 0
    """What the owner keeps already."""

    def refuse(self, size: int | None = None) -> PayloadTooLarge:
        past = "is larger than" if size is None else f"of {size} bytes is larger than"
        if self.quota_bytes is None:
            return FileTooLarge(
                f"the file {past} jobs.max_file_bytes ({self.limit_bytes} bytes)",
                limit_bytes=self.limit_bytes, param="file",
            )  # fmt: skip
        return FileQuotaExceeded(
            f"the file {past} what is left of its owner's quota: {self.limit_bytes} of "
            f"jobs.max_file_bytes_per_owner ({self.quota_bytes} bytes; {self.used_bytes} "
            "kept). Delete files (DELETE /v1/files/{file_id}) or let them expire",
            limit_bytes=self.quota_bytes, used_bytes=self.used_bytes, param="file",
        )  # fmt: skip


def room_for(count: int, used: int, cfg: JobsConfig, size: int | None = None) -> Room:
    """What an owner keeping ``count`` files of ``used`` bytes may upload; the refusal
    (TooManyFiles, FileTooLarge, FileQuotaExceeded) when that is nothing, or less than
    ``size``."""
    if count >= cfg.max_files_per_owner:
        raise TooManyFiles(
            f"the owner keeps {count} files, jobs.max_files_per_owner "
            f"({cfg.max_files_per_owner}): delete one (DELETE /v1/files/{{file_id}}) or let "
            "one expire",
            limit=cfg.max_files_per_owner, param="file",
        )  # fmt: skip
    quota = cfg.max_file_bytes_per_owner
    left = max(quota - used, 0)
    room = Room(cfg.max_file_bytes) if left >= cfg.max_file_bytes else Room(left, quota, used)
    if left == 0 or (size is not None and size > room.limit_bytes):
        raise room.refuse(size)
    return room


# -- receiving an upload --------------------------------------------------------------------


@dataclass(slots=True)
class Upload:
    """A multipart upload as received: its form fields, and its one file, on disk."""

    path: Path
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    """None: the body had no file part."""
    size_bytes: int = 0
    sha256: str = ""
    blank: bool = True
    """The file holds nothing but whitespace."""


class _Multipart:
    """python-multipart's callbacks for one upload: fields kept (small, few), the file
    part written to disk as it comes, counted against ``room`` and hashed."""

    def __init__(
        self,
        out: IO[bytes],
        upload: Upload,
        room: Room,
        on_file: Callable[[dict[str, str]], object],
    ) -> None:
        self.out, self.upload, self.room, self.on_file = out, upload, room, on_file
        self.digest = hashlib.sha256()
        self.ended = False
        self._header = [b"", b""]
        self._disposition = b""
        self._head_bytes = 0
        self._field: tuple[str, bytearray] | None = None  # None: in the file part

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._data,
            "on_part_end": self._end_part, "on_end": self._end,
        }  # fmt: skip

    def _begin(self) -> None:
        self._disposition, self._head_bytes, self._field = b"", 0, None

    def _header_part(self, which: int, data: bytes, start: int, end: int) -> None:
        self._head_bytes += end - start
        if self._head_bytes > FIELD_BYTES * 8:
            raise InvalidInput("a part's headers are too long")
        self._header[which] += data[start:end]

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_part(0, data, start, end)

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_part(1, data, start, end)

    def _header_end(self) -> None:
        if self._header[0].lower() == b"content-disposition":
            self._disposition = self._header[1]
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise InvalidInput("a part of the multipart body has no name")
        upload = self.upload
        if b"filename" not in options:
            if len(upload.fields) >= MAX_FIELDS:
                raise InvalidInput(f"the form has more than {MAX_FIELDS} fields")
            self._field = (name.decode("utf-8", "replace"), bytearray())
            return
        if upload.filename is not None:
            raise InvalidInput("upload one file at a time", param="file")
        upload.filename = options[b"filename"].decode("utf-8", "replace")
        self.on_file(upload.fields)  # its fields so far may be refused before its bytes

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._field is not None:
            value = self._field[1]
            if len(value) + end - start > FIELD_BYTES:
                raise InvalidInput(f"form field {self._field[0]!r} is too long")
            value += data[start:end]
            return
        upload = self.upload
        upload.size_bytes += end - start
        if upload.size_bytes > self.room.limit_bytes:
            raise self.room.refuse()
        piece = memoryview(data)[start:end]
        self.digest.update(piece)
        self.out.write(piece)
        if upload.blank and data[start:end].strip():
            upload.blank = False

    def _end_part(self) -> None:
        if self._field is not None:
            name, value = self._field
            self.upload.fields[name] = value.decode("utf-8", "replace")

    def _end(self) -> None:
        self.ended = True


async def receive(
    content_type: str,
    chunks: AsyncIterator[bytes],
    dest: Path,
    room: Room,
    on_file: Callable[[dict[str, str]], object],
) -> Upload:
    """A ``multipart/form-data`` body parsed as it arrives, its file part written to
    ``dest``; refused (``room.refuse``) as soon as the file, or the whole body, passes
    what ``room`` allows. ``on_file`` sees the fields sent before the file, when it
    begins."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidInput("the multipart/form-data body has no boundary")
    upload = Upload(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with dest.open("wb") as out:
        parts = _Multipart(out, upload, room, on_file)
        parser = MultipartParser(boundary, parts.callbacks())  # type: ignore[arg-type]
        async for chunk in chunks:
            total += len(chunk)
            if total > room.limit_bytes + FORM_BYTES:
                raise room.refuse()
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise InvalidInput(f"the multipart body is malformed: {exc}") from None
    if not parts.ended:
        raise InvalidInput("the multipart body ended before its closing boundary")
    upload.sha256 = parts.digest.hexdigest()
    return upload


# -- the file store: where the bytes are ----------------------------------------------------


def _local(location: str) -> Path | None:
    parsed = urlparse(location)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else None


def _s3(location: str) -> Any:
    from inferd.registry.remote_store import S3Store  # s3fs, for an S3 store only

    return S3Store(location).fs


def _put(staged: Path, location: str) -> None:
    path = _local(location)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staged, path)
        return
    # Parts of PART_BYTES, not s3fs's 50 MiB (a file under two parts is sent in one
    # piece): what a gateway holds of an upload while it goes to the store.
    parts = max(PART_BYTES, -(-staged.stat().st_size // 10_000))  # S3: 10,000 parts at most
    try:
        _s3(location).put_file(str(staged), location, chunksize=parts)
    except Exception as exc:  # OSError, botocore's and aiohttp's connection errors
        raise StoreUnavailable(f"cannot write the file to {location}: {exc}") from None


def _open(location: str) -> IO[bytes]:
    path = _local(location)
    try:
        if path is not None:
            return path.open("rb")
        return _s3(location).open(location, "rb", block_size=READ_BYTES)  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise StoreUnavailable(
            f"the file's bytes are not at {location}: with gateways on several hosts, files "
            "need an S3 artifact_store, as versions do"
        ) from None
    except Exception as exc:  # OSError, botocore's and aiohttp's connection errors
        raise StoreUnavailable(f"cannot read {location}: {exc}") from None


def _remove(location: str | None) -> bool:
    """Delete the bytes at ``location`` (None: in the row); False when they may remain."""
    if location is None:
        return True
    try:
        path = _local(location)
        if path is not None:
            path.unlink(missing_ok=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                _s3(location).rm(location)
    except Exception:  # the store may be down: the next upkeep tries again
        logger.warning("files: could not remove %s; trying again later", location, exc_info=True)
        return False
    return True


# -- the table ------------------------------------------------------------------------------


def _live(now: datetime) -> Any:
    return (files.c.status == "processed") & or_(
        files.c.expires_at.is_(None), files.c.expires_at > now
    )


class FileStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._writes = engine.execution_options(**{WRITE: True})

    def room(self, owner: str | None, cfg: JobsConfig, declared: int | None = None) -> Room:
        """What ``owner`` may upload now; refused at once when it is nothing, or less
        than ``declared`` bytes (a body's length, with its form)."""
        with self.engine.connect() as conn:
            room = room_for(*_kept(conn, owner), cfg)
        if declared is not None and declared - FORM_BYTES > room.limit_bytes:
            raise room.refuse()
        return room

    def create(
        self, upload: Upload, purpose: str, owner: str | None, keep_s: float, root: str,
        cfg: JobsConfig,
    ) -> dict[str, Any]:  # fmt: skip
        """Record ``upload`` and store its bytes under ``root`` (:func:`files_root`);
        refused (its bytes removed) when its owner has no room left for it."""
        now = datetime.now(UTC)
        file_id = new_file_id()
        row = {
            "id": file_id, "purpose": purpose, "filename": (upload.filename or "")[:256],
            "bytes": upload.size_bytes, "owner": owner, "created_at": now,
            "expires_at": now + timedelta(seconds=keep_s),
        }  # fmt: skip
        location = f"{root}/{file_id}"
        with self._writes.begin() as conn:
            conn.execute(insert(files).values({
                **row, "expires_at": now + timedelta(seconds=PENDING_S), "status": "uploading",
                "sha256": upload.sha256, "location": location,
            }))  # fmt: skip
        try:
            _put(upload.path, location)
            with self._writes.begin() as conn:
                _lock_owner(conn, owner)
                room_for(*_kept(conn, owner), cfg, upload.size_bytes)
                conn.execute(
                    update(files)
                    .where(files.c.id == file_id)
                    .values(status="processed", expires_at=row["expires_at"])
                )
        except BaseException:
            self._remove([(file_id, location)])
            raise
        return row

    def get(self, file_id: str) -> dict[str, Any] | None:
        """The file's record (not its content), unless it expired or was deleted."""
        query = select(*_SHOWN).where(files.c.id == file_id, _live(datetime.now(UTC)))
        with self.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else dict(row)

    def open(self, file_id: str) -> IO[bytes]:
        """The file's bytes, to read (and close) in a worker thread; NotFound once it
        expired or was deleted."""
        query = select(files.c.location, files.c.content).where(
            files.c.id == file_id, _live(datetime.now(UTC))
        )
        with self.engine.connect() as conn:
            found = conn.execute(query).first()
        if found is None:
            raise NotFound(f"No such File object: {file_id}")
        location, content = found
        return io.BytesIO(content or b"") if location is None else _open(location)

    def find(
        self, purpose: str | None, owner: str | None, after: str | None, limit: int, newest: bool
    ) -> list[dict[str, Any]]:
        """Files (``owner`` None: everyone's), by id (creation order), after ``after``."""
        query = select(*_SHOWN).where(_live(datetime.now(UTC)))
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
        """Hide the file at once, then remove its bytes and row (the upkeep retries
        what could not be removed now)."""
        now = datetime.now(UTC)
        with self._writes.begin() as conn:
            location = conn.execute(
                update(files)
                .where(files.c.id == file_id, _live(now))
                .values(expires_at=now)
                .returning(files.c.location)
            ).first()
        if location is None:
            return False
        self._remove([(file_id, location[0])])
        return True

    def purge(self, page: int = 500) -> int:
        """Remove the files that expired (or were deleted, or never finished uploading):
        their bytes, then their rows; the count removed."""
        removed = 0
        while True:
            query = select(files.c.id, files.c.location).where(
                files.c.expires_at <= datetime.now(UTC)
            )
            with self.engine.connect() as conn:
                rows = [(r[0], r[1]) for r in conn.execute(query.limit(page))]
            gone = self._remove(rows)
            removed += gone
            if len(rows) < page or gone < len(rows):
                return removed

    def _remove(self, rows: list[tuple[str, str | None]]) -> int:
        done = [file_id for file_id, location in rows if _remove(location)]
        if done:
            with self._writes.begin() as conn:
                conn.execute(delete(files).where(files.c.id.in_(done)))
        return len(done)


def _kept(conn: Connection, owner: str | None) -> tuple[int, int]:
    """The files ``owner`` keeps (not expired nor deleted) and their bytes."""
    query = select(func.count(), func.coalesce(func.sum(files.c.bytes), 0)).where(
        files.c.owner.is_(None) if owner is None else files.c.owner == owner,
        _live(datetime.now(UTC)),
    )
    count, used = conn.execute(query).one()
    return int(count), int(used)


def _lock_owner(conn: Connection, owner: str | None) -> None:
    """Serialise quota checks of one owner: SQLite's write transactions already are
    (``BEGIN IMMEDIATE``); PostgreSQL takes an advisory lock until the commit."""
    if conn.dialect.name == "postgresql":
        key = f"inferd.files:{owner or ''}"
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": key})


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


__all__ = [
    "FileQuotaExceeded",
    "FileStore",
    "FileTooLarge",
    "Room",
    "TooManyFiles",
    "Upload",
    "files_root",
    "new_file_id",
    "output_lines",
    "output_size",
    "receive",
    "room_for",
]
