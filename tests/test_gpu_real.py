"""GPU placement on a real NVIDIA GPU (skipped where ``nvidia-smi`` finds none, as on
the CI machine): replicas of a deployment with ``resources.gpu`` run on the device the
local backend chose for each, hold their memory there, and no more start than the
GPU's memory takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inferd import devices
from tests.conftest import InferdServer, gpu_memory_by_pid, push_source, served

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not devices.local_gpus(), reason="needs an NVIDIA GPU (nvidia-smi)"),
]

HOLDER = """
import os

import numpy as np
import torch


class Holder:
    '''Takes ``hold_gb`` of GPU memory at load, as a model's weights would.'''

    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "seen", "datatype": "BYTES", "shape": [-1]}],
    }

    def load(self, folder):
        self.block = torch.empty(int(HOLD_GB * 1e9), dtype=torch.uint8, device="cuda")
        self.block.fill_(1)

    def predict(self, batch):
        x = torch.as_tensor(batch["x"], device="cuda")
        seen = "{}|{}|{}".format(
            os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
            torch.cuda.device_count(),
            float((x * 2).sum().item()),
        )
        return {"seen": np.array([seen] * len(batch["x"]), dtype=object)}
"""


def _deployment(server: InferdServer, model: str) -> dict[str, Any]:
    return dict(server.client.get(f"/api/v1/deployments/{model}").json())


def test_replicas_run_on_the_gpu_and_stop_at_its_memory(tmp_path: Path) -> None:
    gpu = devices.local_gpus()[0]
    usable_gb = gpu.memory_mib * 2**20 / 1e9 * 0.9
    need_gb = round(usable_gb / 2 - 1, 1)  # two fit on one GPU, a third does not
    source = HOLDER.replace("HOLD_GB", str(min(4.0, need_gb)))
    push_source(tmp_path, "holder", source, "--meta", f"gpu_memory_gb={need_gb}")
    with served(tmp_path) as server:
        reply = server.client.post(
            "/api/v1/deployments",
            json={
                "model_name": "holder",
                "version": "v1",
                "resources": {"gpu": "any", "replicas": 3},
            },
        )
        assert reply.status_code == 201, reply.text

        def ready_gpus() -> list[Any]:
            (version,) = _deployment(server, "holder")["versions"]
            return sorted(r.get("gpus") for r in version["replicas"] if r["state"] == "ready")

        # one GPU: the two that fit share it (no other GPU takes the second)
        want = [[gpu.index]] * 2 if len(devices.local_gpus()) == 1 else None
        server.wait_for(
            lambda: ready_gpus() == want if want else len(ready_gpus()) == 3,
            timeout_s=120,
            what="the replicas on the GPU",
        )
        answer = server.client.post(
            "/api/v1/predict", json={"model": "holder", "input": {"x": 1.5}}
        )
        assert answer.status_code == 200, answer.text
        visible, count, doubled = answer.json()["prediction"].split("|")
        assert visible == str(gpu.index) and count == "1" and float(doubled) == 3.0
        (version,) = _deployment(server, "holder")["versions"]
        pids = {r["pid"] for r in version["replicas"] if r["state"] == "ready"}
        on_gpu = gpu_memory_by_pid()
        assert pids <= set(on_gpu), (pids, on_gpu)
        assert all(on_gpu[p] >= min(4.0, need_gb) * 1e3 * 0.9 for p in pids)
        if want:
            events = [
                e
                for e in _deployment(server, "holder")["scaling_events"]
                if e["reason"] == "capacity"
            ]
            assert len(events) == 1, events
            assert f"needs {need_gb:.1f} GB of GPU memory (gpu_memory_gb)" in events[0]["detail"]
