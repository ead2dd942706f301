"""PyTorch models: TorchScript (``.pt``/``.pth``, ``torch.jit.save``) or torch.export
programs (``.pt2``, ``torch.export.save``).

Weights do not say what a model takes or returns, so the signature must be declared:
at push time (``config.signature``) or inside the file, as an extra file named
``signature.json`` holding ``Signature.to_dict()`` (``_extra_files=`` for
``torch.jit.save``, ``extra_files=`` for ``torch.export.save``). Inputs are passed
positionally in signature order; a returned tensor is the first output, a tuple/list
the outputs in order, a dict the outputs by name.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.shapes.tensors import Signature

logger = logging.getLogger(__name__)

SIGNATURE_FILE = "signature.json"


class TorchRuntime(Runtime):
    framework = "torch"
    file_suffixes = (".pt", ".pth", ".pt2")

    def load(self) -> None:
        import torch

        self._torch = torch
        torch.set_num_threads(self.config.threads)
        path = self.find_file()
        extra = {SIGNATURE_FILE: ""}
        if path.suffix == ".pt2":
            self.module = torch.export.load(path, extra_files=extra).module()
        else:
            self.module = _load_torchscript(torch, path, extra)
        embedded = extra[SIGNATURE_FILE]
        self._embedded = Signature.from_dict(json.loads(embedded)) if embedded else None
        if self.config.signature is None and self._embedded is None:
            raise ValueError(
                f"torch: {path.name} has no signature. Declare one when pushing the model, "
                f'or save it inside the file: extra files {{"{SIGNATURE_FILE}": '
                "json.dumps(signature.to_dict())}"
            )
        self._signature = self.signature
        if any(spec.datatype == "BYTES" for spec in self._signature.inputs):
            raise ValueError("torch: BYTES inputs cannot become tensors")

    def infer_signature(self) -> Signature:
        if self._embedded is None:
            raise ValueError("torch: the signature cannot be inferred from weights")
        return self._embedded

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = []
        for spec in self._signature.inputs:
            array = np.asarray(inputs[spec.name], dtype=spec.numpy_dtype)
            if not array.flags.writeable:
                # torch cannot hold read-only memory (e.g. arrays over a request buffer).
                array = array.copy()
            args.append(self._torch.from_numpy(array))
        with self._torch.inference_mode():
            result = self.module(*args)
        return {name: t.detach().cpu().numpy() for name, t in self._name_outputs(result)}

    def _name_outputs(self, result: Any) -> list[tuple[str, Any]]:
        names = [spec.name for spec in self._signature.outputs]
        if isinstance(result, self._torch.Tensor):
            return [(names[0], result)]
        if isinstance(result, dict):
            missing = [n for n in names if n not in result]
            if missing:
                raise ValueError(f"torch: the model returned no {missing} (got {list(result)})")
            return [(n, result[n]) for n in names]
        if isinstance(result, tuple | list) and len(result) == len(names):
            return list(zip(names, result, strict=True))
        raise ValueError(
            f"torch: the model returned {type(result).__name__}"
            f"{f' of {len(result)}' if isinstance(result, tuple | list) else ''}; "
            f"the signature declares outputs {names}"
        )

    def unload(self) -> None:
        del self.module


def _load_torchscript(torch: Any, path: Path, extra: dict[str, Any]) -> Any:
    # TorchScript is deprecated upstream but still the common artifact; the user chose
    # the format, so its deprecation notice is noise in a server log.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.load` is deprecated", DeprecationWarning)
        try:
            module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except RuntimeError as exc:
            raise ValueError(
                f"torch: {path.name} is not a TorchScript file ({exc}); save models with "
                "torch.jit.save(torch.jit.script(model)) or torch.export.save"
            ) from exc
    extra[SIGNATURE_FILE] = extra[SIGNATURE_FILE].decode() if extra[SIGNATURE_FILE] else ""
    return module.eval()
