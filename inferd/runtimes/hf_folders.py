"""Reading Hugging Face and sentence-transformers folders, and the tensor steps around an
encoder (padding, pooling, int8 quantization), for :mod:`inferd.runtimes.transformers`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.errors import InvalidInput

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken", "weightedmean")
ST_POOLING_FLAGS = {  # sentence-transformers Pooling config flags -> our mode names
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_NAMES = {  # other spellings of the modes
    "mean_tokens": "mean",
    "cls_token": "cls",
    "max_tokens": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean_tokens": "weightedmean",
}
ACTIVATIONS = {  # sentence-transformers Dense activations -> torch functions
    "Tanh": "tanh",
    "Identity": None,
    "ReLU": "relu",
    "GELU": "gelu",
    "Sigmoid": "sigmoid",
}

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_config(folder: Path) -> dict[str, Any] | None:
    try:
        return read_json(folder / "config.json")
    except (OSError, ValueError):
        return None


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _WEIGHT_FILES) or any(
        folder.glob("model-*.safetensors")
    )


def is_sequence_classifier(config: dict[str, Any]) -> bool:
    architectures = config.get("architectures") or ()
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


@dataclass(frozen=True)
class StModule:
    kind: str
    path: Path


def st_modules(folder: Path) -> list[StModule] | None:
    """The modules of a sentence-transformers folder, or None for a plain HF folder."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path} must hold a list of modules")
    modules = []
    for entry in sorted(entries, key=lambda e: e.get("idx", 0)):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        modules.append(StModule(kind, folder / str(entry.get("path", ""))))
    return modules


def model_folder(artifact_dir: Path) -> Path:
    """Where config.json and the weights are: the folder, or the Transformer module's."""
    modules = st_modules(artifact_dir)
    if modules and modules[0].kind == "Transformer":
        return modules[0].path
    return artifact_dir


def load_dense(folder: Path, device: Any, dtype: Any) -> tuple[Any, str | None]:
    """A sentence-transformers Dense module as (linear layer, activation name)."""
    import torch

    config = read_json(folder / "config.json")
    activation = str(config.get("activation_function", "Identity")).rsplit(".", 1)[-1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"transformers: Dense activation {activation!r} is not supported")
    layer = torch.nn.Linear(
        int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True))
    )
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    else:
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    layer.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    return layer.to(device, dtype).eval(), ACTIVATIONS[activation]


def pad_batch(ids: list[Any], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows padded on the right to the longest: (input ids, attention mask),
    both int64 of shape (rows, longest)."""
    longest = max(len(row) for row in ids)
    input_ids = np.full((len(ids), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), longest), dtype=np.int64)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return input_ids, mask


def text_of(row: int, value: Any, name: str = "text") -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            raise InvalidInput(f"'{name}' of row {row} is not UTF-8") from None
    elif not isinstance(value, str):
        kind = type(value).__name__
        raise InvalidInput(f"'{name}' of row {row} must be a string, not {kind}")
    if not value:
        raise InvalidInput(f"'{name}' of row {row} is an empty string")
    return value


def st_pooling(folder: Path) -> str:
    config = read_json(folder / "config.json")
    mode = config.get("pooling_mode")  # sentence-transformers 5+: a name (or names)
    if isinstance(mode, str | list):
        modes = [POOLING_NAMES.get(m, m) for m in ([mode] if isinstance(mode, str) else mode)]
    else:
        modes = [name for flag, name in ST_POOLING_FLAGS.items() if config.get(flag)]
    if len(modes) != 1:
        raise ValueError(
            f"transformers: {folder}/config.json asks for pooling {modes or 'none'}; "
            "exactly one mode is supported"
        )
    return modes[0]


def pool(torch: Any, mode: str, hidden: Any, mask: Any) -> Any:
    """sentence-transformers' Pooling, for right-padded batches."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    expanded = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(expanded == 0, -1e9).max(dim=1).values
    if mode == "weightedmean":
        positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)
        expanded = expanded * positions.view(1, -1, 1)
    summed = (hidden * expanded).sum(dim=1)
    counts = expanded.sum(dim=1).clamp(min=1e-9)
    if mode == "mean_sqrt_len":
        return summed / counts.sqrt()
    return summed / counts


def quantize_int8(torch: Any, module: Any, every_layer: bool = False) -> Any:
    """Dynamic int8 quantization of the linear layers, except (unless ``every_layer``) the
    down-projections (more inputs than outputs: the feed-forward output layers), whose
    inputs carry the large activation outliers of BERT-family models: quantizing those
    per tensor costs most of the accuracy for a third of the speed-up."""
    linear = torch.nn.Linear
    # Wrapped, because quantize_dynamic replaces submodules only: a Dense module's own
    # linear layer is a root and would stay float32.
    root = torch.nn.Sequential(module)
    names = {
        name
        for name, layer in root.named_modules()
        if isinstance(layer, linear) and (every_layer or layer.in_features <= layer.out_features)
    }
    if not names:
        return module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return torch.ao.quantization.quantize_dynamic(root, names, dtype=torch.qint8)[0]
