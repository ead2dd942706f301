"""Versions in an S3-compatible store, against a real one on 127.0.0.1: moto's standalone
server (it speaks the S3 REST API over HTTP, as boto3/s3fs clients use it, with
multipart uploads, listings and errors the way S3 answers them; it runs from PyPI with no
binary download, which MinIO would need).

A version registered through one server lives in the bucket; a server with a fresh data
folder and the same database serves it by fetching it into its cache; a tampered object
is never served; an unreachable store is a 503 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    InferdServer,
    arithmetic_model,
    free_port,
    moto_s3,
    run_cli,
    upload_arithmetic,
)

pytestmark = pytest.mark.slow
BUCKET = "inferd-models"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Path]]:
    """The store's environment, and its request log."""
    pytest.importorskip("s3fs")
    log = tmp_path_factory.mktemp("moto") / "requests.log"
    with moto_s3(BUCKET, log) as env:
        yield env, log


@pytest.fixture(scope="module")
def s3(s3_server: tuple[dict[str, str], Path]) -> dict[str, str]:
    return s3_server[0]


def gets(log: Path, key: str) -> int:
    """How many times the store was asked for the object ``key`` (its request log)."""
    return sum(f'"GET /{BUCKET}/{key} ' in line for line in log.read_text().splitlines())


def _fs(env: dict[str, str]):
    import s3fs

    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=env["AWS_ENDPOINT_URL"],
    )


def _upload(server: InferdServer, model: str, version: str, expression: str) -> httpx.Response:
    return upload_arithmetic(server.client, model, version, expression)


def _y(server: InferdServer, model: str, x: float) -> float | None:
    reply = server.client.post(f"/api/v1/models/{model}/predict", json={"inputs": [{"x": x}]})
    return reply.json()["outputs"][0]["y"] if reply.status_code == 200 else None


def test_a_fresh_server_serves_from_the_store_and_refuses_tampered_files(
    tmp_path: Path, s3: dict[str, str]
):
    db = f"sqlite:///{tmp_path / 'shared' / 'inferd.db'}"
    env = {**s3, "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/prod", "INFERD_DATABASE_URL": db}
    first = InferdServer(tmp_path / "a", workers=1, env=env)
    try:
        first.wait_ready()
        pushed = _upload(first, "calc", "v1", "x * 7")
        assert pushed.status_code == 201, pushed.text
        record = pushed.json()["version"]
        assert record["artifact_uri"] == f"s3://{BUCKET}/prod/calc/v1"
        first.wait_for(lambda: _y(first, "calc", 2.0) == 14.0, what="calc serving")
    finally:
        assert first.stop() == 0, first.log()[-3000:]
    fs = _fs(s3)
    assert sorted(fs.ls(f"{BUCKET}/prod/calc/v1")) == [
        f"{BUCKET}/prod/calc/v1/inferd.json",
        f"{BUCKET}/prod/calc/v1/model.py",
    ]
    manifest = json.loads(fs.cat_file(f"{BUCKET}/prod/calc/v1.manifest.json"))
    assert manifest["sha256"] == record["sha256"]

    # another machine: nothing but the database and the store
    fresh = tmp_path / "b"
    second = InferdServer(fresh, workers=1, env=env)
    try:
        second.wait_ready()
        assert _y(second, "calc", 3.0) == 21.0
        cached = fresh / "artifact-cache" / record["sha256"]  # the host's cache, by content
        assert (cached / "model.py").is_file()
        pulled = second.client.get("/api/v1/models/calc/versions/v1/artifact")
        assert pulled.headers["x-inferd-sha256"] == record["sha256"]
    finally:
        assert second.stop() == 0, second.log()[-3000:]

    # a tampered object is not the registered file: never served
    fs.pipe_file(f"{BUCKET}/prod/calc/v1/model.py", arithmetic_model("x * 0").encode())
    third = InferdServer(tmp_path / "c", workers=1, env=env)
    try:
        third.wait_ready(path="/health/live")  # not ready: its one model is refused
        third.wait_for(
            lambda: "not the registered file" in third.log(), what="the check to refuse it"
        )
        assert _y(third, "calc", 3.0) is None
        detail = third.client.get("/api/v1/models/calc/versions/v1").json()
        assert all(r["state"] != "ready" for r in detail["replicas"]), detail["replicas"]
        cache = tmp_path / "c" / "artifact-cache"
        assert not (cache / record["sha256"]).exists()
        assert not list(cache.glob(".fetch-*"))  # the refused download left nothing
    finally:
        assert third.stop() == 0, third.log()[-3000:]


def test_an_unreachable_store_is_a_503_naming_it(tmp_path: Path, s3: dict[str, str]):
    env = {
        **s3,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "AWS_MAX_ATTEMPTS": "1",
        "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/prod",
    }
    server = InferdServer(tmp_path / "d", workers=1, env=env)
    try:
        server.wait_ready()
        refused = _upload(server, "calc", "v1", "x")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "store_unavailable" and f"s3://{BUCKET}/prod" in error["message"]
        assert server.client.get("/api/v1/models/calc").status_code == 404
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_versions_import_from_s3_uris(tmp_path: Path, s3: dict[str, str]):
    """``source_uri: s3://…`` (a prefix: a folder; a key: one file), into the local store."""
    fs = _fs(s3)
    fs.pipe_file(f"{BUCKET}/exports/double/model.py", arithmetic_model("x * 2").encode())
    fs.pipe_file(f"{BUCKET}/exports/double/notes/readme.txt", b"kept")
    fs.pipe_file(f"{BUCKET}/exports/triple/model.py", arithmetic_model("x * 3").encode())
    server = InferdServer(tmp_path / "e", workers=1, env=s3)
    try:
        server.wait_ready()

        def imported(model: str, uri: str) -> httpx.Response:
            return server.client.post(
                f"/api/v1/models/{model}/versions", json={"version": "v1", "source_uri": uri}
            )

        folder = imported("double", f"s3://{BUCKET}/exports/double")
        assert folder.status_code == 201, folder.text
        stored = tmp_path / "e" / "artifacts" / "double" / "v1"
        assert (stored / "notes" / "readme.txt").read_bytes() == b"kept"
        one = imported("triple", f"s3://{BUCKET}/exports/triple/model.py")
        assert one.status_code == 201, one.text
        server.wait_for(lambda: _y(server, "double", 2.0) == 4.0, what="double serving")
        server.wait_for(lambda: _y(server, "triple", 2.0) == 6.0, what="triple serving")
        missing = imported("none", f"s3://{BUCKET}/exports/nothing")
        assert missing.status_code == 422 and "no object" in missing.json()["error"]["message"]
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_host_downloads_a_version_once_for_all_its_replicas(
    tmp_path: Path, s3_server: tuple[dict[str, str], Path]
):
    """The artifact cache is the host's, by content: the host that registers a version
    has it already; two replicas starting together on another host download it once,
    and a later server there (same cache folder, fresh data folder) not at all."""
    s3, log = s3_server
    db = f"sqlite:///{tmp_path / 'shared' / 'inferd.db'}"
    env = {**s3, "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/hosts", "INFERD_DATABASE_URL": db}
    key = "hosts/calc/v1/model.py"
    pusher = InferdServer(
        tmp_path / "a", workers=1, env={**env, "INFERD_ARTIFACT_CACHE__DIR": str(tmp_path / "h1")}
    )
    try:
        pusher.wait_ready()
        assert _upload(pusher, "calc", "v1", "x * 5").status_code == 201
        pusher.wait_for(lambda: _y(pusher, "calc", 2.0) == 10.0, what="calc serving")
        assert gets(log, key) == 0  # its push seeded the host's cache
    finally:
        assert pusher.stop() == 0, pusher.log()[-3000:]

    host = {**env, "INFERD_ARTIFACT_CACHE__DIR": str(tmp_path / "h2"), "INFERD_REPLICAS": "2"}
    for data in ("b", "c"):  # two servers of one host, one after the other
        server = InferdServer(tmp_path / data, workers=1, env=host)
        try:
            server.wait_ready()
            server.wait_for(
                lambda s=server: (
                    s.client.get("/api/v1/models/calc").json()["versions"]
                    and len(_ready_stats(s)) == 2
                ),
                what="both replicas ready",
            )
            assert _y(server, "calc", 3.0) == 15.0
            fetched = sorted(stats["fetched_bytes"] for stats in _ready_stats(server))
            if data == "b":
                assert fetched[0] == 0 and fetched[1] > 0  # one fetched, the other waited
            else:
                assert fetched == [0, 0]
            assert gets(log, key) == 1
        finally:
            assert server.stop() == 0, server.log()[-3000:]

    # a host made ready before a deploy: `inferd models prefetch` fills its cache
    other = {**env, "INFERD_ARTIFACT_CACHE__DIR": str(tmp_path / "h3")}
    done = run_cli("models", "prefetch", "calc", "v1", data_dir=tmp_path / "d", env=other)
    said = " ".join((done.stdout + done.stderr).split())
    assert "calc:v1 is in this host's cache" in said, said
    assert gets(log, key) == 2
    assert (tmp_path / "h3" / _sha256_of(tmp_path / "h2") / "model.py").is_file()
    pulled = run_cli("models", "pull", "calc", "v1", "--out", str(tmp_path / "out"),
                     data_dir=tmp_path / "e", env=other)  # fmt: skip
    assert "x * 5" in (tmp_path / "out" / "model.py").read_text(), pulled.stderr
    assert gets(log, key) == 2  # pulled from the host's cache


def _sha256_of(cache: Path) -> str:
    (entry,) = [p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return entry


def _ready_stats(server: InferdServer) -> list[dict[str, float]]:
    detail = server.client.get("/api/v1/models/calc/versions/v1").json()
    return [r["stats"] for r in detail["replicas"] if r["state"] == "ready" and "stats" in r]
