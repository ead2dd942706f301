"""A version's drift reference *profile*: per feature its bins and reference counts, and
the embeddings' projections. Built by :mod:`inferd.telemetry.drift` (at push, or by
a replica from its first rows), kept in the registry, sent to replicas in
:class:`~inferd.shapes.replica.DriftQuery` and back in
:class:`~inferd.shapes.replica.DriftCounts`, read by the server's statistics
(:mod:`inferd.monitoring.drift_stats`).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


class FeatureProfile(msgspec.Struct, frozen=True, kw_only=True):
    """One feature of a profile: where it is read, its bins and its reference counts."""

    name: str
    kind: str
    """``numeric`` or ``categorical``."""
    input: str
    column: int | None = None
    """Its column of an input of shape [-1, F]; None: the input is of shape [-1]."""
    length: bool = False
    """A text input, followed by its length in characters."""
    edges: list[float] = []
    """numeric: the inner bin edges, ascending (a value goes to the bin of the edges it
    is at or above); the bins are ``len(edges) + 1`` then NaN."""
    categories: list[str] = []
    """categorical: one bin per value, then one for any other."""
    counts: list[int] = []
    """Reference rows per bin."""
    mean: float | None = None
    std: float | None = None
    """numeric: of the reference's finite values."""


class Projection(msgspec.Struct, frozen=True, kw_only=True):
    """How rows of an embedding become numeric features: their coordinates on the
    reference's principal directions (centred on its mean), the length of what those
    leave out, then their cosine to the mean."""

    tensor: str
    output: bool
    """An output of the model (counted after its batch), else an input."""
    center: list[float]
    directions: list[list[float]]
    """Unit vectors, the most spread first."""

    def matrices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the centre (D), the directions as columns (D, K), the unit centre)."""
        center = np.asarray(self.center, np.float64)
        w = np.asarray(self.directions, np.float64).T.reshape(len(center), -1)
        norm = np.linalg.norm(center)
        return center, w, center / norm if norm else center

    def apply(
        self, rows: np.ndarray, mats: tuple[np.ndarray, np.ndarray, np.ndarray]
    ) -> np.ndarray:
        """``rows`` (n, D) as their features (n, K + 2): their coordinates on the K
        directions, the length of what the directions leave out of them (their
        reconstruction error: what a new topic mostly moves), their cosine to the mean."""
        center, w, unit = mats
        x = np.asarray(rows, np.float64).reshape(len(rows), -1)
        centred = x - center
        coordinates = centred @ w
        rest = np.einsum("ij,ij->i", centred, centred)
        rest -= np.einsum("ij,ij->i", coordinates, coordinates)
        norms = np.linalg.norm(x, axis=1)
        cosine = np.divide(x @ unit, norms, out=np.zeros(len(x)), where=norms > 0)
        return np.column_stack([coordinates, np.sqrt(np.maximum(rest, 0.0)), cosine])


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A version's reference: what its inputs looked like, feature by feature."""

    features: list[FeatureProfile]
    rows: int
    source: str
    """``sample`` (registered with the version) or ``requests`` (its first rows)."""
    digest: str = ""
    """Names the bins (not the counts): replicas counting on the same digest add up."""
    projections: list[Projection] = []
    """The embeddings among the features' tensors (see the module)."""

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, value: Any) -> Profile:
        return msgspec.convert(value, cls)


def bins_of(feature: FeatureProfile) -> int:
    """How many counts the feature has (its bins, and its NaN or "other" bin)."""
    if feature.kind == "categorical":
        return len(feature.categories) + 1
    return len(feature.edges) + 2
