"""Metric primitives with no dependencies: counters and fixed-bucket histograms.

Each process keeps its own (a replica's engine, a gateway); a snapshot is a plain dict
that crosses process boundaries in a status frame and maps one-to-one onto the
Prometheus exposition format (cumulative ``le`` buckets, ``_sum``, ``_count``).
Recording is a bisect and two additions: cheap enough for every token.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Any

LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
"""Seconds: from a few milliseconds (inter-token gaps) to minutes (queued generations)."""

TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

REQUEST_BUCKETS_S = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Seconds a predict request spends in a replica (queue + compute): tabular models answer
in about a millisecond, so the buckets start below it and are dense up to ~50 ms."""


class Histogram:
    """Counts of observations per upper bound, plus their sum (Prometheus semantics)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("bucket bounds must be increasing and distinct")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """Estimate of the q-quantile (0..1), interpolating linearly inside the bucket
        it falls in, as Prometheus' ``histogram_quantile`` does; None when empty."""
        if not self.count:
            return None
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if i == len(self.bounds):  # +Inf bucket: the largest finite bound
                    return self.bounds[-1]
                low = self.bounds[i - 1] if i else 0.0
                return low + (self.bounds[i] - low) * (rank - seen) / n
            seen += n
        return self.bounds[-1]

    @classmethod
    def merged(cls, snapshots: list[dict[str, Any]]) -> Histogram | None:
        """One histogram adding up snapshots with the same buckets (several replicas);
        None when there are none."""
        if not snapshots:
            return None
        merged = cls(tuple(snapshots[0]["le"]))
        for snap in snapshots:
            if tuple(snap["le"]) != merged.bounds:
                raise ValueError("snapshots with different buckets cannot be merged")
            previous = 0
            for i, total in enumerate(snap["cumulative"]):
                merged.counts[i] += total - previous
                previous = total
            merged.sum += snap["sum"]
            merged.count += snap["count"]
        return merged

    def snapshot(self) -> dict[str, Any]:
        """``cumulative[i]`` counts observations <= ``le[i]``; one more entry at the end
        counts them all (the ``+Inf`` bucket). Quantiles are estimates, in the unit observed."""
        cumulative, total = [], 0
        for n in self.counts:
            total += n
            cumulative.append(total)
        p50, p99 = (self.quantile(q) for q in (0.5, 0.99))
        p50, p99 = (None if v is None else round(v, 6) for v in (p50, p99))
        return {
            "le": list(self.bounds),
            "cumulative": cumulative,
            "sum": self.sum,
            "count": self.count,
            "p50": p50,
            "p99": p99,
        }


class LabeledCounter:
    """Counts per label value (a finish reason, an adapter name)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: Counter[str] = Counter()

    def inc(self, label: str, by: int = 1) -> None:
        self.values[label] += by

    def snapshot(self) -> dict[str, int]:
        return dict(self.values)


class Sketch:
    """Quantiles within 1 % of the true value at any scale, from a few dozen counters.

    Bucket ``i`` counts values in (g^(i-1), g^i] with g = GAMMA = 1.02 and reports its midpoint
    2g^i/(g+1), so every estimate is within (g-1)/(g+1) ≈ 1 % of a value in the bucket
    (the DDSketch construction). Fixed Prometheus buckets cannot tell 10 ms from 12 ms;
    a canary analysis must. Only non-empty buckets are kept and sent, and two snapshots
    subtract, so a window's quantiles come from snapshots taken at its two ends."""

    GAMMA = 1.02
    MIN_VALUE = 1e-7
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``value`` ``n`` times (a batch's compute time, once per request in it)."""
        i = math.ceil(math.log(max(value, self.MIN_VALUE)) / _LOG_GAMMA)
        self.buckets[i] = self.buckets.get(i, 0) + n
        self.count += n
        self.sum += value * n

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for i in sorted(self.buckets):
            seen += self.buckets[i]
            if seen > rank:
                return 2 * self.GAMMA**i / (self.GAMMA + 1)
        return None  # not reached: the counts sum to count

    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def snapshot(self) -> dict[str, Any]:
        index = sorted(self.buckets)
        return {
            "index": index,
            "counts": [self.buckets[i] for i in index],
            "sum": self.sum,
            "count": self.count,
        }

    @classmethod
    def of(cls, snapshot: dict[str, Any]) -> Sketch:
        sketch = cls()
        sketch.buckets = dict(zip(snapshot["index"], snapshot["counts"], strict=True))
        sketch.count, sketch.sum = int(snapshot["count"]), float(snapshot["sum"])
        return sketch

    def add(self, other: Sketch) -> Sketch:
        for i, n in other.buckets.items():
            self.buckets[i] = self.buckets.get(i, 0) + n
        self.count += other.count
        self.sum += other.sum
        return self

    def minus(self, earlier: Sketch) -> Sketch:
        """What was recorded after ``earlier`` (a snapshot of the same sketch)."""
        out = Sketch()
        for i, n in self.buckets.items():
            if left := n - earlier.buckets.get(i, 0):
                out.buckets[i] = left
        out.count = self.count - earlier.count
        out.sum = self.sum - earlier.sum
        return out


_LOG_GAMMA = math.log(Sketch.GAMMA)
