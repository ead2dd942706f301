"""Chat templates, structured outputs and tool calls with inferd's own engine, served by
the real server (GPT-2 checkpoints; the vLLM engine has its own tests)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from jsonschema import validate

from inferd.demo.decoders import CHATML_TEMPLATE
from tests.conftest import InferdServer, build_tiny_gpt2, push_folder
from tests.test_generation_server import hf_greedy

pytestmark = pytest.mark.slow
SCORE = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": SCORE},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"enum": ["a", "b"]}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("structured")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    chatty = data / "src" / "chatty"
    shutil.copytree(folder, chatty)
    (chatty / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    push_folder(data, "chatty", chatty, "v1")
    server = InferdServer(data)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: InferdServer) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused") as client:
        yield client


def test_a_gpt2_with_a_chat_template_is_prompted_with_it(server: InferdServer, client: Any):
    from tokenizers import Tokenizer

    from inferd.llm.chat import ChatTemplate

    folder = server.data_dir / "src" / "chatty"
    messages = [{"role": "user", "content": "The server answers"}]
    rendered = ChatTemplate.load(folder).render(messages)
    assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("assistant\n")
    chat = client.chat.completions.create(
        model="chatty", messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    tokens = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(rendered).ids
    assert chat.usage.prompt_tokens == len(tokens)
    assert chat.choices[0].message.content == hf_greedy(folder, rendered, 6)
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    transcript = "user: The server answers\nassistant:"
    assert plain.choices[0].message.content == hf_greedy(folder, transcript, 6)


def test_json_schema_and_json_object(client: Any):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "ok?"}], max_tokens=40,
            response_format=fmt, temperature=1.0, seed=seed,
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ok?"}], max_tokens=40,
        response_format=fmt, temperature=0, stream=True,
    )  # fmt: skip
    validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)),
             SCHEMA)  # fmt: skip
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "?"}], max_tokens=60,
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    cut = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "?"}], max_tokens=2,
        response_format=fmt, temperature=0,
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "length"


def test_forced_tool_calls_with_inferds_engine(client: Any):
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "find a"}], tools=[LOOKUP],
            tool_choice=choice, parallel_tool_calls=False, max_tokens=40, temperature=0,
        )  # fmt: skip
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls", answer
        assert answer.message.content is None
        assert json.loads(answer.message.tool_calls[0].function.arguments)["key"] in ("a", "b")


def test_a_schema_the_backend_cannot_compile_is_a_400(server: InferdServer):
    reply = server.client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "a(?!b)"}}}}},
    })  # fmt: skip
    assert reply.status_code == 400, reply.text
    assert "look-around" in reply.json()["error"]["message"]
    # the engine still serves
    ok = server.client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                     "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200
