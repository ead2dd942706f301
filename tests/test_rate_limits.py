"""Rate limits: the token bucket itself, then the real server — the N+1-th request of a
burst gets 429 with Retry-After and X-RateLimit-* headers, per client and per model, in
process with one gateway process, and shared through the machine's real Redis by two;
gRPC calls draw from the same budget (RESOURCE_EXHAUSTED with the same figures as
trailing metadata); a generation token budget in debt refuses generations on every API."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from inferd.access.limits import LocalLimiter, RateLimits
from inferd.config import Limit, RateLimitConfig, TokenLimit
from inferd.errors import RateLimited
from inferd.shapes.replica import TokenChunk
from tests.conftest import (
    InferdServer,
    arithmetic_model,
    build_tiny_gpt2,
    push_folder,
    push_source,
)
from tests.inprocess import InProcessServer


def test_a_bucket_allows_its_burst_then_refills_at_its_rate():
    limiter, limit = LocalLimiter(), Limit(requests_per_s=2.0, burst=3)
    got = [limiter.take_now("k", limit, 100.0) for _ in range(4)]
    assert [ok for ok, _ in got] == [True, True, True, False]
    assert [left for _, left in got[:3]] == [2.0, 1.0, 0.0]
    assert limiter.take_now("k", limit, 100.4)[0] is False  # 0.8 of a token
    assert limiter.take_now("k", limit, 100.5)[0] is True  # one token after 0.5 s
    assert limiter.take_now("other", limit, 100.5) == (True, 2.0)  # its own bucket
    assert limiter.take_now("k", limit, 200.0) == (True, 2.0)  # full again, capped


def test_a_token_budget_admits_while_not_in_debt_and_charges_into_debt():
    limiter, budget = LocalLimiter(), TokenLimit(tokens_per_minute=60, burst=10)

    def admit(now: float) -> tuple[bool, float]:
        return limiter.take_now("t", budget, now, cost=0.0, need=0.0)

    assert admit(100.0) == (True, 10.0)  # admitting takes nothing
    assert limiter.take_now("t", budget, 100.0, cost=25.0, need=-math.inf) == (True, -15.0)
    assert admit(100.0) == (False, -15.0)
    assert admit(110.0) == (False, -5.0)  # 1 token/s repays the debt
    assert admit(115.0) == (True, 0.0)  # not in debt any more
    assert admit(1000.0) == (True, 10.0)  # full again, capped at the burst
    assert TokenLimit(tokens_per_minute=600).capacity == 600  # burst: one minute's worth


def test_a_generation_is_charged_what_it_made_even_when_closed_early():
    config = RateLimitConfig(tokens=TokenLimit(tokens_per_minute=60, burst=100))
    limits = RateLimits(config, LocalLimiter())
    tokens = config.tokens
    assert tokens is not None

    async def chunks() -> AsyncGenerator[TokenChunk, None]:
        for made in range(1, 300):  # counts are cumulative: 5 prompt tokens, then 1 more each
            yield TokenChunk(1, "x", [7], prompt_tokens=5, completion_tokens=made)

    async def run() -> None:
        budget = limits.budget("ip:10.0.0.1")
        assert budget is not None
        await budget.admit("tiny")
        stream = budget.charged(chunks(), "tiny")
        async with contextlib.aclosing(stream):  # the client reads 3 chunks, then goes away
            for _ in range(3):
                await anext(stream)
        _, left = await limits.limiter.take("tokens:ip:10.0.0.1", tokens, 0.0, 0.0)
        assert 92.0 <= left < 92.5  # 100 - (5 + 3), plus what refilled meanwhile
        async with contextlib.aclosing(budget.charged(chunks(), "tiny")) as whole:
            async for _ in whole:
                pass
        with pytest.raises(RateLimited) as info:  # 92 - (5 + 299): in debt by ~212
            await budget.admit("tiny")
        assert 210 <= int(info.value.headers()["Retry-After"]) <= 213
        assert info.value.headers()["X-RateLimit-Limit"] == "100"
        assert "100 tokens at once, 60 per minute" in info.value.message
        await limits.budget("ip:10.0.0.2").admit("tiny")  # another client's budget

    asyncio.run(run())


BODY = {"inputs": [{"x": 1.0}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("limits")
    for name in ("a", "b"):
        push_source(data, name, arithmetic_model("x"))
    return data


def _server(data: Path, workers: int, **env: str) -> InferdServer:
    limits = {
        "INFERD_RATE_LIMITS__DEFAULT__REQUESTS_PER_S": "0.01",  # no refill during a test
        "INFERD_RATE_LIMITS__DEFAULT__BURST": "8",
        "INFERD_RATE_LIMITS__MODELS": '{"b": {"requests_per_s": 0.01, "burst": 3}}',
    }
    server = InferdServer(data, workers=workers, env={**limits, **env})
    server.wait_ready()
    return server


@pytest.fixture
def one_gateway(data: Path) -> Iterator[InferdServer]:
    server = _server(data, workers=1)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture
def app(data: Path) -> Iterator[InProcessServer]:
    """The same limits on the in-process tier (the HTTP answers need no process)."""
    limits = {
        "default": {"requests_per_s": 0.01, "burst": 8},
        "models": {"b": {"requests_per_s": 0.01, "burst": 3}},
    }
    server = InProcessServer(data, rate_limits=limits)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_the_n_plus_first_request_gets_429_with_headers(app: InProcessServer):
    server = app
    replies = [server.client.post("/api/v1/models/a/predict", json=BODY) for _ in range(9)]
    assert [r.status_code for r in replies] == [200] * 8 + [429]
    first, last = replies[0], replies[-1]
    assert first.headers["x-ratelimit-limit"] == "8"
    assert first.headers["x-ratelimit-remaining"] == "7"
    assert int(first.headers["x-ratelimit-reset"]) > 0
    assert last.json()["error"]["code"] == "rate_limited"
    assert "8 requests at once" in last.json()["error"]["message"]
    assert int(last.headers["retry-after"]) >= 1 and last.headers["x-ratelimit-remaining"] == "0"
    assert server.client.get("/health/ready").status_code == 200  # never limited


def test_a_model_limit_applies_on_top_of_the_default(app: InProcessServer):
    server = app
    codes = [
        server.client.post("/api/v1/models/b/predict", json=BODY).status_code for _ in range(4)
    ]
    assert codes == [200, 200, 200, 429]  # b's own bucket of 3
    refused = server.client.post("/api/v1/models/b/predict", json=BODY)
    assert "for this model" in refused.json()["error"]["message"]
    assert server.client.post("/api/v1/models/a/predict", json=BODY).status_code == 200


@pytest.mark.slow
@pytest.mark.redis
def test_two_gateway_processes_share_one_redis_budget(data: Path, redis_url: str):
    import redis

    bucket = "inferd:rl:all:ip:127.0.0.1"  # this client's bucket for all routes
    redis.from_url(redis_url).delete(bucket)
    server = _server(data, workers=2, INFERD_REDIS_URL=redis_url)
    try:
        codes: Counter[int] = Counter()
        for _ in range(16):  # a new connection each: both gateway processes answer
            with httpx.Client(base_url=server.url, timeout=30) as client:
                codes[client.post("/api/v1/models/a/predict", json=BODY).status_code] += 1
        assert codes == Counter({200: 8, 429: 8}), codes
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        redis.from_url(redis_url).delete(bucket)


def _echo(model: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    return request


@pytest.fixture
def stub(one_gateway: InferdServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{one_gateway.grpc_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.slow
def test_grpc_calls_draw_from_the_http_budget(one_gateway: InferdServer, stub):
    server = one_gateway
    codes = [
        server.client.post("/api/v1/models/a/predict", json=BODY).status_code for _ in range(4)
    ]
    assert codes == [200] * 4
    left = []
    for _ in range(4):  # the other half of the same client's burst of 8
        _, call = stub.ModelInfer.with_call(_echo("a"))
        left.append(dict(call.trailing_metadata())["x-ratelimit-remaining"])
    assert left == ["3", "2", "1", "0"]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(_echo("a"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "8 requests at once" in info.value.details()
    assert "for all routes" in info.value.details()
    trailing = dict(info.value.trailing_metadata())
    assert int(trailing["retry-after"]) >= 1 and int(trailing["x-ratelimit-reset"]) > 0
    assert trailing["x-ratelimit-limit"] == "8" and trailing["x-ratelimit-remaining"] == "0"
    with pytest.raises(grpc.RpcError) as info:  # every RPC counts, not only inference
        stub.ServerMetadata(pb.ServerMetadataRequest())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.client.post("/api/v1/models/a/predict", json=BODY).status_code == 429
    assert stub.ServerLive(pb.ServerLiveRequest()).live  # probes are never limited
    assert stub.ServerReady(pb.ServerReadyRequest()).ready


@pytest.mark.slow
def test_a_model_limit_covers_the_grpc_calls_naming_it(one_gateway: InferdServer, stub):
    assert stub.ModelMetadata(pb.ModelMetadataRequest(name="b")).name == "b"
    assert stub.ModelReady(pb.ModelReadyRequest(name="b")).ready
    stub.ModelInfer(_echo("b"))  # b's bucket of 3 is spent
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(_echo("b"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "for this model" in info.value.details()
    (answer,) = stub.ModelStreamInfer(iter([_echo("b")]))  # each request of a stream counts
    assert "for this model" in answer.error_message
    assert one_gateway.client.post("/api/v1/models/b/predict", json=BODY).status_code == 429
    assert stub.ModelInfer(_echo("a")).model_name == "a"


PROMPT = "The server answers every request."
TOKENS = {  # 30 tokens at once, 0.1 token/s: nothing worth counting refills during a test
    "INFERD_RATE_LIMITS__TOKENS__TOKENS_PER_MINUTE": "6",
    "INFERD_RATE_LIMITS__TOKENS__BURST": "30",
}


@pytest.fixture(scope="module")
def llm_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("token-limits")
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    return data


def _generate(client: httpx.Client, route: str = "/api/v1/models/tiny/generate") -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
    return client.post(route, json={"model": "tiny", **body})


def _spent(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == 20
    return int(usage["total_tokens"])


@pytest.mark.slow
def test_a_token_budget_in_debt_refuses_generations_on_every_api(llm_data: Path):
    import openai

    requests = {  # a request limit too: its figures on what passes, the tokens' on a refusal
        "INFERD_RATE_LIMITS__DEFAULT__REQUESTS_PER_S": "0.01",
        "INFERD_RATE_LIMITS__DEFAULT__BURST": "100",
    }
    server = InferdServer(llm_data, workers=1, env={**TOKENS, **requests})
    try:
        server.wait_ready()
        reply = _generate(server.client)
        assert reply.headers.get_list("x-ratelimit-limit") == ["100"]
        first = _spent(reply)
        assert first <= 30  # still not in debt: the next one starts
        spent = first + _spent(_generate(server.client, "/v1/completions"))
        assert spent > 30  # ... and drives the budget into debt
        debt_s = (spent - 30) / 0.1

        refused = _generate(server.client)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert (
            "token limit exceeded (30 tokens at once, 6 per minute sustained, for all "
            "generative models)" in refused.json()["error"]["message"]
        )
        assert debt_s - 20 <= int(refused.headers["retry-after"]) <= math.ceil(debt_s)
        assert refused.headers.get_list("x-ratelimit-limit") == ["30"]
        assert refused.headers["x-ratelimit-remaining"] == "0"
        assert int(refused.headers["x-ratelimit-reset"]) >= int(refused.headers["retry-after"])

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert info.value.code == "rate_limited" and info.value.type == "invalid_request_error"
        assert int(info.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        v2 = server.client.post("/v2/models/tiny/generate", json={"text_input": PROMPT})
        assert v2.status_code == 429 and "token limit" in v2.json()["error"]
        assert "retry-after" in v2.headers

        request = pb.ModelInferRequest(model_name="tiny", id="g")
        text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        text.contents.bytes_contents.append(PROMPT.encode())
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            (answer,) = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]))
        assert "token limit exceeded" in answer.error_message
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.slow
def test_a_grpc_stream_spends_the_token_budget_with_no_request_limit(llm_data: Path):
    # Only a token limit: no call takes a request from a budget, but a generation over
    # gRPC is charged and refused like any other.
    server = InferdServer(llm_data, workers=1, env=TOKENS)
    try:
        server.wait_ready()
        request = pb.ModelInferRequest(model_name="tiny", id="g")
        text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        text.contents.bytes_contents.append(PROMPT.encode())
        request.parameters["max_tokens"].int64_param = 40
        request.parameters["ignore_eos"].bool_param = True
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answers = list(stub.ModelStreamInfer(iter([request])))
            assert answers[-1].error_message == "", answers[-1].error_message
            final = answers[-1].infer_response.parameters
            assert final["completion_tokens"].int64_param == 40  # 40 of 30: in debt now
            (refused,) = stub.ModelStreamInfer(iter([request]))
        assert "token limit exceeded" in refused.error_message
        assert _generate(server.client).status_code == 429  # the same budget as HTTP
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.slow
@pytest.mark.redis
def test_two_gateway_processes_share_one_token_budget_in_redis(llm_data: Path, redis_url: str):
    import redis

    store = redis.from_url(redis_url)
    bucket = "inferd:rl:tokens:ip:127.0.0.1"  # this client's token budget
    store.delete(bucket)
    server = InferdServer(llm_data, workers=2, env={**TOKENS, "INFERD_REDIS_URL": redis_url})
    try:
        server.wait_ready()
        spent, codes = 0, Counter[int]()
        for _ in range(2):  # a new connection each: both gateway processes answer
            with httpx.Client(base_url=server.url, timeout=30) as client:
                spent += _spent(_generate(client))
        assert spent > 30
        left = float(store.hget(bucket, "tokens") or 0)
        assert 30 - spent <= left < 30 - spent + 2  # the charges, both in Redis
        for _ in range(6):
            with httpx.Client(base_url=server.url, timeout=30) as client:
                codes[_generate(client).status_code] += 1
        assert codes == Counter({429: 6}), codes
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        store.delete(bucket)
