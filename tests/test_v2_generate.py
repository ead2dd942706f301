"""The Open Inference Protocol's generate extension on the in-process tier: a tiny GPT-2
and a non-generative model, compared with ``/api/v1`` generate for the same request. A
client hanging up mid-stream needs a socket: that test is in ``test_generation_server``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import orjson
import pytest

from inferd.api.generate import sse_response
from inferd.api.v2_generate import error_event, stream_events
from inferd.errors import ModelNotReady
from inferd.shapes import replica as p
from tests.conftest import build_tiny_gpt2, push_folder
from tests.inprocess import InProcessServer
from tests.test_generation_server import hf_greedy, sse_events

pytestmark = pytest.mark.slow
PROMPT = "The server answers"
MODELS = Path(__file__).parent / "models"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
               "prompt_lookup_min": 1}  # fmt: skip
"""The version metadata of ``tiny-spec``: the same model with prompt-lookup speculation."""


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    data = tmp_path_factory.mktemp("v2-generate")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    push_folder(data, "tiny-spec", folder, "v1", speculative=SPECULATIVE)
    push_folder(data, "slow_sum", MODELS / "slow_sum", "v1")
    server = InProcessServer(data)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        server.stop()


def v1_text(server: InProcessServer, **params: object) -> str:
    reply = server.client.post("/api/v1/models/tiny/generate", json={"prompt": PROMPT, **params})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["text"])


def test_server_metadata_lists_the_extension(llm: InProcessServer):
    assert "generate" in llm.client.get("/v2").json()["extensions"]


def test_generate_answers_what_v1_generate_answers(llm: InProcessServer):
    body = {"text_input": PROMPT, "parameters": GREEDY, "id": "g-1"}
    reply = llm.client.post("/v2/models/tiny/generate", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["text_output"] == v1_text(llm, **GREEDY)
    assert (out["model_name"], out["model_version"], out["id"]) == ("tiny", "v1", "g-1")
    assert out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12 and out["usage"]["prompt_tokens"] > 0
    assert out["usage"]["total_tokens"] == 12 + out["usage"]["prompt_tokens"]
    pinned = llm.client.post("/v2/models/tiny/versions/v1/generate", json=body).json()
    assert pinned["text_output"] == out["text_output"]


def test_parameters_at_the_top_level_and_parameters_win(llm: InProcessServer):
    top = llm.client.post("/v2/models/tiny/generate", json={"text_input": PROMPT, **GREEDY})
    assert top.status_code == 200, top.text
    assert top.json()["usage"]["completion_tokens"] == 12
    assert "id" not in top.json()
    both = {"text_input": PROMPT, **GREEDY, "parameters": {"max_tokens": 3}}
    reply = llm.client.post("/v2/models/tiny/generate", json=both).json()
    assert reply["usage"]["completion_tokens"] == 3
    assert reply["text_output"] == v1_text(llm, **{**GREEDY, "max_tokens": 3})


def test_generate_stream_events_add_up_to_the_same_text(llm: InProcessServer):
    body = {"text_input": PROMPT, "parameters": GREEDY, "id": "s-1"}
    with llm.client.stream("POST", "/v2/models/tiny/versions/v1/generate_stream", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert len(events) >= 2
    assert all(
        (e["model_name"], e["model_version"], e["id"]) == ("tiny", "v1", "s-1") for e in events
    )
    assert "".join(e["text_output"] for e in events) == v1_text(llm, **GREEDY)
    assert all("finish_reason" not in e for e in events[:-1])
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"parameters": {"max_tokens": 2}}, "text_input"),
        ({"text_input": ""}, "text_input"),
        ({"text_input": ["a", "b"]}, "text_input"),
        ({"text_input": PROMPT, "parameters": [1]}, "parameters"),
        ({"text_input": PROMPT, "parameters": {"max_tokens": 0}}, "max_tokens"),
        ({"text_input": PROMPT, "parameters": {"max_tokens": "8"}}, "max_tokens"),
        ({"text_input": PROMPT, "max_tokens": 10**9}, "max_tokens"),
        ({"text_input": PROMPT, "parameters": {"temperature": 9}}, "temperature"),
        ({"text_input": PROMPT, "parameters": {"stop": [""]}}, "stop"),
        ({"text_input": PROMPT, "id": 7}, "id"),
        ([PROMPT], "JSON object"),
    ],
)
def test_bad_requests_are_400_before_any_event(
    llm: InProcessServer, route: str, body: object, says: str
):
    reply = llm.client.post(f"/v2/models/tiny/{route}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.headers["content-type"] == "application/json"
    assert says in reply.json()["error"]


def test_a_prompt_over_the_context_is_413(llm: InProcessServer):
    for route in ("generate", "generate_stream"):
        body = {"text_input": "word " * 200, "parameters": {"max_tokens": 4}}
        reply = llm.client.post(f"/v2/models/tiny/{route}", json=body)
        assert reply.status_code == 413, reply.text
        assert "context" in reply.json()["error"]


def test_unknown_model_or_version_is_404(llm: InProcessServer):
    for path in ("/v2/models/nope/generate", "/v2/models/tiny/versions/v9/generate_stream"):
        reply = llm.client.post(path, json={"text_input": PROMPT})
        assert reply.status_code == 404, reply.text
        assert "nope" in reply.json()["error"] or "v9" in reply.json()["error"]


def test_a_model_that_does_not_generate_is_400(llm: InProcessServer):
    for route in ("generate", "generate_stream"):
        reply = llm.client.post(f"/v2/models/slow_sum/{route}", json={"text_input": PROMPT})
        assert reply.status_code == 400, reply.text
        assert "does not generate text" in reply.json()["error"]


def test_an_error_after_the_first_token_is_the_last_event():
    closed = []

    async def chunks() -> AsyncGenerator[p.TokenChunk, None]:
        try:
            yield p.TokenChunk(1, "Hello", [5])
            raise ModelNotReady("the replica went away")
        finally:
            closed.append(True)

    async def body() -> list[bytes]:
        head = {"model_name": "tiny", "model_version": "v1"}
        response = sse_response(chunks(), stream_events(head), error_event, {})
        return [bytes(part) async for part in response.body_iterator]  # type: ignore[arg-type]

    parts = asyncio.run(body())
    assert [orjson.loads(part.removeprefix(b"data: ")) for part in parts] == [
        {"model_name": "tiny", "model_version": "v1", "text_output": "Hello"},
        {"error": "the replica went away"},
    ]
    assert closed == [True]


def test_speculative_decoding_gives_the_same_text_and_counts_its_guesses(llm: InProcessServer):
    """``tiny-spec`` (the same weights, metadata ``speculative``) answers greedy requests
    with exactly ``tiny``'s text, on the v1, V2 and OpenAI routes, streamed or not; its
    replica's guesses and their acceptance are in ``/metrics``."""
    prompt = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = {}
    for model in ("tiny", "tiny-spec"):
        reply = llm.client.post(f"/api/v1/models/{model}/generate", json=body)
        assert reply.status_code == 200, reply.text
        texts[model] = reply.json()["text"]
        v2 = {"text_input": prompt, "parameters": {k: v for k, v in body.items() if k != "prompt"}}
        reply = llm.client.post(f"/v2/models/{model}/generate", json=v2)
        assert reply.status_code == 200, reply.text
        assert reply.json()["text_output"] == texts[model]
        openai = {"model": model, "stream": True, **body}
        with llm.client.stream("POST", "/v1/completions", json=openai) as streamed:
            assert streamed.status_code == 200
            text = "".join(e["choices"][0]["text"] for e in sse_events(streamed) if e["choices"])
        assert text == texts[model]
    want = hf_greedy(llm.data_dir / "src" / "tiny", prompt, 24, min_new_tokens=24)
    assert texts["tiny-spec"] == texts["tiny"] == want
    counts: dict[str, float] = {}
    for line in llm.client.get("/metrics").text.splitlines():
        if line.startswith("inferd_spec_decode_") and 'model="tiny-spec"' in line:
            name = line.split("{")[0]
            counts[name] = counts.get(name, 0) + float(line.split()[-1])
    drafted = counts["inferd_spec_decode_draft_tokens_total"]
    assert 0 < counts["inferd_spec_decode_accepted_tokens_total"] <= drafted
