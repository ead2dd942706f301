"""Registering over the API against the real server: uploads (tar.gz, zip, one file)
and ``file://`` imports become versions without the CLI or the server's own folders;
the first version of a model serves at once, a later one takes no traffic until it is
deployed (the design documents' deploy-at-10 % flow); downloads give back the same
files; deletes refuse what is deployed; bad input is a 4xx naming what was wrong, and
leaves no row and no file behind — also when the server is killed mid-upload."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import InferdServer, arithmetic_model, run_cli

pytestmark = pytest.mark.slow
LIMIT = 2 * 1024 * 1024


def tar_gz(files: dict[str, bytes], top: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def zipped(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buf.getvalue()


def model_files(expression: str) -> dict[str, bytes]:
    return {"model.py": arithmetic_model(expression).encode()}


def upload(
    client: httpx.Client, model: str, body: bytes, content_type: str = "application/gzip", **params
) -> httpx.Response:
    params.setdefault("sha256", hashlib.sha256(body).hexdigest())
    return client.post(
        f"/api/v1/models/{model}/versions",
        content=body,
        params={k: (json.dumps(v) if isinstance(v, dict | bool) else v) for k, v in params.items()},
        headers={"content-type": content_type},
    )


def predict(client: httpx.Client, model: str, x: float, **params) -> httpx.Response:
    return client.post(
        f"/api/v1/models/{model}/predict", json={"inputs": [{"x": x}], "params": params}
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("registration")
    imports = data.parent / "imports"
    imports.mkdir(exist_ok=True)
    env = {
        "INFERD_REGISTRY__MAX_UPLOAD_BYTES": str(LIMIT),
        "INFERD_REGISTRY__IMPORT_ROOTS": json.dumps([str(imports)]),
    }
    srv = InferdServer(data, workers=2, env=env)
    try:
        srv.wait_ready()
        srv.imports = imports  # type: ignore[attr-defined]
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def _ready(server: InferdServer, model: str, version: str) -> None:
    server.wait_for(
        lambda: predict(server.client, model, 1.0, version=version).status_code == 200,
        timeout_s=60,
        what=f"{model}:{version} serving",
    )


def _no_scratch_left(server: InferdServer) -> bool:
    scratch = server.data_dir / "uploads"
    return not scratch.exists() or not any(scratch.iterdir())


def test_upload_then_deploy_at_10_percent(server: InferdServer):
    c = server.client
    first = upload(c, "calc", tar_gz(model_files("x * 2"), top="calc-model"), version="v1")
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["serving"] is True and body["version"]["framework"] == "python"
    assert body["version"]["signature"]["inputs"][0]["name"] == "x"
    _ready(server, "calc", "v1")
    got = predict(c, "calc", 2.0)
    assert got.status_code == 200, got.text
    assert got.json()["outputs"][0]["y"] == 4.0

    # a second version (a zip this time) is registered, not deployed
    second = upload(c, "calc", zipped(model_files("x * 3")), "application/zip", version="v2")
    assert second.status_code == 201, second.text
    assert second.json()["serving"] is False
    view = c.get("/api/v1/deployments/calc").json()
    assert view["traffic"] == {"v1": 100}
    # the design documents' flow: v2 at 10 %, v1 keeps serving the rest
    deployed = c.post(
        "/api/v1/deployments", json={"model_name": "calc", "version": "v2", "traffic_percent": 10}
    )
    assert deployed.status_code == 201, deployed.text
    assert deployed.json()["traffic"] == {"v1": 90, "v2": 10}
    _ready(server, "calc", "v2")
    assert predict(c, "calc", 2.0, version="v2").json()["outputs"][0]["y"] == 6.0
    versions = [predict(c, "calc", 1.0).json()["version"] for _ in range(200)]
    assert 0 < versions.count("v2") < 60 and versions.count("v1") > 140, versions.count("v2")
    assert _no_scratch_left(server)


def test_one_file_deploy_true_and_file_imports(server: InferdServer):
    c = server.client
    source = arithmetic_model("x + 1").encode()
    refused = upload(c, "plus", source, "application/octet-stream", version="v1")
    assert refused.status_code == 422 and "filename" in refused.json()["error"]["message"]
    one = upload(c, "plus", source, "application/octet-stream", version="v1", filename="model.py")
    assert one.status_code == 201, one.text
    _ready(server, "plus", "v1")
    # deploy=true: the new version takes all the traffic at once
    folder = server.imports / "plus-v2"  # type: ignore[attr-defined]
    folder.mkdir()
    (folder / "model.py").write_text(arithmetic_model("x + 2"))
    imported = c.post(
        "/api/v1/models/plus/versions",
        json={"version": "v2", "source_uri": folder.as_uri(), "deploy": True,
              "metadata": {"team": "risk"}},
    )  # fmt: skip
    assert imported.status_code == 201, imported.text
    assert imported.json()["serving"] is True
    assert imported.json()["version"]["metadata"] == {"team": "risk"}
    server.wait_for(
        lambda: predict(c, "plus", 1.0).json().get("version") == "v2", what="v2 serving"
    )
    outside = c.post(
        "/api/v1/models/plus/versions",
        json={"version": "v3", "source_uri": Path(__file__).parent.as_uri()},
    )
    assert outside.status_code == 422 and "import_roots" in outside.json()["error"]["message"]
    scheme = c.post(
        "/api/v1/models/plus/versions", json={"version": "v3", "source_uri": "ftp://x/y"}
    )
    assert scheme.status_code == 422 and "'ftp'" in scheme.json()["error"]["message"]


def test_bad_uploads_are_refused_and_leave_nothing(server: InferdServer):
    c = server.client
    good = tar_gz(model_files("x"))

    def refused(response: httpx.Response, status: int, words: str) -> None:
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"], response.json()

    refused(upload(c, "bad", good, version="v1", sha256="0" * 64), 422, "sha256 mismatch")
    refused(upload(c, "bad", good, version="v1", sha256="abc"), 422, "64 hex digits")
    escaping = tar_gz({"../evil.py": b"x", "model.py": arithmetic_model("x").encode()})
    refused(upload(c, "bad", escaping, version="v1"), 422, "escapes the artifact folder")
    absolute = tar_gz({"/etc/evil.py": b"x"})
    refused(upload(c, "bad", absolute, version="v1"), 422, "absolute path")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        link = tarfile.TarInfo("model.py")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    refused(upload(c, "bad", buf.getvalue(), version="v1"), 422, "is a link")
    big = os.urandom(LIMIT + 1)
    refused(upload(c, "bad", big, version="v1"), 413, "max_upload_bytes")
    broken = tar_gz({"model.py": b"this is not python("})
    refused(upload(c, "bad", broken, version="v1"), 422, "cannot load the version")
    refused(upload(c, "bad", good, version="v1", colour="red"), 422, "unknown upload parameter")
    refused(upload(c, "bad", good, version="v1", metadata="{"), 422, "metadata must be JSON")
    refused(upload(c, "bad", good, version="../v1"), 422, "invalid version name")
    assert c.get("/api/v1/models/bad").status_code == 404  # nothing registered
    assert _no_scratch_left(server)
    assert not (server.data_dir / "artifacts" / "bad").exists() or not any(
        p for p in (server.data_dir / "artifacts" / "bad").iterdir() if not p.name.startswith(".")
    )
    # an existing version is immutable
    assert upload(c, "dup", good, version="v1").status_code == 201
    refused(upload(c, "dup", good, version="v1"), 409, "already exists")


def test_download_gives_back_the_registered_files(server: InferdServer, tmp_path: Path):
    c = server.client
    files = {**model_files("x - 1"), "extra/notes.txt": b"kept as pushed\n"}
    assert upload(c, "minus", tar_gz(files), version="v1").status_code == 201
    reply = c.get("/api/v1/models/minus/versions/v1/artifact")
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/gzip"
    record = c.get("/api/v1/models/minus/versions/v1").json()
    assert reply.headers["x-inferd-sha256"] == record["sha256"]
    with tarfile.open(fileobj=io.BytesIO(reply.content), mode="r:gz") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    shipped = json.loads(got.pop("inferd.json"))  # what the files need to answer the same
    assert got == files and shipped["framework"] == "python"
    assert shipped["signature"] == record["signature"]
    again = upload(c, "minus", reply.content, version="v2")  # a pull, pushed back
    assert again.status_code == 201, again.text
    assert again.json()["version"]["sha256"] == record["sha256"]  # the same files
    assert c.get("/api/v1/models/minus/versions/v9/artifact").status_code == 404


def test_delete_refuses_what_serves(server: InferdServer):
    c = server.client
    for version, expression in (("v1", "x"), ("v2", "x * 10")):
        assert (
            upload(c, "gone", tar_gz(model_files(expression)), version=version).status_code == 201
        )
    _ready(server, "gone", "v1")
    serving = c.delete("/api/v1/models/gone/versions/v1")
    assert serving.status_code == 409 and "is deployed" in serving.json()["error"]["message"]
    deleted = c.delete("/api/v1/models/gone/versions/v2")
    assert deleted.status_code == 200, deleted.text
    assert c.get("/api/v1/models/gone/versions/v2").status_code == 404
    assert not (server.data_dir / "artifacts" / "gone" / "v2").exists()
    assert c.delete("/api/v1/models/gone/versions/v2").status_code == 404
    assert predict(c, "gone", 3.0).json()["outputs"][0]["y"] == 3.0


def test_models_are_created_and_edited(server: InferdServer):
    c = server.client
    made = c.post(
        "/api/v1/models",
        json={"name": "fraud", "framework": "xgboost", "owner": "risk-team",
              "description": "card fraud", "tags": {"tier": "gold"}},
    )  # fmt: skip
    assert made.status_code == 201, made.text
    assert made.json()["tags"] == {"tier": "gold"} and made.json()["versions"] == []
    assert c.post("/api/v1/models", json={"name": "fraud"}).status_code == 409
    edited = c.patch("/api/v1/models/fraud", json={"tags": {"tier": "silver"}, "owner": None})
    assert edited.status_code == 200, edited.text
    assert (edited.json()["tags"], edited.json()["owner"]) == ({"tier": "silver"}, None)
    assert edited.json()["description"] == "card fraud"
    bad = c.patch("/api/v1/models/fraud", json={"tags": {"tier": 3}})
    assert bad.status_code == 422 and "'tier'" in bad.json()["error"]["message"]
    assert c.patch("/api/v1/models/nope", json={"owner": "x"}).status_code == 404
    assert c.patch("/api/v1/models/fraud", json={"colour": "red"}).status_code == 422
    # its first version serves at once
    assert upload(c, "fraud", tar_gz(model_files("x * 0")), version="v1").json()["serving"]


def test_a_server_killed_mid_upload_keeps_no_row_and_no_file(tmp_path: Path):
    data = tmp_path / "data"
    first = InferdServer(data, workers=1)
    first.wait_ready()
    sent = threading.Event()

    def slow_body() -> Iterator[bytes]:
        yield os.urandom(256 * 1024)
        sent.set()
        for _ in range(600):  # a minute, unless the server goes first
            time.sleep(0.1)
            yield os.urandom(1024)

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server goes away: expected
            httpx.post(
                f"{first.url}/api/v1/models/cut/versions",
                params={"version": "v1", "filename": "model.py"},
                content=slow_body(),
                headers={"content-type": "application/octet-stream"},
                timeout=70,
            )

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    assert sent.wait(30)
    scratch = data / "uploads"
    first.wait_for(
        lambda: scratch.exists() and any(scratch.iterdir()), what="an upload in progress"
    )
    first.process.kill()
    first.process.wait()
    first._log.close()
    second = InferdServer(data, workers=1)
    try:
        second.wait_ready()
        assert second.client.get("/api/v1/models/cut").status_code == 404
        assert _no_scratch_left(second)
        assert not (data / "artifacts" / "cut").exists()
    finally:
        assert second.stop() == 0, second.log()[-3000:]
    sender.join(5)


def test_the_cli_pushes_pulls_lists_and_shows_against_a_server(
    server: InferdServer, tmp_path: Path
):
    """`inferd models …` with INFERD_URL: nothing on this side but the files pushed."""
    folder = tmp_path / "five"
    folder.mkdir()
    (folder / "model.py").write_text(arithmetic_model("x * 5"))
    elsewhere = tmp_path / "no-registry-here"
    env = {"INFERD_URL": server.url}

    def cli(*args: str, check: bool = True):
        return run_cli(*args, data_dir=elsewhere, env=env, check=check)

    pushed = cli("models", "push", "five", str(folder), "--version", "v1", "--meta", "team=ml")
    assert f"registered five:v1 (python) on {server.url}" in " ".join(pushed.stderr.split())
    record = json.loads(pushed.stdout)
    assert record["metadata"] == {"team": "ml"}
    assert "five" in cli("models", "list").stdout
    shown = json.loads(cli("models", "show", "five", "-v", "v1").stdout)
    assert shown["sha256"] == record["sha256"]
    out = tmp_path / "pulled"
    pulled = cli("models", "pull", "five", "v1", "--out", str(out))
    assert f"sha256 {record['sha256'][:12]}" in " ".join(pulled.stderr.split())
    assert (out / "model.py").read_text() == (folder / "model.py").read_text()
    assert json.loads((out / "inferd.json").read_text())["framework"] == "python"
    # one file goes as it is; the pulled folder pushed back is the same version's files
    single = cli("models", "push", "five", str(folder / "model.py"), "--version", "v2")
    assert json.loads(single.stdout)["framework"] == "python"
    again = json.loads(cli("models", "push", "five", str(out), "--version", "v3").stdout)
    assert again["sha256"] == record["sha256"]
    assert not elsewhere.exists() or not (elsewhere / "inferd.db").exists()  # all remote
    twice = cli("models", "push", "five", str(folder), "--version", "v1", check=False)
    assert twice.returncode == 1 and "409" in twice.stderr and "already exists" in twice.stderr
    gone = run_cli(
        "models", "list", data_dir=elsewhere, env={"INFERD_URL": "http://127.0.0.1:1"},
        check=False,
    )  # fmt: skip
    assert gone.returncode == 1 and "ConnectError" in gone.stderr


def test_a_client_gone_mid_upload_leaves_nothing_and_no_traceback(server: InferdServer):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /api/v1/models/half/versions?version=v1&filename=model.py HTTP/1.1\r\n"
            b"Host: x\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: 1048576\r\n\r\n" + b"x" * 65536
        )
        server.wait_for(lambda: not _no_scratch_left(server), what="the upload's scratch file")
    server.wait_for(lambda: _no_scratch_left(server), timeout_s=10, what="the scratch to go")
    assert server.client.get("/api/v1/models/half").status_code == 404
    time.sleep(0.3)
    assert "Traceback" not in server.log() and "-> 500" not in server.log(), server.log()[-2000:]
