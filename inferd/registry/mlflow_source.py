"""Versions imported from an MLflow tracking server and Model Registry.

``source_uri`` is ``models:/name/3``, ``models:/name@alias``, ``models:/name/Production``
(a stage), ``models:/name/latest`` or ``runs:/<run_id>/<path>``; the tracking server is
``registry.mlflow_tracking_uri`` (else ``MLFLOW_TRACKING_URI``).

This runs in the check's child process (:mod:`inferd.registry.inspection`), never in a
gateway: the MLflow client, the model's framework and its pickles stay out of the
processes that serve traffic. :func:`fetch` downloads the model with the MLflow client
and reads its run (metrics, params); :func:`convert` turns the MLflow model folder into
an inferd version folder that needs no MLflow to serve, except a pyfunc:

=============== ============ ==========================================================
MLflow flavor   framework    files
=============== ============ ==========================================================
onnx            onnx         ``model.onnx``
xgboost         xgboost      ``model.json``/``model.ubj`` (a legacy ``.xgb`` re-saved)
lightgbm        lightgbm     ``model.lgb``, or ``model.joblib`` for the scikit-learn API
sklearn         sklearn      ``model.joblib`` (skops, pickle or cloudpickle files re-saved)
pytorch         torch        ``model.pt2`` (torch.export) or ``model.pt`` (TorchScript);
                             a pickled ``nn.Module`` is exported and checked against it
tensorflow      onnx         the SavedModel or ``.keras`` file, converted to ONNX when the
keras                        version is checked (:mod:`inferd.runtimes.tf_onnx`)
python_function python       ``model.py`` serving ``mlflow_model/`` with ``mlflow.pyfunc``
=============== ============ ==========================================================

MLflow's signature becomes inferd's: a column schema of numeric columns is one
``features`` matrix (the column names kept as metadata ``feature_names``), a tensor
schema keeps its tensors. Tabular and ONNX models keep the outputs their runtime reads
from the model (``label`` and ``probabilities`` for a classifier, richer than MLflow's
``predict`` schema); PyTorch and pyfunc models take MLflow's outputs as well.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferd.errors import InvalidInput, PayloadTooLarge, StoreUnavailable
from inferd.shapes.tensors import Signature, TensorSpec, datatype_of

SCHEMES = ("models", "runs")
FLAVORS = (
    "onnx", "xgboost", "lightgbm", "sklearn", "pytorch", "tensorflow", "keras", "python_function"
)  # fmt: skip
"""Flavors inferd serves, most specific first (every model also has python_function)."""
PYFUNC_IO = "mlflow_io.json"
"""Beside a pyfunc's generated ``model.py``: its signature and how columns are passed."""
_COLUMN_TYPES = {
    "double": "FP64", "float": "FP32", "long": "INT64", "integer": "INT32",
    "boolean": "BOOL", "string": "BYTES", "binary": "BYTES",
}  # fmt: skip
_NOT_FOUND = {"RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE", "BAD_REQUEST"}


def is_mlflow_uri(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in SCHEMES and ":/" in uri


@dataclass
class Imported:
    """An MLflow model made into an inferd version folder."""

    folder: Path
    framework: str | None
    """None: detected when checked (a TensorFlow model is converted to ONNX then)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[TensorSpec, ...] | None = None
    """MLflow's inputs, replacing those the runtime reads from the model."""
    signature: Signature | None = None
    """A whole signature, for models whose runtime cannot tell one (torch, pyfunc)."""
    description: str | None = None


def import_model(uri: str, tracking_uri: str | None, scratch: Path, limit_bytes: int) -> Imported:
    """Fetch ``uri`` from the tracking server into ``scratch`` and convert it."""
    downloaded, info = fetch(uri, tracking_uri, scratch / "mlflow", limit_bytes)
    imported = convert(downloaded, scratch / "version")
    imported.description = info.pop("description", None)
    imported.metadata = {**info.pop("metadata"), **imported.metadata}
    imported.metadata["mlflow"] = {**info, **imported.metadata.get("mlflow", {})}
    return imported


def fetch(
    uri: str, tracking_uri: str | None, dest: Path, limit_bytes: int
) -> tuple[Path, dict[str, Any]]:
    """Download the MLflow model ``uri`` names; its folder and what the registry says."""
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise InvalidInput(
            f"{uri}: no MLflow tracking server configured; set registry.mlflow_tracking_uri "
            "(INFERD_REGISTRY__MLFLOW_TRACKING_URI) or MLFLOW_TRACKING_URI"
        )
    # This process is the import's own: fail fast rather than MLflow's minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        import mlflow
        from mlflow.exceptions import MlflowException
    except ImportError:
        raise InvalidInput(
            f"{uri}: importing from MLflow needs its client: pip install 'inferd[mlflow]'"
        ) from None
    # Both URIs, always: MLflow's default registry is a SQLite file in the working folder.
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    info: dict[str, Any] = {"source_uri": uri, "tracking_uri": tracking_uri}
    try:
        if uri.startswith("models:/"):
            version = _model_version(client, uri)
            info |= {"model_name": version.name, "model_version": str(version.version)}
            info["description"] = version.description or None
            run_id = version.run_id
            download = f"models:/{version.name}/{version.version}"
        else:
            run_id, _, path = uri.removeprefix("runs:/").partition("/")
            if not run_id or not path:
                raise InvalidInput(f"{uri}: expected runs:/<run_id>/<artifact path>")
            download = uri
        info["metadata"] = _run_metadata(client, run_id) if run_id else {}
        if run_id:
            info["run_id"] = run_id
        dest.mkdir(parents=True, exist_ok=True)
        folder = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=download, dst_path=str(dest), tracking_uri=tracking_uri
            )
        )
    except MlflowException as exc:
        code = getattr(exc, "error_code", "")
        if code in _NOT_FOUND:
            raise InvalidInput(f"MLflow at {tracking_uri}: {exc.message}") from None
        raise StoreUnavailable(
            f"MLflow at {tracking_uri} could not be used: {exc.message}"
        ) from None
    except OSError as exc:  # requests' connection errors are OSErrors
        raise StoreUnavailable(f"MLflow at {tracking_uri} could not be reached: {exc}") from None
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if size > limit_bytes:
        raise PayloadTooLarge(
            f"{uri} is {size} bytes, over registry.max_upload_bytes ({limit_bytes})",
            limit_bytes=limit_bytes,
        )
    return folder, info


def _model_version(client: Any, uri: str) -> Any:
    rest = uri.removeprefix("models:/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return client.get_model_version_by_alias(name, alias)
    name, _, ref = rest.partition("/")
    if not name or not ref or "/" in ref:
        raise InvalidInput(
            f"{uri}: expected models:/<name>/<version>, models:/<name>@<alias>, "
            "models:/<name>/<stage> or models:/<name>/latest"
        )
    if ref.isdigit():
        return client.get_model_version(name, ref)
    if ref.lower() == "latest":
        found = client.search_model_versions(f"name='{name}'")
    else:
        found = client.get_latest_versions(name, [ref])
    if not found:
        raise InvalidInput(f"{uri}: MLflow model {name!r} has no version {ref!r}")
    return max(found, key=lambda v: int(v.version))


def _run_metadata(client: Any, run_id: str) -> dict[str, Any]:
    run = client.get_run(run_id)
    metadata: dict[str, Any] = {}
    if run.data.metrics:
        metadata["metrics"] = dict(run.data.metrics)
    if run.data.params:
        metadata["params"] = dict(run.data.params)
    return metadata


def convert(mlflow_dir: Path, out: Path) -> Imported:
    """An inferd version folder (``out``) from an MLflow model folder."""
    import yaml

    spec_path = mlflow_dir / "MLmodel"
    if not spec_path.is_file():
        raise InvalidInput(f"{mlflow_dir.name} is not an MLflow model: it has no MLmodel file")
    spec = yaml.safe_load(spec_path.read_text()) or {}
    flavors: dict[str, Any] = spec.get("flavors") or {}
    flavor = next((f for f in FLAVORS if f in flavors and _serves(f, flavors[f])), None)
    if flavor is None:
        raise InvalidInput(
            f"MLflow flavor(s) {', '.join(sorted(flavors)) or 'none'} cannot be served; "
            f"inferd serves {', '.join(FLAVORS[:-1])} and pyfunc (python_function) models"
        )
    out.mkdir(parents=True)
    conf = flavors[flavor]
    inputs_schema = _schema(spec, "inputs")
    outputs_schema = _schema(spec, "outputs")
    metadata: dict[str, Any] = {"mlflow": {"flavor": flavor}}
    if spec.get("run_id"):
        metadata["mlflow"]["run_id"] = spec["run_id"]
    if inputs_schema and _is_columns(inputs_schema):
        metadata["feature_names"] = [c.get("name") for c in inputs_schema]
    inputs = _specs(inputs_schema, "features", "MLflow input") if inputs_schema else None
    if flavor == "python_function":
        signature = _whole_signature(inputs, outputs_schema, flavor)
        _pyfunc(mlflow_dir, out, signature, inputs_schema)
        return Imported(out, "python", metadata, signature=signature)
    if flavor == "pytorch":
        signature = _whole_signature(inputs, outputs_schema, flavor)
        _torch(mlflow_dir / conf["model_data"], out, signature, mlflow_dir / "code")
        return Imported(out, "torch", metadata, signature=signature)
    if flavor == "onnx":
        shutil.copy2(mlflow_dir / conf["data"], out / "model.onnx")
        return Imported(out, "onnx", metadata)  # the graph names its own inputs
    if flavor in ("tensorflow", "keras"):
        _tensorflow(mlflow_dir, conf, out)
        return Imported(out, None, metadata)  # converted to ONNX when it is checked
    if flavor == "xgboost":
        _xgboost(mlflow_dir / conf["data"], conf.get("model_format", "xgb"), out)
    elif flavor == "lightgbm" and Path(conf["data"]).suffix in (".txt", ".lgb"):
        shutil.copy2(mlflow_dir / conf["data"], out / "model.lgb")
    else:  # sklearn, and lightgbm's scikit-learn API, both saved by MLflow's sklearn code
        data = conf.get("pickled_model") or conf["data"]
        _resave_estimator(mlflow_dir / data, conf, out / "model.joblib")
    from inferd.runtimes import detect_framework

    # a tabular model takes one features matrix: MLflow's only when it is one
    matrix = inputs if inputs and [s.name for s in inputs] == ["features"] else None
    return Imported(out, detect_framework(out), metadata, inputs=matrix)


def _serves(flavor: str, conf: dict[str, Any]) -> bool:
    # python_function is every model's generic flavor: only a PythonModel is served as one
    return flavor != "python_function" or conf.get("loader_module") == "mlflow.pyfunc.model"


def _schema(spec: dict[str, Any], part: str) -> list[dict[str, Any]] | None:
    raw = (spec.get("signature") or {}).get(part)
    if not raw:
        return None
    parsed = json.loads(raw) if isinstance(raw, str) else raw
    return parsed or None


def _is_columns(schema: list[dict[str, Any]]) -> bool:
    return all(s.get("type") != "tensor" for s in schema)


def _specs(schema: list[dict[str, Any]], matrix: str, what: str) -> tuple[TensorSpec, ...]:
    """inferd tensors for an MLflow schema: numeric columns make one matrix."""
    if not _is_columns(schema):
        specs = []
        for i, s in enumerate(schema):
            tensor = s.get("tensor-spec") or {}
            datatype = datatype_of(np.empty(0, dtype=np.dtype(tensor.get("dtype", "float32"))))
            dims = list(tensor.get("shape") or [-1])
            dims[0] = -1
            default = matrix if len(schema) == 1 else f"{matrix}_{i}"
            specs.append(TensorSpec(s.get("name") or default, datatype, tuple(dims)))
        return tuple(specs)
    unknown = sorted({c.get("type", "?") for c in schema} - set(_COLUMN_TYPES))
    if unknown:
        raise InvalidInput(f"{what} column type(s) {', '.join(map(str, unknown))} are not served")
    types = [_COLUMN_TYPES[c["type"]] for c in schema]
    if all(t not in ("BYTES", "BOOL") for t in types):
        datatype = types[0] if len(set(types)) == 1 else "FP64"
        shape = (-1,) if len(schema) == 1 and matrix == "prediction" else (-1, len(schema))
        return (TensorSpec(matrix, datatype, shape),)
    if len(schema) == 1:
        return (TensorSpec(schema[0].get("name") or matrix, types[0]),)
    names = [c.get("name") for c in schema]
    if not all(names):
        raise InvalidInput(f"{what}: columns of mixed types need names")
    return tuple(TensorSpec(str(n), t) for n, t in zip(names, types, strict=True))


def _whole_signature(
    inputs: tuple[TensorSpec, ...] | None, outputs: list[dict[str, Any]] | None, flavor: str
) -> Signature:
    if inputs is None or outputs is None:
        raise InvalidInput(
            f"the MLflow {flavor} model has no {'input' if inputs is None else 'output'} "
            "signature: log it with one (signature= or input_example=), or declare a "
            "signature when importing it"
        )
    return Signature(inputs, _specs(outputs, "prediction", "MLflow output"))


def _tensorflow(mlflow_dir: Path, conf: dict[str, Any], out: Path) -> None:
    """A SavedModel folder or a ``.keras`` file, as the TensorFlow runtime reads them."""
    for key in ("saved_model_dir", "data"):
        if not conf.get(key) or not (mlflow_dir / conf[key]).is_dir():
            continue
        folder = mlflow_dir / conf[key]
        if (folder / "saved_model.pb").is_file():
            shutil.rmtree(out)
            shutil.copytree(folder, out)
            return
        kept = sorted(folder.glob("*.keras"))
        if len(kept) == 1:
            shutil.copy2(kept[0], out / kept[0].name)
            return
    raise InvalidInput("the MLflow tensorflow model holds no SavedModel and no .keras file")


def _xgboost(path: Path, model_format: str, out: Path) -> None:
    if model_format in ("json", "ubj"):
        shutil.copy2(path, out / f"model.{model_format}")
        return
    import xgboost

    booster = xgboost.Booster()
    booster.load_model(str(path))  # the legacy binary format, re-saved as UBJSON
    booster.save_model(str(out / "model.ubj"))


def _resave_estimator(path: Path, conf: dict[str, Any], out: Path) -> None:
    """A scikit-learn-API estimator, as the joblib file the tabular runtimes read."""
    import joblib

    fmt = conf.get("serialization_format") or ("skops" if path.suffix == ".skops" else "pickle")
    if fmt == "skops":
        import skops.io

        trusted = conf.get("skops_trusted_types") or skops.io.get_untrusted_types(file=path)
        estimator = skops.io.load(path, trusted=trusted)
    elif fmt in ("pickle", "cloudpickle"):
        import cloudpickle  # noqa: F401 -- a cloudpickled object needs it importable

        estimator = joblib.load(path)
    else:
        raise InvalidInput(f"MLflow serialization format {fmt!r} is not read by inferd")
    joblib.dump(estimator, out)


def _torch(data: Path, out: Path, signature: Signature, code: Path) -> None:
    exported = sorted(data.glob("*.pt2"))
    if exported:
        shutil.copy2(exported[0], out / "model.pt2")
        return
    path = data / "model.pth"
    if not path.is_file():
        raise InvalidInput(f"the MLflow pytorch model has no model.pth or .pt2 in {data.name}/")
    if zipfile.is_zipfile(path) and _is_torchscript(path):
        shutil.copy2(path, out / "model.pt")
        return
    _export_pickled_module(path, out / "model.pt2", signature, code)


def _is_torchscript(path: Path) -> bool:
    with zipfile.ZipFile(path) as archive:
        return any(name.split("/", 1)[-1].startswith("code/") for name in archive.namelist())


def _export_pickled_module(path: Path, out: Path, signature: Signature, code: Path) -> None:
    """torch.export a pickled ``nn.Module`` (MLflow's "pickle" format), batch dimension
    dynamic, and keep it only if it answers as the module does."""
    import sys

    import torch
    from torch.export import Dim

    if code.is_dir():
        sys.path.insert(0, str(code))
    module = torch.load(path, map_location="cpu", weights_only=False)
    module.eval()
    generator = torch.Generator().manual_seed(0)
    examples = tuple(
        torch.rand((3, *(max(d, 1) for d in spec.shape[1:])), generator=generator).to(
            getattr(torch, str(spec.numpy_dtype))
        )
        for spec in signature.inputs
    )
    dynamic = tuple({0: Dim.AUTO} for _ in examples)
    try:
        program = torch.export.export(module, examples, dynamic_shapes=dynamic)
    except Exception as exc:
        raise InvalidInput(f"the pickled PyTorch module cannot be exported: {exc}") from None
    with torch.inference_mode():
        expected, got = module(*examples), program.module()(*examples)
    pairs = zip(_tensors(expected), _tensors(got), strict=True)
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs):
        raise InvalidInput("the exported PyTorch program does not answer as the pickled module")
    torch.export.save(program, out)


def _tensors(result: Any) -> list[Any]:
    if isinstance(result, dict):
        return list(result.values())
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def _pyfunc(
    mlflow_dir: Path, out: Path, signature: Signature, columns: list[dict[str, Any]] | None
) -> None:
    shutil.copytree(mlflow_dir, out / "mlflow_model")
    names = [c.get("name") for c in columns] if columns and _is_columns(columns) else None
    io = {"signature": signature.to_dict(), "columns": names}
    (out / PYFUNC_IO).write_text(json.dumps(io, indent=2))
    (out / "model.py").write_text(
        '"""An MLflow pyfunc model (./mlflow_model), served by inferd\'s Python runtime."""\n\n'
        "from inferd.runtimes.mlflow_pyfunc import MlflowPyfunc\n\n\n"
        "class Model(MlflowPyfunc):\n"
        "    pass\n"
    )
