"""``POST /v1/files`` as a demanding client and an attacker try it, against a real
``inferd serve`` with auth on and one gateway process: an upload streams to the file
store (the gateway's resident memory does not grow by its size), one past
``jobs.max_file_bytes`` is answered 413 as soon as it passes and the connection closes
with the rest unread, the per-owner quota and count hold one owner and not another,
files are their owner's, and an expired file is gone, its bytes removed by the upkeep.
With an S3 artifact store the bytes are in the bucket, where any host reads them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import InferdServer, create_key, moto_s3
from tests.test_abuse_grpc import Guarded, PeakRss, _wait

pytestmark = pytest.mark.slow
MiB = 1 << 20
MAX_FILE = 64 * MiB
QUOTA = 80 * MiB
MAX_FILES = 4
LINE = b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m"}}\n'


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    data: Path = tmp_path_factory.mktemp("abuse-files")
    keys = {name: create_key(data, name, "infer") for name in ("alice", "bob", "carol", "dave")}
    keys["admin"] = create_key(data, "ops", "admin")
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_JOBS__MAX_FILE_BYTES": str(MAX_FILE),
        "INFERD_JOBS__MAX_FILE_BYTES_PER_OWNER": str(QUOTA),
        "INFERD_JOBS__MAX_FILES_PER_OWNER": str(MAX_FILES),
    }
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        yield Guarded(server, keys)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _auth(guarded: Guarded, who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {guarded.keys[who]}"}


def _upload(
    guarded: Guarded, who: str, content: Any, name: str = "in.jsonl", **fields: str
) -> httpx.Response:
    return guarded.server.client.post(
        "/v1/files", files={"file": (name, content)}, data={"purpose": "batch", **fields},
        headers=_auth(guarded, who), timeout=120,
    )  # fmt: skip


def _openai(guarded: Guarded, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{guarded.server.url}/v1", api_key=guarded.keys[who])


def _stored(guarded: Guarded) -> set[str]:
    folder = guarded.server.data_dir / "files"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def _error(reply: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error  # OpenAI's shape
    return error


def test_an_upload_streams_to_the_file_store_in_bounded_memory(
    guarded: Guarded, tmp_path: Path
) -> None:
    assert _upload(guarded, "alice", LINE).status_code == 200  # the database layer loads
    big = tmp_path / "big.jsonl"
    with big.open("wb") as out:
        for _ in range(48):
            out.write(LINE * (MiB // len(LINE)))
    size, digest = big.stat().st_size, hashlib.sha256(big.read_bytes()).hexdigest()
    guarded.settle()
    with PeakRss(guarded) as rss, big.open("rb") as f:
        reply = _upload(guarded, "alice", f, "big.jsonl")
    assert reply.status_code == 200, reply.text
    print(f"\nupload of {size / MiB:.0f} MiB: gateway RSS grew {rss.growth / MiB:.1f} MiB")
    assert rss.growth < 16 * MiB, rss.growth / MiB
    uploaded = reply.json()
    assert uploaded["bytes"] == size and uploaded["filename"] == "big.jsonl"
    stored = guarded.server.data_dir / "files" / uploaded["id"]  # in the store, not the db
    assert stored.stat().st_size == size
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == digest
    read = hashlib.sha256()
    with PeakRss(guarded) as rss, guarded.server.client.stream(
        "GET", f"/v1/files/{uploaded['id']}/content", headers=_auth(guarded, "alice")
    ) as content:  # fmt: skip
        assert content.headers["content-length"] == str(size)
        for piece in content.iter_bytes():
            read.update(piece)
    print(f"download of it: gateway RSS grew {rss.growth / MiB:.1f} MiB")
    assert read.hexdigest() == digest and rss.growth < 16 * MiB, rss.growth / MiB
    deleted = guarded.server.client.delete(
        f"/v1/files/{uploaded['id']}", headers=_auth(guarded, "alice")
    )
    assert deleted.json()["deleted"] and not stored.exists()  # its bytes with it


def _connect(guarded: Guarded) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _head(guarded: Guarded, length: str) -> bytes:
    return (
        b"POST /v1/files HTTP/1.1\r\nhost: x\r\n"
        b"authorization: Bearer " + guarded.keys["bob"].encode() + b"\r\n"
        b"content-type: multipart/form-data; boundary=b\r\n" + length.encode() + b"\r\n\r\n"
    )


_FILE_PART = (
    b'--b\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    b'--b\r\ncontent-disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
)


def _response(sock: socket.socket) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Status, headers and JSON body of the one response on ``sock``, read until the
    server closes it (with a reset once the response is in: it left bytes unread)."""
    sock.settimeout(10)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_past_the_file_limit_413_as_it_passes_and_the_rest_is_never_read(
    guarded: Guarded,
) -> None:
    stored = _stored(guarded)
    piece = _chunk(LINE * (MiB // len(LINE)))
    with PeakRss(guarded) as rss, _connect(guarded) as sock:
        sock.sendall(_head(guarded, "transfer-encoding: chunked") + _chunk(_FILE_PART))
        for _ in range(MAX_FILE // MiB + 2):  # 2 MiB past the limit, then wait
            sock.sendall(piece)
        status, headers, body = _response(sock)
        with pytest.raises(OSError):  # closed: what the client would send next is refused
            for _ in range(256):
                sock.sendall(piece)
    assert status == 413 and headers["connection"] == "close", (status, headers)
    assert body["error"]["code"] == "file_too_large"
    assert f"jobs.max_file_bytes ({MAX_FILE} bytes)" in body["error"]["message"]
    assert body["error"]["param"] == "file"
    assert rss.growth < 16 * MiB, rss.growth / MiB
    assert _stored(guarded) == stored  # nothing kept
    assert not list((guarded.server.data_dir / "uploads").glob("*/file"))  # scratch gone


def test_a_declared_length_past_the_limit_is_refused_before_the_body(guarded: Guarded) -> None:
    with _connect(guarded) as sock:
        sock.sendall(_head(guarded, f"content-length: {1 << 40}"))  # 1 TiB; no body sent
        status, headers, body = _response(sock)
    assert status == 413 and headers["connection"] == "close"
    assert "jobs.max_file_bytes" in body["error"]["message"]


def test_the_count_limit_holds_one_owner_and_not_another(guarded: Guarded) -> None:
    ids = [_upload(guarded, "carol", LINE).json()["id"] for _ in range(MAX_FILES)]
    refused = _upload(guarded, "carol", LINE)
    assert refused.status_code == 409, refused.text
    assert refused.headers["x-should-retry"] == "false"  # openai's clients retry a 409
    error = _error(refused)
    assert error["code"] == "too_many_files" and error["type"] == "invalid_request_error"
    assert f"jobs.max_files_per_owner ({MAX_FILES})" in error["message"]
    with pytest.raises(openai.ConflictError, match=r"jobs\.max_files_per_owner"):
        _openai(guarded, "carol").files.create(file=("in.jsonl", LINE), purpose="batch")
    assert _upload(guarded, "bob", LINE).status_code == 200  # another owner is unaffected
    client = guarded.server.client
    assert client.delete(f"/v1/files/{ids[0]}", headers=_auth(guarded, "carol")).status_code == 200
    assert _upload(guarded, "carol", LINE).status_code == 200  # a deleted file is not counted


def test_the_byte_quota_holds_one_owner_and_not_another(guarded: Guarded) -> None:
    part = LINE * (36 * MiB // len(LINE))
    first = _upload(guarded, "dave", part).json()["id"]
    assert _upload(guarded, "dave", part).status_code == 200  # 72 of 80 MiB
    refused = _upload(guarded, "dave", part[: 10 * MiB])
    assert refused.status_code == 413, refused.text
    error = _error(refused)
    assert error["code"] == "file_quota_exceeded" and error["param"] == "file"
    assert f"jobs.max_file_bytes_per_owner ({QUOTA} bytes" in error["message"]
    with pytest.raises(openai.APIStatusError, match=r"jobs\.max_file_bytes_per_owner") as seen:
        _openai(guarded, "dave").files.create(file=("in.jsonl", part), purpose="batch")
    assert seen.value.status_code == 413  # refused at its headers, the body unread
    assert _upload(guarded, "bob", part[: 10 * MiB]).status_code == 200
    client = guarded.server.client
    assert client.delete(f"/v1/files/{first}", headers=_auth(guarded, "dave")).status_code == 200
    assert _upload(guarded, "dave", part[: 10 * MiB]).status_code == 200


def test_a_file_is_its_owner_s(guarded: Guarded) -> None:
    c = guarded.server.client
    file_id = _upload(guarded, "alice", LINE, "mine.jsonl").json()["id"]
    bob, alice = _auth(guarded, "bob"), _auth(guarded, "alice")
    assert (
        c.post("/v1/files", files={"file": ("x", LINE)}, data={"purpose": "batch"}).status_code
        == 401
    )
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        reply = c.request(method, f"/v1/files/{file_id}{path}", headers=bob)
        assert reply.status_code == 404 and "No such File" in _error(reply)["message"]
    assert file_id not in [f["id"] for f in c.get("/v1/files", headers=bob).json()["data"]]
    batch = {"input_file_id": file_id, "endpoint": "/v1/embeddings"}
    assert c.post("/v1/batches", json=batch, headers=bob).status_code == 404
    assert c.get(f"/v1/files/{file_id}", headers=_auth(guarded, "admin")).status_code == 200
    assert c.get(f"/v1/files/{file_id}/content", headers=alice).content == LINE
    assert file_id in [f["id"] for f in c.get("/v1/files", headers=alice).json()["data"]]


@pytest.fixture(scope="module")
def expiring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    """A server whose files are kept 3 s unless their upload says otherwise, and whose
    upkeep runs twice a second."""
    data: Path = tmp_path_factory.mktemp("expiring-files")
    keys = {"alice": create_key(data, "alice", "infer")}
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_JOBS__FILE_KEEP_S": "3",
        "INFERD_JOBS__UPKEEP_INTERVAL_S": "0.5",
    }
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        yield Guarded(server, keys)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_files_expire_and_the_upkeep_removes_their_bytes(expiring: Guarded) -> None:
    c, alice = expiring.server.client, _auth(expiring, "alice")
    kept = _upload(expiring, "alice", LINE, **{
        "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600",
    }).json()  # fmt: skip
    assert kept["expires_at"] == kept["created_at"] + 3600
    short = _upload(expiring, "alice", LINE).json()
    assert short["expires_at"] - short["created_at"] in (2, 3, 4)  # jobs.file_keep_s
    assert _stored(expiring) == {kept["id"], short["id"]}
    for fields, says in (
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "anchor"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "3600 to"),
        ({"expires_after[anchor]": "created_at"}, "seconds"),
        ({"purpose": "fine-tune"}, "'purpose' must be 'batch'"),
        ({"colour": "blue"}, "Unrecognized form field(s): colour"),
    ):
        reply = _upload(expiring, "alice", LINE, **fields)
        assert reply.status_code == 400 and says in _error(reply)["message"], reply.text
    assert _wait(lambda: c.get(f"/v1/files/{short['id']}", headers=alice).status_code == 404, 10)
    assert c.get(f"/v1/files/{short['id']}/content", headers=alice).status_code == 404
    listed = [f["id"] for f in c.get("/v1/files", headers=alice).json()["data"]]
    assert listed == [kept["id"]]
    batch = {"input_file_id": short["id"], "endpoint": "/v1/embeddings"}
    refused = c.post("/v1/batches", json=batch, headers=alice)
    assert refused.status_code == 404 and _error(refused)["param"] == "input_file_id"
    assert _wait(lambda: _stored(expiring) == {kept["id"]}, 10), _stored(expiring)


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    pytest.importorskip("s3fs")
    with moto_s3("inferd-files") as env:
        yield env


def test_with_an_s3_store_the_bytes_are_in_the_bucket(
    tmp_path: Path, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from inferd.jobs.files import FileStore
    from inferd.registry.engine import create_registry_engine

    db = f"sqlite:///{tmp_path / 'shared' / 'inferd.db'}"
    env = {**s3_env, "INFERD_ARTIFACT_STORE": "s3://inferd-files/prod", "INFERD_DATABASE_URL": db}
    server = InferdServer(tmp_path / "a", workers=1, env=env)
    fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    try:
        server.wait_ready()
        content = LINE * (20 * MiB // len(LINE))  # sent to the bucket in parts
        reply = server.client.post(
            "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
        )
        file_id = reply.json()["id"]
        assert fs.cat_file(f"inferd-files/prod/_files/{file_id}") == content
        assert not (tmp_path / "a" / "files").exists()
        assert server.client.get(f"/v1/files/{file_id}/content").content == content
        batch = {"input_file_id": file_id, "endpoint": "/v1/embeddings"}
        reply = server.client.post("/v1/batches", json=batch)  # its lines read from the bucket
        assert reply.status_code == 400 and "line 2 repeats custom_id 'c'" in reply.text
        # another host: only the database and the bucket in common
        for key, value in s3_env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # one an earlier test made, for its moto
        engine = create_registry_engine(db)
        with FileStore(engine).open(file_id) as opened:
            assert opened.read() == content
        engine.dispose()
        assert server.client.delete(f"/v1/files/{file_id}").json()["deleted"]
        assert not fs.exists(f"inferd-files/prod/_files/{file_id}")
    finally:
        assert server.stop() == 0, server.log()[-3000:]
