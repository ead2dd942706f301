"""Structured outputs in inferd's own engine (llguidance token masks), chat templates,
and the OpenAI tool-calling plan, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import validate

from inferd.api import structured
from inferd.config import LLMConfig
from inferd.errors import InvalidInput
from inferd.llm.chat import ChatTemplate
from inferd.llm.engine import LLMEngine
from inferd.llm.loader import engine_for
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    folder = build_tiny_gpt2(tmp_path_factory.mktemp("tiny") / "tiny")
    return engine_for(folder, 1, LLMConfig(kv_cache_mb=16))


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple[str, str]]:
    texts: dict[str, str] = {}
    done: dict[str, tuple[str, str]] = {}
    for rid, params in requests.items():
        engine.add_request(rid, "The server", params)
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                done[out.request_id] = (texts[out.request_id], str(out.finish_reason))
    return done


def test_guided_and_free_sequences_share_a_batch(engine: LLMEngine):
    free = SamplingParams(max_tokens=16, temperature=0)
    alone = run(engine, {"alone": free})["alone"]
    guided = {
        f"g{seed}": SamplingParams(
            max_tokens=80, temperature=1.0, seed=seed, guide={"json": PERSON}
        )
        for seed in range(6)
    }
    done = run(engine, {**guided, "free": free, "object": SamplingParams(
        max_tokens=40, temperature=0, guide={"json_object": True})})  # fmt: skip
    assert done["free"] == alone  # the masks touch only their own rows
    parsed = 0
    for rid in guided:
        text, reason = done[rid]
        assert text.startswith('{"name":"'), text
        if reason == "stop":  # a random model may write digits until max_tokens
            validate(json.loads(text), PERSON)
            parsed += 1
    assert parsed >= 3, done
    text, reason = done["object"]
    assert reason == "stop" and isinstance(json.loads(text), dict)


def test_a_cut_constrained_output_finishes_with_length(engine: LLMEngine):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    text, reason = run(engine, {"cut": SamplingParams(max_tokens=3, guide={"json": schema})})["cut"]
    assert reason == "length" and text.startswith("{")


def test_schemas_the_backend_cannot_compile_are_refused(engine: LLMEngine):
    lookahead = {"type": "string", "pattern": "(?=a)b"}
    with pytest.raises(ValueError, match="look-around"):
        engine.add_request("bad", "x", SamplingParams(guide={"json": lookahead}))
    assert "bad" not in engine.requests


def test_chat_templates_render_as_transformers_does(tmp_path: Path):
    from transformers import AutoTokenizer

    from inferd.demo.decoders import random_decoder

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    for family in ("qwen2", "llama"):
        folder = random_decoder(tmp_path, family, vocab=600)
        hf = AutoTokenizer.from_pretrained(folder)
        ours = ChatTemplate.load(folder)
        for with_tools in (None, tools):
            expected = hf.apply_chat_template(
                messages, tools=with_tools, tokenize=False, add_generation_prompt=True
            )
            assert ours.render(messages, with_tools) == expected


def test_plain_transcript_and_template_refusals():
    plain = ChatTemplate(None)
    assert plain.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    strict = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(InvalidInput, match="no system messages"):
        strict.render([{"role": "system", "content": "x"}])


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_choice_plans():
    auto = structured.plan({"tools": [WEATHER]})
    assert auto.parse_calls and auto.guide is None and auto.tools
    none = structured.plan({"tools": [WEATHER], "tool_choice": "none"})
    assert not none.tools and not none.parse_calls
    required = structured.plan({"tools": [WEATHER], "tool_choice": "required"})
    assert required.forced and required.guide is not None
    assert required.guide["json"]["type"] == "array"
    single = structured.plan(
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert single.guide is not None and single.guide["json"]["properties"]["name"] == {
        "const": "weather"
    }
    with pytest.raises(InvalidInput, match="not both"):
        structured.plan({"tools": [WEATHER], "tool_choice": "required",
                         "response_format": {"type": "json_object"}})  # fmt: skip


def test_tool_calls_are_read_from_text():
    content, calls = structured.parse_calls(
        'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>',
        frozenset({"weather"}),
    )
    assert content == "Let me look." and calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    text = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert structured.parse_calls(text, frozenset({"weather"})) == (text, [])
    forced = structured.forced_calls('[{"name": "weather", "arguments": {"city": "Rome"}}]')
    assert forced is not None and forced[0]["id"].startswith("call_")
    assert structured.forced_calls('{"name": "weather", "argum') is None


def test_streamed_answers_hold_back_what_may_be_a_call():
    watch = structured.StreamedCalls(structured.plan({"tools": [WEATHER]}))
    pieces = ["Sure", ". <tool", '_call>{"name": "weather"', ', "arguments": {}}']
    sent = [watch.feed(piece) for piece in pieces]
    assert sent == ["Sure", ". ", "", ""]
    rest, calls, reason = watch.finish("stop")
    assert rest == "" and reason == "tool_calls" and calls[0]["function"]["name"] == "weather"
    plain = structured.StreamedCalls(structured.plan({"tools": [WEATHER]}))
    assert plain.feed("a <b") == "a <b"
    assert plain.feed(" <too") == " "
    assert plain.finish("stop") == ("<too", [], "stop")


def test_an_output_complete_on_its_last_allowed_token_finishes_with_stop(engine: LLMEngine):
    guide = {"json": {"enum": ["yes", "no"]}}
    ids: list[int] = []
    engine.add_request("full", "The server", SamplingParams(max_tokens=20, guide=guide))
    while engine.has_work():
        ids += [out.token_id for out in engine.step() if out.token_id is not None]
    text, reason = run(engine, {"exact": SamplingParams(max_tokens=len(ids), guide=guide)})["exact"]
    assert reason == "stop" and json.loads(text) in ("yes", "no")
