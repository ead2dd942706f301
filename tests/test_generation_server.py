"""Generation: a GPT-2 served by the gateway, inferd SSE and OpenAI APIs.

The routes run on the in-process tier (:class:`tests.inprocess.InProcessServer`); what
needs a process boundary stays end to end on ``llm_e2e`` or a server of its own: gRPC,
a client that hangs up on a socket mid-stream, concurrent bursts and first-byte timings.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import InferdServer, build_tiny_gpt2, push_folder, run_cli
from tests.inprocess import InProcessServer

pytestmark = pytest.mark.slow
PROMPT = "The server answers"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    data = tmp_path_factory.mktemp("llm")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    server = InProcessServer(data)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def llm_e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    """The same model served by ``inferd serve``: for gRPC and clients that hang up on
    a socket."""
    data = tmp_path_factory.mktemp("llm-e2e")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    server = InferdServer(data, workers=2)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def hf_greedy(folder: Path, prompt: str, max_new_tokens: int, **options) -> str:
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        attention_mask=torch.ones_like(ids),
        pad_token_id=model.config.eos_token_id,
        **options,
    )
    return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_greedy_generation_matches_hugging_face(llm: InProcessServer):
    folder = llm.data_dir / "src" / "tiny"
    expected = hf_greedy(folder, PROMPT, 20)
    reply = llm.client.post(
        "/api/v1/models/tiny/generate", json={"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["text"] == expected
    assert body["usage"]["completion_tokens"] <= 20 and body["usage"]["prompt_tokens"] > 0
    assert body["finish_reason"] in ("length", "stop")


def test_vllm_sampling_extensions_are_taken_and_match_hugging_face(llm: InProcessServer):
    """What vLLM's clients send (its benchmark client: ``repetition_penalty: 1.0`` with
    every request) is the same request as without it; a real penalty gives Hugging
    Face's output with the same penalty; vLLM-only fields at their defaults pass."""
    folder = llm.data_dir / "src" / "tiny"
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = llm.client.post("/v1/completions", json=base)
    assert plain.status_code == 200, plain.text
    vllm_defaults = {
        "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "top_k": -1,
        "skip_special_tokens": True, "include_stop_str_in_output": False,
        "use_beam_search": False, "length_penalty": 1.0, "add_special_tokens": True,
        "spaces_between_special_tokens": True, "stop_token_ids": [], "logprobs": None,
    }  # fmt: skip
    same = llm.client.post("/v1/completions", json={**base, **vllm_defaults})
    assert same.status_code == 200, same.text
    assert same.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    penalized = llm.client.post("/v1/completions", json={**base, "repetition_penalty": 1.5})
    assert penalized.status_code == 200, penalized.text
    expected = hf_greedy(folder, PROMPT, 16, repetition_penalty=1.5)
    assert penalized.json()["choices"][0]["text"] == expected
    assert expected != plain.json()["choices"][0]["text"]
    refused = llm.client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [USER], "spaces_between_special_tokens": False},
    )
    assert refused.status_code == 400, refused.text
    assert "spaces_between_special_tokens" in refused.json()["error"]["message"]


def test_sse_stream_framing(llm: InProcessServer):
    with llm.client.stream(
        "POST",
        "/api/v1/generate",
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 12,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        },
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = sse_events(reply)
    tokens = [e["token"] for e in events if "token" in e]
    final = events[-1]
    assert final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 12
    assert 1 <= len(tokens) <= 12
    whole = llm.client.post(
        "/api/v1/models/tiny/generate",
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    ).json()
    assert "".join(tokens) == whole["text"]


def test_openai_client_completions_and_chat(llm: InProcessServer):
    import openai

    client = openai.OpenAI(base_url=f"{llm.url}/v1", api_key="unused", http_client=llm.client)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.object == "text_completion"
    assert done.choices[0].text == hf_greedy(llm.data_dir / "src" / "tiny", PROMPT, 8)
    assert done.usage is not None and done.usage.completion_tokens <= 8
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6
    )
    assert chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    assert any(c.choices and c.choices[0].finish_reason for c in streamed)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # OpenAI's status for invalid requests
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def _running(llm: InferdServer) -> float:
    detail = llm.client.get("/api/v1/models/tiny").json()
    return detail["versions"][0]["replicas"][0]["stats"]["running"]


def _grpc_generate(
    server: InferdServer, prompt: str, sampling: dict | None = None, **parameters
) -> list:
    """Responses of one ModelStreamInfer generation with Triton's client, to the final one;
    ``sampling`` goes as a ``sampling_parameters`` JSON input (Triton's vLLM backend)."""
    import queue

    import numpy as np
    import tritonclient.grpc as triton

    results: queue.Queue = queue.Queue()
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    inputs = [text]
    if sampling is not None:
        options = triton.InferInput("sampling_parameters", [1], "BYTES")
        options.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
        inputs.append(options)
    responses = []
    with triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tiny", inputs, request_id="g1", parameters=parameters)
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                client.stop_stream()
                return [error]
            responses.append(result)
            params = result.get_response().parameters
            if "triton_final_response" in params:
                break
        client.stop_stream()
    return responses


def test_grpc_stream_generation_matches_the_rest_api(llm_e2e: InferdServer):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    rest = llm_e2e.client.post("/api/v1/models/tiny/generate", json=body).json()
    responses = _grpc_generate(llm_e2e, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    chunks = [r.as_numpy("text_output")[0].decode() for r in responses]
    assert len(chunks) > 1  # streamed, not one reply
    assert "".join(chunks) == rest["text"]
    final = responses[-1].get_response()
    assert final.id == "g1" and final.model_name == "tiny"
    assert final.parameters["finish_reason"].string_param == "length"
    assert final.parameters["completion_tokens"].int64_param == 12
    error = _grpc_generate(llm_e2e, PROMPT, max_tokens=0)[0]
    assert "max_tokens" in error.message()
    vllm_style = _grpc_generate(llm_e2e, PROMPT, {"max_tokens": 5, "temperature": 0.0})
    assert vllm_style[-1].get_response().parameters["completion_tokens"].int64_param == 5


def _leave_early(llm: InferdServer, body: dict, request_id: str | None = None) -> None:
    """Stream a 100-token generation of ``body`` and hang up after its first events."""
    headers = {"x-request-id": request_id} if request_id else {}
    with (
        httpx.Client(base_url=llm.url, timeout=30) as c,
        c.stream(
            "POST",
            "/api/v1/models/tiny/generate",
            json={**body, "max_tokens": 100, "stream": True},
            headers=headers,
        ) as r,
    ):
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break


def test_client_disconnect_cancels_the_sequence(llm_e2e: InferdServer):
    _leave_early(llm_e2e, {"prompt": PROMPT, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while _running(llm_e2e) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(llm_e2e) == 0


def test_v2_client_disconnect_cancels_the_sequence(llm_e2e: InferdServer):
    """The Open Inference Protocol's generate_stream (``test_v2_generate``) likewise."""
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 100, "ignore_eos": True}}
    with (
        httpx.Client(base_url=llm_e2e.url, timeout=30) as c,
        c.stream("POST", "/v2/models/tiny/generate_stream", json=body) as r,
    ):
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    llm_e2e.wait_for(
        lambda: _running(llm_e2e) == 0, timeout_s=10, what="the sequence to be cancelled"
    )


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"prompt": "word " * 200, "max_tokens": 4}, 413, "context"),
        ({"prompt": PROMPT, "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 10**9}, 422, "max_tokens"),
        ({"prompt": PROMPT, "temperature": 9}, 422, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, 422, "top_p"),
        ({"prompt": ""}, 422, "prompt"),
        ({"prompt": PROMPT, "adapter": "nope"}, 404, "nope"),
        ({"prompt": [1, 2, 10**6], "max_tokens": 2}, 422, "outside the vocabulary"),
        ({"prompt": [1, -5], "max_tokens": 2}, 422, "outside the vocabulary"),
    ],
)
def test_bad_generation_requests(llm: InProcessServer, body: dict, status: int, says: str):
    reply = llm.client.post("/api/v1/models/tiny/generate", json=body)
    assert reply.status_code == status, reply.text
    assert says in reply.json()["error"]["message"]


def test_replica_reports_generation_metrics(llm: InProcessServer):
    def metrics() -> dict:
        detail = llm.client.get("/api/v1/models/tiny").json()
        (replica,) = detail["versions"][0]["replicas"]
        return replica["metrics"]

    before = metrics()
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    assert llm.client.post("/api/v1/models/tiny/generate", json=body).status_code == 200
    after = metrics()
    assert after["ttft_s"]["count"] == before["ttft_s"]["count"] + 1
    assert after["itl_s"]["count"] == before["itl_s"]["count"] + 4
    assert after["generation_tokens_total"] == before["generation_tokens_total"] + 5
    assert after["finished"]["length"] == before["finished"].get("length", 0) + 1
    assert 0 < after["ttft_s"]["p50"] < 60  # seconds, from the request's arrival


def test_generations_are_in_the_inference_log(llm_e2e: InferdServer):
    """One row per generation, written when it ends: token counts when it finished,
    the error's status when it was refused, 499 when the client went away."""
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    done = llm_e2e.client.post("/api/v1/models/tiny/generate", json=body)
    chat = llm_e2e.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "user": "ann", "temperature": 0},
    )
    refused = llm_e2e.client.post("/api/v1/models/tiny/generate", json={**body, "max_tokens": 0})
    assert (done.status_code, chat.status_code, refused.status_code) == (200, 200, 422)
    _leave_early(llm_e2e, body, "gone-early")

    def row(rid: str) -> dict | None:
        rows = llm_e2e.client.get("/api/v1/logs", params={"request_id": rid}).json()["logs"]
        return rows[0] if rows else None

    rids = [
        done.headers["x-request-id"],
        chat.headers["x-request-id"],
        refused.json()["error"]["request_id"],
        "gone-early",
    ]
    try:
        llm_e2e.wait_for(lambda: all(row(r) for r in rids), timeout_s=15, what="the four rows")
    except AssertionError:
        raise AssertionError(
            f"missing {[r for r in rids if not row(r)]}; have "
            f"{llm_e2e.client.get('/api/v1/logs').json()}"
        ) from None
    first = row(done.headers["x-request-id"])
    assert first is not None and (first["api"], first["status_code"]) == ("v1", 200)
    assert (first["version"], first["completion_tokens"]) == ("v1", 4)
    assert first["prompt_tokens"] > 0
    openai = row(chat.headers["x-request-id"])
    assert openai is not None and openai["api"] == "openai" and openai["completion_tokens"] == 3
    assert openai["user_hash"] is not None
    bad = row(refused.json()["error"]["request_id"])
    assert bad is not None and bad["status_code"] == 422
    # A client that leaves mid-stream is logged 499. The tiny model can write its whole
    # stream into the socket's buffers before the gateway sees the close (seen under
    # parallel tests): that one is a complete 200, and the leaving is tried again.
    for attempt in range(6):
        rid = "gone-early" if attempt == 0 else f"gone-early-{attempt}"
        if attempt:
            _leave_early(llm_e2e, body, rid)
            llm_e2e.wait_for(lambda rid=rid: row(rid), timeout_s=15, what=f"the row of {rid}")
        gone = row(rid)
        assert gone is not None
        if gone["status_code"] == 499:
            break
        assert (gone["status_code"], gone["completion_tokens"]) == (200, 100), gone
    else:
        raise AssertionError("no early disconnect was logged 499 in 6 tries")


def test_predict_on_a_generative_model_says_use_generate(llm: InProcessServer):
    reply = llm.client.post("/api/v1/models/tiny/predict", json={"inputs": [{"prompt": "x"}]})
    assert reply.status_code == 422
    assert "generate" in reply.json()["error"]["message"]


def make_adapter(base: Path, out: Path, seed: int, targets: list[str]) -> Path:
    """A PEFT LoRA adapter of ``base`` (any causal LM folder) on ``targets``, with random
    B matrices so it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    gpt2 = model.config.model_type == "gpt2"  # its Conv1D layers store weights transposed
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=gpt2)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapter matter
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path, prompt: str, n: int) -> str:
    import torch
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), adapter).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_adapters_load_reload_unload_at_run_time(llm: InProcessServer, tmp_path: Path):
    base = llm.data_dir / "src" / "tiny"
    first = make_adapter(base, tmp_path / "a1", seed=1, targets=["c_attn"])
    second = make_adapter(base, tmp_path / "a2", seed=2, targets=["c_attn", "c_proj"])
    c = llm.client

    def gen(model: str) -> httpx.Response:
        return c.post(
            "/api/v1/generate",
            json={"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0},
        )

    loaded = c.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(first)})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["model"] == "tiny:mine"
    with_first = gen("tiny:mine").json()["text"]
    assert with_first == peft_greedy(base, first, PROMPT, 10)
    assert with_first != gen("tiny").json()["text"]
    # one batch mixing the base and the adapter still gives each its own output
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        mixed = list(pool.map(lambda m: gen(m).json()["text"], ["tiny", "tiny:mine"] * 3))
    assert mixed[1::2] == [with_first] * 3
    reloaded = c.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(second)})
    assert reloaded.status_code == 200
    assert gen("tiny:mine").json()["text"] == peft_greedy(base, second, PROMPT, 10)
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200
    gone = gen("tiny:mine")
    assert gone.status_code == 404 and "mine" in gone.json()["error"]["message"]
    missing = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert missing.status_code == 400


@pytest.fixture(scope="module")
def llm_with_registered_adapter(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[InProcessServer]:
    import shutil

    data = tmp_path_factory.mktemp("llm-adapter")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    make_adapter(folder, data / "src" / "style", seed=5, targets=["c_attn"])
    shutil.copytree(data / "src" / "style", folder / "adapters" / "style")
    run_cli(
        "models",
        "push",
        "tiny",
        str(folder),
        "--version",
        "v1",
        "--meta",
        'adapters={"tiny-style": "adapters/style"}',
        data_dir=data,
    )
    server = InProcessServer(data)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_registered_adapter_is_its_own_model_name(
    llm_with_registered_adapter: InProcessServer,
):
    server = llm_with_registered_adapter
    listed = server.client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None), ("tiny-style", "tiny")]
    src = server.data_dir / "src"
    reply = server.client.post(
        "/v1/completions",
        json={"model": "tiny-style", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == peft_greedy(src / "tiny", src / "style", PROMPT, 8)


def test_full_engine_queue_answers_503_with_retry_after(tmp_path: Path):
    folder = build_tiny_gpt2(tmp_path / "src" / "tiny")
    push_folder(tmp_path, "tiny", folder, "v1")
    env = {"INFERD_LLM__MAX_NUM_SEQS": "1", "INFERD_LLM__MAX_WAITING": "1"}
    server = InferdServer(tmp_path, workers=1, env=env)
    try:
        server.wait_ready(timeout_s=120)
        body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}

        async def burst() -> list[httpx.Response]:
            # all at once (not a thread pool's 8 at a time, which a busy machine spreads
            # out until each finds the one slot free)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                path = "/api/v1/models/tiny/generate"
                return list(await asyncio.gather(*(c.post(path, json=body) for _ in range(24))))

        replies = asyncio.run(burst())
        codes = sorted(r.status_code for r in replies)
        assert 200 in codes and 503 in codes, codes
        assert set(codes) <= {200, 503}
        refused = next(r for r in replies if r.status_code == 503)
        assert refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "overloaded"
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_queued_requests_wait_past_the_idle_timeout_then_get_503_at_the_queue_timeout(
    tmp_path: Path,
):
    """A request waiting for a sequence slot is not idle: it may wait longer than the
    gateway's request timeout (which counts between tokens) and completes; past the LLM
    queue timeout the replica gives up on it with 503 + Retry-After, never a 504."""
    import math
    from concurrent.futures import ThreadPoolExecutor

    folder = build_tiny_gpt2(tmp_path / "src" / "tiny")
    push_folder(tmp_path, "tiny", folder, "v1")
    idle_s, queue_s = 0.5, 2.0
    env = {
        "INFERD_LLM__MAX_NUM_SEQS": "1",
        "INFERD_REQUEST_TIMEOUT_S": str(idle_s),
        "INFERD_LLM__QUEUE_TIMEOUT_S": str(queue_s),
    }
    server = InferdServer(tmp_path, workers=1, env=env)
    body = {"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "temperature": 0}

    def first_byte(client: httpx.Client) -> tuple[int, float, dict]:
        started = time.perf_counter()
        with client.stream(
            "POST", "/api/v1/models/tiny/generate", json={**body, "stream": True}
        ) as reply:
            waited = time.perf_counter() - started
            reply.read()
            error = reply.json() if reply.status_code != 200 else {}
        return reply.status_code, waited, error

    try:
        server.wait_ready(timeout_s=120)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            durations = []  # one request alone, start to finish: the fastest of 3
            for _ in range(3):  # (the first is slower: connection, cold caches)
                started = time.perf_counter()
                assert first_byte(client)[0] == 200
                durations.append(time.perf_counter() - started)
            one = min(durations)
            # Request k waits about k * one: enough of them that some wait between the
            # two timeouts and some beyond the queue timeout, whatever this machine's speed.
            count = min(200, math.ceil((queue_s + 1.0) / one) + 2)
            with ThreadPoolExecutor(count) as pool:
                replies = list(pool.map(lambda _: first_byte(client), range(count)))
        codes = {code for code, _, _ in replies}
        assert codes <= {200, 503}, replies
        assert any(code == 200 and waited > idle_s for code, waited, _ in replies), replies
        refused = [error for code, _, error in replies if code == 503]
        assert refused, replies
        assert refused[0]["error"]["code"] == "overloaded"
        assert "queue timeout" in refused[0]["error"]["message"]
    finally:
        assert server.stop() == 0, server.log()[-3000:]


USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": "hi"}, "messages", "non-empty list of messages"),
        ({"messages": []}, "messages", "non-empty list of messages"),
        ({"messages": ["hi"]}, "messages.[0]", "must be an object"),
        ({"messages": [{"content": "hi"}]}, "messages.[0].role", "must be one of"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.[0].role",
         "'system', 'developer', 'user', 'assistant', 'tool', not 'function'"),
        ({"messages": [{**USER, "foo": 1}]}, "messages.[0].foo", "unknown field 'foo'"),
        ({"messages": [USER, {"role": "user"}]}, "messages.[1].content", "a string or a non"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages.[0].content", "a string"),
        ({"messages": [{"role": "user", "content": []}]}, "messages.[0].content", "non-empty"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]},
         "messages.[0].content.[0].type", "content part with a 'type'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.[0].content.[0].text", "must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
         "messages.[0].content.[0].y", "unknown field 'y' in a text part"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
         "messages.[0].content.[0]", "image_url parts are not supported"),
        ({"messages": [{"role": "system", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
         "messages.[0].content.[0].type", "a system message takes no 'image_url' parts"),
        ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
         "messages.[0].content.[0].type", "a user message takes no 'refusal' parts"),
        ({"messages": [USER, {"role": "tool", "content": "42"}]}, "messages.[1].tool_call_id",
         "must be a string"),
        ({"messages": [USER, {"role": "assistant"}]}, "messages.[1].content", "a string or"),
        ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]},
         "messages.[1].tool_calls.[0]", "'type': 'function'"),
        ({"messages": [{**USER, "name": 3}]}, "messages.[0].name", "non-empty string"),
        ({"messages": [USER], "foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        ({"messages": [USER], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "objekt"}}}]},
         "tools.[0].function.parameters", "not a valid JSON Schema"),
        ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f g"}}]},
         "tools.[0].function.name", "letters, digits"),
        ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice.function.name", "not among the tools"),
        ({"messages": [USER], "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "required": "a"}}}},
         "response_format.json_schema.schema", "not a valid JSON Schema"),
        ({"messages": [USER], "response_format": {"type": "yaml"}}, "response_format.type",
         "text, json_object or json_schema"),
        ({"messages": [USER], "functions": [{"name": "f"}]}, "functions", "use 'tools'"),
        ({"messages": [USER], "n": 2}, "n", "one choice per request"),
        ({"messages": [USER], "logit_bias": {"5": 10}}, "logit_bias", "not supported"),
        ({"messages": [USER], "presence_penalty": 3}, "presence_penalty", "from -2 to 2"),
        ({"messages": [USER], "use_beam_search": True}, "use_beam_search", "not supported"),
        ({"messages": [USER], "length_penalty": 2}, "length_penalty", "not supported"),
        ({"messages": [USER], "add_special_tokens": True}, "add_special_tokens",
         "not supported"),
        ({"messages": [USER], "repetition_penalty": 0}, "repetition_penalty", "(0, 10]"),
        ({"messages": [USER], "min_tokens": 5, "max_tokens": 2}, "min_tokens", "above"),
        ({"messages": [USER], "top_logprobs": 3}, "top_logprobs", "not supported"),
        ({"messages": [USER], "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens",
         "not both"),
    ],
)  # fmt: skip
def test_chat_requests_are_checked_against_the_openai_reference(
    llm: InProcessServer, body: dict, param: str, says: str
):
    reply = llm.client.post("/v1/chat/completions", json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert says in error["message"], error
    assert_chat_works(llm)


def assert_chat_works(llm: InProcessServer) -> None:
    ok = llm.client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [USER], "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def test_chat_messages_of_every_role_and_part(llm: InProcessServer):
    import openai

    client = openai.OpenAI(base_url=f"{llm.url}/v1", api_key="unused", http_client=llm.client)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "You are a server."}]},
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "1 and 2."}],
            },
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "user", "content": "Again?"},
        ],
        max_completion_tokens=3,
        response_format={"type": "text"},
        temperature=0,
        extra_body={"top_k": 5, "ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "bot", "content": "x"}], max_tokens=2
        )
    assert info.value.body["param"] == "messages.[0].role"
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        client.completions.create(model="tiny", prompt="x", extra_body={"foo": 1})
