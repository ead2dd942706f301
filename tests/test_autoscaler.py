"""The autoscaling policy as a pure function of the replicas' signals over time."""

from __future__ import annotations

import itertools
import os

import pytest

from inferd.control.autoscaler import Autoscaler, Signals
from inferd.errors import InvalidInput
from inferd.registry.autoscaling import AutoscalingPolicy, dump, load

STEP = 10.0  # seconds between looks


def run(
    scaler: Autoscaler,
    start: float,
    seconds: float,
    utilisation: float = 0.0,
    queued: int = 0,
    requests: int = 10,
    p99_ms: float | None = None,
    room: int | None = None,
) -> list:
    """Looks every STEP seconds with every desired replica ready; the decisions made."""
    decisions = []
    t = start
    while t < start + seconds:
        signals = Signals(t, scaler.desired, utilisation, queued, requests, p99_ms)
        decision = scaler.observe(signals, room)
        if decision is not None:
            decisions.append(decision)
        t += STEP
    return decisions


def test_the_defaults_are_the_design_documents_table():
    policy = AutoscalingPolicy()
    assert (policy.utilisation_up, policy.up_window_s) == (0.8, 120)
    assert (policy.utilisation_down, policy.down_window_s) == (0.3, 600)
    assert (policy.queue_up, policy.queue_empty_s) == (50, 300)
    assert policy.latency_down == 0.5


def test_utilisation_over_80_percent_for_two_minutes_scales_up():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=8), replicas=2, now=0)
    assert run(scaler, 0, 110, utilisation=0.95) == []  # not for two minutes yet
    (decision,) = run(scaler, 110, 20, utilisation=0.95)
    assert decision.t == 120 and (decision.replicas, decision.desired) == (2, 3)
    assert decision.reason == "utilisation" and "95%" in decision.detail
    assert decision.figures["utilisation"] == 0.95 and decision.figures["ready"] == 2


def test_a_dip_restarts_the_window():
    scaler = Autoscaler(AutoscalingPolicy(), replicas=1, now=0)
    assert run(scaler, 0, 100, utilisation=0.9) == []
    assert run(scaler, 100, 10, utilisation=0.5) == []
    assert run(scaler, 110, 110, utilisation=0.9) == []  # 110 s over since the dip
    assert len(run(scaler, 220, 20, utilisation=0.9)) == 1


def test_far_over_adds_several_replicas_at_once_up_to_the_step_and_the_maximum():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=10), replicas=1, now=0)
    (decision,) = run(scaler, 0, 10, queued=260)  # 6 x queue_up
    assert (decision.replicas, decision.desired, decision.reason) == (1, 5, "queue")
    capped = Autoscaler(AutoscalingPolicy(max_replicas=3), replicas=1, now=0)
    assert run(capped, 0, 10, queued=260)[0].desired == 3


def test_no_new_scale_up_while_the_last_new_replicas_start():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=10, up_cooldown_s=0), replicas=1, now=0)
    assert scaler.observe(Signals(0, 1, 0.0, 100, 5)).desired == 3
    for t in (10, 20, 30):  # still one ready of three
        assert scaler.observe(Signals(t, 1, 0.0, 400, 5)) is None
    assert scaler.observe(Signals(40, 3, 0.0, 400, 5)).desired == 7


def test_scale_down_needs_every_signal_calm_and_goes_one_at_a_time():
    policy = AutoscalingPolicy(max_replicas=8, down_cooldown_s=120)
    scaler = Autoscaler(policy, replicas=4, now=0)
    # low utilisation but requests queue now and then: no scale-down
    decisions = []
    for t in range(0, 1200, 10):
        queued = 3 if t % 200 == 0 else 0
        decision = scaler.observe(Signals(t, scaler.desired, 0.1, queued, 10))
        if decision:
            decisions.append(decision)
    assert decisions == []  # the queue never stayed empty for 5 minutes
    calm = run(scaler, 1200, 1800, utilisation=0.1)
    assert [(d.replicas, d.desired) for d in calm] == [(4, 3), (3, 2), (2, 1)]
    assert all(d.reason == "calm" for d in calm)
    gaps = [b.t - a.t for a, b in itertools.pairwise(calm)]
    assert all(gap >= 120 for gap in gaps)  # one at a time, after the cooldown
    assert calm[0].t >= 1010 + 300  # the queue (last seen at t=1000) empty for 5 minutes
    assert run(scaler, 3000, 3600, utilisation=0.0) == []  # never under min_replicas


def test_a_steady_load_never_flaps():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=8), replicas=3, now=0)
    assert run(scaler, 0, 4 * 3600, utilisation=0.55, queued=4) == []


def test_a_ramp_scales_1_to_n_to_1_with_every_decision_explained():
    policy = AutoscalingPolicy(
        max_replicas=6, up_window_s=20, down_window_s=60, queue_empty_s=30,
        up_cooldown_s=10, down_cooldown_s=30,
    )  # fmt: skip
    scaler = Autoscaler(policy, replicas=1, now=0)
    events = run(scaler, 0, 60, utilisation=0.2)  # low
    events += run(scaler, 60, 200, utilisation=0.99, queued=30)  # high
    peak = scaler.desired
    events += run(scaler, 260, 600, utilisation=0.05)  # low again
    assert peak >= 3 and scaler.desired == 1
    ups = [d for d in events if d.desired > d.replicas]
    downs = [d for d in events if d.desired < d.replicas]
    assert ups and all(d.reason == "utilisation" for d in ups)
    assert [d.replicas - d.desired for d in downs] == [1] * (peak - 1)
    assert all(d.detail and d.figures for d in events)
    assert list(scaler.events) == events


def test_latency_over_the_sla_scales_up_and_under_half_of_it_lets_it_down():
    policy = AutoscalingPolicy(sla_p99_ms=100, latency_window_s=30, down_window_s=60,
                               queue_empty_s=60, down_cooldown_s=60)  # fmt: skip
    scaler = Autoscaler(policy, replicas=1, now=0)
    (up,) = run(scaler, 0, 40, utilisation=0.5, p99_ms=180)
    assert up.reason == "latency" and up.desired == 2 and "SLA 100 ms" in up.detail
    assert run(scaler, 40, 300, utilisation=0.1, p99_ms=70) == []  # under the SLA, not half
    (down,) = run(scaler, 340, 100, utilisation=0.1, p99_ms=30)
    assert down.reason == "calm" and down.desired == 1


def test_idle_versions_scale_to_zero_and_a_held_request_brings_one_back():
    policy = AutoscalingPolicy(min_replicas=0, idle_timeout_s=60)
    scaler = Autoscaler(policy, replicas=1, now=0)
    assert run(scaler, 0, 50, requests=0) == []
    (idle,) = run(scaler, 50, 20, requests=0)
    assert (idle.desired, idle.reason) == (0, "idle")
    assert run(scaler, 70, 600, requests=0) == []
    back = scaler.demand(700)
    assert back is not None and (back.replicas, back.desired, back.reason) == (0, 1, "demand")
    assert scaler.demand(701) is None
    kept = Autoscaler(AutoscalingPolicy(min_replicas=1, idle_timeout_s=60), replicas=1, now=0)
    assert run(kept, 0, 600, requests=0) == []  # min_replicas 1: never to zero


def test_a_start_longer_than_the_idle_timeout_is_not_stopped_until_it_served():
    """Found by bench/replica_start.py: a version at zero whose replica takes longer to
    start than ``idle_timeout_s`` was scaled to zero again while it started, its held
    request started it again, and so on: the request never got an answer."""
    scaler = Autoscaler(AutoscalingPolicy(min_replicas=0, idle_timeout_s=1), replicas=0, now=0)
    assert scaler.demand(10) is not None
    for t in range(11, 40):  # the replica starts for 30 s: nothing answered, none ready
        assert scaler.observe(Signals(t, 0, 0.0, 0, 0)) is None, t
    assert scaler.observe(Signals(40, 1, 0.0, 0, 1)) is None  # ready, the request answered
    idle = scaler.observe(Signals(41.5, 1, 0.0, 0, 0))
    assert idle is not None and (idle.desired, idle.reason) == (0, "idle")


def test_no_room_is_recorded_once_instead_of_thrashing():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=8), replicas=2, now=0)
    assert run(scaler, 0, 300, queued=500, room=2) == []
    capacity = [e for e in scaler.events if e.reason == "capacity"]
    assert len(capacity) == 1 and scaler.desired == 2
    assert "room for 2" in capacity[0].detail
    (partial,) = run(scaler, 300, 10, queued=500, room=4)
    assert partial.desired == 4 and "room for 4 of the 6 wanted" in partial.detail


def test_a_desired_count_outside_new_bounds_is_brought_inside():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=8), replicas=6, now=0)
    scaler.retune(AutoscalingPolicy(max_replicas=3))
    (decision,) = run(scaler, 0, 10, utilisation=0.5)
    assert (decision.desired, decision.reason) == (3, "bounds")


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
        ({"utilisation_up": 0.2, "utilisation_down": 0.3}, "utilisation_down < utilisation_up"),
        ({"sla_p99_ms": -5}, "sla_p99_ms > 0"),
        ({"queue_up": 0}, "queue_up"),
        ({"up_window_s": -1}, "windows"),
        ({"max_replica": 3}, "max_replica"),
        ({"min_replicas": "two"}, "min_replicas"),
    ],
)
def test_bad_policies_are_named(raw: dict, named: str):
    with pytest.raises(InvalidInput, match=named):
        load(raw)


def test_policies_round_trip():
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=5, sla_p99_ms=250.0)
    assert load(dump(policy)) == policy
    assert load(None) is None and dump(None) is None


def test_capacity_by_memory_and_by_cores(tmp_path):
    from inferd.control.scaling import cpu_room, cpu_seconds, machine_cpu, room_for

    gib = 2**30
    assert room_for(2, 3 * gib, 10 * gib, 2 * gib) == 4  # 8 GiB free beyond the headroom
    assert room_for(2, 3 * gib, gib, 2 * gib) == 2  # nothing more fits
    assert room_for(2, 0, 10 * gib, 0) is None  # size unknown yet
    assert cpu_room(1, 1.0, 0.5, 4) == 3  # 2 idle cores, a core each
    assert cpu_room(1, 0.1, 0.0, 4) is None  # not CPU-bound: cores do not limit it
    assert cpu_room(1, 1.0, None, 4) is None
    assert cpu_seconds(os.getpid()) is not None and cpu_seconds(2**22 + 7) is None
    idle, total = machine_cpu() or (0, 0)
    assert 0 <= idle <= total
    stat = tmp_path / "1234"
    stat.mkdir()
    (stat / "stat").write_text("1234 (a (b) c) S 1 1 1 0 -1 0 0 0 0 0 250 150 0 0 20 0 1 0")
    assert cpu_seconds(1234, tmp_path) == pytest.approx(400 / os.sysconf("SC_CLK_TCK"))


def test_a_capacity_event_names_its_limit():
    scaler = Autoscaler(AutoscalingPolicy(max_replicas=8), replicas=2, now=0)
    assert (
        scaler.observe(Signals(0, 2, 0.0, 500, 5), room=2, limit="cores: 1.00 per replica") is None
    )
    assert "(cores: 1.00 per replica)" in scaler.events[-1].detail


def test_the_tightest_room_wins_gpu_memory_included():
    from inferd.control.scaling import Look, Scaling
    from inferd.telemetry.metrics import Sketch

    async def record(*_):
        return None

    scaling = Scaling(record, memory_headroom=0.1)
    assert scaling._room(1, {}, {}) == (None, "")  # nothing measured yet
    gpu = (2, "GPU memory: 30.0 GB per replica")
    assert scaling._room(1, {}, {}, gpu) == gpu
    # a replica of 1 TiB: memory holds fewer than the GPUs would
    huge = {("r1", 1): Look(0.0, 0.0, 0, 2**40, Sketch())}
    room, why = scaling._room(1, {}, huge, (5, "GPU memory: 1.0 GB per replica"))
    assert room == 1 and why.startswith("memory: 1048576 MiB per replica")
