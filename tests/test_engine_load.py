"""Generation replicas are chosen by what their engines hold: each replica pushes its
engine's running and waiting sequences and KV-cache use (``Load`` frames) to every
connected gateway, and the router weighs those, not one gateway's own requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.routing.choice import engine_load, generation_load, least_loaded
from inferd.serving.client import ReplicaClient
from inferd.shapes import replica as p
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2, push_folder, served


def _client(name: str, outstanding: int, load: p.Load | None, sent: int = 0) -> ReplicaClient:
    client = ReplicaClient(f"unix:/nowhere/{name}", name)
    client.closed = False
    client.outstanding, client.engine, client.sent_since_load = outstanding, load, sent
    return client


def _pick(*clients: ReplicaClient) -> str:
    chosen = least_loaded(clients, set(), generation_load)
    assert chosen is not None
    return chosen.replica_id


def test_the_engine_s_report_outweighs_this_gateway_s_own_count() -> None:
    # another gateway filled a: this one sees nothing outstanding there, its engine does
    a = _client("a", outstanding=0, load=p.Load(0, running=8, waiting=20, kv_used=0.5))
    b = _client("b", outstanding=3, load=p.Load(0, running=3, waiting=0, kv_used=0.2))
    assert _pick(a, b) == "b"
    # sent since the last report count on top of it, so a burst does not all go one way
    b.sent_since_load = 30
    assert _pick(a, b) == "a"
    # a nearly full KV cache is chosen last, however short its queue
    full = _client("full", outstanding=0, load=p.Load(0, running=1, waiting=0, kv_used=0.95))
    assert _pick(full, a) == "a"
    # before any report: this gateway's own outstanding requests
    fresh = _client("fresh", outstanding=1, load=None)
    assert engine_load(fresh) == (0.0, 1.0)
    assert _pick(fresh, _client("idle", outstanding=0, load=None)) == "idle"


async def _drain(stream: Any) -> int:
    tokens = 0
    async for chunk in stream:
        tokens += len(chunk.token_ids)
    return tokens


def _finished(server: Any) -> dict[int, float]:
    """Generations each replica (by pid) has finished, from its own metrics."""
    version = server.client.get("/api/v1/models/tiny").json()["versions"][0]
    return {
        r["pid"]: sum((r.get("metrics", {}).get("finished") or {}).values())
        for r in version["replicas"]
    }


def _unix_entries(sock: Path) -> int:
    """Sockets bound to ``sock``'s path: its listener and every connection it accepted."""
    with open("/proc/net/unix") as table:
        return sum(line.rstrip("\n").endswith(f" {sock}") for line in table)


@pytest.mark.slow
def test_gateways_send_generations_where_the_engines_hold_least(tmp_path: Path) -> None:
    folder = build_tiny_gpt2(tmp_path / "src" / "tiny")
    push_folder(tmp_path, "tiny", folder, batching={"replicas": 2})
    run = tmp_path / "run"
    env = {"INFERD_RUN_DIR": str(run), "INFERD_LLM__MAX_NUM_SEQS": "2"}
    with served(tmp_path, workers=2, env=env) as server:
        deadline = time.monotonic() + 60
        while len([r for r in _finished(server)]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # every gateway process connected to both replicas (one that has a single replica
        # yet sends there whatever its load): on each replica's socket, the listener,
        # the controller's connection and the two gateways'
        socks = sorted(run.glob("r*.sock"))
        while min(_unix_entries(s) for s in socks) < 4:
            assert time.monotonic() < deadline, [_unix_entries(s) for s in socks]
            time.sleep(0.05)
        before = _finished(server)

        async def scenario() -> tuple[int, list[int]]:
            direct = [ReplicaClient(f"unix:{s}") for s in socks]
            for client in direct:
                await client.connect()
            busy = direct[0]
            busy_pid = (await busy.status(timeout_s=5)).pid
            # 16 long generations straight into one replica: no gateway knows of them
            params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
            request = p.GenerateRequest(prompt="The server", params=params, idle_timeout_s=60)
            load = [asyncio.create_task(_drain(busy.generate(request))) for _ in range(16)]
            until = time.monotonic() + 10
            while busy.engine is None or busy.engine.waiting < 8:  # its own Load frames
                assert time.monotonic() < until, busy.engine
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the gateways have had theirs too
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
                replies = await asyncio.gather(
                    *(http.post("/api/v1/generate", json=body) for _ in range(6))
                )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            tokens = await asyncio.gather(*load)
            for client in direct:
                client.close()
            return busy_pid, tokens

        busy_pid, tokens = asyncio.run(scenario())
        assert tokens == [120] * 16
        deadline = time.monotonic() + 10
        while sum(_finished(server).values()) < sum(before.values()) + 22:
            assert time.monotonic() < deadline, _finished(server)
            time.sleep(0.1)
        after = _finished(server)
        (other_pid,) = set(after) - {busy_pid}
        assert after[busy_pid] - before[busy_pid] == 16  # only the direct ones
        assert after[other_pid] - before[other_pid] == 6  # every gateway request
