"""A user's own Python class, for models no built-in runtime covers.

The version folder holds ``model.py`` (or the module named by metadata
``python_module``) defining one class with ``predict`` (or the class named by metadata
``python_class``)::

    class Model:
        signature = {"inputs": [...], "outputs": [...]}   # Signature.to_dict() form
        def load(self, artifact_dir: Path) -> None: ...    # optional
        def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray] | np.ndarray

A returned array becomes the output ``prediction``. The object is held and called,
never modified.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.shapes.tensors import Signature

logger = logging.getLogger(__name__)


class PythonRuntime(Runtime):
    framework = "python"
    explains_beside_batches = False  # user code: one thread at a time
    file_suffixes = (".py",)

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        return (artifact_dir / "model.py").is_file()

    def load(self) -> None:
        module_name = str(self.config.metadata.get("python_module", "model")).removesuffix(".py")
        self._module = _import_file(self.artifact_dir / f"{module_name}.py")
        try:
            cls = _find_class(self._module, self.config.metadata.get("python_class"))
            self.model = cls()
            if callable(getattr(self.model, "load", None)):
                self.model.load(self.artifact_dir)
        except BaseException:
            sys.modules.pop(self._module.__name__, None)
            raise
        _limit_threads(self.config.threads)

    def infer_signature(self) -> Signature:
        declared = getattr(self.model, "signature", None)
        if isinstance(declared, Signature):
            return declared
        if isinstance(declared, dict):
            return Signature.from_dict(declared)
        raise ValueError(
            f"python: {type(self.model).__name__} declares no signature; give the class a "
            "`signature` attribute (a dict in Signature.to_dict() form) or declare one at push"
        )

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self.model.predict(inputs)
        if isinstance(result, dict):
            return {name: np.asarray(value) for name, value in result.items()}
        return {"prediction": np.asarray(result)}

    def unload(self) -> None:
        sys.modules.pop(self._module.__name__, None)
        del self.model


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise FileNotFoundError(f"python: no {path.name} in {path.parent}")
    # One module per artifact folder, so two versions' model.py never share a name.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"inferd_user_{digest}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _find_class(module: ModuleType, name: str | None) -> type[Any]:
    if name:
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            raise ValueError(f"python: {module.__file__} defines no class {name!r}")
        return cls
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and obj.__module__ == module.__name__
        and callable(getattr(obj, "predict", None))
    ]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(
            f"python: expected one class with predict() in {module.__file__}, found {names}; "
            "name it with metadata python_class"
        )
    return found[0]


def _limit_threads(threads: int) -> None:
    """Cap the pools of what the user's load() brought in (BLAS, OpenMP, torch)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
