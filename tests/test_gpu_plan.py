"""The GPU packing planner as an algorithm: every placement keeps the rules, never beats
the lower bound, and matches an exact search on small cases."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from inferd.control.gpu_plan import (
    GpuType,
    ModelNeed,
    Rules,
    exact,
    fits,
    lower_bound,
    parse_inventory,
    plan,
)
from tests.conftest import arithmetic_model, push_source, run_cli

A100 = GpuType("A100-80GB", 80, 64)


def generated(rng: random.Random, n: int, largest_gb: float = 40) -> list[ModelNeed]:
    """``n`` models as a serving fleet has them: most small, a few large (log-uniform
    0.5 GB .. ``largest_gb``), 1-3 replicas, a fifth latency-critical."""
    models = []
    for i in range(n):
        memory = round(0.5 * (largest_gb / 0.5) ** rng.random(), 2)
        latency = rng.choices(["critical", "standard", "batch"], [0.2, 0.6, 0.2])[0]
        models.append(ModelNeed(f"m{i}", memory, rng.randint(1, 3), latency))
    return models


def assert_valid(models: list[ModelNeed], placed, rules: Rules) -> None:
    seen = []
    for gpu in placed.gpus:
        assert gpu.replicas, "an empty GPU counted as used"
        assert gpu.used_gb <= gpu.type.memory_gb * (1 - rules.headroom) + 1e-9
        names = [r.model for r in gpu.replicas]
        assert len(names) == len(set(names)), f"two replicas of one model on {gpu.name}"
        for i, replica in enumerate(gpu.replicas):  # each one would be admitted again
            rest = type(gpu)(gpu.type, gpu.index, gpu.replicas[:i] + gpu.replicas[i + 1 :])
            assert fits(rest, replica, rules), (gpu.name, replica)
        seen += [(r.model, r.index) for r in gpu.replicas]
    wanted = sorted((m.name, i) for m in models for i in range(m.replicas))
    assert sorted(seen + [(r.model, r.index) for r in placed.unplaced]) == wanted


def test_the_design_documents_practice_problem():
    """30 models from 500 MB to 40 GB on 80 GB A100s, with latency classes."""
    rng = random.Random(30)
    models = generated(rng, 30)
    rules = Rules()
    placed = plan(models, [A100], rules)
    assert_valid(models, placed, rules)
    assert not placed.unplaced
    assert placed.lower_bound <= placed.used <= placed.lower_bound + 1


@pytest.mark.parametrize("seed", range(40))
def test_generated_fleets_are_packed_validly_and_close_to_the_lower_bound(seed: int):
    rng = random.Random(seed)
    models = generated(rng, rng.randint(5, 60))
    rules = Rules(headroom=rng.choice([0.05, 0.1, 0.2]))
    inventory = [A100, GpuType("L4", 24, rng.randint(0, 8))]
    placed = plan(models, inventory, rules)
    assert_valid(models, placed, rules)
    assert not placed.unplaced
    assert placed.used >= placed.lower_bound


def test_over_generated_fleets_the_plan_stays_near_the_lower_bound():
    ratios = []
    for seed in range(100):
        rng = random.Random(1000 + seed)
        models = generated(rng, 30)
        placed = plan(models, [A100])
        ratios.append(placed.used / placed.lower_bound)
    # The bound is loose where critical and heavy models crowd (on small cases it is the
    # optimum 50 times in 60, and the plan 60 times): measured mean 1.14, 46 at the bound.
    assert statistics.mean(ratios) <= 1.16, statistics.mean(ratios)
    assert sum(r == 1 for r in ratios) >= 40


def test_small_cases_match_the_exact_search():
    gaps, bound_gaps = [], []
    for seed in range(60):
        rng = random.Random(seed)
        models = generated(rng, rng.randint(2, 6), largest_gb=60)
        inventory = [GpuType("A100-80GB", 80, 12), GpuType("L4", 24, 4)]
        rules = Rules(headroom=0.1)
        best = exact(models, inventory, rules)
        placed = plan(models, inventory, rules)
        assert best is not None
        assert best >= placed.lower_bound
        assert placed.used >= best  # nothing beats the optimum
        gaps.append(placed.used - best)
        bound_gaps.append(best - placed.lower_bound)
    assert gaps == [0] * len(gaps)  # measured: the optimum in all 60
    assert sum(g == 0 for g in bound_gaps) >= 50


def test_a_latency_critical_model_is_kept_from_heavy_neighbours():
    models = [
        ModelNeed("fraud", 1, 1, "critical"),
        ModelNeed("llm-a", 30, 1, "batch"),
        ModelNeed("llm-b", 30, 1, "batch"),
    ]
    placed = plan(models, [A100], Rules(headroom=0.1, heavy_gb=20, critical_heavy_gb=30))
    fraud = next(g for g in placed.gpus if any(r.model == "fraud" for r in g.replicas))
    heavy = sum(r.memory_gb for r in fraud.replicas if r.model != "fraud")
    assert heavy <= 30
    strict = plan(models, [A100], Rules(headroom=0.1, heavy_gb=20, critical_heavy_gb=0))
    fraud = next(g for g in strict.gpus if any(r.model == "fraud" for r in g.replicas))
    assert [r.model for r in fraud.replicas] == ["fraud"]


def test_replicas_of_one_model_go_to_different_gpus_and_too_small_an_inventory_says_so():
    placed = plan([ModelNeed("m", 1, 3)], [GpuType("T4", 16, 2)])
    assert len(placed.gpus) == 2 and [r.index for r in placed.unplaced] == [2]
    assert lower_bound([ModelNeed("m", 1, 3)], [GpuType("T4", 16, 2)], Rules()) == 3


def test_inventories_parse_and_bad_ones_are_named():
    assert parse_inventory("A100-80GB:80:16, L4:24:4") == [
        GpuType("A100-80GB", 80, 16),
        GpuType("L4", 24, 4),
    ]
    with pytest.raises(ValueError, match="type:memory_gb:count"):
        parse_inventory("A100:lots:2")
    with pytest.raises(ValueError, match="latency"):
        ModelNeed("m", 1, 1, "urgent")


PLAN_YAML = """
gpus:
  - {name: A100-80GB, memory_gb: 80, count: 8}
rules: {headroom: 0.1}
models:
  - {name: fraud, memory_gb: 0.5, replicas: 3, latency: critical}
  - {name: llama-70b-int4, memory_gb: 40, replicas: 2, latency: standard}
  - {name: minilm, memory_gb: 1.2, replicas: 2, latency: critical}
  - {name: whisper, memory_gb: 10, replicas: 2, latency: standard}
  - {name: sdxl, memory_gb: 24, replicas: 1, latency: batch}
"""


def test_the_cli_plans_from_a_file_and_from_the_registry(tmp_path):
    spec = tmp_path / "plan.yaml"
    spec.write_text(PLAN_YAML)
    out = run_cli("plan", "gpus", "--file", str(spec), "--json", data_dir=tmp_path)
    planned = json.loads(out.stdout)
    assert planned["gpus_used"] == planned["lower_bound"] == 5 and not planned["unplaced"]
    small = run_cli(
        "plan", "gpus", "--file", str(spec), "--gpus", "A100-80GB:80:3", data_dir=tmp_path,
        check=False,
    )  # fmt: skip
    assert small.returncode == 1 and "not placed" in small.stderr

    push_source(tmp_path, "fraud", arithmetic_model("x"), "--meta", "gpu_memory_gb=0.5",
                "--meta", "latency_class=critical")  # fmt: skip
    push_source(tmp_path, "big", arithmetic_model("x"), "--meta", "gpu_memory_gb=60")
    push_source(tmp_path, "untagged", arithmetic_model("x"))  # no gpu_memory_gb: left out
    out = run_cli("plan", "gpus", "--gpus", "A100-80GB:80:4", "--json", data_dir=tmp_path)
    planned = json.loads(out.stdout)
    placed = sorted(r for g in planned["gpus"] for r in g["replicas"])
    assert placed == ["big:v1[0]", "fraud:v1[0]"] and planned["gpus_used"] == 2
