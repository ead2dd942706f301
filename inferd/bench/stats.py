"""What a benchmark run measured: per-request samples in, percentiles and rates out.

Pure arithmetic, no I/O, so every figure ``inferd bench`` prints can be checked by a
unit test on hand-made samples.

Conventions the whole report relies on:

* One :class:`Sample` per request sent, whatever happened to it, so
  ``requests == successes + errors`` always holds.
* A sample is a success exactly when ``error is None``; the load generator decides
  (2xx and a well-formed body). Latency, TTFT, inter-token latency and token
  throughput are computed over successes only: a fast 503 must not make the server
  look quick.
* Times are seconds in samples and milliseconds in summaries (rounded to 3 decimals,
  i.e. microseconds). A distribution with no data reports ``None`` rather than NaN so
  the JSON output stays valid.
* An SLO threshold is met when the value is ``<=`` the threshold: a request exactly at
  the limit counts toward goodput.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class Sample:
    """One request as the load generator saw it (times in seconds, from ``time.perf_counter()``)."""

    start: float
    """When the request was sent."""
    latency: float
    """Send -> last byte of the response (also for errors that got a response)."""
    status: int
    """HTTP status; 0 when no response came back."""
    error: str | None = None
    """None = success (2xx and well-formed); else a kind: ``http_503``, ``timeout``,
    ``connect``, ``closed``, ``malformed_sse``, ..."""
    ttft: float | None = None
    """Streams: send -> first token."""
    itl: list[float] | None = None
    """Streams: gaps between consecutive tokens (seconds); ``[]`` for a one-token stream."""
    output_tokens: int = 0


PERCENTILES = (50, 90, 95, 99)
_MS = 1000.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of ``values``; NaN when empty.

    Linear interpolation between the closest ranks, the same as ``numpy.percentile``'s
    default ``method="linear"``.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return _percentile_sorted(sorted(values), q)


def _percentile_sorted(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max of durations given in seconds, in milliseconds."""
    ordered = sorted(values_s)
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if not ordered:
        return dict.fromkeys(keys)
    figures = [
        math.fsum(ordered) / len(ordered),
        *(_percentile_sorted(ordered, q) for q in PERCENTILES),
        ordered[-1],
    ]
    return {key: round(value * _MS, 3) for key, value in zip(keys, figures, strict=True)}


# --- parsing the command line's durations and SLOs ------------------------------------

_UNIT_S = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zµ]*)\s*", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """``"500ms"``, ``"2s"``, ``"1.5s"``, ``"250us"``, ``"1m"``, ``"1h"`` -> seconds.

    A bare number means seconds. Negative, non-finite or unit-less garbage raises
    :class:`ValueError`.
    """
    match = _DURATION.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in {"", *_UNIT_S}:
        raise ValueError(
            f"invalid duration {text!r}: expected a number with an optional unit "
            f"({', '.join(_UNIT_S)}), e.g. '500ms' or '2s'"
        )
    return float(match.group(1)) * _UNIT_S.get(unit, 1.0)


SLO_KEYS = ("latency", "ttft", "itl")
"""``latency``: whole request; ``ttft``: time to first token; ``itl``: the request's MEAN
gap between consecutive tokens (a per-request mean, so one slow gap in a long stream does
not fail the request; the ITL percentiles in the summary show the gaps themselves)."""


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=500ms,latency=2s,itl=50ms"`` -> ``{"ttft": 0.5, "latency": 2.0, "itl": 0.05}``.

    Keys are :data:`SLO_KEYS`; values are durations (see :func:`parse_duration`) and must
    be positive. An empty string means no SLO (``{}``).
    """
    slo: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            raise ValueError(f"invalid SLO item {item!r}: expected KEY=DURATION, e.g. ttft=500ms")
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO key {key!r}; allowed: {', '.join(SLO_KEYS)}")
        if key in slo:
            raise ValueError(f"SLO key {key!r} given twice")
        threshold = parse_duration(value)
        if threshold <= 0:
            raise ValueError(f"SLO {key} must be positive, got {value!r}")
        slo[key] = threshold
    return slo


def meets_slo(sample: Sample, slo: dict[str, float]) -> bool:
    """Whether a successful sample meets every threshold (``<=``, inclusive).

    A request without a TTFT fails a ``ttft`` SLO, and one without inter-token gaps
    data (``itl is None``: not a stream) fails an ``itl`` SLO; a one-token stream
    (``itl == []``) has no gap that could be slow and meets it.
    """
    if sample.error is not None:
        return False
    limit = slo.get("latency")
    if limit is not None and sample.latency > limit:
        return False
    limit = slo.get("ttft")
    if limit is not None and (sample.ttft is None or sample.ttft > limit):
        return False
    limit = slo.get("itl")
    if limit is not None:
        if sample.itl is None:
            return False
        if sample.itl and math.fsum(sample.itl) / len(sample.itl) > limit:
            return False
    return True


# --- the summary -----------------------------------------------------------------------


@dataclass(slots=True)
class Summary:
    """The figures of one load level. Distributions are in milliseconds.

    ``ttft``, ``itl``, ``output_tokens`` and ``output_tokens_per_s`` are set only when
    some sample has a TTFT (a streaming run); ``goodput_*`` only when an SLO was given.
    """

    requests: int
    successes: int
    errors: int
    errors_by_kind: dict[str, int]
    status_counts: dict[str, int]
    duration_s: float
    rps: float
    """All requests (successes and errors) per second of the run."""
    success_rps: float
    latency: dict[str, float | None]
    ttft: dict[str, float | None] | None = None
    itl: dict[str, float | None] | None = None
    """Percentiles over every gap of every successful stream."""
    output_tokens: int | None = None
    """Tokens of successful requests."""
    output_tokens_per_s: float | None = None
    slo_s: dict[str, float] | None = None
    goodput_requests: int | None = None
    """Successful requests meeting every SLO."""
    goodput_rps: float | None = None
    client_cpu: float | None = None
    """Cores' worth of CPU the load generator used while it ran (1.0 = one core busy):
    near 1.0 the generator, not the server, may be what limits the figures."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures; the stream and goodput keys are left out when not set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return out


def summarize(
    samples: Sequence[Sample], duration_s: float, slo: dict[str, float] | None = None
) -> Summary:
    """Summarise one load level that ran for ``duration_s`` seconds.

    Rates divide by ``duration_s``; a run of zero (or negative) duration reports rates
    of 0 rather than dividing by zero.
    """
    successes = [s for s in samples if s.error is None]
    kinds = Counter(s.error for s in samples if s.error is not None)
    statuses = Counter(s.status for s in samples)

    def rate(count: float) -> float:
        return round(count / duration_s, 3) if duration_s > 0 else 0.0

    summary = Summary(
        requests=len(samples),
        successes=len(successes),
        errors=len(samples) - len(successes),
        errors_by_kind=dict(sorted(kinds.items())),
        status_counts={str(code): statuses[code] for code in sorted(statuses)},
        duration_s=round(duration_s, 3),
        rps=rate(len(samples)),
        success_rps=rate(len(successes)),
        latency=distribution_ms(s.latency for s in successes),
    )
    if any(s.ttft is not None for s in samples):
        summary.ttft = distribution_ms(s.ttft for s in successes if s.ttft is not None)
        summary.itl = distribution_ms(gap for s in successes if s.itl for gap in s.itl)
        summary.output_tokens = sum(s.output_tokens for s in successes)
        summary.output_tokens_per_s = rate(summary.output_tokens)
    if slo is not None:
        good = sum(1 for s in successes if meets_slo(s, slo))
        summary.slo_s = dict(slo)
        summary.goodput_requests = good
        summary.goodput_rps = rate(good)
    return summary


def timeline(samples: Sequence[Sample], bucket_s: float = 1.0) -> list[dict[str, Any]]:
    """Per ``bucket_s`` window from the first request sent: what completed in it.

    Each row: ``t`` (window start, seconds since the first send), ``requests`` completed,
    ``errors`` among them, ``rps``, and ``p50_ms``/``p99_ms`` latency of the successes
    (``None`` when none). Empty windows in between are kept so a plot shows the gap.
    """
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be positive, got {bucket_s}")
    if not samples:
        return []
    origin = min(s.start for s in samples)
    buckets: dict[int, list[Sample]] = {}
    for s in samples:
        index = int((s.start + s.latency - origin) // bucket_s)
        buckets.setdefault(index, []).append(s)
    rows = []
    for index in range(max(buckets) + 1):
        done = buckets.get(index, [])
        ok = sorted(s.latency for s in done if s.error is None)
        rows.append(
            {
                "t": round(index * bucket_s, 3),
                "requests": len(done),
                "errors": len(done) - len(ok),
                "rps": round(len(done) / bucket_s, 3),
                "p50_ms": round(_percentile_sorted(ok, 50) * _MS, 3) if ok else None,
                "p99_ms": round(_percentile_sorted(ok, 99) * _MS, 3) if ok else None,
            }
        )
    return rows
