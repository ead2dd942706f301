"""The registry commands against a running server (``--url`` / ``INFERD_URL``): push
uploads over ``POST /api/v1/models/{model}/versions``, pull downloads
``…/versions/{version}/artifact`` and checks it, list and show read ``/api/v1/models``.

Uploads and downloads stream through temporary files with a progress bar: an artifact
is never held whole in memory on either side.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from inferd.cli.common import console

CHUNK = 1 << 20


class RemoteRegistry:
    def __init__(self, url: str, api_key: str | None, timeout_s: float = 600) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def __enter__(self) -> RemoteRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def push(self, name: str, path: Path, version: str, options: dict[str, Any]) -> dict[str, Any]:
        """Upload ``path`` (a folder goes as a tar.gz) and register it; the reply's JSON."""
        params: dict[str, str] = {"version": version}
        for key, value in options.items():
            if value is None or value == {} or value is False:
                continue
            params[key] = json.dumps(value) if isinstance(value, dict | bool) else str(value)
        with tempfile.TemporaryDirectory(prefix="inferd-push-") as tmp:
            if path.is_dir():
                body = Path(tmp) / "artifact.tar.gz"
                with console.status(f"packing {path.name} ..."), tarfile.open(body, "w:gz") as tar:
                    for item in sorted(path.rglob("*")):
                        tar.add(item, arcname=item.relative_to(path).as_posix(), recursive=False)
                content_type = "application/gzip"
            else:
                body, content_type = path, "application/octet-stream"
                params["filename"] = path.name
            params["sha256"] = _sha256(body)
            size = body.stat().st_size
            with _bar(f"uploading {path.name}", size) as (progress, task):

                def chunks() -> Iterator[bytes]:
                    with body.open("rb") as f:
                        while chunk := f.read(CHUNK):
                            progress.advance(task, len(chunk))
                            yield chunk

                reply = self.client.post(
                    f"/api/v1/models/{name}/versions",
                    params=params,
                    content=chunks(),
                    headers={"content-type": content_type, "content-length": str(size)},
                )
        return _json(reply)

    def push_source(
        self, name: str, uri: str, version: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        """Have the server import ``uri`` (s3://, MLflow's models:/ or runs:/) as a version."""
        body = {"version": version, "source_uri": uri}
        body |= {k: v for k, v in options.items() if v is not None and v != {}}
        return _json(self.client.post(f"/api/v1/models/{name}/versions", json=body))

    def pull(self, name: str, version: str, out: Path) -> str:
        """Download the version into ``out`` (a new folder) and check it against the
        server's digest; the digest."""
        from inferd.registry.store import digest_of
        from inferd.registry.uploads import unpack

        if out.exists() and any(out.iterdir()):
            raise _fail(f"{out} exists and is not empty")
        with tempfile.TemporaryDirectory(prefix="inferd-pull-") as tmp:
            archive = Path(tmp) / "artifact.tar.gz"
            path = f"/api/v1/models/{name}/versions/{version}/artifact"
            with self.client.stream("GET", path) as reply:
                if reply.status_code != 200:
                    reply.read()
                    _json(reply)
                expected = reply.headers["x-inferd-sha256"]
                size = int(reply.headers.get("content-length") or 0) or None
                bar = _bar(f"downloading {name}:{version}", size)
                with bar as (progress, task), archive.open("wb") as f:
                    for chunk in reply.iter_bytes(CHUNK):
                        f.write(chunk)
                        progress.advance(task, len(chunk))
            folder = unpack(archive, Path(tmp) / "unpacked", None, 1 << 50)
            got = digest_of(folder)
            if got != expected:
                raise _fail(f"the download's files hash to {got}, the server says {expected}")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(folder, out)
        return expected

    def get(self, path: str) -> Any:
        return _json(self.client.get(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _bar:
    """A transfer progress bar on stderr (quiet when stderr is not a terminal)."""

    def __init__(self, what: str, total: int | None) -> None:
        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task(what, total=total)

    def __enter__(self) -> tuple[Progress, Any]:
        self.progress.start()
        return self.progress, self.task

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def _json(reply: httpx.Response) -> Any:
    try:
        body = reply.json()
    except ValueError:
        body = None
    if reply.status_code >= 400:
        error = (body or {}).get("error", {}) if isinstance(body, dict) else {}
        raise _fail(f"{reply.status_code} {error.get('message') or reply.text[:300]}")
    return body


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(1)
