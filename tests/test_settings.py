"""Settings refuse what names no setting, and replica specs carry typed settings."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from inferd.config import BatchingConfig, LLMConfig, Settings, UnknownSetting, load_settings
from inferd.shapes.replica_spec import ReplicaSpec
from tests.conftest import ROOT


def test_an_unknown_variable_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_REPLICA", "2")
    with pytest.raises(UnknownSetting) as caught:
        Settings()
    message = str(caught.value)
    assert message.startswith("unknown setting INFERD_REPLICA: settings have no 'replica'")
    assert "replicas" in message.split("valid: ")[1].split(", ")


def test_an_unknown_group_key_lists_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_BATCHING__MAX_BATCH_SISE", "64")
    with pytest.raises(UnknownSetting) as caught:
        Settings()
    assert str(caught.value) == (
        "unknown setting INFERD_BATCHING__MAX_BATCH_SISE: batching has no 'max_batch_sise'; "
        "valid: adaptive, batch_queue_share, default_priority, length_buckets, "
        "low_queue_share, "
        "max_batch_size, max_queue_rows, max_wait_ms, priority_levels, queue_timeout_ms, "
        "warmup_requests"
    )
    monkeypatch.delenv("INFERD_BATCHING__MAX_BATCH_SISE")
    monkeypatch.setenv("INFERD_RATE_LIMITS__DEFAULT__BURTS", "5")  # a group inside a group
    with pytest.raises(UnknownSetting, match=r"rate_limits\.default has no 'burts'; valid: burst"):
        Settings()


def test_the_drift_group_lists_its_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_DRIFT__WINDOW_ROW", "500")
    with pytest.raises(UnknownSetting) as caught:
        Settings()
    assert str(caught.value) == (
        "unknown setting INFERD_DRIFT__WINDOW_ROW: drift has no 'window_row'; valid: enabled, "
        "interval_s, max_categories, max_rows_per_s, min_window_rows, psi_threshold, "
        "reference_rows, window_rows, window_s"
    )
    monkeypatch.delenv("INFERD_DRIFT__WINDOW_ROW")
    monkeypatch.setenv("INFERD_DRIFT__PSI_THRESHOLD", "0.1")
    assert Settings().drift.psi_threshold == 0.1


def test_the_payload_log_group_lists_its_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_PAYLOAD_LOG__SINK", "[]")
    with pytest.raises(UnknownSetting) as caught:
        Settings()
    assert str(caught.value) == (
        "unknown setting INFERD_PAYLOAD_LOG__SINK: payload_log has no 'sink'; valid: attempts, "
        "batch_rows, flush_interval_s, http_headers, max_buffer_mb, max_buffer_rows, "
        "max_payload_bytes, payloads, redact, sample_rate, sinks, timeout_s"
    )
    monkeypatch.delenv("INFERD_PAYLOAD_LOG__SINK")
    monkeypatch.setenv("INFERD_PAYLOAD_LOG__SINKS", '["http://127.0.0.1:9/e", "s3://b/p"]')
    monkeypatch.setenv("INFERD_PAYLOAD_LOG__REDACT", '["ssn"]')
    cfg = Settings().payload_log
    assert cfg.sinks == ["http://127.0.0.1:9/e", "s3://b/p"]
    assert (cfg.redact, cfg.payloads) == (["ssn"], False)


def test_variables_that_are_settings_or_not_settings_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_BATCHING__MAX_BATCH_SIZE", "64")
    monkeypatch.setenv("inferd_replicas", "3")  # names are not case-sensitive
    monkeypatch.setenv("INFERD_RATE_LIMITS__MODELS", '{"m": {"requests_per_s": 5, "burst": 10}}')
    monkeypatch.setenv("INFERD_LLM__NATIVE", "0")
    for name in ("INFERD_API_KEY", "INFERD_URL", "INFERD_TEST_POSTGRES_URL", "INFERD_BENCH_X"):
        monkeypatch.setenv(name, "x")  # client credentials, test and benchmark knobs
    settings = Settings()
    assert (settings.batching.max_batch_size, settings.replicas) == (64, 3)
    assert settings.rate_limits.models["m"].requests_per_s == 5
    assert settings.llm.native is False


def test_an_unknown_yaml_key_is_refused_with_its_path(tmp_path: Path) -> None:
    config = tmp_path / "inferd.yaml"
    config.write_text("port: 8001\nbatching:\n  max_wait_ms: 2\n  max_batch_sise: 64\n")
    with pytest.raises(UnknownSetting) as caught:
        load_settings(config)
    assert str(caught.value).startswith(
        f"unknown setting in {config}: batching.max_batch_sise: batching has no "
        "'max_batch_sise'; valid: adaptive, batch_queue_share"
    )
    config.write_text("prot: 8001\n")
    valid = "valid: artifact_cache, artifact_store, auth"
    with pytest.raises(UnknownSetting, match=f"prot: settings have no 'prot'; {valid}"):
        load_settings(config)
    config.write_text("port: 8001\nbatching:\n  max_wait_ms: 2\n")
    settings = load_settings(config)
    assert (settings.port, settings.batching.max_wait_ms) == (8001, 2)


def test_serve_stops_at_an_unknown_variable_before_starting_anything(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "inferd", "serve", "--data-dir", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_clean_env(), "INFERD_BATCHING__MAX_BATCH_SISE": "64"},
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "unknown setting INFERD_BATCHING__MAX_BATCH_SISE" in output
    assert "Traceback" not in output
    assert not (tmp_path / "inferd.db").exists()  # nothing was created
    assert time.monotonic() - started < 30


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.upper().startswith("INFERD_")}


def test_a_replica_spec_carries_typed_settings() -> None:
    spec = ReplicaSpec(
        replica_id="m-v1-1",
        model="m",
        version="v1",
        framework="python",
        artifact_dir="/tmp/m",
        address="unix:/tmp/r1.sock",
        batching=BatchingConfig(max_batch_size=8, length_buckets=[4, 8]),
        llm=LLMConfig(kv_cache_mb=16, dtype="bfloat16"),
        adapters={"reviews": "adapters/reviews"},
    )
    back = ReplicaSpec.from_json(spec.to_json())
    assert back == spec
    assert isinstance(back.batching, BatchingConfig) and back.batching.length_buckets == [4, 8]
    assert back.llm.max_num_seqs == LLMConfig().max_num_seqs  # one source of defaults
    wrong = spec.to_json().replace('"kv_cache_mb":16', '"kv_cache_mb":0')
    with pytest.raises((msgspec.ValidationError, ValueError)):
        ReplicaSpec.from_json(wrong)
