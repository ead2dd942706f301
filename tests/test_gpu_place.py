"""Where the local backend runs a GPU replica (inferd.control.gpu_place): one device per
replica under the planner's rules, never more than a GPU holds."""

from __future__ import annotations

from inferd.control.gpu_place import choose, need_of, room
from inferd.control.gpu_plan import Replica, Rules
from inferd.devices import Gpu, parse_gpus

A100 = 81920  # MiB, as nvidia-smi reports an 80 GB A100
GB = 2**20 * 1e-9  # GB per MiB


def gpus(*mib: int) -> list[Gpu]:
    return [Gpu(i, f"NVIDIA GPU{i}", m) for i, m in enumerate(mib)]


def test_nvidia_smi_csv_with_and_without_memory() -> None:
    out = "0, NVIDIA A100-SXM4-80GB, 81920\n1, NVIDIA H100 80GB HBM3, 81559\nbad line\n"
    assert parse_gpus(out) == (
        Gpu(0, "NVIDIA A100-SXM4-80GB", 81920),
        Gpu(1, "NVIDIA H100 80GB HBM3", 81559),
    )
    assert parse_gpus("0, Tesla T4\n") == (Gpu(0, "Tesla T4", 0),)  # an older query


def test_the_need_is_stated_or_estimated_from_the_artifact() -> None:
    stated = need_of("m", {"gpu_memory_gb": 12, "latency_class": "critical"}, 10**9)
    assert (stated.memory_gb, stated.latency, stated.estimated) == (12.0, "critical", False)
    guessed = need_of("m", {"gpu_memory_gb": "a lot", "latency_class": "fast"}, 5 * 10**9)
    assert guessed.estimated and guessed.memory_gb == 7.0  # 5 GB x 1.2 + 1 GB of context
    assert guessed.latency == "standard"  # an unknown class is not trusted


def test_replicas_spread_then_share_then_stop_at_memory() -> None:
    need = need_of("llm", {"gpu_memory_gb": 30}, 0)
    devices = gpus(A100, A100)
    placed: dict[int, list[Replica]] = {}
    where = []
    for i in range(5):
        chosen = choose(need, devices, placed)
        where.append(chosen.device)
        if chosen.device is not None:
            placed.setdefault(chosen.device, []).append(need.replica(i))
    # one on each GPU first, then a second on each (77.3 GB usable of 85.9 GB), then none
    assert where == [0, 1, 0, 1, None]
    refused = choose(need, devices, placed)
    assert "needs 30.0 GB" in refused.why and "GPU 0 17.3 GB free" in refused.why
    assert room(need, devices, {}) == 4
    assert room(need, devices, placed) == 0


def test_a_replica_goes_to_the_fullest_gpu_it_fits_on() -> None:
    devices = gpus(A100, A100, A100)
    placed = {0: [Replica("a", 0, 10, "standard")], 1: [Replica("b", 0, 50, "standard")]}
    assert choose(need_of("c", {"gpu_memory_gb": 20}, 0), devices, placed).device == 1
    assert choose(need_of("c", {"gpu_memory_gb": 30}, 0), devices, placed).device == 0
    assert choose(need_of("c", {"gpu_memory_gb": 70}, 0), devices, placed).device == 2


def test_a_latency_critical_replica_keeps_away_from_heavy_ones() -> None:
    devices = gpus(A100, A100)
    placed = {0: [Replica("big", 0, 40, "batch")], 1: [Replica("small", 0, 5, "standard")]}
    fraud = need_of("fraud", {"gpu_memory_gb": 2, "latency_class": "critical"}, 0)
    assert choose(fraud, devices, placed).device == 1  # not beside the 40 GB one
    # and a heavy replica is not put beside a critical one past the limit
    placed = {0: [Replica("fraud", 0, 2, "critical")], 1: [Replica("other", 0, 60, "batch")]}
    heavy = need_of("big", {"gpu_memory_gb": 30}, 0)
    assert choose(heavy, devices, placed).device is None
    assert choose(heavy, devices, placed, Rules(critical_heavy_gb=40)).device == 0


def test_unknown_gpu_memory_places_without_a_limit() -> None:
    devices = [Gpu(0, "NVIDIA T4", 0)]
    need = need_of("m", {"gpu_memory_gb": 500}, 0)
    assert choose(need, devices, {}).device == 0
    assert choose(need, [], {}).why == "no GPU of the deployment's type on this machine"


def test_gb_are_decimal_as_gpu_memory_gb() -> None:
    # 81920 MiB is 85.9 GB; with 10 % kept free, 77.3 GB take a replica, 77.4 do not
    one = gpus(A100)
    assert round(A100 * GB * 0.9, 1) == 77.3
    assert choose(need_of("m", {"gpu_memory_gb": 77.3}, 0), one, {}).device == 0
    assert choose(need_of("m", {"gpu_memory_gb": 77.4}, 0), one, {}).device is None
