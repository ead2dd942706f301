"""The runtime contract: how a framework's model is loaded and run on a batch.

A runtime is a small subclass of :class:`Runtime`, one module per framework. It is
created in the replica process with the folder of one registered version, ``load()``-ed
once, then called with columnar batches: ``predict_batch({"features": array(N, 30)})``
returns ``{"label": array(N), "probabilities": array(N, 2)}`` -- every output has the
same first (batch) dimension N as the inputs. Runtimes never import HTTP code and
never run on an event loop (the replica calls them from its compute thread).

Output naming conventions the gateway relies on:
- classifiers return ``label`` (class names as BYTES when known, else INT64) and
  ``probabilities`` (FP32, one column per class, in ``labels`` order);
- regressors and everything else return ``prediction`` or their own names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from inferd.shapes.tensors import Signature

if TYPE_CHECKING:
    from inferd.replica_config import ExplainConfig, ImagesConfig
    from inferd.runtimes.explain import Explanation

MAX_WARMUP_SAMPLES = 1000
"""Most rows a version's ``warmup_samples`` may hold (a push runs them all at once)."""


@dataclass
class RuntimeConfig:
    """What a runtime gets besides its folder: the version's registry metadata."""

    threads: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    signature: Signature | None = None
    """A signature declared at push time; overrides what the runtime infers."""
    images: ImagesConfig | None = None
    """Limits of image inputs (the replica's ``images`` settings; None: the defaults)."""
    explain: ExplainConfig | None = None
    """Limits of explanations (the replica's ``explain`` settings; None: the defaults)."""


class Runtime(ABC):
    framework: ClassVar[str]
    """Registry name of the framework, e.g. ``"sklearn"``."""
    file_suffixes: ClassVar[tuple[str, ...]] = ()
    """Artifact file suffixes this runtime recognises, used by framework detection."""
    prepares_off_loop: ClassVar[bool] = False
    """:meth:`prepare` is heavy (decoding images): the replica runs it on several
    decoding threads (``images.decode_threads``), a request at a time each, instead of
    on its one preparing thread."""
    explains_beside_batches: ClassVar[bool] = True
    """An explanation may compute on a thread of its own while batches compute (the
    model is safe to call from two threads); False for user code, which then explains
    on the model's own thread, between batches."""
    warm_up_at_push: ClassVar[bool] = True
    """A push runs the loaded model on :meth:`warmup_inputs`; False for runtimes whose
    :meth:`load` is the whole check (LLMs served by an engine in their replica)."""

    def __init__(self, artifact_dir: Path, config: RuntimeConfig | None = None) -> None:
        self.artifact_dir = Path(artifact_dir)
        self.config = config or RuntimeConfig()

    @classmethod
    def accepts(cls, path: Path) -> bool:
        """Whether one file is an artifact of this framework (cheap: no loading)."""
        return path.is_file() and path.suffix in cls.file_suffixes

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        """Whether the folder holds an artifact of this framework."""
        return any(cls.accepts(p) for p in artifact_dir.iterdir())

    @abstractmethod
    def load(self) -> None:
        """Load the model into memory. Called once, off the event loop."""

    @abstractmethod
    def infer_signature(self) -> Signature:
        """The signature as far as the loaded model tells it."""

    @abstractmethod
    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model on a columnar batch; every output keeps the batch dimension."""

    def prepare(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
        """Per-request work done once, before batching (tokenizing, for text models).

        Called on the replica's preparing thread (never its event loop) with one
        request's columns, one request at a time. Returns the columns
        :meth:`predict_batch` takes (batches concatenate them row-wise, so every column
        keeps the batch dimension) and each row's length (an int array; requests of
        similar lengths are batched together) or None.
        """
        return inputs, None

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`prepare` then :meth:`predict_batch`: a whole inference, off the batcher."""
        return self.predict_batch(self.prepare(inputs)[0])

    def explain(self, inputs: dict[str, np.ndarray], deadline: float) -> Explanation:
        """Each feature's share of each row's prediction (:mod:`inferd.runtimes.explain`):
        KernelSHAP over :meth:`predict_batch` against the version's background rows; tree
        runtimes override it with exact TreeSHAP. ``deadline`` is ``time.monotonic()``'s."""
        from inferd.runtimes.explain import kernel_explain

        return kernel_explain(self, inputs, deadline)

    def unload(self) -> None:  # noqa: B027 -- optional hook
        """Release what ``load`` took beyond what process exit frees."""

    @property
    def signature(self) -> Signature:
        if self.config.signature is not None:
            return self.config.signature
        return self.infer_signature()

    def warmup_inputs(self, rows: int = 1, first: int = 0) -> dict[str, np.ndarray]:
        """``rows`` rows to warm the model up with: the version's registered samples
        (metadata ``warmup_samples``) from the ``first``-th on, cycled, or else rows
        generated from the signature (:meth:`generated_inputs`)."""
        samples = self.config.metadata.get("warmup_samples")
        if samples is not None:
            return sample_columns(self.signature, samples, rows, first)
        return self.generated_inputs(rows)

    def generated_inputs(self, rows: int) -> dict[str, np.ndarray]:
        """Rows of zeros (or of the text "warm up") matching the signature."""
        batch: dict[str, np.ndarray] = {}
        for spec in self.signature.inputs:
            shape = (rows, *(max(d, 1) for d in spec.shape[1:]))
            if spec.datatype == "BYTES":
                batch[spec.name] = np.full(shape, "warm up", dtype=object)
            else:
                batch[spec.name] = np.zeros(shape, dtype=spec.numpy_dtype)
        return batch

    def find_file(self) -> Path:
        """The single file of the version folder that :meth:`accepts` takes."""
        found = sorted(p for p in self.artifact_dir.iterdir() if self.accepts(p))
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise FileNotFoundError(
                f"{self.framework}: expected one model file ({'/'.join(self.file_suffixes)}) "
                f"in {self.artifact_dir}, found {names}"
            )
        return found[0]


def sample_columns(
    signature: Signature, samples: Any, rows: int, first: int = 0, field: str = "warmup_samples"
) -> dict[str, np.ndarray]:
    """Columns of ``rows`` rows taken from ``samples`` (cycled from the ``first``-th):
    a list of rows, each an object by input name or, for a model of one input, that
    input's value. ValueError naming what does not fit the signature (and the metadata
    ``field`` the rows came from)."""
    if not isinstance(samples, list) or not 0 < len(samples) <= MAX_WARMUP_SAMPLES:
        raise ValueError(f"metadata {field} must be a list of 1 to {MAX_WARMUP_SAMPLES} rows")
    picked = [samples[(first + i) % len(samples)] for i in range(rows)]
    columns: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        values = []
        for row in picked:
            if isinstance(row, dict):
                if spec.name not in row:
                    raise ValueError(f"metadata {field}: a row has no input {spec.name!r}")
                values.append(row[spec.name])
            elif len(signature.inputs) == 1:
                values.append(row)
            else:
                names = ", ".join(repr(s.name) for s in signature.inputs)
                raise ValueError(
                    f"metadata {field}: each row must be an object naming the inputs {names}"
                )
        try:
            dtype = object if spec.datatype == "BYTES" else spec.numpy_dtype
            array = np.array(values, dtype=dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"metadata {field}: input {spec.name!r} is not {spec.datatype}: {exc}"
            ) from None
        if array.ndim != len(spec.shape) or any(
            d not in (-1, n) for d, n in zip(spec.shape[1:], array.shape[1:], strict=True)
        ):
            raise ValueError(
                f"metadata {field}: input {spec.name!r} has rows of shape "
                f"{list(array.shape[1:])}, the signature says {list(spec.shape[1:])}"
            )
        columns[spec.name] = array
    return columns
