"""Per-feature attributions of a prediction: Shapley values, exact for trees, estimated
for the rest.

An :class:`Explanation` says, for each row and each explained output, how much each
input feature moved the output away from the model's expected value: the attributions
of a row add up to ``value - expected`` (Shapley's efficiency), in the output's own
space (``space``: a tree booster's margin, a class probability, a regression's
prediction).

- Tree models explain themselves exactly (TreeSHAP): XGBoost's ``pred_contribs``,
  LightGBM's ``pred_contrib``, scikit-learn's forests and boosted trees through the
  ``shap`` package (``inferd[explain]``). Their runtimes override
  :meth:`~inferd.runtimes.base.Runtime.explain`.
- Every other model with numeric inputs gets :func:`kernel_shap` over its
  ``predict_batch``: features outside a coalition take the values of a *background*
  set registered with the version (metadata ``background_samples``, rows as a
  predict's inputs; else its ``warmup_samples``), and the values are the weighted
  least-squares fit of the coalitions' outputs under the efficiency constraint. With
  few features (2^M - 2 coalitions within the budget) every coalition is evaluated, which
  makes the values exact Shapley values of that background; otherwise coalitions are
  sampled by the Shapley kernel's weight, in complementary pairs.

The work runs in the replica, off its event loop, admitted first: at most
``explain.max_rows`` rows, and a KernelSHAP explanation's cost (:func:`kernel_cost`:
rows x coalitions x background rows) within ``explain.max_model_rows`` before anything
is computed (413 naming the limit); the coalitions and the background are capped by
``explain.coalitions`` and ``explain.background_rows``. A request's deadline is checked
before it starts and between pieces of :data:`CHUNK_ROWS` model rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.errors import InvalidInput, PayloadTooLarge, RequestTimeout
from inferd.replica_config import ExplainConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from inferd.runtimes.base import Runtime
    from inferd.shapes.tensors import Signature

COALITIONS = ExplainConfig().coalitions
"""Coalitions KernelSHAP evaluates per row by default (``explain.coalitions``)."""
CHUNK_ROWS = 16384
"""Model rows KernelSHAP evaluates at once: the deadline is checked between pieces."""


@dataclass(frozen=True, slots=True)
class Explanation:
    attributions: np.ndarray
    """(rows, features, outputs): each feature's share of ``value - expected``."""
    values: np.ndarray
    """(rows, outputs): what is explained, in ``space``."""
    expected: np.ndarray
    """(outputs,): the model's expected value (over its training data, or the background)."""
    features: tuple[str, ...]
    outputs: tuple[str, ...]
    """What each output column is: a class name, ``prediction``, an output's name."""
    method: str
    """``tree_shap`` (exact) or ``kernel_shap``."""
    space: str
    """``margin`` (a booster's raw score: log-odds for a binary classifier),
    ``probability`` or ``prediction``."""


@dataclass(frozen=True, slots=True)
class Features:
    """A model's numeric inputs seen as one feature matrix, and back."""

    names: tuple[str, ...]
    slices: tuple[tuple[str, int, int, bool], ...]
    """(input, first column, end column, one column of shape (N,))"""
    dtypes: dict[str, np.dtype[Any]]

    @classmethod
    def of(
        cls, signature: Signature, metadata: dict[str, Any], known: list[str] | None = None
    ) -> Features:
        """Each numeric input of shape (N,) is a feature named as the input; one of shape
        (N, F) gives F features, named by the version's ``features`` (or
        ``feature_names``) metadata, else by the names the model ``known``s."""
        names: list[str] = []
        slices = []
        dtypes = {}
        for spec in signature.inputs:
            if spec.datatype == "BYTES" or len(spec.shape) > 2:
                raise InvalidInput(
                    f"explanations cover numeric features (inputs of shape [N] or [N, F]); "
                    f"input {spec.name!r} is {spec.datatype} {list(spec.shape)}"
                )
            width = 1 if len(spec.shape) == 1 else spec.shape[1]
            if width < 1:
                raise InvalidInput(f"input {spec.name!r} has no fixed number of features")
            start, flat = len(names), len(spec.shape) == 1
            names.extend([spec.name] if flat else _names(spec.name, width, metadata, known))
            slices.append((spec.name, start, len(names), flat))
            dtypes[spec.name] = spec.numpy_dtype
        return cls(tuple(names), tuple(slices), dtypes)

    def matrix(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        parts = [
            np.asarray(columns[name], dtype=np.float64).reshape(len(columns[name]), -1)
            for name, *_ in self.slices
        ]
        return np.concatenate(parts, axis=1)

    def columns(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {
            name: (x[:, a] if flat else x[:, a:b]).astype(self.dtypes[name])
            for name, a, b, flat in self.slices
        }


def _names(
    input_name: str, width: int, metadata: dict[str, Any], known: list[str] | None
) -> list[str]:
    for given in (metadata.get("features"), metadata.get("feature_names"), known):
        if isinstance(given, list) and len(given) == width:
            return [str(n) for n in given]
    return [f"{input_name}[{i}]" for i in range(width)]


def explained_output(
    outputs: dict[str, np.ndarray], signature: Signature
) -> tuple[str, np.ndarray, tuple[str, ...], str]:
    """Which output KernelSHAP explains: a classifier's ``probabilities`` (a column per
    class), else ``prediction``, else the first numeric output; as (name, (N, K) values,
    column names, space)."""
    name = next(
        (n for n in ("probabilities", "prediction") if n in outputs),
        next((n for n, a in outputs.items() if a.dtype.kind in "fiub"), None),
    )
    if name is None:
        raise InvalidInput("the model has no numeric output to explain")
    values = np.asarray(outputs[name], dtype=np.float64).reshape(len(outputs[name]), -1)
    if name == "probabilities" and signature.labels and len(signature.labels) == values.shape[1]:
        columns = tuple(signature.labels)
    elif values.shape[1] == 1:
        columns = (name,)
    else:
        columns = tuple(f"{name}[{i}]" for i in range(values.shape[1]))
    return name, values, columns, "probability" if name == "probabilities" else "prediction"


def limits_of(runtime: Runtime) -> ExplainConfig:
    return runtime.config.explain or ExplainConfig()


def background_of(runtime: Runtime, features: Features) -> np.ndarray:
    """The version's background rows as a feature matrix (at most
    ``explain.background_rows``)."""
    from inferd.runtimes.base import sample_columns

    metadata = runtime.config.metadata
    key = next((k for k in ("background_samples", "warmup_samples") if k in metadata), None)
    if key is None:
        raise InvalidInput(
            "this version has no background set to explain against: register "
            "'background_samples' (rows as a predict's inputs, e.g. a sample of the "
            "training data) in its metadata"
        )
    samples = metadata[key]
    rows = sample_columns(runtime.signature, samples, len(samples), field=key)
    x = features.matrix(rows)
    most = limits_of(runtime).background_rows
    if len(x) > most:
        x = x[np.linspace(0, len(x) - 1, most).round().astype(int)]
    return x


def kernel_cost(rows: int, features: int, background: int, coalitions: int) -> int:
    """Model rows KernelSHAP of ``rows`` rows computes: each row's coalitions over the
    background, and the rows and the background themselves."""
    c = 0 if features < 2 else min(2**features - 2, coalitions)
    return rows * c * background + rows + background


def kernel_explain(runtime: Runtime, inputs: dict[str, np.ndarray], deadline: float) -> Explanation:
    """KernelSHAP of ``runtime``'s ``predict_batch`` on ``inputs`` (see the module)."""
    signature = runtime.signature
    limits = limits_of(runtime)
    features = Features.of(signature, runtime.config.metadata)
    background = background_of(runtime, features)
    x = features.matrix(inputs)
    cost = kernel_cost(len(x), len(features.names), len(background), limits.coalitions)
    if cost > limits.max_model_rows:
        raise PayloadTooLarge(
            f"explaining {len(x)} rows of {len(features.names)} features against "
            f"{len(background)} background rows computes {cost:,} model rows, over the "
            f"limit of {limits.max_model_rows:,} (explain.max_model_rows): explain fewer rows"
        )
    if time.monotonic() > deadline:
        raise RequestTimeout("the explanation's deadline passed before it started")
    name, values, columns, space = explained_output(runtime.predict_batch(inputs), signature)

    def f(batch: np.ndarray) -> np.ndarray:
        out = runtime.predict_batch(features.columns(batch))[name]
        return np.asarray(out, dtype=np.float64).reshape(len(batch), -1)

    expected = f(background).mean(axis=0)
    attributions = np.empty((len(x), len(features.names), values.shape[1]))
    masks, weights = coalitions(len(features.names), np.random.default_rng(0), limits.coalitions)
    for i, row in enumerate(x):

        def timed(batch: np.ndarray, i: int = i) -> np.ndarray:
            """``f`` in pieces, the deadline checked before each."""
            out = []
            for at in range(0, len(batch), CHUNK_ROWS):
                if time.monotonic() > deadline:
                    raise RequestTimeout(
                        f"the explanation ran out of time after {i} of {len(x)} rows"
                    )
                out.append(f(batch[at : at + CHUNK_ROWS]))
            return np.concatenate(out)

        attributions[i] = kernel_shap(timed, row, background, values[i], expected, masks, weights)
    return Explanation(
        attributions, values, expected, features.names, columns, "kernel_shap", space
    )


def coalitions(
    m: int, rng: np.random.Generator, most: int = COALITIONS
) -> tuple[np.ndarray, np.ndarray]:
    """Coalition masks (C, m) without the empty and the full one, and their weights:
    all of them with the Shapley kernel's weights when 2^m - 2 fit in ``most``, else
    ``most`` (an even number of them) drawn by size in proportion to the kernel (pairs of
    complements, equal weights)."""
    if m < 2:
        return np.zeros((0, m), dtype=bool), np.zeros(0)
    if 2**m - 2 <= most:
        return _all_coalitions(m)
    pairs = most // 2
    sizes = np.arange(1, m)
    kernel = (m - 1) / (sizes * (m - sizes))  # a size's total weight, over its comb(m, size)
    drawn = rng.choice(sizes, size=pairs, p=kernel / kernel.sum())
    masks = np.zeros((2 * pairs, m), dtype=bool)
    for k, size in enumerate(drawn):
        masks[2 * k, rng.choice(m, size=size, replace=False)] = True
        masks[2 * k + 1] = ~masks[2 * k]
    return masks, np.ones(2 * pairs)


def _all_coalitions(m: int) -> tuple[np.ndarray, np.ndarray]:
    members = [c for size in range(1, m) for c in combinations(range(m), size)]
    masks = np.zeros((len(members), m), dtype=bool)
    weights = np.empty(len(members))
    for i, coalition in enumerate(members):
        masks[i, list(coalition)] = True
        size = len(coalition)
        weights[i] = (m - 1) / (comb(m, size) * size * (m - size))
    return masks, weights


def kernel_shap(
    f: Callable[[np.ndarray], np.ndarray],
    x: np.ndarray,
    background: np.ndarray,
    fx: np.ndarray,
    expected: np.ndarray,
    masks: np.ndarray,
    weights: np.ndarray,
) -> np.ndarray:
    """One row's (features, outputs) attributions: v(S) = the mean output over the
    background with the coalition's features taken from ``x``; phi the weighted
    least-squares fit of v(S) - E[f] = sum of phi over S, with sum(phi) = f(x) - E[f]
    (the last feature's phi eliminated)."""
    m = len(x)
    total = fx - expected  # (K,)
    if m == 1:
        return total[None, :]
    batch = np.where(masks[:, None, :], x[None, None, :], background[None, :, :])
    v = f(batch.reshape(-1, m)).reshape(len(masks), len(background), -1).mean(axis=1)
    z = masks.astype(np.float64)
    y = v - expected - z[:, -1:] * total  # (C, K)
    a = z[:, :-1] - z[:, -1:]  # (C, m - 1)
    sw = np.sqrt(weights)[:, None]
    phi, *_ = np.linalg.lstsq(a * sw, y * sw, rcond=None)  # (m - 1, K)
    return np.vstack([phi, total - phi.sum(axis=0)])


def tree_explanation(
    contributions: np.ndarray, features: Features, outputs: tuple[str, ...], space: str
) -> Explanation:
    """An Explanation from a booster's per-feature contributions, (N, F + 1) or
    (N, K, F + 1), the last column being the bias (the expected value)."""
    c = np.asarray(contributions, dtype=np.float64)
    if c.ndim == 2:
        c = c[:, None, :]
    attributions = np.transpose(c[:, :, :-1], (0, 2, 1))
    return Explanation(
        attributions, c.sum(axis=2), c[0, :, -1], features.names, outputs, "tree_shap", space
    )


def check_rows(rows: int, limits: ExplainConfig) -> None:
    if rows > limits.max_rows:
        raise PayloadTooLarge(
            f"{rows} rows to explain exceed the limit of {limits.max_rows} per request "
            "(explain.max_rows)"
        )
