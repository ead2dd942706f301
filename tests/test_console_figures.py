"""The console's recent figures (:mod:`inferd.monitoring.recent`): pure, no sockets,
times given by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferd.monitoring.recent import RecentFigures
from inferd.shapes.logs import LogRow
from inferd.shapes.replica import ReplicaStats
from inferd.telemetry.metrics import Histogram, Sketch

T0 = 1_000_000.0  # a slot boundary for slots of 2 s


def row(
    t: float,
    model: str = "m",
    version: str | None = "v1",
    status: int = 200,
    ms: float = 10.0,
    cache: bool | None = None,
    tokens: int | None = None,
) -> LogRow:
    return LogRow(
        timestamp=t, request_id="r", model_name=model, version=version, api="v1",
        status_code=status, latency_ms=ms, cache_hit=cache, completion_tokens=tokens,
    )  # fmt: skip


def test_rows_become_per_slot_series_of_settled_slots_only() -> None:
    f = RecentFigures(slot_s=2.0, history_s=60, settle_s=1.5)
    f.started = T0 - 10
    rows = [row(T0 + 0.1 * i, ms=10.0 + i) for i in range(10)]  # slot 0: 10 requests
    rows += [row(T0 + 2.5, status=503, ms=100.0), row(T0 + 2.6, ms=20.0)]  # slot 1
    rows += [row(T0 + 2.7, model="unknown")]
    f.observe(rows, {"m"})
    found = f.series(None, None, 60, now=T0 + 4.0)  # slot 1 (T0+2..4) not settled yet
    assert found["t"][-1] == T0 and found["until"] == T0 + 2
    assert list(found["models"]) == ["m"]  # rows of unknown models are dropped
    series = found["models"]["m"]["versions"]["v1"]
    assert series["rps"][-1] == 5.0 and series["error_rate"][-1] == 0.0
    assert series["p50_ms"][-1] == pytest.approx(14.0, rel=0.02)  # a value observed, within 1 %
    assert series["p99_ms"][-1] == pytest.approx(18.0, rel=0.02)

    later = f.series(None, found["until"] - 0.001, 60, now=T0 + 6.0)
    assert later["t"] == [T0 + 2]  # only what the last answer did not have
    series = later["models"]["m"]["versions"]["v1"]
    assert series["rps"] == [1.0] and series["error_rate"] == [0.5]
    assert later["models"]["m"]["total"]["rps"] == [1.0]


def test_summary_over_a_window() -> None:
    f = RecentFigures(slot_s=2.0, history_s=600, settle_s=1.5)
    f.started = T0 - 1000
    f.observe([row(T0 + i, cache=i % 4 == 0, tokens=3) for i in range(60)], {"m"})
    f.observe([row(T0 + 10, status=500)], {"m"})
    found = f.summary({"m"}, 60, now=T0 + 61.6)
    m = found["models"]["m"]
    assert found["window_s"] == 60 and m["requests"] == 61
    assert m["rps"] == pytest.approx(61 / 60, rel=1e-3)
    assert m["error_rate"] == pytest.approx(1 / 61, rel=1e-3)
    assert m["cache_hit_rate"] == pytest.approx(15 / 60, rel=1e-3)
    assert m["tokens_per_s"] == pytest.approx(3.0, rel=1e-3)
    assert f.summary({"other"}, 60, now=T0 + 61.6)["models"] == {}


def status(batches: int, rows: int, queued: int, ttft: list[float], itl: list[float]):
    sketch, hist = Sketch(), Histogram((0.01, 0.05, 0.1))
    for value in ttft:
        sketch.observe(value)
    for value in itl:
        hist.observe(value)
    stats = {"batches": batches, "rows": rows, "queued_rows": queued, "inflight": 2,
             "kv_blocks_used": 5, "kv_blocks_total": 20, "running": 3}  # fmt: skip
    metrics = {"ttft_sketch": sketch.snapshot(), "itl_s": hist.snapshot()}
    return SimpleNamespace(stats=ReplicaStats(**stats), metrics=metrics)


def test_replica_samples_difference_their_counters() -> None:
    f = RecentFigures(slot_s=1.0, history_s=60, settle_s=0.5)
    f.started = T0
    labels = {"model": "m", "version": "v1", "replica": "m-v1-0"}
    f.sample_replicas(T0, [(labels, status(10, 40, 3, [0.1] * 5, [0.02] * 5))])
    first = f.gauges[("m", "v1")][int(T0)]
    assert "batch_size" not in first and first["queue"] == 3  # nothing to difference yet
    f.sample_replicas(
        T0 + 1, [(labels, status(20, 120, 7, [0.1] * 5 + [0.3] * 5, [0.02] * 5 + [0.08] * 5))]
    )
    second = f.gauges[("m", "v1")][int(T0) + 1]
    assert second["batch_size"] == 8.0  # 80 rows in 10 batches since the last sample
    assert second["queue"] == 7 and second["inflight"] == 2
    assert second["kv_use"] == 0.25 and second["running"] == 3
    assert second["ttft_p50_ms"] == pytest.approx(300, rel=0.02)  # the new ones only
    assert 50 <= second["itl_p50_ms"] <= 100

    # a restarted replica counts from zero again: no negative figures
    f.sample_replicas(T0 + 2, [(labels, status(2, 4, 0, [0.2], [0.02]))])
    third = f.gauges[("m", "v1")][int(T0) + 2]
    assert third.get("batch_size", 0) >= 0 and third["ttft_p50_ms"] > 0
    found = f.series({"m"}, None, 10, now=T0 + 3.6)
    assert found["models"]["m"]["versions"]["v1"]["batch_size"][-2:] == [8.0, None]


def test_old_slots_are_pruned() -> None:
    f = RecentFigures(slot_s=2.0, history_s=10, settle_s=1.5)
    f.observe([row(T0), row(T0 + 20)], {"m"})
    f.prune(now=T0 + 21)
    assert list(f.traffic[("m", "v1")]) == [int((T0 + 20) // 2)]
    f.prune(now=T0 + 100)
    assert f.traffic == {}
