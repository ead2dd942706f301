"""Label-free drift, the replica's half: what a version's inputs looked like when it was
registered (its reference *profile*) and what they look like now (cumulative *counts*
on the profile's bins). The statistics and the rolling windows are the server's
(:mod:`inferd.monitoring.drift_stats`, :mod:`inferd.control.drift`).

A profile is built once per version: from a sample registered with it (a
``drift_reference.npz`` in its folder, read at push: :func:`read_reference_sample`), or
else from the first ``drift.reference_rows`` rows one of its replicas counts. The server
keeps it (the registry's ``drift_references`` table) and hands it to every replica of
the version, so all of them count on the same bins and their counts add up.

Features (:func:`build_profile`): a numeric input of shape ``[-1]`` is one feature named
as the input; one of shape ``[-1, F]`` gives F, named by the version's ``features`` (or
``feature_names``) metadata, else ``input[j]``. A BYTES input of shape ``[-1]`` is
categorical when the reference holds at most ``max_categories`` distinct values (one
bin each, and one for any other value), else a text, followed by its length in
characters (``input.length``). Other inputs (images, sequences) are not profiled.

Embeddings (a :class:`Projection`): a float input of shape ``[-1, D]`` wider than
:data:`MAX_FEATURES`, and a float output of shape ``[-1, D]`` named ``embedding`` (or
``embeddings``, or listed in the version's ``drift_embeddings`` metadata) -- what a text
embedding model says of its texts, where a text's length says little. The reference's
mean and its top :data:`DIRECTIONS` principal directions summarise its distribution;
each row is counted as numeric features: its coordinate on each direction
(``embedding.pc1`` …, centred on the mean), the length of the rest of it (what the
directions do not reconstruct: ``embedding.residual``) and its cosine to the mean
(``embedding.cosine``). A topic the reference did not have moves them (mostly the
residual and the cosine: a new topic's direction lies mostly outside the reference's
top ones), and their PSI and KS flag it as any feature's; the window's mean over them,
in reference standard deviations, is the embedding's distance
(:func:`~inferd.monitoring.drift_stats.embedding_distances`). The directions are
fitted to half of the reference's rows, the features' bins to the other half. A
version's outputs are counted after its batch computed them (its inputs before);
a registered sample holds the outputs' embeddings too (as an array named by the
output), else the embedding is profiled only from requests.

A numeric feature's bins are the reference's deciles (:data:`BINS`; each distinct value
its own bin when there are fewer), plus a bin for NaN. Counting a batch
(:class:`Binner`) is a comparison with each feature's edges and one ``bincount``: tens
of microseconds for a batch of 64 rows of 30 features, so every row is counted (a batch
over :data:`MAX_ROWS_COUNTED` rows is counted by a stride of its rows).
"""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from inferd.shapes.drift import FeatureProfile, Profile, Projection, bins_of
from inferd.shapes.tensors import Signature

Columns = dict[str, np.ndarray]

REFERENCE_FILE = "drift_reference.npz"
"""A version's registered reference sample: arrays by input name, rows first."""
BINS = 10
"""Bins per numeric feature: the reference's deciles, PSI's usual resolution."""
MIN_REFERENCE_ROWS = 100
"""Fewest rows a reference is built from (fewer: bins of a few rows each say nothing)."""
MAX_REFERENCE_ROWS = 100_000
"""Rows of a registered sample the profile is built from at most (a random subset)."""
MAX_FEATURES = 256
"""An input of more columns than this (an image, a sequence) is not profiled."""
DIRECTIONS = 8
"""Principal directions of an embedding's reference it is counted on."""
EMBEDDING_OUTPUTS = ("embedding", "embeddings")
"""Outputs profiled as embeddings (float, ``[-1, D]``), with the ``drift_embeddings``
metadata's."""
FLOATS = ("FP16", "BF16", "FP32", "FP64")
MAX_ROWS_COUNTED = 1024
"""Rows of one batch counted at most; a larger batch is counted by a stride of its rows."""
PENDING_ROWS = 1024
"""Batches are kept (their arrays, not copies) until this many rows wait, then counted
at once: a count costs a dozen numpy calls whatever its rows, ~30 us, which for a light
model's batch of a few rows would be as much as its compute."""


def _digest(features: list[FeatureProfile], projections: list[Projection]) -> str:
    layout = [(f.name, f.input, f.column, f.length, f.edges, f.categories) for f in features]
    return hashlib.sha256(msgspec.json.encode([layout, projections])).hexdigest()[:16]


def embedding_outputs(signature: Signature, metadata: dict[str, Any]) -> list[str]:
    """The outputs profiled as embeddings (see the module)."""
    listed = metadata.get("drift_embeddings")
    named = set(listed) if isinstance(listed, list) else set(EMBEDDING_OUTPUTS)
    return [
        spec.name
        for spec in signature.outputs
        if spec.name in named and spec.datatype in FLOATS and len(spec.shape) == 2
    ]


# -- building a profile -------------------------------------------------------------------


def build_profile(
    signature: Signature,
    columns: Columns,
    source: str,
    metadata: dict[str, Any] | None = None,
    max_categories: int = 50,
) -> Profile:
    """The profile of ``columns`` (the reference rows, by input name): the features of
    the inputs found there (see the module), their bins and counts."""
    rows = _rows_of(columns)
    layout, projections = _input_features(signature, columns, metadata or {}, max_categories)
    for name in embedding_outputs(signature, metadata or {}):
        if (array := columns.get(name)) is not None and array.ndim == 2:
            projections.append(_projection(name, True, array[0::2]))
    for projection in projections:  # on the rows the directions were not fitted to
        tensor = projection.tensor
        values = projection.apply(columns[tensor][1::2], projection.matrices())
        names = [f"{tensor}.pc{k + 1}" for k in range(values.shape[1] - 2)]
        layout.extend(
            _numeric_feature(name, tensor, k, values[:, k])
            for k, name in enumerate([*names, f"{tensor}.residual", f"{tensor}.cosine"])
        )
    features = [msgspec.structs.replace(f, counts=[0] * bins_of(f)) for f in layout]
    binner = Binner(features, projections)
    projected = {p.tensor for p in projections}
    counts = binner.count({n: a for n, a in columns.items() if n not in projected}, most=None)[0]
    if projected:
        counts += binner.count({n: columns[n][1::2] for n in projected}, most=None)[0]
    out, start = [], 0
    for feature in features:
        end = start + bins_of(feature)
        out.append(msgspec.structs.replace(feature, counts=counts[start:end].tolist()))
        start = end
    return Profile(
        features=out, rows=rows, source=source, digest=_digest(out, projections),
        projections=projections,
    )  # fmt: skip


def _input_features(
    signature: Signature, columns: Columns, metadata: dict[str, Any], max_categories: int
) -> tuple[list[FeatureProfile], list[Projection]]:
    """The features of the inputs found in ``columns`` (their bins, not their counts yet),
    and the projections of those that are embeddings."""
    layout: list[FeatureProfile] = []
    projections: list[Projection] = []
    for spec in signature.inputs:
        array = columns.get(spec.name)
        if array is None or spec.media is not None:
            continue
        if spec.datatype == "BYTES":
            if array.ndim == 1:
                layout.append(_text_feature(spec.name, array, max_categories))
        elif array.ndim == 1:
            layout.append(_numeric_feature(spec.name, spec.name, None, array))
        elif array.ndim == 2 and array.shape[1] <= MAX_FEATURES:
            names = _feature_names(spec.name, array.shape[1], metadata)
            layout.extend(
                _numeric_feature(name, spec.name, j, array[:, j]) for j, name in enumerate(names)
            )
        elif array.ndim == 2 and spec.datatype in FLOATS:
            projections.append(_projection(spec.name, False, array[0::2]))
    return layout, projections


def _projection(tensor: str, output: bool, array: np.ndarray) -> Projection:
    """The mean and principal directions of an embedding's reference rows (SVD of at
    most 10,000 of them, centred). Fitted to half of the reference: the features' bins
    and moments come from the other half, as directions fitted to rows spread those
    rows more along them (and leave them less residual) than they will spread new rows."""
    x = np.asarray(array, np.float64)
    x = x[np.isfinite(x).all(axis=1)][:10_000]
    if len(x) < 2:
        raise ValueError(f"{tensor}: an embedding's reference needs finite rows")
    center = x.mean(axis=0)
    _, spread, vt = np.linalg.svd(x - center, full_matrices=False)
    keep = vt[: min(DIRECTIONS, int((spread > 1e-9 * max(spread[0], 1e-300)).sum()))]
    return Projection(
        tensor=tensor, output=output, center=center.tolist(), directions=keep.tolist()
    )


def _rows_of(columns: Columns) -> int:
    sizes = {len(array) for array in columns.values()}
    if len(sizes) != 1:
        raise ValueError(f"the reference's inputs have different numbers of rows: {sorted(sizes)}")
    return sizes.pop()


def _feature_names(input_name: str, width: int, metadata: dict[str, Any]) -> list[str]:
    """Named as explanations name them: the ``features`` (or ``feature_names``) metadata."""
    for given in (metadata.get("features"), metadata.get("feature_names")):
        if isinstance(given, list) and len(given) == width:
            return [str(name) for name in given]
    return [f"{input_name}[{j}]" for j in range(width)]


def _numeric_feature(
    name: str, input_name: str, column: int | None, values: np.ndarray, length: bool = False
) -> FeatureProfile:
    x = np.asarray(values, dtype=np.float64)
    finite = x[np.isfinite(x)]
    mean = float(finite.mean()) if finite.size else None
    std = float(finite.std()) if finite.size else None
    return FeatureProfile(
        name=name, kind="numeric", input=input_name, column=column, length=length,
        edges=_edges(finite), mean=mean, std=std,
    )  # fmt: skip


def _edges(finite: np.ndarray) -> list[float]:
    """Inner edges of deciles of ``finite``; with fewer distinct values than bins, one
    bin per value (edges halfway between them): a flag or a small count keeps each of
    its values apart instead of merging them into tied quantiles."""
    distinct = np.unique(finite)
    if distinct.size <= 1:
        return [float(v) for v in distinct]
    if distinct.size <= BINS:
        return [float(v) for v in (distinct[:-1] + distinct[1:]) / 2]
    edges = np.unique(np.quantile(finite, np.linspace(0, 1, BINS + 1)[1:-1]))
    return [float(v) for v in edges]


def _text_feature(name: str, values: np.ndarray, max_categories: int) -> FeatureProfile:
    texts = [_text(v) for v in values.tolist()]
    distinct, counts = np.unique(np.array(texts, dtype=object), return_counts=True)
    if len(distinct) <= max_categories:
        order = sorted(range(len(distinct)), key=lambda i: (-counts[i], distinct[i]))
        categories = [str(distinct[i]) for i in order]
        return FeatureProfile(name=name, kind="categorical", input=name, categories=categories)
    lengths = np.fromiter((len(t) for t in texts), np.float64, len(texts))
    return _numeric_feature(f"{name}.length", name, None, lengths, length=True)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# -- counting -----------------------------------------------------------------------------


class Binner:
    """Counts rows on a profile's bins: one flat count vector (each feature's bins in
    profile order), and per feature the sum and the sum of squares of its finite values
    (a window's mean and spread without keeping its rows)."""

    def __init__(
        self, features: list[FeatureProfile], projections: list[Projection] | None = None
    ) -> None:
        self.features = features
        sizes = [bins_of(f) for f in features]
        self.size = sum(sizes)
        self._projections = {p.tensor: (p, p.matrices()) for p in projections or ()}
        self.outputs = {p.tensor for p in projections or () if p.output}
        """The model's outputs it reads."""
        self.inputs = {f.input for f in features} - self.outputs
        """The inputs it reads."""
        offsets = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        self._matrices: dict[str, tuple[np.ndarray, ...]] = {}
        """Input -> its numeric features: (indices, columns, edges (edge, feature), NaN
        bins, offsets)."""
        self._others: list[tuple[int, FeatureProfile, int, dict[Any, int]]] = []
        by_input: dict[str, list[int]] = {}
        for i, f in enumerate(features):
            if f.kind == "numeric" and not f.length:
                by_input.setdefault(f.input, []).append(i)
            else:
                index: dict[Any, int] = {c: k for k, c in enumerate(f.categories)}
                index.update({c.encode(): k for k, c in enumerate(f.categories)})
                self._others.append((i, f, int(offsets[i]), index))
        for input_name, members in by_input.items():
            width = max((len(features[i].edges) for i in members), default=0)
            edges = np.full((max(width, 1), len(members)), np.nan)  # NaN pads: never <= x
            for k, i in enumerate(members):
                edges[: len(features[i].edges), k] = features[i].edges
            nan_bin = np.array([len(features[i].edges) + 1 for i in members], np.int64)
            columns = np.array([features[i].column or 0 for i in members], np.int64)
            self._matrices[input_name] = (
                np.array(members), columns, edges, nan_bin, offsets[members]
            )  # fmt: skip

    def count(
        self, columns: Columns, most: int | None = MAX_ROWS_COUNTED
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(counts, sums, squares, rows counted) of ``columns``, a batch by input name
        (the features of tensors it lacks are not counted): every row, or a stride of
        them when there are more than ``most``."""
        rows = _rows_of(columns) if columns else 0
        counts = np.zeros(self.size, np.int64)
        sums = np.zeros(len(self.features))
        squares = np.zeros(len(self.features))
        if rows == 0:
            return counts, sums, squares, 0
        step = 1 if most is None else -(-rows // most)
        for input_name, (members, cols, edges, nan_bin, offsets) in self._matrices.items():
            if input_name not in columns:
                continue
            x = np.asarray(columns[input_name][::step], dtype=np.float64)
            if input_name in self._projections:
                projection, mats = self._projections[input_name]
                x = projection.apply(x, mats)
            x = x.reshape(len(x), 1) if x.ndim == 1 else x[:, cols]
            # edges first: one comparison, then a sum over the leading axis (a sum over
            # a short last axis is several times slower); fewer than 256 edges: uint8
            bins = np.add.reduce(x[None] >= edges[:, None, :], axis=0, dtype=np.uint8)
            finite = np.isfinite(x)
            if not finite.all():  # rare: NaN to its own bin, out of the sums
                bins = np.where(np.isnan(x), nan_bin, bins)
                x = np.where(finite, x, 0.0)
            counts += np.bincount((bins + offsets).ravel(), minlength=self.size)
            sums[members] += x.sum(axis=0)
            squares[members] += np.einsum("ij,ij->j", x, x)
        for i, feature, offset, index in self._others:
            if feature.input not in columns:
                continue
            values = columns[feature.input][::step].tolist()
            if feature.kind == "categorical":
                other = len(feature.categories)
                bins = np.fromiter((index.get(v, other) for v in values), np.int64, len(values))
            else:  # a text's length
                x = np.fromiter((len(v) for v in values), np.float64, len(values))
                bins = np.searchsorted(np.array(feature.edges), x, side="right")
                sums[i] += x.sum()
                squares[i] += (x * x).sum()
            counts += np.bincount(bins + offset, minlength=self.size)
        return counts, sums, squares, -(-rows // step)


class DriftCounter:
    """A replica's counts of its rows on its version's profile. Idle (nothing counted,
    nothing kept) until the server first asks (:meth:`configure`): a server with drift
    off never does. Without a profile it keeps its first ``reference_rows`` rows and
    builds one from them, which it reports until the server hands a profile back (that
    one, or the version's own if another replica's came first). Batches are counted on
    the replica's compute thread while reports are read on its event loop: a lock keeps
    the counts and the row count one consistent pair."""

    def __init__(
        self,
        signature: Signature,
        metadata: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signature = signature
        self.metadata = metadata
        self.outputs = embedding_outputs(signature, metadata)
        """The outputs a profile of its own is built of too (its embeddings)."""
        self._clock = clock
        self.active = False
        """Count what :meth:`observe` is given (set by the server's first question)."""
        self.profile: Profile | None = None
        self.acknowledged = False
        """The server handed the profile counted on (else: this replica built it)."""
        self.reference_rows = 1000
        self.max_categories = 50
        self.max_rows_per_s = 5000
        self._stride = 1
        """One row in this many is counted (more rows a second than ``max_rows_per_s``)."""
        self._rate_at = clock()
        self._recent = 0
        """Rows given since ``_rate_at`` (the arrival rate, measured each second)."""
        self.seen = 0
        self._lock = threading.Lock()
        self._collected: list[Columns] = []
        self._collected_rows = 0
        self._collected_out: list[Columns] = []
        self._collected_out_rows = 0
        self._binner: Binner | None = None
        self._pending: list[Columns] = []
        self._pending_rows = 0
        self._pending_out: list[Columns] = []
        self._pending_out_rows = 0
        self._seen_out = 0
        self.counts = np.zeros(0, np.int64)
        self.sums = np.zeros(0)
        self.squares = np.zeros(0)
        self.rows = 0
        self.since = time.time()
        """When counting on the profile began (wall clock; monotonic: ``_began``)."""
        self._began = clock()

    def configure(
        self,
        reference: Profile | None,
        reference_rows: int,
        max_categories: int,
        max_rows_per_s: int = 5000,
    ) -> None:
        """Start counting; ``reference``: the version's profile (counted on from now)."""
        with self._lock:
            self.active = True
            self.reference_rows, self.max_categories = reference_rows, max_categories
            self.max_rows_per_s = max_rows_per_s
            if reference is not None:
                self.acknowledged = True
                if self.profile is None or reference.digest != self.profile.digest:
                    self._count_on(reference)

    def _count_on(self, profile: Profile) -> None:
        self.profile = profile
        self._binner = Binner(profile.features, profile.projections)
        self.counts = np.zeros(self._binner.size, np.int64)
        self.sums = np.zeros(len(profile.features))
        self.squares = np.zeros(len(profile.features))
        self.rows = 0
        self.since, self._began = time.time(), self._clock()
        self._collected, self._collected_rows = [], 0
        self._collected_out, self._collected_out_rows = [], 0
        self._pending, self._pending_rows = [], 0
        self._pending_out, self._pending_out_rows = [], 0
        self.seen = self._seen_out = 0

    def observe(self, columns: Columns) -> None:
        """Count one batch (or request) of input columns (kept until
        :data:`PENDING_ROWS` rows wait)."""
        if not self.active:
            return
        with self._lock:
            binner = self._binner
            if binner is None:
                self._collect(columns)
                return
            rows = _rows_of(columns)
            step = max(self._sampling(rows), -(-rows // MAX_ROWS_COUNTED))
            first = (-self.seen) % step  # the next row of the stride across batches
            self.seen += rows
            if first >= rows:
                return
            self._pending.append({name: columns[name][first::step] for name in binner.inputs})
            self._pending_rows += -(-(rows - first) // step)
            if self._pending_rows >= PENDING_ROWS:
                self._count_pending(binner)

    def observe_outputs(self, columns: Columns) -> None:
        """Count one batch's outputs (its embeddings; see the module), by the stride
        its inputs were counted at. Its rows were counted with its inputs."""
        if not self.active or not self.outputs:
            return
        with self._lock:
            binner = self._binner
            if binner is None:
                self._collect_outputs(columns)
                return
            if not binner.outputs:
                return
            kept = {name: columns[name] for name in binner.outputs if name in columns}
            if not kept:
                return
            rows = _rows_of(kept)
            stride = self._stride if binner.inputs else self._sampling(rows)
            step = max(stride, -(-rows // MAX_ROWS_COUNTED))
            first = (-self._seen_out) % step
            self._seen_out += rows
            if first >= rows:
                return
            self._pending_out.append({name: array[first::step] for name, array in kept.items()})
            self._pending_out_rows += -(-(rows - first) // step)
            if self._pending_out_rows >= PENDING_ROWS:
                self._count_pending(binner)

    def _sampling(self, rows: int) -> int:
        """One row in how many to count: the arrival rate of the last second over
        ``max_rows_per_s`` (1 below it)."""
        now = self._clock()
        if now - self._rate_at >= 1.0:
            rate = self._recent / (now - self._rate_at)
            self._stride = max(1, int(-(-rate // self.max_rows_per_s)))
            self._rate_at, self._recent = now, 0
        self._recent += rows
        return self._stride

    def _count_pending(self, binner: Binner) -> None:
        """Count the kept inputs, then the kept outputs (whose rows were counted with
        their inputs, unless only outputs are profiled: an image embedding model)."""
        pending, self._pending, self._pending_rows = self._pending, [], 0
        self._count(binner, pending, binner.inputs, rows=True)
        pending, self._pending_out, self._pending_out_rows = self._pending_out, [], 0
        self._count(binner, pending, binner.outputs, rows=not binner.inputs)

    def _count(self, binner: Binner, pending: list[Columns], names: set[str], rows: bool) -> None:
        if not pending:
            return
        joined = {n: np.concatenate([part[n] for part in pending]) for n in names}
        counts, sums, squares, counted = binner.count(joined, most=None)
        self.counts += counts
        self.sums += sums
        self.squares += squares
        if rows:
            self.rows += counted

    def _collect(self, columns: Columns) -> None:
        wanted = self.reference_rows - self._collected_rows
        if wanted > 0:
            self._collected.append({name: array[:wanted] for name, array in columns.items()})
            self._collected_rows += min(wanted, _rows_of(columns))
        self._build_when_collected()

    def _collect_outputs(self, columns: Columns) -> None:
        wanted = self.reference_rows - self._collected_out_rows
        kept = {name: columns[name][:wanted] for name in self.outputs if name in columns}
        if wanted > 0 and kept:
            self._collected_out.append(kept)
            self._collected_out_rows += min(wanted, _rows_of(kept))
        self._build_when_collected()

    def _build_when_collected(self) -> None:
        """A profile of its own once it has its first ``reference_rows`` rows' inputs
        (and, with embedding outputs, their outputs)."""
        want = self.reference_rows
        inputs = self._collected_rows >= want or (self.outputs and not self._profiled_inputs())
        if not inputs or (self.outputs and self._collected_out_rows < want):
            return
        sample: Columns = {}
        for parts in (self._collected, self._collected_out):
            for name in parts[0] if parts else ():
                sample[name] = np.concatenate([part[name] for part in parts])[:want]
        self._count_on(
            build_profile(self.signature, sample, "requests", self.metadata, self.max_categories)
        )

    def _profiled_inputs(self) -> bool:
        """Does the signature have inputs a profile would count (not images)?"""
        return any(spec.media is None for spec in self.signature.inputs)

    def report(self) -> dict[str, Any]:
        """The counts since this replica started counting on its profile, as the
        :class:`~inferd.shapes.replica.DriftCounts` frame's fields."""
        with self._lock:
            if self._binner is not None:
                self._count_pending(self._binner)
            profile = self.profile
            return {
                "digest": "" if profile is None else profile.digest,
                "since": self.since,
                "age_s": self._clock() - self._began,
                "rows": self.rows,
                "counts": self.counts.tolist(),
                "sums": self.sums.tolist(),
                "squares": self.squares.tolist(),
                "collected": self._collected_rows,
                "seen": self.seen,
                "profile": None if self.acknowledged else profile,
            }


# -- a registered sample ------------------------------------------------------------------


def read_reference_sample(
    folder: Path, signature: Signature, metadata: dict[str, Any] | None = None
) -> Columns | None:
    """The version's registered reference rows (``drift_reference.npz`` in ``folder``:
    numpy arrays by input name, and by embedding output name (:func:`embedding_outputs`),
    rows first; texts as numpy str arrays, no pickles), at most
    :data:`MAX_REFERENCE_ROWS` of them; None when there is no such file. ValueError
    saying what does not fit the signature."""
    path = Path(folder) / REFERENCE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as found:
            columns = {name: found[name] for name in found.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{REFERENCE_FILE}: not a numpy .npz of arrays ({exc})") from None
    known = {spec.name: spec for spec in signature.inputs}
    outputs = embedding_outputs(signature, metadata or {})
    known.update((spec.name, spec) for spec in signature.outputs if spec.name in outputs)
    unknown = sorted(set(columns) - set(known))
    if unknown or not columns:
        what = "inputs" + (" (and embedding outputs)" if outputs else "")
        raise ValueError(
            f"{REFERENCE_FILE}: arrays must be named by the {what} {sorted(known)}; "
            f"found {sorted(columns) or 'none'}"
        )
    for name, array in columns.items():
        spec = known[name]
        widths = zip(spec.shape[1:], array.shape[1:], strict=False)
        if (
            array.ndim != len(spec.shape)
            or any(d not in (-1, n) for d, n in widths)
            or (spec.datatype == "BYTES") != (array.dtype.kind in "US")
        ):
            raise ValueError(
                f"{REFERENCE_FILE}: {name!r} is {array.dtype} of shape {list(array.shape)}; "
                f"the input is {spec.datatype} {list(spec.shape)}"
            )
    rows = _rows_of(columns)
    if rows < MIN_REFERENCE_ROWS:
        raise ValueError(f"{REFERENCE_FILE}: {rows} rows; a reference needs {MIN_REFERENCE_ROWS}+")
    if rows > MAX_REFERENCE_ROWS:
        keep = np.sort(np.random.default_rng(0).choice(rows, MAX_REFERENCE_ROWS, replace=False))
        columns = {name: array[keep] for name, array in columns.items()}
    return {n: a.astype(object) if a.dtype.kind in "US" else a for n, a in columns.items()}
