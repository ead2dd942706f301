"""Checksummed storage of model artifacts on the local filesystem.

Layout under ``root``::

    <model>/<version>/                 the artifact files (a runtime looks in here), with
                                       the registry's inferd.json (framework, signature,
                                       the metadata that changes the answers)
    <model>/<version>.manifest.json    per-file sha256 and sizes, for ``verify``
    <model>/.staging-<version>-<hex>/  a copy in progress (same filesystem, so the
                                       final ``os.rename`` is atomic)

A version folder appears all at once or not at all: files are copied into a staging
folder beside it and renamed into place. The artifact digest is the sha256 of the
``sha256sum``-style listing ``"<file sha256>  <relative posix path>\\n"`` over the files
sorted by path, so it depends only on names and contents, never on copy order or
timestamps, and can be reproduced with standard tools.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.errors import InvalidInput

logger = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MANIFEST_SUFFIX = ".manifest.json"
_CHUNK_BYTES = 1024 * 1024


def check_name(kind: str, value: str) -> str:
    """``value`` if it is a safe single path component, else InvalidInput."""
    # fullmatch, not match with "$": "$" also matches before a trailing newline.
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value):
        raise InvalidInput(
            f"invalid {kind} name {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            **{kind: str(value)},
        )
    # The manifest sits beside the version folder; a version named like one would clash.
    if kind == "version" and value.endswith(_MANIFEST_SUFFIX):
        raise InvalidInput(f"invalid version name {value!r}: reserved suffix", version=value)
    return value


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    uri: str
    path: Path
    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class StagedArtifact:
    """A complete copy waiting in its staging folder for :meth:`ArtifactStore.publish`."""

    model: str
    version: str
    staging_path: Path
    sha256: str
    size_bytes: int
    files: dict[str, dict[str, Any]]


def _file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest_of(folder: Path) -> str:
    """The artifact digest of ``folder`` (see the module note)."""
    return str(_manifest_of(folder)["sha256"])


def _manifest_of(folder: Path) -> dict[str, Any]:
    """Digest, total size and per-file sha256/size of every file under ``folder``."""
    files: dict[str, dict[str, Any]] = {}
    for path in folder.rglob("*"):
        if path.is_file():
            rel = path.relative_to(folder).as_posix()
            files[rel] = {"sha256": _file_sha256(path), "size_bytes": path.stat().st_size}
    listing = hashlib.sha256()
    for rel in sorted(files):
        listing.update(f"{files[rel]['sha256']}  {rel}\n".encode())
    return {
        "sha256": listing.hexdigest(),
        "size_bytes": sum(f["size_bytes"] for f in files.values()),
        "files": dict(sorted(files.items())),
    }


def _remove(path: Path) -> None:
    """Delete a file or folder if present; a folder is first renamed aside so readers
    never see it half-deleted."""
    if path.is_dir() and not path.is_symlink():
        trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    def path(self, model: str, version: str) -> Path:
        return self.root / check_name("model", model) / check_name("version", version)

    def manifest_path(self, model: str, version: str) -> Path:
        return self.path(model, version).with_name(version + _MANIFEST_SUFFIX)

    def digest(self, model: str, version: str) -> str | None:
        """The digest the local manifest records (None: no readable manifest)."""
        try:
            return str(json.loads(self.manifest_path(model, version).read_text())["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, model: str, version: str, source: Path) -> StoredArtifact:
        """Copy ``source`` (a file or a folder) in as ``model``/``version``.

        A file lands in the version folder under its own name; a folder's contents
        become the version folder. Refuses (FileExistsError) if the version is already
        stored: the store never overwrites on its own (see ``publish``).
        """
        staged = self.stage(model, version, source)
        try:
            return self.publish(staged)
        finally:
            self.discard(staged)

    def stage(
        self,
        model: str,
        version: str,
        source: Path,
        extra: dict[str, bytes] | None = None,
    ) -> StagedArtifact:
        """Copy ``source`` into a fresh staging folder beside the final one, write the
        ``extra`` files (name -> content; they replace copies of the same name), and
        hash it."""
        final = self.path(model, version)
        source = Path(source)
        if not source.exists():
            raise InvalidInput(f"artifact source not found: {source}", source=str(source))
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.with_name(f".staging-{version}-{uuid.uuid4().hex}")
        try:
            if source.is_dir():
                shutil.copytree(source, staging)
            else:
                staging.mkdir()
                shutil.copy2(source, staging / source.name)
            if not any(p.is_file() for p in staging.rglob("*")):
                raise InvalidInput(f"artifact source holds no files: {source}", source=str(source))
            for name, content in (extra or {}).items():
                (staging / name).write_bytes(content)
            manifest = _manifest_of(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return StagedArtifact(
            model=model,
            version=version,
            staging_path=staging,
            sha256=manifest["sha256"],
            size_bytes=manifest["size_bytes"],
            files=manifest["files"],
        )

    def publish(self, staged: StagedArtifact, *, replace: bool = False) -> StoredArtifact:
        """Rename the staged folder into place, then write its manifest.

        With ``replace``, a folder already at the final path is swapped out. Only a
        caller that knows it is an orphan (the registry, holding the version's unique
        row, after a crash between rename and commit) may ask for that.
        """
        final = self.path(staged.model, staged.version)
        if final.exists():
            if not replace:
                raise FileExistsError(f"artifact already stored: {final}")
            logger.warning("replacing orphaned artifact folder %s", final)
            _remove(final)
        try:
            os.rename(staged.staging_path, final)
        except OSError as exc:
            # Renaming onto a non-empty folder fails: someone else published meanwhile.
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"artifact already stored: {final}") from exc
            raise
        # The manifest is written only once the folder is ours, so a lost race above
        # never overwrites the winner's manifest.
        try:
            self._write_manifest(staged)
        except BaseException:
            _remove(final)
            raise
        return StoredArtifact(
            uri=final.as_uri(), path=final, sha256=staged.sha256, size_bytes=staged.size_bytes
        )

    def _write_manifest(self, staged: StagedArtifact) -> None:
        manifest = {
            "sha256": staged.sha256,
            "size_bytes": staged.size_bytes,
            "files": staged.files,
        }
        path = self.manifest_path(staged.model, staged.version)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, path)

    def discard(self, staged: StagedArtifact) -> None:
        """Drop a staging folder; a no-op once it has been published."""
        shutil.rmtree(staged.staging_path, ignore_errors=True)

    def verify(self, model: str, version: str) -> bool:
        """Whether the stored files still match the manifest written when they were put.

        False also when the folder or the manifest is missing or unreadable.
        """
        folder = self.path(model, version)
        try:
            expected = json.loads(self.manifest_path(model, version).read_text())
        except (OSError, ValueError):
            return False
        if not folder.is_dir():
            return False
        actual = _manifest_of(folder)
        return actual["sha256"] == expected.get("sha256") and actual["files"] == expected.get(
            "files"
        )

    def delete(self, model: str, version: str) -> None:
        """Remove a version's files and manifest; missing ones are not an error."""
        _remove(self.path(model, version))
        self.manifest_path(model, version).unlink(missing_ok=True)
