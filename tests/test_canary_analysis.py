"""The pieces of a canary rollout without a server: the latency sketch, the window
arithmetic over replica samples, the verdict, and the registry's canary steps (advance,
rollback with its reason, halt, promotion, a person taking over), on both databases."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from msgspec.structs import replace

from inferd.control.canary import Figures, ReplicaSample, judge, window
from inferd.errors import Conflict
from inferd.registry import Registry
from inferd.registry.rollout import CanaryRollout
from inferd.serving.replica import agrees
from inferd.shapes.replica import to_tensor
from inferd.shapes.tensors import Signature, TensorSpec
from inferd.telemetry.metrics import Sketch

# -- the sketch -----------------------------------------------------------------------------


def test_sketch_quantiles_are_within_two_percent_at_any_scale():
    rng = random.Random(7)
    for scale in (1e-4, 1e-2, 5.0):
        values = sorted(rng.lognormvariate(0, 0.6) * scale for _ in range(20_000))
        sketch = Sketch()
        for v in values:
            sketch.observe(v)
        for q in (0.5, 0.9, 0.99):
            exact = values[int(q * (len(values) - 1))]
            assert abs(sketch.quantile(q) / exact - 1) < 0.025, (scale, q)
    assert Sketch().quantile(0.5) is None and Sketch().mean() is None


def test_sketch_tells_10_ms_from_12_ms_and_subtracts_snapshots():
    fast, slow = Sketch(), Sketch()
    fast.observe(0.010, 100)
    slow.observe(0.012, 100)
    assert 1.15 < slow.quantile(0.99) / fast.quantile(0.99) < 1.25
    before = Sketch.of(fast.snapshot())
    fast.observe(0.050, 10)
    later = fast.minus(before)
    assert later.count == 10 and abs(later.quantile(0.5) - 0.050) < 0.001
    assert abs(later.sum - 0.5) < 1e-9
    merged = Sketch().add(fast).add(slow)
    assert merged.count == 210


# -- windows and verdicts -------------------------------------------------------------------


def _sample(answered: int, failed: int, seconds: float) -> ReplicaSample:
    latency, compute = Sketch(), Sketch()
    if answered:
        latency.observe(seconds * 1.5, answered)
        compute.observe(seconds, answered)
    return ReplicaSample(answered, failed, latency, compute)


def _figures(requests: int, errors: int, seconds: float) -> Figures:
    return window({}, {("r", 1): _sample(requests - errors, errors, seconds)})


def test_a_window_counts_only_what_happened_inside_it():
    start = {("a", 10): _sample(100, 1, 0.01), ("b", 20): _sample(50, 0, 0.01)}
    now = {
        ("a", 10): _sample(130, 3, 0.01),  # +30 answered, +2 failed
        ("b", 21): _sample(5, 0, 0.01),  # restarted: counts from its start
    }
    figures = window(start, now)
    assert (figures.requests, figures.errors, figures.replicas) == (37, 2, 2)
    assert figures.compute.count == 35


ROLLOUT = CanaryRollout(steps=[1, 100], min_requests=50)


def test_verdicts():
    good = _figures(200, 0, 0.020)
    stable = _figures(2000, 2, 0.020)
    assert judge(good, stable, ROLLOUT, final=False).outcome == "wait"
    assert judge(good, stable, ROLLOUT, final=True).outcome == "pass"
    slower = judge(_figures(200, 0, 0.024), stable, ROLLOUT, final=True)
    assert slower.outcome == "fail" and "compute p50" in slower.reason and "+2" in slower.reason
    total = judge(_figures(200, 0, 0.024), stable, replace(ROLLOUT, latency="total"), final=True)
    assert total.outcome == "fail" and total.reason.startswith("total p50")
    tiny = judge(_figures(200, 0, 0.00103), _figures(2000, 0, 0.00089), ROLLOUT, final=True)
    assert tiny.outcome == "pass"  # +15 %, but 0.14 ms: under min_latency_increase_ms
    strict = replace(ROLLOUT, min_latency_increase_ms=0.0)
    assert judge(_figures(200, 0, 0.00103), _figures(2000, 0, 0.00089), strict, True).outcome == (
        "fail"
    )
    lenient = replace(ROLLOUT, max_latency_increase=0.3)
    assert judge(_figures(200, 0, 0.024), stable, lenient, final=True).outcome == "pass"
    # Errors fail before the window ends, once min_requests were answered.
    failing = judge(_figures(60, 6, 0.020), stable, ROLLOUT, final=False)
    assert failing.outcome == "fail" and failing.reason.startswith("error rate 10.00% (6/60)")
    assert judge(_figures(40, 6, 0.020), stable, ROLLOUT, final=False).outcome == "wait"
    waiting = judge(_figures(10, 0, 0.020), stable, ROLLOUT, final=True)
    assert waiting == waiting.__class__("wait", "waiting for traffic: 10 of 50 requests")
    crashed = _figures(200, 0, 0.020)
    crashed.crashes = 1
    assert judge(crashed, stable, ROLLOUT, final=False).reason.startswith("canary replicas crashed")
    capped = judge(good, stable, replace(ROLLOUT, max_p99_ms=10.0), final=True)
    assert capped.outcome == "fail" and "over the 10 ms limit" in capped.reason
    # Without enough stable traffic to compare with, latency is not judged relatively.
    assert judge(_figures(200, 0, 0.05), _figures(10, 0, 0.02), ROLLOUT, True).outcome == "pass"


def test_shadow_agreement():
    import numpy as np

    live = {"p": to_tensor(np.array([1.0, 2.0], dtype=np.float32))}
    assert agrees({"p": np.array([1.0, 2.0000001], dtype=np.float32)}, live, 1e-5)
    assert not agrees({"p": np.array([1.0, 2.1], dtype=np.float32)}, live, 1e-5)
    assert not agrees({"p": np.array([1.0], dtype=np.float32)}, live, 1e-5)
    assert not agrees({"q": np.array([1.0, 2.0], dtype=np.float32)}, live, 1e-5)
    labels = {"label": to_tensor(np.array(["cat", "dog"], dtype=object))}
    assert agrees({"label": np.array(["cat", "dog"], dtype=object)}, labels, 0.0)
    assert not agrees({"label": np.array(["cat", "cow"], dtype=object)}, labels, 0.0)


# -- the registry ---------------------------------------------------------------------------

SIGNATURE = Signature(inputs=(TensorSpec("x", "FP32", (-1,)),), outputs=())


@pytest.fixture
def deployed(registry: Registry, tmp_path: Path) -> Registry:
    """m: v1 serves everything; v2 and v3 registered, not deployed."""
    source = tmp_path / "src" / "model.py"
    source.parent.mkdir()
    source.write_text("class M:\n    pass\n")
    for version in ("v2", "v3", "v1"):  # v1 newest: nothing is adopted
        registry.push("m", source, version, framework="python", signature=SIGNATURE, deploy=True)
    registry.deployments.deploy("m", "v1", traffic_pct=100)
    return registry


def _split(registry: Registry) -> dict[str, int]:
    return {d.version: d.traffic_pct for d in registry.deployments.list_all("m")}


def test_canary_steps_then_promotion(deployed: Registry):
    d = deployed.deployments
    record = d.deploy("m", "v2", strategy="canary", rollout={"steps": [5, 25, 100]})
    assert record.traffic_pct == 5 and record.canary.state == "progressing"
    assert _split(deployed) == {"v2": 5, "v1": 95}
    with pytest.raises(Conflict, match="already deployed"):
        d.deploy("m", "v2", strategy="canary")
    rollouts = deployed.rollouts
    assert rollouts.advance_canary("m", "v2", 1, {}, "stale step") is None  # it is at step 0
    passed = rollouts.advance_canary("m", "v2", 0, {"verdict": "pass"}, "step 1 of 2 passed")
    assert passed is not None and passed.reason == "canary_step"
    assert _split(deployed) == {"v2": 25, "v1": 75}
    promoted = deployed.rollouts.advance_canary("m", "v2", 1, {}, "step 2 of 2 passed")
    assert promoted is not None and promoted.reason == "canary_promoted"
    (v2,) = [r for r in d.list_all("m") if r.version == "v2"]
    assert v2.canary.state == "promoted" and v2.canary.promoted_at
    assert _split(deployed) == {"v2": 100, "v1": 0}
    assert deployed.rollouts.finish_rollout("m", "v2") == ["v1"]  # the controller, after keep_old_s
    assert deployed.rollouts.finish_rollout("m", "v2") == []  # once


def test_canary_rollback_records_why_and_halts_without_auto_rollback(deployed: Registry):
    d = deployed.deployments
    d.deploy("m", "v2", strategy="canary", traffic_pct=10)
    assert deployed.rollouts.end_canary("m", "v2", 1, "stale", None, True) is None
    why = "compute p50 24 ms vs 20 ms"
    change = deployed.rollouts.end_canary("m", "v2", 0, why, {"x": 1}, True)
    assert change is not None and change.reason == "canary_rollback"
    assert change.detail == "compute p50 24 ms vs 20 ms" and change.actor == "inferd"
    assert _split(deployed) == {"v2": 0, "v1": 100}
    (v2,) = [r for r in d.list_all("m") if r.version == "v2"]
    assert (v2.status, v2.canary.state, v2.canary.analysis) == (
        "rolled_back",
        "rolled_back",
        {"x": 1},
    )
    deployed.rollouts.set_status("m", "v2", "active")  # the controller cannot revive it
    assert [r.status for r in d.list_all("m") if r.version == "v2"] == ["rolled_back"]
    with pytest.raises(Exception, match="take no traffic"):
        d.set_traffic("m", {"v2": 50, "v1": 50})
    d.undeploy("m", "v2")  # removable like any other at 0 %
    deployed.rollouts.remove("m", "v2")
    d.deploy("m", "v2", strategy="canary", rollout={"auto_rollback": False})
    assert deployed.rollouts.end_canary("m", "v2", 0, "too slow", None, False) is None
    (v2,) = [r for r in d.list_all("m") if r.version == "v2"]
    assert v2.canary.state == "halted" and v2.canary.reason == "too slow"
    assert _split(deployed) == {"v2": 1, "v1": 99}  # where it was, for a person to decide


def test_a_person_taking_over_stops_the_canary(deployed: Registry):
    d = deployed.deployments
    d.deploy("m", "v2", strategy="canary", traffic_pct=10)
    with pytest.raises(Conflict, match="canary in progress"):
        d.deploy("m", "v3", strategy="canary", traffic_pct=10)
    d.set_traffic("m", {"v2": 30, "v1": 70}, actor="carol")
    (v2,) = [r for r in d.list_all("m") if r.version == "v2"]
    assert v2.canary.state == "overridden" and "carol" in v2.canary.reason
    assert deployed.rollouts.advance_canary("m", "v2", 0, {}, "late") is None
    d.set_traffic("m", {"v1": 100})
    d.undeploy("m", "v2")
    deployed.rollouts.remove("m", "v2")
    d.deploy("m", "v2", strategy="canary", traffic_pct=10)
    d.rollback("m", actor="dave")
    (v2,) = [r for r in d.list_all("m") if r.version == "v2"]
    assert (v2.status, v2.canary.state, v2.traffic_pct) == ("rolled_back", "rolled_back", 0)
    assert v2.canary.reason == "rollback by dave"


def test_shadow_deployments(deployed: Registry):
    d = deployed.deployments
    record = d.deploy("m", "v2", strategy="shadow", traffic_pct=25, rollout={"tolerance": 0.01})
    assert record.traffic_pct == 0 and record.to_dict()["rollout"] == {
        "mirror_pct": 25,
        "tolerance": 0.01,
    }
    assert _split(deployed) == {"v2": 0, "v1": 100}
    with pytest.raises(Conflict, match="already has a shadow"):
        d.deploy("m", "v3", strategy="shadow")
    with pytest.raises(Exception, match="take no traffic"):
        d.set_traffic("m", {"v2": 10, "v1": 90})
