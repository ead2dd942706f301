"""Settings precedence, the public surface, and the registry CLI (no server needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import inferd
from inferd.config import Settings, load_settings
from tests.conftest import ROOT, run_cli

MODELS = Path(__file__).parent / "models"


def test_public_surface():
    assert sorted(inferd.__all__) == [
        "InferdError",
        "Runtime",
        "Settings",
        "Signature",
        "TensorSpec",
        "__version__",
    ]
    for name in inferd.__all__:
        assert hasattr(inferd, name)


def test_importing_inferd_starts_nothing_heavy():
    code = (
        "import sys, inferd, inferd.cli, inferd.server; "
        "print(any(m in sys.modules for m in ('torch', 'xgboost', 'lightgbm', 'sklearn')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_defaults_env_and_yaml_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert Settings().port == 8000
    assert Settings().batching.max_batch_size == 32
    config = tmp_path / "inferd.yaml"
    config.write_text("port: 9001\nreplicas: 3\nbatching:\n  max_wait_ms: 2\n")
    monkeypatch.setenv("INFERD_REPLICAS", "2")
    settings = load_settings(config)
    assert settings.port == 9001  # from YAML
    assert settings.replicas == 2  # env beats YAML
    assert settings.batching.max_wait_ms == 2
    assert load_settings(config, port=9100).port == 9100  # explicit beats everything
    assert settings.resolved_database_url.startswith("sqlite:///")


def test_invalid_settings_are_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("INFERD_REPLICAS", "0")
    with pytest.raises(ValueError, match="replicas"):
        Settings()


def test_cli_version():
    out = subprocess.run(
        [sys.executable, "-m", "inferd", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == f"inferd {inferd.__version__}"


def test_cli_push_list_show_and_immutability(tmp_path: Path):
    pushed = run_cli(
        "models",
        "push",
        "summer",
        str(MODELS / "slow_sum"),
        "--version",
        "v1",
        "--meta",
        "accuracy=0.93",
        "--meta",
        "dataset=d-2026",
        "--description",
        "sums things",
        data_dir=tmp_path,
    )
    record = json.loads(pushed.stdout)
    assert record["framework"] == "python"
    assert record["metadata"] == {"accuracy": 0.93, "dataset": "d-2026"}
    assert record["signature"]["inputs"][0]["shape"] == [-1, 4]
    again = run_cli(
        "models",
        "push",
        "summer",
        str(MODELS / "slow_sum"),
        "--version",
        "v1",
        data_dir=tmp_path,
        check=False,
    )
    assert again.returncode == 1
    assert "409" in again.stderr and "already" in again.stderr
    listing = run_cli("models", "list", data_dir=tmp_path).stdout
    assert "summer" in listing and "python" in listing
    shown = json.loads(run_cli("models", "show", "summer", data_dir=tmp_path).stdout)
    assert shown["description"] == "sums things"
    missing = run_cli("models", "show", "nope", data_dir=tmp_path, check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_cli_push_rejects_what_cannot_load(tmp_path: Path):
    junk = tmp_path / "model.onnx"
    junk.write_bytes(b"not an onnx file")
    out = run_cli(
        "models",
        "push",
        "junk",
        str(junk),
        "--version",
        "v1",
        data_dir=tmp_path / "data",
        check=False,
    )
    assert out.returncode == 1
    assert "cannot load" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_pull_copies_a_checked_version(tmp_path: Path):
    data = tmp_path / "data"
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.py").write_text(
        "import numpy as np\n\nclass M:\n"
        "    signature = {'inputs': [{'name': 'x', 'datatype': 'FP32', 'shape': [-1]}],\n"
        "                 'outputs': [{'name': 'y', 'datatype': 'FP32', 'shape': [-1]}]}\n"
        "    def predict(self, b):\n        return {'y': b['x']}\n"
    )
    pushed = json.loads(run_cli("models", "push", "m", str(src), "--version", "v1",
                                "--meta", 'labels=["a"]', data_dir=data).stdout)  # fmt: skip
    out = tmp_path / "out"
    pulled = run_cli("models", "pull", "m", "v1", "--out", str(out), data_dir=data)
    assert f"sha256 {pushed['sha256'][:12]}" in " ".join(pulled.stderr.split())
    assert (out / "model.py").read_text() == (src / "model.py").read_text()
    shipped = json.loads((out / "inferd.json").read_text())
    assert shipped["metadata"] == {"labels": ["a"]}  # what changes the answers travels
    again = run_cli("models", "pull", "m", "v1", "--out", str(out), data_dir=data, check=False)
    assert again.returncode == 1 and "not empty" in again.stderr
    (data / "artifacts" / "m" / "v1" / "model.py").write_text("tampered")
    damaged = run_cli(
        "models", "pull", "m", "v1", "--out", str(tmp_path / "o2"), data_dir=data, check=False
    )
    assert damaged.returncode == 1 and "damaged" in damaged.stderr
