"""Generation against the real server with the result cache on and token caps set:
deterministic generations (greedy or seeded) are answered from the cache, sampled ones
never; prompts over ``llm.max_prompt_tokens`` get 413, ``max_tokens`` over
``llm.max_tokens_limit`` 422."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from inferd.routing.cache import deterministic, generation_key
from inferd.shapes.llm import SamplingParams as S
from tests.conftest import InferdServer, build_tiny_gpt2, push_folder

PROMPT = "The cache answers"


def test_only_deterministic_generations_have_keys_and_keys_name_everything():
    assert deterministic(S(temperature=0.0)) and deterministic(S(top_k=1))
    assert deterministic(S(temperature=0.9, seed=7))
    assert not deterministic(S()) and not deterministic(S(temperature=0.5))
    key = generation_key("m", "v1", "abc", None, "hi", S(max_tokens=4))
    assert key == generation_key("m", "v1", "abc", None, "hi", S(max_tokens=4))
    for other in (
        generation_key("m", "v1", "abd", None, "hi", S(max_tokens=4)),  # new artifact
        generation_key("m", "v1", "abc", "sql", "hi", S(max_tokens=4)),  # an adapter
        generation_key("m", "v2", "abc", None, "hi", S(max_tokens=4)),
        generation_key("m", "v1", "abc", None, "hi", S(max_tokens=5)),
        generation_key("m", "v1", "abc", None, [1, 2], S(max_tokens=4)),
    ):
        assert other != key


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("genlimits")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    env = {
        "INFERD_CACHE__ENABLED": "true",
        "INFERD_LLM__MAX_PROMPT_TOKENS": "24",
        "INFERD_LLM__MAX_TOKENS_LIMIT": "64",
        "INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2",
    }
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _generate(llm: InferdServer, **body: object):
    return llm.client.post("/api/v1/models/tiny/generate", json={"prompt": PROMPT, **body})


@pytest.mark.slow
def test_deterministic_generations_come_from_the_cache(llm: InferdServer):
    first = _generate(llm, max_tokens=12, temperature=0)
    second = _generate(llm, max_tokens=12, temperature=0)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    assert second.json()["text"] == first.json()["text"]
    assert second.json()["usage"] == first.json()["usage"]
    assert second.json()["finish_reason"] == first.json()["finish_reason"]
    # another length is another answer
    assert _generate(llm, max_tokens=11, temperature=0).headers["x-cache"] == "miss"
    # streamed: the hit is replayed as one chunk, then the finish event
    with llm.client.stream(
        "POST",
        "/api/v1/models/tiny/generate",
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True},
    ) as stream:
        assert stream.headers["x-cache"] == "hit"
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert "".join(e.get("token", "") for e in events) == first.json()["text"]
    assert events[-1]["usage"] == first.json()["usage"]
    # seeded sampling is deterministic: cached; sampling without a seed never is
    seeded = [_generate(llm, max_tokens=8, temperature=0.9, seed=3) for _ in range(2)]
    assert [r.headers["x-cache"] for r in seeded] == ["miss", "hit"]
    assert seeded[0].json()["text"] == seeded[1].json()["text"]
    sampled = [_generate(llm, max_tokens=8, temperature=0.9) for _ in range(2)]
    assert all(r.status_code == 200 and "x-cache" not in r.headers for r in sampled)
    # the OpenAI API shares the entries (same model, prompt and parameters)
    openai = llm.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
    )
    assert openai.headers["x-cache"] == "hit"
    assert openai.json()["choices"][0]["text"] == first.json()["text"]
    # the inference log says which generations were hits
    rid = second.headers["x-request-id"]
    deadline = time.monotonic() + 10
    rows: list = []
    while not rows and time.monotonic() < deadline:
        rows = llm.client.get("/api/v1/logs", params={"request_id": rid}).json()["logs"]
        time.sleep(0.2)
    assert rows and rows[0]["cache_hit"] is True and rows[0]["completion_tokens"] > 0


@pytest.mark.slow
def test_prompt_and_max_tokens_caps(llm: InferdServer):
    long_prompt = " ".join(["word"] * 60)
    too_long = _generate(llm, prompt=long_prompt, max_tokens=4, temperature=0)
    assert too_long.status_code == 413, too_long.text
    assert "llm.max_prompt_tokens" in too_long.json()["error"]["message"]
    too_many = _generate(llm, max_tokens=65)
    assert too_many.status_code == 422
    assert "limit of 64" in too_many.json()["error"]["message"]
    openai = llm.client.post(
        "/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 4}
    )
    error = openai.json()["error"]  # OpenAI's answer to a prompt too long
    assert openai.status_code == 400 and error["code"] == "context_length_exceeded", error
    assert too_long.json()["error"]["code"] == "prompt_too_long"
    # a refused prompt is not left in flight (it would hold up every drain for its grace)
    inflight = [
        line
        for line in llm.client.get("/metrics").text.splitlines()
        if line.startswith("inferd_inflight_requests{") and 'model="tiny"' in line
    ]
    assert inflight and all(line.endswith(" 0") for line in inflight), inflight
    assert _generate(llm, max_tokens=64, temperature=0.5).status_code == 200
    assert _generate(llm, max_tokens=4, priority="low").status_code == 200
    urgent = _generate(llm, max_tokens=4, priority="urgent")
    assert urgent.status_code == 422 and "'priority'" in urgent.json()["error"]["message"]
