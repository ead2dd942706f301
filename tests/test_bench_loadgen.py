"""The load generator against real servers: counts add up, errors are counted by kind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, InferdServer, free_port
from tests.roles import wait

TRIVIAL = Path(__file__).parent / "servers" / "trivial.py"


@pytest.fixture(scope="module")
def trivial() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(TRIVIAL), str(port)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"LISTENING"
    proc.stdout.close()
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def bench(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{time.monotonic_ns()}.json"
    result = subprocess.run(
        [sys.executable, "-m", "inferd", "bench", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    data = json.loads(out.read_text()) if out.exists() else {}
    out.unlink(missing_ok=True)
    return result, data


def test_closed_loop_counts_add_up(trivial: str):
    result, data = bench(
        f"{trivial}/flaky", "--body", "{}", "-c", "8", "-n", "300", "--warmup", "0s"
    )
    assert result.returncode == 0, result.stderr
    (level,) = data["levels"]
    assert level["requests"] == 300
    assert level["successes"] + level["errors"] == level["requests"]
    assert level["errors_by_kind"] == {"http_500": 100}
    assert level["status_counts"] == {"200": 200, "500": 100}
    assert "throughput" in result.stdout and "http_500" in result.stdout
    # The generator reports its own CPU: a share of one core, and in the table.
    assert 0 < level["client_cpu"] <= 1.5
    assert "load generator" in result.stdout and "of a core" in result.stdout


def test_open_loop_sends_about_rate_times_duration(trivial: str):
    result, data = bench(
        f"{trivial}/ok",
        "--body",
        "{}",
        "--rate",
        "200",
        "-d",
        "3s",
        "--warmup",
        "0s",
        "--seed",
        "7",
    )
    assert result.returncode == 0, result.stderr
    (level,) = data["levels"]
    assert 600 * 0.85 <= level["requests"] <= 600 * 1.15
    assert level["errors"] == 0


def test_streams_time_tokens_and_goodput(trivial: str):
    result, data = bench(
        f"{trivial}/sse/5/20",
        "--target",
        "url",
        "--body",
        "{}",
        "-c",
        "4",
        "-n",
        "20",
        "--warmup",
        "0s",
        "--slo",
        "ttft=500ms,latency=2s",
    )
    assert result.returncode == 0, result.stderr
    (level,) = data["levels"]
    assert level["errors"] == 0
    assert level["output_tokens"] == 100  # usage of the final event
    assert 15 <= level["ttft"]["p50"] <= 200
    assert 15 <= level["itl"]["p50"] <= 100
    assert level["goodput_requests"] == 20


def test_errors_are_counted_by_kind_never_crash(trivial: str):
    _, bad_sse = bench(f"{trivial}/sse-bad", "--body", "{}", "-c", "2", "-n", "6", "--warmup", "0s")
    assert bad_sse["levels"][0]["errors_by_kind"] == {"malformed_sse": 6}
    _, slow = bench(
        f"{trivial}/slow/2000",
        "--body",
        "{}",
        "-c",
        "2",
        "-n",
        "2",
        "--timeout",
        "200ms",
        "--warmup",
        "0s",
    )
    assert slow["levels"][0]["errors_by_kind"] == {"timeout": 2}
    _, closed = bench(f"{trivial}/close", "--body", "{}", "-c", "2", "-n", "4", "--warmup", "0s")
    assert closed["levels"][0]["errors_by_kind"] == {"closed": 4}
    _, unavailable = bench(
        f"{trivial}/status/503", "--body", "{}", "-c", "2", "-n", "10", "--warmup", "0s"
    )
    assert unavailable["levels"][0]["errors_by_kind"] == {"http_503": 10}


def test_unreachable_target_is_reported_not_a_traceback():
    result, _ = bench(f"http://127.0.0.1:{free_port()}/x", "--body", "{}", "-c", "2", "-d", "1s")
    assert result.returncode == 2
    assert "cannot connect" in result.stderr
    assert "Traceback" not in result.stderr


def test_sweep_prints_one_row_per_level_and_plots(trivial: str, tmp_path: Path):
    plot = tmp_path / "sweep.png"
    result, data = bench(
        f"{trivial}/ok",
        "--body",
        "{}",
        "--sweep",
        "concurrency=1,4",
        "-n",
        "50",
        "--warmup",
        "0s",
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    assert [lv["level"] for lv in data["levels"]] == ["c=1", "c=4"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _seen(trivial: str, path: str) -> int:
    """Requests the trivial server got on ``/<path>...`` so far."""
    return int(httpx.get(f"{trivial}/seen").json().get(path, 0))


def test_ctrl_c_prints_what_was_collected(trivial: str, tmp_path: Path):
    out = tmp_path / "partial.json"
    before = _seen(trivial, "ok")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd",
            "bench",
            f"{trivial}/ok",
            "--body",
            "{}",
            "-c",
            "4",
            "-d",
            "60s",
            "--warmup",
            "0s",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    # Interrupted while it runs: once the server got 20 of its requests. With 4 in
    # flight at most, some have been answered (and its SIGINT handler is in place).
    wait(
        lambda: proc.poll() is not None or _seen(trivial, "ok") >= before + 20,
        "bench's first requests",
    )
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "interrupted" in stdout
    level = json.loads(out.read_text())["levels"][0]
    assert level["requests"] > 0 and level["requests"] == level["successes"] + level["errors"]


@pytest.mark.slow
def test_against_real_inferd_server(demo_server: InferdServer):
    template = '{"inputs": [{"features": "{{floats:30:-1:1}}"}]}'
    result, data = bench(
        demo_server.url,
        "--target",
        "predict",
        "--model",
        "fraud",
        "--template",
        template,
        "-c",
        "16",
        "-n",
        "400",
        "--warmup",
        "0s",
    )
    assert result.returncode == 0, result.stderr
    (level,) = data["levels"]
    assert level["requests"] == 400 and level["successes"] == 400
    assert level["latency"]["p99"] > 0
    result, data = bench(
        demo_server.url,
        "--target",
        "predict",
        "--model",
        "nope",
        "--body",
        '{"inputs": [[1]]}',
        "-c",
        "2",
        "-n",
        "10",
        "--warmup",
        "0s",
    )
    assert data["levels"][0]["errors_by_kind"] == {"http_404": 10}


@pytest.mark.parametrize("target", ["generate", "completions", "chat"])
def test_generation_targets_stream_tokens(trivial: str, target: str):
    result, data = bench(
        trivial,
        "--target",
        target,
        "--model",
        "gpt",
        "--max-tokens",
        "6",
        "--prompt-tokens",
        "uniform:8:16",
        "-c",
        "3",
        "-n",
        "12",
        "--warmup",
        "0s",
        "--seed",
        "3",
    )
    assert result.returncode == 0, result.stderr
    (level,) = data["levels"]
    assert level["successes"] == 12, level
    assert level["output_tokens"] == 72
    assert level["ttft"]["p50"] is not None and level["itl"]["p50"] is not None


@pytest.mark.parametrize("target", ["embed", "embeddings"])
def test_embedding_targets(trivial: str, target: str):
    result, data = bench(
        trivial, "--target", target, "--model", "minilm", "-c", "2", "-n", "10", "--warmup", "0s"
    )
    assert result.returncode == 0, result.stderr
    assert data["levels"][0]["successes"] == 10


def test_v2_target_with_payload_file(trivial: str, tmp_path: Path):
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text(
        '{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", '
        '"data": [1.0]}]}\n\n{"inputs": []}\n'
    )
    result, data = bench(
        trivial,
        "--target",
        "v2",
        "--model",
        "m",
        "--payloads",
        str(bodies),
        "-c",
        "2",
        "-n",
        "10",
        "--warmup",
        "0s",
    )
    assert result.returncode == 0, result.stderr
    assert data["levels"][0]["successes"] == 10
