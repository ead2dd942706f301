"""Generations that outlive their replica (#37): a replica killed mid-stream, and the
gateway goes on with the generation on another one -- the prompt and the tokens already
sent -- so the client's stream finishes with no error, no token twice, none missing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2, push_folder, served
from tests.test_llm_engine import CharTokenizer, PlusOneModel, run_all, tokens

MAX_TOKENS = 400


def test_a_resumed_request_goes_on_where_the_lost_one_was():
    """The engine's side: the first output carries the text so far, as it would have
    streamed it (a stop string's start still held back), then the new token's."""
    config = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_batched_tokens=32)
    whole = LLMEngine(PlusOneModel(), CharTokenizer(), config)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=10, temperature=0, stop=("HIJ",))
    whole.add_request("w", [ord("A")], params)
    outs = run_all(whole)["w"]
    want_text = "".join(o.text for o in outs)
    assert want_text == "BCDEFG"  # "H" would start the stop string: held, then cut
    resumed = LLMEngine(PlusOneModel(), CharTokenizer(), config)  # type: ignore[arg-type]
    resumed.add_request("r", [ord("A")], params, resume=[ord(c) for c in "BCD"])
    rest = run_all(resumed)["r"]
    assert tokens(rest)[0] == ord("E") and rest[0].text == "BCDE" and rest[0].replayed == 3
    assert "".join(o.text for o in rest) == want_text and rest[-1].finish_reason == "stop"
    assert rest[-1].completion_tokens == outs[-1].completion_tokens
    with pytest.raises(ValueError):
        resumed.add_request("x", [ord("A")], params, resume=list(range(66, 76)))  # all of it


def test_seeded_draws_depend_on_the_position_only():
    config = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_batched_tokens=32)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    whole = LLMEngine(PlusOneModel(random_logits=True), CharTokenizer(), config)  # type: ignore[arg-type]
    whole.add_request("w", [5, 6], params)
    want = tokens(run_all(whole)["w"])
    resumed = LLMEngine(PlusOneModel(random_logits=True), CharTokenizer(), config)  # type: ignore[arg-type]
    resumed.add_request("r", [5, 6], params, resume=want[:5])
    assert want[:5] + tokens(run_all(resumed)["r"]) == want


async def _stream(http: httpx.AsyncClient, kind: str, i: int, got: dict, gaps: dict) -> str:
    prompt = f"Request {i} asks the server"
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "openai":
        body = {"model": "tiny", "prompt": prompt, "stream": True, **greedy}
        url, pick = "/v1/completions", lambda e: e["choices"][0]["text"] if e.get("choices") else ""
    elif kind == "v2":
        body = {"text_input": prompt, "parameters": greedy}
        url, pick = "/v2/models/tiny/generate_stream", lambda e: e.get("text_output", "")
    else:
        body = {"model": "tiny", "prompt": prompt, "stream": True, **greedy}
        url, pick = "/api/v1/generate", lambda e: e.get("token", "")
    if kind == "whole":  # not streamed
        reply = await http.post("/api/v1/generate", json={**body, "stream": False})
        assert reply.status_code == 200, reply.text
        return str(reply.json()["text"])
    text, last = [], time.perf_counter()
    got[(kind, i)] = 0
    async with http.stream("POST", url, json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(pick(event))
            got[(kind, i)] += 1
            now = time.perf_counter()
            gaps[(kind, i)] = max(gaps.get((kind, i), 0.0), now - last)
            last = now
    return "".join(text)


@pytest.mark.slow
def test_a_replica_killed_under_32_streams_fails_none(tmp_path: Path):
    folder = build_tiny_gpt2(tmp_path / "src" / "tiny", n_positions=512)
    push_folder(tmp_path, "tiny", folder, batching={"replicas": 2})
    with served(tmp_path, workers=2) as server:
        deadline = time.monotonic() + 60
        while len(pids := _ready_pids(server)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        kinds = ["v1", "openai", "v2", "whole"] * 8

        async def scenario() -> tuple[list[str], list[str], dict]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
                # uninterrupted, one replica or the other: the reference
                want = await asyncio.gather(
                    *(_stream(http, k, i, {}, {}) for i, k in enumerate(kinds))
                )
                got: dict = {}
                gaps: dict = {}
                tasks = [
                    asyncio.create_task(_stream(http, k, i, got, gaps)) for i, k in enumerate(kinds)
                ]
                until = time.monotonic() + 30
                while len(got) < 24 or min(got.values()) < 3:  # every stream under way
                    assert time.monotonic() < until, got
                    await asyncio.sleep(0.005)
                os.kill(pids[0], signal.SIGKILL)
                texts = await asyncio.gather(*tasks)
                return want, texts, gaps

        want, texts, gaps = asyncio.run(scenario())
        for i, (a, b) in enumerate(zip(want, texts, strict=True)):
            assert a == b, (i, kinds[i], a[:80], b[:80])
        deadline = time.monotonic() + 10
        while _resumed(server) == 0:  # gateways ship their counters every moment
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert max(gaps.values()) < 10, max(gaps.values())  # bench/stream_resume.py measures it


def _resumed(server) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith("inferd_generations_resumed_total "):
            return float(line.split()[-1])
    return 0.0


def _ready_pids(server) -> list[int]:
    version = server.client.get("/api/v1/models/tiny").json()["versions"][0]
    return [r["pid"] for r in version["replicas"] if r["state"] == "ready"]
