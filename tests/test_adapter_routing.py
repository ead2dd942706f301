"""Many LoRA adapters on few slots (#37): adapters load when a request needs them,
least recently used out, and requests go to a replica that has theirs loaded.

Adapters here are copies of one PEFT adapter with their ``B`` matrices drawn again (a
PEFT model per adapter would cost a second each)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from inferd.routing.choice import ROUTED
from inferd.routing.router import Router
from inferd.serving.client import ReplicaClient
from inferd.shapes import replica as p
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2, push_folder, served
from tests.test_generation_server import make_adapter, peft_greedy

PROMPT = "The server answers"
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


def adapters(base: Path, into: Path, count: int) -> dict[str, str]:
    """``count`` adapters of ``base`` under ``into`` (name -> folder relative to ``base``)."""
    import torch
    from safetensors.torch import load_file, save_file

    first = make_adapter(base, into / "a0", seed=0, targets=["c_attn"])
    weights = load_file(str(first / "adapter_model.safetensors"))
    config = (first / "adapter_config.json").read_text()
    gen = torch.Generator().manual_seed(1)
    for i in range(1, count):
        folder = into / f"a{i}"
        folder.mkdir(parents=True)
        changed = {
            k: (torch.randn(v.shape, generator=gen) * 0.5 if "lora_B" in k else v)
            for k, v in weights.items()
        }
        save_file(changed, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(config)
    return {f"a{i}": str((into / f"a{i}").relative_to(base)) for i in range(count)}


def _client(name: str, running: int = 0, loaded: tuple[str, ...] = (), room: int = 4):
    client = ReplicaClient(f"unix:/nowhere/{name}", name)
    client.closed = False
    client.engine = p.Load(0, running, 0, 0.1, [], list(loaded), room)
    return client


def _choose(router: Router, clients: list[ReplicaClient], adapter: str) -> str:
    router.routes.ready[("m", "v1")] = clients
    request = p.GenerateRequest(
        prompt="hi", params=SamplingParams(), adapter=adapter, idle_timeout_s=1
    )
    target = SimpleNamespace(model="m", version="v1")
    chosen, _ = router.pick_generation(target, set(), request)  # type: ignore[arg-type]
    assert chosen is not None
    return chosen.replica_id


def test_a_request_goes_where_its_adapter_is_loaded_or_where_it_can_be():
    router = Router(prefix_block_bytes=64)
    a, b = _client("a", running=1, loaded=("x",)), _client("b", running=0, loaded=("y",))
    assert _choose(router, [a, b], "x") == "a"  # busier, but it has x
    assert ROUTED.get().decision == "adapter"  # type: ignore[union-attr]
    # loaded nowhere: the least loaded with a slot free (or held by an idle adapter)
    assert _choose(router, [a, b], "z") == "b"
    assert ROUTED.get().decision == "adapter-load"  # type: ignore[union-attr]
    # ... and it now counts as b's until b's reports say otherwise, for a moment
    b.engine = p.Load(0, 2, 0, 0.1, [], ["y"], 4)
    assert _choose(router, [a, b], "z") == "b"
    b.engine = p.Load(0, 0, 0, 0.1, [], ["y"], 0)  # every slot of b runs sequences
    assert _choose(router, [a, b], "w") == "a"
    # a holder over its share of the load loses the preference
    a.engine = p.Load(0, 9, 0, 0.1, [], ["x"], 4)
    b.engine = p.Load(0, 0, 0, 0.1, [], ["y"], 4)
    assert _choose(router, [a, b], "x") == "b"


@pytest.mark.slow
def test_fifty_adapters_over_two_replicas_of_four_slots(tmp_path: Path):
    src = tmp_path / "src" / "tiny"
    build_tiny_gpt2(src)
    names = adapters(src, src / "adapters", 50)
    push_folder(tmp_path, "tiny", src, batching={"replicas": 2}, adapters=names)
    env = {"INFERD_LLM__MAX_ADAPTERS": "4"}
    with served(tmp_path, workers=2, env=env) as server:
        deadline = time.monotonic() + 60
        while len(_replicas(server)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)

        def gen(adapter: str) -> str:
            body = {"model": adapter, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            reply = httpx.post(f"{server.url}/api/v1/generate", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            return str(reply.json()["text"])

        # one at a time, three requests each: every adapter is loaded once, on one replica
        # (a replica reports what it loaded within 20 ms: the next request is later)
        first: dict[str, set[str]] = {}
        for i in range(10, 22):
            for _ in range(3):
                first.setdefault(f"a{i}", set()).add(gen(f"a{i}"))
                time.sleep(0.05)
        assert all(len(texts) == 1 for texts in first.values()), first
        assert _loads(server) == 12
        # 150 requests over all 50 at once, 12 in flight: no error, each adapter's text
        # always the same (no slot computes with another's weights or cache)
        rng = random.Random(0)
        asked = [f"a{rng.randrange(50)}" for _ in range(150)]
        with ThreadPoolExecutor(12) as pool:
            texts = list(pool.map(gen, asked))
        seen: dict[str, set[str]] = {}
        for name, text in zip(asked, texts, strict=True):
            seen.setdefault(name, set()).add(text)
        assert all(len(v) == 1 for v in seen.values()), seen
        for name in ("a0", "a33"):
            want = peft_greedy(src, src / names[name], PROMPT, 8)
            assert gen(name) == want, name
        assert len({t for v in seen.values() for t in v}) > 20  # the adapters differ
        metrics = server.client.get("/metrics").text
        assert "inferd_lora_adapter_loads_total" in metrics
        assert "inferd_lora_adapter_load_seconds_bucket" in metrics


def _replicas(server) -> list[dict]:
    return server.client.get("/api/v1/models/tiny").json()["versions"][0]["replicas"]


def _loads(server) -> int:
    return int(sum(r["stats"].get("adapter_loads", 0) for r in _replicas(server)))
