"""Prefix-aware replica choice for generations (#37): a chat's next turn goes to the
replica that computed its earlier turns, whichever gateway process takes it, unless
that replica is over its share of the load."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from inferd.routing.choice import ROUTED
from inferd.routing.prefix import PrefixIndex, prompt_bytes, prompt_keys
from inferd.routing.router import Router
from inferd.serving.client import ReplicaClient
from inferd.shapes import replica as p
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2, push_folder, served

SYSTEM = {"role": "system", "content": "You answer questions about the server. " * 6}


def _client(name: str, running: int = 0, kv_used: float = 0.1) -> ReplicaClient:
    client = ReplicaClient(f"unix:/nowhere/{name}", name)
    client.closed = False
    client.engine = p.Load(0, running=running, waiting=0, kv_used=kv_used)
    return client


def _chat(*messages: dict[str, str]) -> p.GenerateRequest:
    prompt = {"messages": [SYSTEM, *messages], "tools": None}
    return p.GenerateRequest(prompt=prompt, params=SamplingParams(), idle_timeout_s=1)


def _choose(router: Router, clients: list[ReplicaClient], request: p.GenerateRequest) -> str:
    router.routes.ready[("m", "v1")] = clients
    target = SimpleNamespace(model="m", version="v1")
    chosen, keys = router.pick_generation(target, set(), request)  # type: ignore[arg-type]
    assert chosen is not None and keys
    return chosen.replica_id


def test_a_chats_next_turn_starts_with_this_turns_keys():
    turn1 = [SYSTEM, {"role": "user", "content": "How are versions kept? " * 4}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "Immutable."},
        {"role": "user", "content": "Why?"},
    ]
    one = prompt_keys(prompt_bytes({"messages": turn1}, None), 64)
    two = prompt_keys(prompt_bytes({"messages": turn2}, None), 64)
    assert len(two) > len(one) > 3 and two[: len(one)] == one
    # an adapter, other tools, token ids or another text start elsewhere
    assert prompt_keys(prompt_bytes({"messages": turn1}, "sql"), 64)[0] != one[0]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert prompt_keys(prompt_bytes({"messages": turn1, "tools": tools}, None), 64)[0] != one[0]
    text = "x" * 200
    assert prompt_keys(prompt_bytes(text, None), 64) == prompt_keys(text.encode(), 64)
    assert len(prompt_keys(b"y" * 63, 64)) == 0 and len(prompt_keys(b"y" * 10**6, 64)) == 256


def test_the_index_keeps_the_latest_holders_and_forgets_the_oldest_keys():
    index = PrefixIndex(max_keys=3)
    index.add([1, 2], "a")
    index.add([1, 3], "b")
    assert index.holders(1) == ("b", "a") and index.holders(2) == ("a",)
    index.add([4, 5], "a")  # 2, then 1, were sent least recently
    assert len(index) == 3 and index.holders(2) == () and index.holders(1) == ()
    index.forget("a")
    assert index.holders(3) == ("b",) and index.holders(4) == () and len(index) == 1


def test_a_known_prefix_wins_until_its_replica_is_over_its_share():
    router = Router(prefix_block_bytes=64, prefix_margin=0.5)
    a, b = _client("a"), _client("b")
    user = {"role": "user", "content": "Tell me about replicas and their engines. " * 3}
    first = _choose(router, [a, b], _chat(user))
    assert ROUTED.get() is not None and ROUTED.get().decision == "new"
    later = _chat(
        user, {"role": "assistant", "content": "They run."}, {"role": "user", "content": "More."}
    )
    chosen = _choose(router, [a, b], later)
    routed = ROUTED.get()
    assert chosen == first and routed is not None and routed.decision == "prefix"
    assert 0.5 < routed.expected < 1
    # the holder gets busier: 7 + 1 is within 1.5 x a fair share of (7 + 4 + 1) / 2 ...
    holder, other = (a, b) if first == "a" else (b, a)
    holder.engine = p.Load(0, running=7, waiting=0, kv_used=0.3)
    other.engine = p.Load(0, running=4, waiting=0, kv_used=0.3)
    assert _choose(router, [a, b], later) == first
    # ... near idle, one more than the fair share (2 + 1 > (2 + 0 + 1) / 2 + 1) is not
    other.engine = p.Load(0, running=0, waiting=0, kv_used=0.3)
    holder.engine = p.Load(0, running=1, waiting=0, kv_used=0.3)
    assert _choose(router, [a, b], later) == first
    holder.engine = p.Load(0, running=2, waiting=0, kv_used=0.3)
    assert _choose(router, [a, b], later) == other.replica_id
    assert ROUTED.get().decision == "overloaded"  # type: ignore[union-attr]
    # ... and the other replica now holds it too: it keeps it while the first is busy
    holder.engine = p.Load(0, running=0, waiting=0, kv_used=0.95)  # a nearly full cache
    assert _choose(router, [a, b], later) == other.replica_id
    # a replica's report of what other gateways sent it counts like this gateway's sends
    c = _client("c")
    fresh = _chat({"role": "user", "content": "Something no one asked before, at length. " * 3})
    keys = prompt_keys(prompt_bytes(fresh.prompt, None), 64)
    router.choice.prefix.add(keys, "c")
    assert _choose(router, [a, b, c], fresh) == "c"


def test_a_less_loaded_replica_takes_a_chat_while_it_lacks_little_of_it():
    """``llm.prefix_routing_move_tokens``: a chat whose holder is busier goes where less
    is running while the other replica lacks at most that much more of its prompt (its
    first turns: the load evens out cheaply); a long history stays where it is cached."""
    router = Router(prefix_block_bytes=64, prefix_margin=0.5, prefix_move_tokens=64)
    assert router.choice.prefix_move_blocks == 4  # 64 tokens of ~4 bytes, in 64-byte blocks
    a, b = _client("a", running=1), _client("b", running=1)

    def keys(request: p.GenerateRequest) -> list[int]:
        return prompt_keys(prompt_bytes(request.prompt, None), 64)

    def later(question: str) -> p.GenerateRequest:
        asked = {"role": "user", "content": question}
        answer = {"role": "assistant", "content": "8000."}
        return _chat(asked, answer, {"role": "user", "content": "And gRPC?"})

    short, long = "Which port?", "Which port does the gateway listen on, and why? " * 12
    router.choice.prefix.add(keys(_chat({"role": "user", "content": short})), "a")
    router.choice.prefix.add(keys(_chat({"role": "user", "content": long})), "a")
    router.choice.prefix.add(keys(_chat({"role": "user", "content": "Another chat."})), "b")
    shared = len(keys(_chat()))  # the system prompt's blocks: both were sent them
    assert len(keys(later(short))) - shared <= 4 < len(keys(later(long))) - shared
    # as loaded as the other: where its prefix went
    assert _choose(router, [a, b], later(short)) == "a"
    assert ROUTED.get().decision == "prefix"  # type: ignore[union-attr]
    # one sequence against none is not busy (it may be this chat's last turn, just ended)
    b.engine = p.Load(0, running=0, waiting=0, kv_used=0.1)
    assert _choose(router, [a, b], later(short)) == "a"
    assert ROUTED.get().decision == "prefix"  # type: ignore[union-attr]
    # two against one: the other replica lacks 4 blocks at most more of it
    b.engine = p.Load(0, running=1, waiting=0, kv_used=0.1)
    a.engine = p.Load(0, running=2, waiting=0, kv_used=0.1)
    assert _choose(router, [a, b], later(short)) == "b"
    routed = ROUTED.get()
    assert routed is not None and routed.decision == "balance" and 0 < routed.expected < 1
    # at the same loads, a long history stays where it is cached
    assert _choose(router, [a, b], later(long)) == "a"
    assert ROUTED.get().decision == "prefix"  # type: ignore[union-attr]
    # 0 tokens: only the margin moves a chat
    still = Router(prefix_block_bytes=64, prefix_margin=0.5, prefix_move_tokens=0)
    still.choice.prefix.add(keys(later(short)), "a")
    still.choice.prefix.add(keys(_chat({"role": "user", "content": "Another chat."})), "b")
    assert _choose(still, [a, b], later(short)) == "a"


def test_one_replica_or_the_setting_off_computes_no_keys():
    request = _chat({"role": "user", "content": "A question of some length, asked twice. " * 3})
    router = Router(prefix_block_bytes=64)
    router.routes.ready[("m", "v1")] = [_client("a")]
    target = SimpleNamespace(model="m", version="v1")
    assert router.pick_generation(target, set(), request)[1] is None  # type: ignore[arg-type]
    off = Router(prefix_block_bytes=0)
    off.routes.ready[("m", "v1")] = [_client("a"), _client("b")]
    assert off.pick_generation(target, set(), request)[1] is None  # type: ignore[arg-type]
    assert len(off.choice.prefix) == 0


@pytest.mark.slow
def test_each_turn_of_each_chat_finds_its_earlier_turns_cached(tmp_path: Path):
    """Two replicas, two gateway processes, a new connection per request (so turns of
    one chat reach either gateway): from its second turn, every turn finds the whole
    of its previous turn's prompt in the prefix cache of the replica it went to."""
    folder = build_tiny_gpt2(tmp_path / "src" / "tiny", n_positions=512)
    push_folder(tmp_path, "tiny", folder, batching={"replicas": 2})
    with served(tmp_path, workers=2) as server:
        deadline = time.monotonic() + 60
        while len(server.client.get("/api/v1/models/tiny").json()["versions"][0]["replicas"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        chats: dict[int, list[dict[str, str]]] = {u: [SYSTEM] for u in range(4)}
        previous: dict[int, int] = {}
        found: list[tuple[int, int]] = []
        for turn in range(3):
            for user, messages in chats.items():
                asks = f"User {user} asks question {turn} about the batch size and the queue."
                messages.append({"role": "user", "content": asks})
                body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
                reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
                assert reply.status_code == 200, reply.text
                usage = reply.json()["usage"]
                if turn:
                    found.append((usage["prompt_tokens_details"]["cached_tokens"], previous[user]))
                previous[user] = usage["prompt_tokens"]
                answer = reply.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": answer})
        # each later turn: all of the previous prompt's full blocks (16 tokens) were there
        assert all(cached >= before - 16 for cached, before in found), found
        deadline = time.monotonic() + 20
        while True:  # the log rows reach the server in batches
            metrics = server.client.get("/metrics").text
            logs = server.client.get("/api/v1/logs", params={"model": "tiny", "limit": 20})
            routed = [r for r in logs.json()["logs"] if r["routed_by"] is not None]
            if len(routed) >= 12 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert 'inferd_generation_routed_total{model="tiny",decision="prefix"}' in metrics
        assert len(routed) == 12 and all(r["cached_tokens"] is not None for r in routed)
        assert sum(r["routed_by"] == "prefix" for r in routed) >= 8, routed
        assert all(r["expected_cached"] > 0.5 for r in routed if r["routed_by"] == "prefix")
