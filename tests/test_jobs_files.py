"""Uploaded files without a server, on SQLite and the machine's PostgreSQL: a multipart
body streamed to disk and cut off at its limit, the per-owner quota and count, expiry
and purge removing the bytes, and rows an older server wrote (bytes in the database)
still readable after the migration."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text, update

from inferd.config import JobsConfig
from inferd.errors import InvalidInput
from inferd.jobs.files import (
    FileQuotaExceeded,
    FileStore,
    FileTooLarge,
    Room,
    TooManyFiles,
    Upload,
    receive,
    room_for,
)
from inferd.registry import schema
from inferd.registry.engine import WRITE, _alembic_config, create_registry_engine
from inferd.registry.tables import files

MiB = 1 << 20


def _multipart(content: bytes, **fields: str) -> tuple[str, bytes]:
    """(content type, body) as the ``openai`` client sends an upload (httpx's encoder)."""
    request = httpx.Request(
        "POST", "http://x/v1/files", data=fields, files={"file": ("in.jsonl", content)}
    )
    return request.headers["content-type"], request.read()


async def _chunks(body: bytes, size: int, taken: list[int]) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        taken.append(start)
        yield body[start : start + size]


def _receive(body: bytes, content_type: str, dest: Path, room: Room) -> tuple[Upload, int]:
    """The upload, and how many chunks of ``body`` were taken from the stream."""
    taken: list[int] = []
    upload = asyncio.run(receive(content_type, _chunks(body, 65536, taken), dest, room, dict))
    return upload, len(taken)


def test_an_upload_streams_to_disk_counted_and_hashed(tmp_path: Path) -> None:
    content = b'{"custom_id": "a"}\n' * 100_000  # 1.9 MB
    content_type, body = _multipart(
        content, purpose="batch", **{"expires_after[anchor]": "created_at"}
    )
    upload, _ = _receive(body, content_type, tmp_path / "up" / "file", Room(10 * MiB))
    assert upload.filename == "in.jsonl" and not upload.blank
    assert upload.fields == {"purpose": "batch", "expires_after[anchor]": "created_at"}
    assert upload.size_bytes == len(content) and (tmp_path / "up" / "file").read_bytes() == content
    assert upload.sha256 == hashlib.sha256(content).hexdigest()
    content_type, body = _multipart(b" \n\n", purpose="batch")
    blank, _ = _receive(body, content_type, tmp_path / "blank", Room(MiB))
    assert blank.blank and blank.size_bytes == 3


def test_an_upload_past_its_room_is_refused_with_the_rest_unread(tmp_path: Path) -> None:
    content_type, body = _multipart(b"x" * (8 * MiB), purpose="batch")
    with pytest.raises(FileTooLarge, match=r"jobs.max_file_bytes \(1048576 bytes\)"):
        _receive(body, content_type, tmp_path / "file", Room(MiB))
    taken: list[int] = []
    left = Room(MiB, 5 * MiB, 4 * MiB)
    with pytest.raises(FileQuotaExceeded, match=r"jobs\.max_file_bytes_per_owner"):
        asyncio.run(receive(content_type, _chunks(body, 65536, taken), tmp_path / "f", left, dict))
    assert len(taken) * 65536 <= MiB + 2 * 65536  # not the 8 MiB
    assert (tmp_path / "f").stat().st_size <= MiB


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n", "ended"),
        (b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n", "no name"),
        (b"--b\r\nContent-Disposition: form-data; name=\"p\"\r\n\r\n" + b"x" * 2000, "too long"),
        (b"garbage", "malformed"),
    ],
)  # fmt: skip
def test_malformed_multipart_is_a_400(tmp_path: Path, body: bytes, says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        _receive(body, "multipart/form-data; boundary=b", tmp_path / "file", Room(MiB))


def test_two_files_in_one_upload_are_refused(tmp_path: Path) -> None:
    request = httpx.Request(
        "POST", "http://x/", files=[("file", ("a", b"1")), ("file", ("b", b"2"))]
    )
    with pytest.raises(InvalidInput, match="one file at a time"):
        _receive(request.read(), request.headers["content-type"], tmp_path / "f", Room(MiB))


def test_room_is_the_file_limit_or_what_is_left_of_the_quota() -> None:
    cfg = JobsConfig(max_file_bytes=10 * MiB, max_file_bytes_per_owner=25 * MiB,
                     max_files_per_owner=3)  # fmt: skip
    assert room_for(0, 0, cfg) == Room(10 * MiB)
    assert room_for(2, 20 * MiB, cfg) == Room(5 * MiB, 25 * MiB, 20 * MiB)
    with pytest.raises(TooManyFiles, match=r"keeps 3 files, jobs.max_files_per_owner \(3\)"):
        room_for(3, 0, cfg)
    with pytest.raises(FileQuotaExceeded, match=r"per_owner \(26214400 bytes; 26214400 kept\)"):
        room_for(2, 25 * MiB, cfg)
    with pytest.raises(FileTooLarge):
        room_for(0, 0, cfg, 11 * MiB)
    with pytest.raises(FileQuotaExceeded):
        room_for(1, 20 * MiB, cfg, 6 * MiB)


def _upload(tmp_path: Path, content: bytes) -> Upload:
    path = tmp_path / "scratch" / hashlib.sha256(content).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    digest = hashlib.sha256(content).hexdigest()
    return Upload(path, {}, "in.jsonl", len(content), digest, not content.strip())


def test_files_live_in_the_store_until_they_expire_or_are_deleted(
    database_url: str, tmp_path: Path
) -> None:
    engine = create_registry_engine(database_url)
    schema.upgrade(engine)
    store, root = FileStore(engine), (tmp_path / "files").as_uri()
    cfg = JobsConfig(max_file_bytes=MiB, max_file_bytes_per_owner=2 * MiB, max_files_per_owner=2)
    content = b'{"custom_id": "a"}\n' + bytes(range(256))  # kept byte for byte
    first = store.create(_upload(tmp_path, content), "batch", "key:alice", 3600, root, cfg)
    on_disk = tmp_path / "files" / first["id"]
    assert on_disk.read_bytes() == content
    assert first["expires_at"] - first["created_at"] == timedelta(hours=1)
    with store.open(first["id"]) as opened:
        assert opened.read() == content
    second = store.create(_upload(tmp_path, b"x\n"), "batch", "key:alice", 3600, root, cfg)
    with pytest.raises(TooManyFiles):  # a third for alice; her bytes are removed again
        store.create(_upload(tmp_path, b"y\n"), "batch", "key:alice", 3600, root, cfg)
    assert sorted(p.name for p in on_disk.parent.iterdir()) == sorted([first["id"], second["id"]])
    other = store.create(_upload(tmp_path, b"z\n"), "batch", "key:bob", 3600, root, cfg)
    assert [f["id"] for f in store.find("batch", "key:alice", None, 10, True)] == [
        second["id"], first["id"]
    ]  # fmt: skip
    assert store.room("key:bob", cfg).limit_bytes == MiB
    # an expired file is gone at once; the upkeep removes its bytes and row
    with engine.begin() as conn:
        past = datetime.now(UTC) - timedelta(seconds=1)
        conn.execute(update(files).where(files.c.id == first["id"]).values(expires_at=past))
    assert store.get(first["id"]) is None
    assert first["id"] not in [f["id"] for f in store.find(None, None, None, 10, True)]
    with pytest.raises(Exception, match="No such File"):
        store.open(first["id"])
    assert store.room("key:alice", cfg).limit_bytes == MiB  # counts live files only
    assert on_disk.exists() and store.purge() == 1 and not on_disk.exists()
    assert store.delete(second["id"]) and not store.delete(second["id"])
    assert not (tmp_path / "files" / second["id"]).exists()
    assert store.get(other["id"]) is not None
    engine.dispose()


def test_rows_an_older_server_wrote_stay_readable(database_url: str, tmp_path: Path) -> None:
    """Migrated from 0013 with a file in the database, the row reads as before, never
    expires, and counts in its owner's quota."""
    from alembic import command

    engine = create_registry_engine(database_url)
    with engine.execution_options(**{WRITE: True}).begin() as conn:
        command.upgrade(_alembic_config(conn), "0013")
    old = b'{"custom_id": "old"}\n' * 3
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO files (id, purpose, filename, bytes, owner, created_at, content) "
                "VALUES (:id, 'batch', 'old.jsonl', :n, 'key:alice', :at, :content)"
            ),
            {"id": "file-old", "n": len(old), "at": datetime.now(UTC), "content": old},
        )
    schema.upgrade(engine)
    store = FileStore(engine)
    row = store.get("file-old")
    assert row is not None and row["bytes"] == len(old) and row["expires_at"] is None
    with store.open("file-old") as opened:
        assert opened.read() == old
    assert [f["id"] for f in store.find("batch", "key:alice", None, 10, True)] == ["file-old"]
    cfg = JobsConfig(max_files_per_owner=1)
    with pytest.raises(TooManyFiles):
        store.room("key:alice", cfg)
    assert store.purge() == 0 and store.get("file-old") is not None
    assert store.delete("file-old") and store.get("file-old") is None
    store.purge()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM files")).scalar() == 0
    engine.dispose()
