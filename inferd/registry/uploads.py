"""Artifacts that arrive over the API: an upload streamed to a file (counted and hashed
as it comes, never whole in memory), unpacked into a folder no entry may escape, or a
``file://`` source inside the folders the server was told it may read.

Rules this module keeps:
- Nothing is trusted before it is checked: the size against the limit while bytes
  arrive (413), the client's sha256 once they all did (422), every archive entry's name
  and kind before anything is written (422 naming the entry: absolute paths, ``..``,
  links and devices are refused), and the total an archive unpacks to (413).
- Everything lands under one scratch folder per request, which the caller removes
  whatever happens; the server clears the scratch root when it starts, so an upload
  cut by a crash leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from inferd.errors import InvalidInput, PayloadTooLarge

UPLOADS = "uploads"
"""Scratch folder under the data folder for uploads and downloads in progress; the
server clears it when it starts."""
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
SAFE_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


@dataclass(frozen=True, slots=True)
class Received:
    path: Path
    sha256: str
    size_bytes: int


async def receive(chunks: AsyncIterator[bytes], dest: Path, limit: int) -> Received:
    """Write ``chunks`` to ``dest``, hashing and counting them; 413 past ``limit``."""
    digest = hashlib.sha256()
    size = 0
    with dest.open("wb") as out:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"the upload exceeds registry.max_upload_bytes ({limit} bytes)",
                    limit_bytes=limit,
                )
            digest.update(chunk)
            out.write(chunk)
    return Received(dest, digest.hexdigest(), size)


def check_sha256(received: Received, expected: str | None) -> None:
    if expected is None:
        return
    if expected.lower() != received.sha256:
        raise InvalidInput(
            f"sha256 mismatch: the client sent {expected.lower()}, the server received "
            f"{received.sha256} ({received.size_bytes} bytes); nothing was registered"
        )


def archive_kind(path: Path) -> str | None:
    """``tar`` (plain or compressed), ``zip``, or None (a single file), by content."""
    with path.open("rb") as f:
        head = f.read(512)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00":
        return "tar"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def unpack(upload: Path, out: Path, filename: str | None, limit: int) -> Path:
    """The artifact folder ``upload`` holds (or that holds it, a single file), written
    under ``out``.

    An archive whose entries all sit in one top-level folder gives that folder (``tar
    czf m.tgz my-model/`` and ``tar czf m.tgz -C my-model .`` register the same thing).
    A single file needs ``filename``: runtimes detect the framework by it."""
    out.mkdir(parents=True, exist_ok=True)
    kind = archive_kind(upload)
    if kind is None:
        if filename is None:
            raise InvalidInput(
                "the upload is not a tar or zip archive: name the single file it is with "
                "the 'filename' query parameter (e.g. filename=model.onnx)"
            )
        if not SAFE_FILENAME.match(filename):
            raise InvalidInput(
                f"filename {filename!r} must be a plain file name (letters, digits, . _ -)"
            )
        root = out / "artifact"
        root.mkdir()
        shutil.move(upload, root / filename)
        return root
    root = out / "artifact"
    root.mkdir()
    if kind == "tar":
        _untar(upload, root, limit)
    else:
        _unzip(upload, root, limit)
    upload.unlink(missing_ok=True)
    entries = list(root.iterdir())
    if not entries:
        raise InvalidInput("the archive is empty")
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return root


def _entry_path(name: str) -> PurePosixPath:
    """The entry's relative path, or 422 when it would land outside the folder."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise InvalidInput(f"archive entry {name!r} is an absolute path; entries must be relative")
    if ".." in path.parts:
        raise InvalidInput(f"archive entry {name!r} escapes the artifact folder ('..')")
    return path


def _check_total(total: int, limit: int) -> None:
    if total > limit:
        raise PayloadTooLarge(
            f"the archive unpacks to more than registry.max_upload_bytes ({limit} bytes)",
            limit_bytes=limit,
        )


def _untar(upload: Path, root: Path, limit: int) -> None:
    try:
        with tarfile.open(upload, "r:*") as tar:
            members = tar.getmembers()
            total = 0
            for member in members:
                _entry_path(member.name)
                if not (member.isfile() or member.isdir()):
                    what = "link" if member.issym() or member.islnk() else "special file"
                    raise InvalidInput(
                        f"archive entry {member.name!r} is a {what}; only files and "
                        "folders are accepted"
                    )
                total += member.size
                _check_total(total, limit)
            tar.extractall(root, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidInput(f"the upload is not a readable tar archive: {exc}") from None


def _unzip(upload: Path, root: Path, limit: int) -> None:
    try:
        with zipfile.ZipFile(upload) as archive:
            infos = archive.infolist()
            total = 0
            for info in infos:
                path = _entry_path(info.filename)
                kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no Unix mode recorded
                if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
                    raise InvalidInput(
                        f"archive entry {info.filename!r} is a link or special file; only "
                        "files and folders are accepted"
                    )
                total += info.file_size
                _check_total(total, limit)
                target = root.joinpath(*path.parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
        raise InvalidInput(f"the upload is not a readable zip archive: {exc}") from None


def file_source(uri: str, roots: list[Path]) -> Path:
    """The local path a ``file://`` URI names, when it lies inside one of ``roots``."""
    parsed = urlparse(uri)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidInput(f"source_uri {uri!r}: a file:// URI names a path on this server")
    if not roots:
        raise InvalidInput(
            "file:// imports are off: the server reads files only inside "
            "registry.import_roots (INFERD_REGISTRY__IMPORT_ROOTS), which is empty"
        )
    path = Path(unquote(parsed.path)).resolve()
    if not any(path.is_relative_to(root.resolve()) for root in roots):
        raise InvalidInput(
            f"source_uri {uri!r} is outside registry.import_roots "
            f"({', '.join(str(r) for r in roots)})"
        )
    if not path.exists():
        raise InvalidInput(f"source_uri {uri!r}: {path} does not exist")
    return path
