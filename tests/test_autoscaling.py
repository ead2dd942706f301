"""Autoscaling end to end: a real server, real replicas, real load (``inferd bench
--rate``). A load step scales a version up; when it stops, the version comes back down
one replica at a time; every decision is recorded with its figures; no request fails."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, InferdServer, build_tiny_gpt2, push_folder, push_source, run_cli

pytestmark = pytest.mark.slow
SLOW_CALC = """
import time

class Calc:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        time.sleep(0.02)  # 20 ms a batch: one replica computes about 50 a second
        return {"y": batch["x"] * 2}
"""
POLICY = {
    "min_replicas": 1,
    "max_replicas": 3,
    "utilisation_up": 0.6,
    "up_window_s": 1,
    "utilisation_down": 0.2,
    "down_window_s": 3,
    "queue_empty_s": 2,
    "up_cooldown_s": 1,
    "down_cooldown_s": 2,
}


def _deployment(server: InferdServer) -> dict:
    return server.client.get("/api/v1/deployments/calc").json()


def _desired(server: InferdServer) -> int:
    (version,) = _deployment(server)["versions"]
    return version["replicas_desired"]


def test_a_load_step_scales_up_then_back_down_one_at_a_time_with_no_failed_request(
    tmp_path: Path,
):
    push_source(tmp_path, "calc", SLOW_CALC, "--batching", '{"max_batch_size": 1}')
    env = {"INFERD_AUTOSCALE_INTERVAL_S": "0.5"}
    server = InferdServer(tmp_path, workers=1, env=env)
    try:
        server.wait_ready()
        deployed = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "autoscaling": POLICY},
        )
        assert deployed.status_code == 201, deployed.text
        assert deployed.json()["deployment"]["autoscaling"]["max_replicas"] == 3
        out = tmp_path / "bench.json"
        # fmt: off
        load = subprocess.Popen(
            [
                sys.executable, "-m", "inferd", "bench", server.url, "--target", "predict",
                "--model", "calc", "--rate", "80", "--duration", "10s", "--warmup", "0s",
                "--timeout", "20s", "--body", '{"inputs": [{"x": 2}]}', "--json", str(out),
            ],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        # fmt: on
        peak = 1
        while load.poll() is None:
            peak = max(peak, _desired(server))
            time.sleep(0.3)
        _, err = load.communicate()
        assert load.returncode == 0, err
        assert peak >= 2
        server.wait_for(lambda: _desired(server) == 1, timeout_s=60, what="scaling back to 1")
        (run,) = json.loads(out.read_text())["levels"]
        assert run["errors"] == 0 and run["requests"] >= 600, run

        events = list(reversed(_deployment(server)["scaling_events"]))  # oldest first
        ups = [e for e in events if e["to"] > e["from"]]
        downs = [e for e in events if e["to"] < e["from"]]
        assert ups and all(e["reason"] in ("utilisation", "queue") for e in ups), events
        assert [e["from"] - e["to"] for e in downs] == [1] * (peak - 1), events
        assert all(e["reason"] == "calm" for e in downs)
        assert all(e["detail"] and "utilisation" in e["figures"] for e in events)
        metrics = server.client.get("/metrics").text
        assert (
            'inferd_autoscaling_decisions_total{model="calc",version="v1",reason="calm"}' in metrics
        )
        assert 'inferd_replicas_desired{model="calc",version="v1",autoscaled="true"} 1' in metrics
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_bad_autoscaling_is_a_422_naming_the_field(tmp_path: Path):
    push_source(tmp_path, "calc", SLOW_CALC)
    server = InferdServer(tmp_path, workers=1)
    try:
        server.wait_ready()
        refused = server.client.post(
            "/api/v1/deployments",
            json={
                "model_name": "calc",
                "version": "v1",
                "autoscaling": {"min_replicas": 5, "max_replicas": 2},
            },
        )
        assert refused.status_code == 422
        assert "min_replicas <= max_replicas" in refused.json()["error"]["message"]
        typo = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "autoscaling": {"max_replica": 2}},
        )
        assert typo.status_code == 422 and "max_replica" in typo.text
        assert server.client.get("/api/v1/deployments/calc").json()["mode"] == "automatic"
        ok = server.client.post("/api/v1/deployments", json={"model_name": "calc", "version": "v1"})
        assert ok.status_code == 201
        patched = server.client.patch(
            "/api/v1/deployments/calc/v1", json={"autoscaling": {"max_replicas": 2}}
        )
        assert patched.status_code == 200, patched.text
        assert patched.json()["deployment"]["autoscaling"]["max_replicas"] == 2
        off = server.client.patch("/api/v1/deployments/calc/v1", json={"autoscaling": None})
        assert off.json()["deployment"]["autoscaling"] is None
    finally:
        assert server.stop() == 0, server.log()[-3000:]


FAST_CALC = SLOW_CALC.replace("time.sleep(0.02)", "pass")


def test_an_idle_version_scales_to_zero_and_a_held_request_starts_it_again(tmp_path: Path):
    push_source(tmp_path, "calc", FAST_CALC)
    server = InferdServer(tmp_path, workers=1, env={"INFERD_AUTOSCALE_INTERVAL_S": "0.3"})
    try:
        server.wait_ready()
        policy = {"min_replicas": 0, "max_replicas": 2, "idle_timeout_s": 2}
        deployed = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "autoscaling": policy},
        )
        assert deployed.status_code == 201, deployed.text

        def predict(**headers: str):
            return server.client.post(
                "/api/v1/models/calc/predict", json={"inputs": [{"x": 4}]}, headers=headers
            )

        assert predict().status_code == 200

        def at_zero() -> bool:
            (version,) = _deployment(server)["versions"]
            return version["replicas_desired"] == 0 and not version["replicas"]

        server.wait_for(at_zero, timeout_s=30, what="scaling to zero after 2 s idle")
        # a deadline shorter than a start: 503 with Retry-After, not a hang
        hurried = predict(**{"x-request-timeout": "50ms"})
        assert hurried.status_code == 503 and hurried.headers["retry-after"], hurried.text

        def reasons() -> list[str]:
            return [e["reason"] for e in reversed(_deployment(server)["scaling_events"])]

        # the start it asked for is recorded before "back at zero" means anything (read
        # at once, the table could still show zero and the next request take that start)
        server.wait_for(lambda: reasons()[:2] == ["idle", "demand"], timeout_s=30,
                        what="the held request's start")  # fmt: skip
        server.wait_for(at_zero, timeout_s=30, what="back at zero")
        started = time.monotonic()
        cold = predict()
        assert cold.status_code == 200, cold.text
        assert cold.json()["outputs"] == [{"y": 8.0}]
        cold_ms = float(cold.headers["x-inferd-cold-start-ms"])
        assert 0 < cold_ms <= (time.monotonic() - started) * 1000 + 1
        warm = predict()
        assert warm.status_code == 200 and "x-inferd-cold-start-ms" not in warm.headers

        seen = reasons()
        assert seen[:3] == ["idle", "demand", "idle"] and seen[3] == "demand", seen
        metrics = server.client.get("/metrics").text
        assert 'inferd_cold_start_seconds_count{model="calc",version="v1"} 2' in metrics
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_the_cli_sets_and_clears_autoscaling(tmp_path: Path):
    push_source(tmp_path, "calc", FAST_CALC)
    run_cli("deploy", "calc", "v1", "--min-replicas", "0", "--max-replicas", "3", data_dir=tmp_path)
    assert "auto 0..3" in run_cli("deployments", "calc", data_dir=tmp_path).stdout
    tuned = run_cli(
        "autoscale", "calc", "v1", "--autoscaling", '{"sla_p99_ms": 50, "max_replicas": 5}',
        data_dir=tmp_path,
    )  # fmt: skip
    assert "autoscaling 1..5 replicas" in tuned.stderr
    bad = run_cli("autoscale", "calc", "v1", "--max-replicas", "0", data_dir=tmp_path, check=False)
    assert bad.returncode == 1 and "max_replicas" in bad.stderr
    off = run_cli("autoscale", "calc", "v1", "--off", data_dir=tmp_path)
    assert "a fixed replica count" in off.stderr
    assert "auto" not in run_cli("deployments", "calc", data_dir=tmp_path).stdout


def test_no_room_is_a_recorded_capacity_event_not_a_start(tmp_path: Path):
    push_source(tmp_path, "calc", SLOW_CALC, "--batching", '{"max_batch_size": 1}')
    # keep 99.9 % of the machine's memory free: no replica fits beside that
    env = {"INFERD_AUTOSCALE_INTERVAL_S": "0.5", "INFERD_AUTOSCALE_MEMORY_HEADROOM": "0.999"}
    server = InferdServer(tmp_path, workers=1, env=env)
    try:
        server.wait_ready()
        deployed = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "calc", "version": "v1", "autoscaling": POLICY},
        )
        assert deployed.status_code == 201, deployed.text
        out = tmp_path / "bench.json"
        # fmt: off
        load = subprocess.run(
            [
                sys.executable, "-m", "inferd", "bench", server.url, "--target", "predict",
                "--model", "calc", "--rate", "80", "--duration", "5s", "--warmup", "0s",
                "--timeout", "20s", "--body", '{"inputs": [{"x": 2}]}', "--json", str(out),
            ],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
        # fmt: on
        assert load.returncode == 0, load.stderr
        (run,) = json.loads(out.read_text())["levels"]
        assert run["errors"] == 0, run
        events = _deployment(server)["scaling_events"]
        assert [e["reason"] for e in events] == ["capacity"], events
        assert "room for 1" in events[0]["detail"] and events[0]["from"] == events[0]["to"] == 1
        assert _desired(server) == 1
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_both_versions_of_a_canary_scale_and_a_steady_load_does_not_flap(tmp_path: Path):
    """v1 autoscaled, v2 a canary at 50 % autoscaled too: a steady load over what one
    replica of each computes scales both up, then nothing changes while it stays the
    same (no scale-down, no second scale-up), and no request fails."""
    push_source(tmp_path, "calc", SLOW_CALC, "--batching", '{"max_batch_size": 1}')
    push_source(tmp_path, "calc", SLOW_CALC, "--batching", '{"max_batch_size": 1}', version="v2")
    env = {"INFERD_AUTOSCALE_INTERVAL_S": "0.5"}
    server = InferdServer(tmp_path, workers=1, env=env)
    policy = {**POLICY, "utilisation_up": 0.75}  # 2 replicas at ~0.5 each: inside the band
    try:
        server.wait_ready()
        # v1 serves (the first version); v2 was registered beside it at 0 %
        first = server.client.patch("/api/v1/deployments/calc/v1", json={"autoscaling": policy})
        assert first.status_code == 200, first.text
        canary = server.client.post(
            "/api/v1/deployments",
            json={
                "model_name": "calc",
                "version": "v2",
                "strategy": "canary",
                "rollout": {"steps": [50, 100], "step_s": 120},
                "autoscaling": policy,
            },
        )
        assert canary.status_code == 201, canary.text
        server.wait_for(
            lambda: all(v["replicas_ready"] == 1 for v in _deployment(server)["versions"]),
            timeout_s=30,
            what="one ready replica of each version",
        )
        out = tmp_path / "bench.json"
        # fmt: off
        load = subprocess.Popen(
            [
                sys.executable, "-m", "inferd", "bench", server.url, "--target", "predict",
                "--model", "calc", "--rate", "100", "--duration", "16s", "--warmup", "0s",
                "--timeout", "20s", "--body", '{"inputs": [{"x": 2}]}', "--json", str(out),
            ],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        # fmt: on
        _, err = load.communicate(timeout=60)
        assert load.returncode == 0, err
        (run,) = json.loads(out.read_text())["levels"]
        assert run["errors"] == 0 and run["requests"] >= 1200, run

        shown = _deployment(server)
        assert shown["traffic"] == {"v1": 50, "v2": 50}  # still the canary's first step
        events = list(reversed(shown["scaling_events"]))  # oldest first, during the load
        for version in ("v1", "v2"):
            mine = [e for e in events if e["version"] == version]
            assert mine and mine[0]["to"] > mine[0]["from"] == 1, events  # it scaled up
            assert all(e["to"] > e["from"] for e in mine), events  # and never back down
            assert len(mine) <= 2, events  # at most a second step up, no oscillation
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_generation_version_scales_on_its_engines_waiting_requests(tmp_path: Path):
    """An LLM replica's own figures drive it: requests waiting for a sequence slot
    (one slot here), its occupancy and its time to first token."""
    folder = build_tiny_gpt2(tmp_path / "src" / "tiny")
    push_folder(tmp_path, "tiny", folder, "v1")
    env = {"INFERD_AUTOSCALE_INTERVAL_S": "0.5", "INFERD_LLM__MAX_NUM_SEQS": "1"}
    server = InferdServer(tmp_path, workers=1, env=env)
    policy = {"min_replicas": 1, "max_replicas": 2, "queue_up": 2, "up_cooldown_s": 1}
    try:
        server.wait_ready(timeout_s=120)
        deployed = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "tiny", "version": "v1", "autoscaling": policy},
        )
        assert deployed.status_code == 201, deployed.text
        body = {"prompt": "The server", "max_tokens": 100, "temperature": 0, "ignore_eos": True}

        async def burst() -> list[int]:
            # all at once: a thread pool's 8 at a time, spread out by a busy machine, could
            # each find the one sequence slot free; and 64 of them, ~3 s of work for the
            # tiny model (24 were ~1 s: two or three of the autoscaler's samples)
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                path = "/api/v1/models/tiny/generate"
                replies = await asyncio.gather(*(client.post(path, json=body) for _ in range(64)))
            return [r.status_code for r in replies]

        def events() -> list[dict]:
            shown = server.client.get("/api/v1/deployments/tiny").json()
            return [e for e in shown["scaling_events"] if e["reason"] in ("queue", "capacity")]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            codes = pool.submit(asyncio.run, burst())
            server.wait_for(events, timeout_s=60, what="a decision on the waiting requests")
            assert codes.result() == [200] * 64
        event = events()[-1]
        assert event["figures"]["queued"] > 2 and "requests waiting, over 2" in event["detail"]
        if event["reason"] == "queue":  # a second replica started
            assert (event["from"], event["to"]) == (1, 2)
        else:  # or this 2-core machine had no idle core for another CPU-bound replica
            assert "cores" in event["detail"], event
        assert "p99_ms" in event["figures"]  # time to first token, from the engine's sketch
    finally:
        assert server.stop() == 0, server.log()[-3000:]
