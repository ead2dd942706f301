"""Choosing, loading and checking a runtime for a model folder.

Runtimes are named lazily ("module:Class"), so importing this package imports no
framework: a replica serving ONNX never pays for importing torch. A folder's framework
is detected from its files; where several runtimes claim a folder the more specific
wins (a ``model.py`` wraps whatever else is there; a pickle that names xgboost or
lightgbm is theirs rather than plain scikit-learn's), and anything else ambiguous is
refused rather than guessed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from inferd.replica_config import ImagesConfig
from inferd.runtimes.base import Runtime, RuntimeConfig, sample_columns
from inferd.shapes.tensors import Signature, TensorSpec, datatype_of

logger = logging.getLogger(__name__)

RUNTIMES: dict[str, str] = {
    "sklearn": "inferd.runtimes.sklearn:SklearnRuntime",
    "xgboost": "inferd.runtimes.xgboost:XGBoostRuntime",
    "lightgbm": "inferd.runtimes.lightgbm:LightGBMRuntime",
    "onnx": "inferd.runtimes.onnx:OnnxRuntime",
    "torch": "inferd.runtimes.torch:TorchRuntime",
    "python": "inferd.runtimes.python:PythonRuntime",
    "gpt2": "inferd.runtimes.gpt2:GPT2Runtime",
    "llm": "inferd.runtimes.decoder:DecoderRuntime",
    "transformers": "inferd.runtimes.transformers:TransformersRuntime",
    "tensorflow": "inferd.runtimes.tensorflow:TensorFlowRuntime",
    "graph": "inferd.runtimes.graph:GraphRuntime",
}
GENERATIVE = ("gpt2", "llm")
"""Frameworks whose replicas run an LLM engine and generate text (the others predict):
GPT-2 checkpoints (inferd's own engine, or vLLM) and other decoders (vLLM)."""
# framework -> the frameworks it overrules when both detect the same folder
_OVERRULES: dict[str, set[str]] = {
    "python": set(RUNTIMES) - {"python", "graph"},
    "graph": set(RUNTIMES) - {"graph"},  # its graph.json says so, whatever lies beside it
    "xgboost": {"sklearn"},
    "lightgbm": {"sklearn"},
}
MANIFEST = "inferd.json"
_MANIFEST_KEYS = {"framework", "signature", "labels", "metadata"}
OUTPUT_METADATA = frozenset(
    {
        "labels", "dtype", "device", "max_length", "normalize", "pooling", "task",
        "quantization", "python_class", "python_module", "allow_non_finite", "adapters",
        "engine", "vllm_args", "image",
    }
)  # fmt: skip
"""Metadata keys that change what a version computes or accepts: the registry writes them
into the version's ``inferd.json``, so its files alone (a pull, a re-push of the stored
folder) reproduce its answers."""
_WARMUP_ROWS = 2  # two rows, so an output that drops the batch dimension shows


def resolve_runtime(framework: str) -> type[Runtime]:
    """The Runtime class for a framework name or an import path ``pkg.mod:Class``."""
    path = RUNTIMES.get(framework, framework)
    if ":" not in path:
        raise ValueError(
            f"unknown framework {framework!r}; use one of {', '.join(RUNTIMES)} "
            "or an import path 'package.module:Class'"
        )
    module_name, _, class_name = path.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        raise ValueError(f"{path} is not an inferd Runtime subclass")
    return cls


def load_runtime(
    framework: str, artifact_dir: Path, config: RuntimeConfig | None = None
) -> Runtime:
    """The framework's runtime, loaded; served from encoded images when the version's
    metadata declares ``image`` preprocessing (:mod:`inferd.runtimes.images`)."""
    config = config or RuntimeConfig()
    if config.metadata.get("image") is None:
        runtime = resolve_runtime(framework)(Path(artifact_dir), config)
        runtime.load()
        return runtime
    from inferd.runtimes.images import ImageInput, ImageSpec, inner_config

    spec = ImageSpec.parse(config.metadata["image"])
    inner = resolve_runtime(framework)(Path(artifact_dir), inner_config(config))
    inner.load()
    wrapped = ImageInput(inner, spec, config.images or ImagesConfig())
    wrapped.load()
    return wrapped


def detect_framework(artifact_dir: Path) -> str:
    artifact_dir = _require_dir(artifact_dir)
    found = {name for name in RUNTIMES if resolve_runtime(name).detect(artifact_dir)}
    overruled = set().union(*(_OVERRULES.get(name, set()) for name in found))
    candidates = sorted(found - overruled)
    if len(candidates) == 1:
        return candidates[0]
    files = ", ".join(sorted(p.name for p in artifact_dir.iterdir())) or "no files"
    what = f"several frameworks match ({', '.join(candidates)})" if candidates else "no model"
    raise ValueError(
        f"cannot tell the framework of {artifact_dir}: {what}; found {files}. "
        f"Pass --framework ({'/'.join(RUNTIMES)})"
    )


def prepare_artifact(
    folder: Path, framework: str | None, scratch: Path
) -> tuple[Path, str | None, dict[str, Any]]:
    """The folder a version is stored from, its framework and what making it adds to its
    metadata. A TensorFlow model not pushed as ``tensorflow`` becomes an ONNX one
    (:mod:`inferd.runtimes.tf_onnx`), in ``scratch``; anything else is left as it is."""
    if framework is None and Path(folder).is_dir():
        from inferd.runtimes.tensorflow import tf_model_path

        if tf_model_path(Path(folder)) is not None and detect_framework(folder) == "tensorflow":
            from inferd.runtimes.tf_onnx import convert

            converted = convert(Path(folder), Path(scratch) / "onnx")
            return converted.folder, converted.framework, converted.metadata
    return folder, framework, {}


def inspect_artifact(
    artifact_dir: Path,
    framework: str | None = None,
    metadata: dict[str, Any] | None = None,
    signature: Signature | None = None,
    inputs: tuple[TensorSpec, ...] | None = None,
) -> tuple[str, Signature]:
    """Detect, load and warm up a model folder; return its framework and signature.

    Precedence: explicit arguments, then the folder's ``inferd.json`` manifest, then
    what the runtime infers from the model. ``inputs`` (an import's own schema, e.g.
    MLflow's) replace the inputs the runtime infers, and the warm-up uses them.
    """
    artifact_dir = _require_dir(artifact_dir)
    manifest = read_manifest(artifact_dir)
    framework = framework or manifest.get("framework") or detect_framework(artifact_dir)
    if signature is None and "signature" in manifest:
        signature = Signature.from_dict(manifest["signature"])
    meta = {**manifest.get("metadata", {}), **(metadata or {})}
    labels = meta.get("labels") or (signature and signature.labels) or manifest.get("labels")
    if labels:
        meta["labels"] = [str(label) for label in labels]
    runtime = load_runtime(framework, artifact_dir, RuntimeConfig(1, meta, signature))
    try:
        resolved = runtime.signature
        if labels and resolved.labels != tuple(meta["labels"]):
            resolved = dataclasses.replace(resolved, labels=tuple(meta["labels"]))
        if inputs and signature is None:
            resolved = dataclasses.replace(resolved, inputs=inputs)
            runtime.config.signature = resolved
        if not runtime.warm_up_at_push:
            return framework, resolved
        samples = meta.get("warmup_samples")
        rows = max(_WARMUP_ROWS, len(samples)) if isinstance(samples, list) else _WARMUP_ROWS
        batch = runtime.warmup_inputs(rows)  # every registered sample, checked once here
        try:
            outputs = runtime.run(batch)
        except Exception as exc:
            shapes = {name: array.shape for name, array in batch.items()}
            raise ValueError(f"{framework} model failed its warm-up on {shapes}: {exc}") from exc
        _check_outputs(outputs, resolved, rows)
        if "background_samples" in meta:
            _check_background(runtime, resolved, meta["background_samples"])
    finally:
        runtime.unload()
    return framework, resolved


def _check_background(runtime: Runtime, signature: Signature, rows: Any) -> None:
    """An explanation's background rows (metadata ``background_samples``) fit the
    signature and the model runs on them: checked once here, not at the first explain."""
    count = len(rows) if isinstance(rows, list) else 1
    batch = sample_columns(signature, rows, count, field="background_samples")
    try:
        runtime.run(batch)
    except Exception as exc:
        raise ValueError(f"the model failed on its background_samples: {exc}") from exc


def _require_dir(path: Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; put the model's files in a folder and pass that")
    return path


def read_manifest(artifact_dir: Path) -> dict[str, Any]:
    """The folder's ``inferd.json`` (framework, signature, labels, metadata), or {}."""
    path = Path(artifact_dir) / MANIFEST
    if not path.is_file():
        return {}
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} must hold a JSON object")
    if not isinstance(manifest.get("metadata", {}), dict):
        raise ValueError(f"{path}: metadata must be a JSON object")
    unknown = set(manifest) - _MANIFEST_KEYS
    if unknown:
        logger.warning("%s: ignoring unknown keys %s", path, sorted(unknown))
    return manifest


def _check_outputs(outputs: dict[str, np.ndarray], signature: Signature, rows: int) -> None:
    declared = [spec.name for spec in signature.outputs]
    if sorted(outputs) != sorted(declared):
        raise ValueError(f"the model returned outputs {sorted(outputs)}, its signature {declared}")
    labels = signature.labels
    for spec in signature.outputs:
        array = outputs[spec.name]
        if not isinstance(array, np.ndarray) or array.shape[:1] != (rows,):
            got = getattr(array, "shape", type(array).__name__)
            raise ValueError(
                f"output {spec.name!r} lost the batch dimension: {rows} rows in, {got} out"
            )
        if array.ndim != len(spec.shape) or any(
            d not in (-1, n) for d, n in zip(spec.shape, array.shape, strict=True)
        ):
            raise ValueError(f"output {spec.name!r} has shape {array.shape}, not {spec.shape}")
        if datatype_of(array) != spec.datatype:
            raise ValueError(f"output {spec.name!r} is {datatype_of(array)}, not {spec.datatype}")
        if spec.name == "probabilities" and labels and array.shape[1:] != (len(labels),):
            raise ValueError(f"{len(labels)} labels for {array.shape[1:]} probability columns")
