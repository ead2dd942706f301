"""The last minutes of every version's figures, as time series the console draws
without Prometheus: what ``/metrics`` counts, cut into slots of ``console.slot_s``.

Kept by the server process (one per machine, or per cluster with ``inferd control``), so
every gateway process answers the same figures. Two sources:

- **requests**, from the inference log rows gateways already ship about once a second
  (no work added to the request path): requests, server errors (5xx), latency (a
  :class:`~inferd.telemetry.metrics.Sketch`, so p99 is within 1 %), cache hits and
  misses, generated tokens. Always on: it costs a few dict operations per row.
- **replicas**, from their status frames, sampled once a slot (whether a console is
  open or not, so a page opened during an incident shows the minutes before it):
  queued rows or waiting generations, requests in the replica, mean batch size, TTFT
  and inter-token quantiles, KV-cache use.

A slot is *settled* once rows can no longer arrive for it (gateways flush every
``inference_log.flush_interval_s``); queries return settled slots only, so a client
polling with ``since`` appends points and never revises one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inferd.shapes.logs import LogRow
from inferd.telemetry.metrics import Histogram, Sketch

LLM_SERIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "kv_use", "running")


@dataclass(slots=True)
class Traffic:
    """One slot of one version's requests, from log rows."""

    requests: int = 0
    errors: int = 0
    hits: int = 0
    misses: int = 0
    tokens: int = 0
    latency: Sketch = field(default_factory=Sketch)

    def add(self, other: Traffic) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.hits += other.hits
        self.misses += other.misses
        self.tokens += other.tokens
        self.latency.add(other.latency)


@dataclass(slots=True)
class ReplicaSeen:
    """What one replica's last status frame counted (its counters difference into the
    next slot's figures)."""

    batches: float
    rows: float
    ttft: Sketch | None
    itl: dict[str, Any] | None


Key = tuple[str, str]
"""(model, version); version "" for rows no version answered."""


class RecentFigures:
    def __init__(self, slot_s: float = 2.0, history_s: float = 900.0, settle_s: float = 1.5):
        self.slot_s = slot_s
        self.slots = max(2, math.ceil(history_s / slot_s))
        self.settle_s = settle_s
        self.traffic: dict[Key, dict[int, Traffic]] = {}
        self.gauges: dict[Key, dict[int, dict[str, float | None]]] = {}
        self._seen: dict[str, ReplicaSeen] = {}
        self.started = time.time()

    # -- what comes in ---------------------------------------------------------------------

    def slot(self, t: float) -> int:
        return int(t // self.slot_s)

    def observe(self, rows: Iterable[LogRow], known: Any) -> None:
        """Rows of models in ``known`` (a container of model names: rows naming unknown
        models must not grow this without bound)."""
        for row in rows:
            model = row.model_name
            if model not in known:
                continue
            key = (model, row.version or "")
            slots = self.traffic.get(key)
            if slots is None:
                slots = self.traffic[key] = {}
            index = int(row.timestamp // self.slot_s)
            traffic = slots.get(index)
            if traffic is None:
                traffic = slots[index] = Traffic()
            traffic.requests += 1
            if row.status_code >= 500:
                traffic.errors += 1
            traffic.latency.observe(row.latency_ms)
            if row.cache_hit is not None:
                if row.cache_hit:
                    traffic.hits += 1
                else:
                    traffic.misses += 1
            if row.completion_tokens:
                traffic.tokens += row.completion_tokens

    def sample_replicas(self, t: float, statuses: list[tuple[dict[str, str], Any]]) -> None:
        """One sample of the replicas' status frames (labels: model, version, replica)."""
        per_version: dict[Key, list[tuple[str, Any]]] = {}
        for labels, status in statuses:
            key = (labels["model"], labels["version"])
            per_version.setdefault(key, []).append((labels["replica"], status))
        index = self.slot(t)
        for key, replicas in per_version.items():
            figures = self._gauges_of(replicas)
            if figures:
                self.gauges.setdefault(key, {})[index] = figures
        alive = {labels["replica"] for labels, _ in statuses}
        for replica in [r for r in self._seen if r not in alive]:
            del self._seen[replica]

    def _gauges_of(self, replicas: list[tuple[str, Any]]) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        queue = inflight = running = 0.0
        batches = rows = 0.0
        kv: list[float] = []
        ttft, itl = Sketch(), []
        for replica, status in replicas:
            stats, metrics = status.stats, status.metrics
            queue += stats.queued
            inflight += stats.inflight or 0.0
            running += stats.running or 0.0
            if stats.kv_blocks_total:
                kv.append((stats.kv_blocks_used or 0.0) / stats.kv_blocks_total)
            elif stats.kv_cache_usage is not None:
                kv.append(stats.kv_cache_usage)
            seen = ReplicaSeen(
                stats.batches or 0.0,
                stats.rows or 0.0,
                Sketch.of(metrics["ttft_sketch"]) if "ttft_sketch" in metrics else None,
                metrics.get("itl_s"),
            )
            before = self._seen.get(replica)
            self._seen[replica] = seen
            if before is None:
                continue  # its first sample: nothing to difference yet
            batches += max(0.0, seen.batches - before.batches)
            rows += max(0.0, seen.rows - before.rows)
            if seen.ttft is not None and before.ttft is not None:
                ttft.add(_since(seen.ttft, before.ttft))
            if seen.itl is not None and before.itl is not None:
                itl.append(_histogram_since(seen.itl, before.itl))
        out["queue"] = queue
        out["inflight"] = inflight
        if batches:
            out["batch_size"] = rows / batches
        if kv:
            out["kv_use"] = sum(kv) / len(kv)
            out["running"] = running
        if ttft.count:
            out["ttft_p50_ms"] = _ms(ttft.quantile(0.5))
            out["ttft_p99_ms"] = _ms(ttft.quantile(0.99))
        merged = Histogram.merged([h for h in itl if h["count"]])
        if merged is not None:
            out["itl_p50_ms"] = _ms(merged.quantile(0.5))
            out["itl_p99_ms"] = _ms(merged.quantile(0.99))
        return out

    def prune(self, now: float | None = None) -> None:
        """Forget slots older than the history (called once a slot)."""
        oldest = self.slot(time.time() if now is None else now) - self.slots
        for store in (self.traffic, self.gauges):
            for key in list(store):
                slots = store[key]
                for index in [i for i in slots if i < oldest]:
                    del slots[index]
                if not slots:
                    del store[key]

    # -- what goes out ---------------------------------------------------------------------

    def settled(self, now: float) -> int:
        """The newest slot no row can arrive for any more (exclusive end)."""
        return self.slot(now - self.settle_s)

    def series(
        self, models: set[str] | None, since: float | None, window_s: float, now: float
    ) -> dict[str, Any]:
        """Per version, each figure per settled slot after ``since`` (a slot start time
        a previous answer ended with) or over the last ``window_s``; a model's
        ``total`` sums its versions."""
        end = self.settled(now)
        first = end - min(self.slots, max(1, math.ceil(window_s / self.slot_s)))
        first = max(first, self.slot(self.started))  # nothing was measured before
        if since is not None:
            first = max(first, self.slot(since) + 1)
        indices = range(first, end)
        out: dict[str, Any] = {}
        for model, versions in self._keys(models).items():
            entry: dict[str, Any] = {}
            for version in versions:
                if version:
                    entry[version] = self._version_series((model, version), indices)
            entry_total = self._traffic_series([(model, v) for v in versions], indices)
            out[model] = {"versions": entry, "total": entry_total}
        return {
            "slot_s": self.slot_s,
            "t": [i * self.slot_s for i in indices],
            "until": end * self.slot_s,
            "models": out,
        }

    def _keys(self, models: set[str] | None) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for model, version in {*self.traffic, *self.gauges}:
            if models is None or model in models:
                found.setdefault(model, []).append(version)
        return {m: sorted(v) for m, v in sorted(found.items())}

    def _version_series(self, key: Key, indices: range) -> dict[str, Any]:
        series = self._traffic_series([key], indices)
        gauges = self.gauges.get(key, {})
        for name in ("queue", "inflight", "batch_size", *LLM_SERIES):
            values = [_round(gauges.get(i, {}).get(name)) for i in indices]
            if any(v is not None for v in values):
                series[name] = values
        return series

    def _traffic_series(self, keys: list[Key], indices: range) -> dict[str, list[Any]]:
        slot_s = self.slot_s
        rps, errors, p50, p99, hit_rate, tokens = [], [], [], [], [], []
        for i in indices:
            t = Traffic()
            for key in keys:
                found = self.traffic.get(key, {}).get(i)
                if found is not None:
                    t.add(found)
            rps.append(round(t.requests / slot_s, 3))
            errors.append(round(t.errors / t.requests, 5) if t.requests else None)
            p50.append(_round(t.latency.quantile(0.5)))
            p99.append(_round(t.latency.quantile(0.99)))
            lookups = t.hits + t.misses
            hit_rate.append(round(t.hits / lookups, 4) if lookups else None)
            tokens.append(round(t.tokens / slot_s, 2))
        series: dict[str, list[Any]] = {
            "rps": rps,
            "error_rate": errors,
            "p50_ms": p50,
            "p99_ms": p99,
        }
        if any(v is not None for v in hit_rate):
            series["cache_hit_rate"] = hit_rate
        if any(tokens):
            series["tokens_per_s"] = tokens
        return series

    def summary(self, models: set[str] | None, window_s: float, now: float) -> dict[str, Any]:
        """Per model over the last ``window_s`` (or since the server started, if
        later): requests/s, p50/p99 latency, error and cache hit rates, tokens/s."""
        end = self.settled(now)
        first = end - min(self.slots, max(1, math.ceil(window_s / self.slot_s)))
        span_s = min((end - first) * self.slot_s, max(self.slot_s, now - self.started))
        out: dict[str, Any] = {}
        for model, versions in self._keys(models).items():
            total = Traffic()
            for version in versions:
                for i, found in self.traffic.get((model, version), {}).items():
                    if first <= i < end:
                        total.add(found)
            out[model] = _summary_of(total, span_s)
        return {"window_s": round(span_s, 1), "models": out}


def _summary_of(t: Traffic, span_s: float) -> dict[str, Any]:
    lookups = t.hits + t.misses
    return {
        "requests": t.requests,
        "rps": round(t.requests / span_s, 3) if span_s > 0 else 0.0,
        "p50_ms": _round(t.latency.quantile(0.5)),
        "p99_ms": _round(t.latency.quantile(0.99)),
        "error_rate": round(t.errors / t.requests, 5) if t.requests else None,
        "cache_hit_rate": round(t.hits / lookups, 4) if lookups else None,
        "tokens_per_s": round(t.tokens / span_s, 2) if span_s > 0 else 0.0,
    }


def _since(now: Sketch, before: Sketch) -> Sketch:
    if now.count < before.count:  # the replica restarted: all it has is new
        return now
    return now.minus(before)


def _histogram_since(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """A histogram snapshot's observations after ``before`` (same buckets)."""
    if now["count"] < before["count"] or now["le"] != before["le"]:
        return now
    cumulative = [a - b for a, b in zip(now["cumulative"], before["cumulative"], strict=True)]
    return {
        "le": now["le"],
        "cumulative": cumulative,
        "sum": now["sum"] - before["sum"],
        "count": now["count"] - before["count"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
