"""Artifacts in an S3-compatible object store (``artifact_store: s3://bucket/prefix``),
with the local artifact folder as a verified cache.

Layout under ``s3://bucket/prefix``::

    <model>/<version>/...              the version's files, as the local store has them
    <model>/<version>.manifest.json    digest, sizes and per-file sha256; written last,
                                       so a version without it is an unfinished upload

Endpoint, region and credentials come the usual AWS way (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles),
through fsspec/s3fs. A process that needs a version's files (a replica, a download)
opens them in its host's artifact cache (:mod:`inferd.registry.artifact_cache`), which
fetches them with :func:`download`: every file is checked against the manifest and the
whole against the registry's digest, then renamed into place at once, so a corrupt or
partial download is never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

from inferd.errors import InferdError, InvalidInput, PayloadTooLarge, StoreUnavailable
from inferd.registry.store import StagedArtifact

_MANIFEST = ".manifest.json"


class S3Store:
    def __init__(self, url: str) -> None:
        if not url.startswith("s3://") or len(url) <= len("s3://"):
            raise InvalidInput(f"artifact_store {url!r}: expected s3://bucket[/prefix]")
        self.url = url.rstrip("/")
        self._fs: Any = None

    @property
    def fs(self) -> Any:
        if self._fs is None:
            try:
                import s3fs
            except ImportError:
                raise InvalidInput(
                    "an s3:// artifact store needs s3fs: pip install 'inferd[s3]'"
                ) from None
            self._fs = s3fs.S3FileSystem()
        return self._fs

    def uri(self, model: str, version: str) -> str:
        return f"{self.url}/{model}/{version}"

    def upload(self, staged: StagedArtifact) -> str:
        """Put a staged version's files, then its manifest; the version's URI."""
        uri = self.uri(staged.model, staged.version)
        manifest = {"sha256": staged.sha256, "size_bytes": staged.size_bytes, "files": staged.files}
        try:
            for name in staged.files:
                self.fs.put_file(str(staged.staging_path / name), f"{uri}/{name}")
            self.fs.pipe_file(uri + _MANIFEST, json.dumps(manifest, indent=2).encode())
        except Exception as exc:  # OSError, botocore's and aiohttp's connection errors
            self.delete(staged.model, staged.version)
            raise StoreUnavailable(f"cannot write to {self.url}: {exc}") from None
        return uri

    def delete(self, model: str, version: str) -> None:
        uri = self.uri(model, version)
        for path in (uri + _MANIFEST, uri):
            with contextlib.suppress(Exception):  # best effort: the store may be down
                self.fs.rm(path, recursive=True)

    def manifest(self, uri: str) -> dict[str, Any]:
        try:
            return dict(json.loads(self.fs.cat_file(uri + _MANIFEST)))
        except FileNotFoundError:
            raise InvalidInput(f"{uri} has no manifest: the upload never finished") from None
        except Exception as exc:  # OSError, botocore's and aiohttp's connection errors
            raise StoreUnavailable(f"cannot read {uri}: {exc}") from None


def download(remote: S3Store, uri: str, sha256: str, folder: Path) -> int:
    """Fetch the version at ``uri`` into ``folder`` (new), each file checked against the
    store's manifest and the whole against the registered ``sha256``; the bytes fetched.
    InvalidInput when what the store holds is not what was registered."""
    manifest = remote.manifest(uri)
    if manifest.get("sha256") != sha256:
        raise InvalidInput(
            f"{uri}: the store's manifest says sha256 {manifest.get('sha256')}, the registry "
            f"{sha256}; not served"
        )
    listing = hashlib.sha256()
    total = 0
    for name, entry in sorted(manifest["files"].items()):
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise InvalidInput(f"{uri}: the manifest names a file outside the folder: {name!r}")
        target = folder.joinpath(*Path(name).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            remote.fs.get_file(f"{uri}/{name}", str(target))
        except Exception as exc:  # OSError, botocore's and aiohttp's connection errors
            raise StoreUnavailable(f"cannot fetch {uri}/{name}: {exc}") from None
        got = _sha256(target)
        if got != entry["sha256"] or target.stat().st_size != entry["size_bytes"]:
            raise InvalidInput(
                f"{uri}/{name} is not the registered file (sha256 {got}, expected "
                f"{entry['sha256']}); not served"
            )
        listing.update(f"{got}  {Path(name).as_posix()}\n".encode())
        total += entry["size_bytes"]
    if listing.hexdigest() != sha256:
        raise InvalidInput(f"{uri}: the files hash to {listing.hexdigest()}, not {sha256}")
    return total


def fetch_source(uri: str, dest: Path, limit: int) -> Path:
    """A folder (every object under the prefix) or one object of an S3-compatible store,
    copied under ``dest`` to be registered; 413 past ``limit`` bytes, 422 when nothing
    is there, 503 when the store cannot be reached."""
    fs = S3Store("s3://" + uri[5:].split("/", 1)[0]).fs
    path = uri[5:].rstrip("/")
    root = dest / "artifact"
    try:
        found = fs.find(path, detail=True)
        if not found:
            raise InvalidInput(f"source_uri {uri!r}: no object there")
        if path in found and len(found) == 1:  # one object: it is the artifact
            found = {path: found[path]}
            base = path.rsplit("/", 1)[0]
        else:
            base = path
        total = sum(int(info.get("size") or 0) for info in found.values())
        if total > limit:
            raise PayloadTooLarge(
                f"source_uri {uri!r} holds {total} bytes, over registry.max_upload_bytes ({limit})",
                limit_bytes=limit,
            )
        for key in sorted(found):
            relative = key[len(base) :].lstrip("/")
            if not relative or ".." in Path(relative).parts:
                raise InvalidInput(f"source_uri {uri!r}: object {key!r} cannot be a file name")
            target = root.joinpath(*Path(relative).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(key, str(target))
    except InferdError:
        raise
    except Exception as exc:  # OSError, botocore's and aiohttp's connection errors
        raise StoreUnavailable(f"cannot read {uri}: {type(exc).__name__}: {exc}") from None
    return root


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
