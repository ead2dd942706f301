"""Histogram and counter arithmetic on known data."""

from __future__ import annotations

import pytest

from inferd.telemetry.metrics import Histogram, LabeledCounter


def test_buckets_are_cumulative_with_le_semantics():
    h = Histogram((1.0, 2.0, 5.0))
    for value in (0.5, 1.0, 1.5, 2.0, 4.0, 9.0):
        h.observe(value)
    snap = h.snapshot()
    assert snap["le"] == [1.0, 2.0, 5.0]
    assert snap["cumulative"] == [2, 4, 5, 6]  # <=1, <=2, <=5, +Inf
    assert snap["count"] == 6 and snap["sum"] == pytest.approx(18.0)


def test_quantiles_interpolate_inside_the_bucket():
    h = Histogram((10.0, 20.0))
    for _ in range(10):
        h.observe(15.0)  # all ten in (10, 20]
    assert h.quantile(0.5) == pytest.approx(15.0)  # halfway through the bucket
    assert h.quantile(1.0) == pytest.approx(20.0)
    h.observe(100.0)  # in +Inf: reported as the largest finite bound
    assert h.quantile(1.0) == 20.0
    assert Histogram((1.0,)).quantile(0.5) is None


def test_bad_bounds_and_counters():
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))
    with pytest.raises(ValueError):
        Histogram(())
    c = LabeledCounter()
    c.inc("stop")
    c.inc("stop")
    c.inc("length", 3)
    assert c.snapshot() == {"stop": 2, "length": 3}


def test_merged_snapshots_add_up_like_one_histogram():
    one, two, both = (Histogram((0.01, 0.1, 1.0)) for _ in range(3))
    for value in (0.005, 0.05, 0.05, 2.0):
        one.observe(value)
        both.observe(value)
    for value in (0.5, 0.005):
        two.observe(value)
        both.observe(value)
    merged = Histogram.merged([one.snapshot(), two.snapshot()])
    assert merged is not None and merged.snapshot() == both.snapshot()
    assert Histogram.merged([]) is None
    with pytest.raises(ValueError, match="different buckets"):
        Histogram.merged([one.snapshot(), Histogram((0.5,)).snapshot()])
