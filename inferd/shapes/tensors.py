"""Tensors as every layer names them: the Open Inference Protocol's datatypes, a named
input or output (:class:`TensorSpec`) and a model version's :class:`Signature`.

A runtime infers a signature (:mod:`inferd.runtimes.base`), the registry keeps it, the
routing table carries it to the gateways, whose codecs check requests against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Open Inference Protocol datatypes -> numpy. BYTES are object arrays of str/bytes.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_BY_NUMPY = {v.str: k for k, v in DATATYPES.items() if k != "BYTES"}
MEDIA = ("image",)
"""What a BYTES input may hold besides UTF-8 text (``TensorSpec.media``)."""


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype name of a numpy array (str/bytes/object -> BYTES)."""
    if array.dtype.kind in "OUS":
        return "BYTES"
    try:
        return _BY_NUMPY[array.dtype.str]
    except KeyError:
        raise TypeError(f"unsupported dtype {array.dtype}") from None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named input or output. ``shape[0]`` is the batch dimension, always -1."""

    name: str
    datatype: str
    shape: tuple[int, ...] = (-1,)
    media: str | None = None
    """What a BYTES input's elements are when not UTF-8 text: ``image`` (encoded JPEG,
    PNG, …, or an ``s3://`` URI of one; :mod:`inferd.runtimes.images`)."""

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise ValueError(f"unknown datatype {self.datatype!r}; one of {sorted(DATATYPES)}")
        if not self.shape or self.shape[0] != -1:
            raise ValueError(f"{self.name}: shape must start with the batch dimension -1")
        if self.media is not None and (self.media not in MEDIA or self.datatype != "BYTES"):
            raise ValueError(f"{self.name}: media {self.media!r} needs BYTES and one of {MEDIA}")

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "datatype": self.datatype,
            "shape": list(self.shape),
        }
        if self.media is not None:
            d["media"] = self.media
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        shape = tuple(d.get("shape", (-1,)))
        return cls(name=d["name"], datatype=d["datatype"], shape=shape, media=d.get("media"))


@dataclass(frozen=True, slots=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    labels: tuple[str, ...] | None = None
    """Class names of a classifier, in ``probabilities`` column order."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }
        if self.labels is not None:
            d["labels"] = list(self.labels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Signature:
        labels = d.get("labels")
        return cls(
            inputs=tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_dict(t) for t in d["outputs"]),
            labels=tuple(labels) if labels is not None else None,
        )

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)
