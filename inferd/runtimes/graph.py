"""The ``graph`` framework at push: a folder with ``graph.json`` is an inference graph.

A graph never runs in a replica (the gateway runs it, :mod:`inferd.graphs.runner`), so
this runtime only checks the spec's shape when the version is inspected at push; the
registry then checks the models it names and gives it their signature
(:meth:`inferd.registry.Registry.push`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.shapes.graph import GRAPH_FRAMEWORK, SPEC_FILE, parse
from inferd.shapes.tensors import Signature


class GraphRuntime(Runtime):
    framework = GRAPH_FRAMEWORK
    warm_up_at_push = False

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        return (artifact_dir / SPEC_FILE).is_file()

    def load(self) -> None:
        path = self.artifact_dir / SPEC_FILE
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {SPEC_FILE}: {exc}") from None
        self.graph = parse(spec)

    def infer_signature(self) -> Signature:
        # The models' signatures are the registry's to know: it replaces this one.
        return Signature((), ())

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError("a graph runs in the gateway, never in a replica")
