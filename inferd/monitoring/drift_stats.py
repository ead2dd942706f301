"""Label-free drift, the server's statistics: a window of a version's recent counts
against its reference profile (:mod:`inferd.telemetry.drift`), feature by feature.

- **PSI** (population stability index) for every feature, on the profile's bins, is the
  line a feature is flagged at (``drift.psi_threshold``, 0.2 by default, the usual
  "significant shift"): it says how far apart the two distributions are, where a
  p-value says how sure we are that they differ at all, and with thousands of rows a
  test flags shifts too small to matter. Shares are smoothed by half a row per bin
  (bins empty on both sides left out), so an empty bin does not make it infinite.
- **Kolmogorov-Smirnov** for numeric features, from the binned distributions: the
  largest gap between the reference's and the window's cumulative shares at the bins'
  edges. That is a lower bound of the statistic on the raw values (the edges are the
  reference's deciles: it can miss at most what happens inside one decile), and it
  costs nothing beyond the counts, which add up across replicas and difference into
  windows; an exact KS would need a sample of rows kept and shipped. Its p-value: the
  asymptotic Kolmogorov distribution with Stephens' correction (conservative, since
  the statistic is a lower bound).
- **Chi-squared** for categorical features: the 2 x K table of reference and window
  counts.

The p-values are computed here (Kolmogorov's series, the regularised gamma function),
so the server needs no SciPy; the tests check them against SciPy's.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.shapes.drift import FeatureProfile, Profile, bins_of

SMOOTHING = 0.5
"""Rows added to each bin's count (on both sides) before taking shares, for PSI."""


def psi(reference: np.ndarray, window: np.ndarray) -> float:
    """Population stability index of ``window``'s counts against ``reference``'s (same
    bins): the sum over bins of (w - r) * ln(w / r), w and r the smoothed shares."""
    used = (reference > 0) | (window > 0)
    if not used.any() or not window.sum() or not reference.sum():
        return 0.0
    r = reference[used] + SMOOTHING
    w = window[used] + SMOOTHING
    r, w = r / r.sum(), w / w.sum()
    return float(np.sum((w - r) * np.log(w / r)))


def ks(reference: np.ndarray, window: np.ndarray) -> tuple[float, float]:
    """(statistic, p-value) of the two-sample Kolmogorov-Smirnov test on binned counts
    (the bins in order; a NaN bin left out by the caller)."""
    n, m = float(reference.sum()), float(window.sum())
    if not n or not m:
        return 0.0, 1.0
    gap = float(np.max(np.abs(np.cumsum(reference) / n - np.cumsum(window) / m)))
    effective = math.sqrt(n * m / (n + m))
    return gap, kolmogorov_sf((effective + 0.12 + 0.11 / effective) * gap)


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for Kolmogorov's distribution: 2 Σ (-1)^(k-1) exp(-2 k² x²)."""
    if x < 0.18:  # the series converges slowly there, and its value is 1 to 1e-9
        return 1.0
    total = 0.0
    for k in range(1, 101):
        term = 2.0 * (-1) ** (k - 1) * math.exp(-2.0 * k * k * x * x)
        total += term
        if abs(term) < 1e-16:
            break
    return min(1.0, max(0.0, total))


def chi2(reference: np.ndarray, window: np.ndarray) -> tuple[float, float]:
    """(statistic, p-value) of the chi-squared test of homogeneity of two count rows
    (bins empty on both sides left out)."""
    used = (reference > 0) | (window > 0)
    table = np.vstack([reference[used], window[used]]).astype(np.float64)
    total = table.sum()
    if table.shape[1] < 2 or not table[0].sum() or not table[1].sum():
        return 0.0, 1.0
    expected = np.outer(table.sum(axis=1), table.sum(axis=0)) / total
    statistic = float(np.sum((table - expected) ** 2 / expected))
    return statistic, chi2_sf(statistic, table.shape[1] - 1)


def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for a chi-squared variable of ``dof`` degrees of freedom."""
    if x <= 0:
        return 1.0
    return _gamma_q(dof / 2.0, x / 2.0)


def _gamma_q(a: float, x: float) -> float:
    """The regularised upper incomplete gamma function Q(a, x): the series of P below
    a + 1, Lentz's continued fraction above (Numerical Recipes' ``gammq``)."""
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * front)
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return min(1.0, front * h)


# -- windows ------------------------------------------------------------------------------


@dataclass
class Counts:
    """Rows counted on a profile's bins, over some span of time."""

    since: float
    until: float
    rows: int
    counts: np.ndarray
    sums: np.ndarray
    squares: np.ndarray

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            min(self.since, other.since), max(self.until, other.until), self.rows + other.rows,
            self.counts + other.counts, self.sums + other.sums, self.squares + other.squares,
        )  # fmt: skip


class DriftWindow:
    """A version's rolling window: the counts each look added (all its replicas' counts
    differenced from the look before), newest last. The window is the newest of them
    that hold ``rows`` rows (whole looks: it may hold more), none older than ``max_age_s``."""

    def __init__(self) -> None:
        self.looks: deque[Counts] = deque()

    def add(self, counts: Counts) -> None:
        if counts.rows:
            self.looks.append(counts)

    def clear(self) -> None:
        self.looks.clear()

    def current(self, now: float, rows: int, max_age_s: float) -> Counts | None:
        """The window now (None: no rows in it), forgetting what no window needs again."""
        looks = self.looks
        while looks and looks[0].until < now - max_age_s:
            looks.popleft()
        held = 0
        for i in range(len(looks) - 1, -1, -1):
            held += looks[i].rows
            if held >= rows:
                for _ in range(i):
                    looks.popleft()
                break
        if not looks:
            return None
        total = looks[0]
        for look in list(looks)[1:]:
            total = total + look
        return total


# -- scores -------------------------------------------------------------------------------


def scores(profile: Profile, window: Counts, threshold: float) -> list[dict[str, Any]]:
    """Each feature's scores over ``window``, the most moved first (by PSI)."""
    out = []
    start = 0
    for i, feature in enumerate(profile.features):
        end = start + bins_of(feature)
        mine = window.counts[start:end]
        start = end
        entry = _feature_scores(feature, np.asarray(feature.counts), mine)
        if feature.kind == "numeric":
            entry.update(_moments(feature, mine, float(window.sums[i]), float(window.squares[i])))
        entry["drifted"] = entry["psi"] >= threshold
        out.append(entry)
    out.sort(key=lambda e: (-e["psi"], e["name"]))
    return out


def _feature_scores(feature: FeatureProfile, ref: np.ndarray, mine: np.ndarray) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": feature.name, "kind": feature.kind, "psi": psi(ref, mine)}
    if feature.kind == "numeric":
        statistic, p_value = ks(ref[:-1], mine[:-1])
        entry.update(ks=statistic, ks_p_value=p_value)
        total = mine.sum()
        entry["missing_share"] = float(mine[-1] / total) if total else 0.0
        return entry
    statistic, p_value = chi2(ref, mine)
    entry.update(chi2=statistic, chi2_p_value=p_value)
    entry["shares"] = _shares(feature, ref, mine)
    return entry


def _moments(feature: FeatureProfile, mine: np.ndarray, total: float, squares: float) -> dict:
    """The window's mean and spread, and how far its mean moved in reference standard deviations."""
    n = float(mine[:-1].sum())
    if not n:
        return {"mean": None, "std": None, "mean_shift_sigma": None}
    mean = total / n
    std = math.sqrt(max(0.0, squares / n - mean * mean))
    shift = None
    if feature.mean is not None and feature.std:
        shift = (mean - feature.mean) / feature.std
    return {"mean": mean, "std": std, "mean_shift_sigma": shift}


def _shares(feature: FeatureProfile, ref: np.ndarray, mine: np.ndarray) -> list[dict[str, Any]]:
    """The categories whose share moved most (five at most), for a person to read."""
    names = [*feature.categories, "(other)"]
    r = ref / max(1, ref.sum())
    w = mine / max(1, mine.sum())
    order = np.argsort(-np.abs(w - r), kind="stable")[:5]
    return [
        {"value": names[i], "reference": float(r[i]), "window": float(w[i])}
        for i in order
        if r[i] or w[i]
    ]


def embedding_distances(profile: Profile, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per embedding of ``profile`` (its projections), from its features' ``entries``:
    how far the window's mean moved over its directions and its residual (in reference
    standard deviations, the root of the sum of their squared mean shifts: the
    Mahalanobis distance, as the directions are uncorrelated in the reference), its
    cosine feature's shift, and which of its features are flagged. Both means are
    estimates: a window of the reference's own distribution (1,000 rows against a
    reference of 1,000) is at 0.1 to 0.3; 20 % of a new topic moves it to ~0.7
    (``bench/embedding_drift.py``)."""
    by_name = {entry["name"]: entry for entry in entries}
    out = []
    for projection in profile.projections:
        prefix = f"{projection.tensor}."
        names = [f"{prefix}pc{k + 1}" for k in range(len(projection.directions))]
        names.append(f"{prefix}residual")
        shifts = [by_name.get(name, {}).get("mean_shift_sigma") for name in names]
        known = [shift for shift in shifts if shift is not None]
        cosine = by_name.get(f"{prefix}cosine", {})
        out.append({
            "name": projection.tensor,
            "output": projection.output,
            "directions": len(projection.directions),
            "distance": math.sqrt(sum(x * x for x in known)) if known else None,
            "cosine_shift_sigma": cosine.get("mean_shift_sigma"),
            "drifted": [e["name"] for e in entries
                        if e["drifted"] and e["name"].startswith(prefix)],
        })  # fmt: skip
    return out
