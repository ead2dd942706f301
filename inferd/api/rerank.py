"""Cross-encoder APIs: ``/v1/score`` (vLLM's shape) and ``/v1/rerank``, ``/v2/rerank``
(the shape vLLM, Jina and Cohere clients use).

Both score (query, document) pairs with a cross-encoder version (a transformers model of
task ``score``, :mod:`inferd.runtimes.transformers`) through the same data plane as a
predict: one request, its pairs batched with other requests' in the replica.

- ``POST /v1/score`` ``{"model", "text_1": str | [str], "text_2": str | [str]}``: one
  ``text_1`` against each ``text_2``, or the two lists pairwise ->
  ``{"id", "object": "list", "created", "model", "data": [{"index", "object": "score",
  "score"}], "usage"}``.
- ``POST /v1/rerank`` (and ``/v2/rerank``, Cohere's v2 client) ``{"model", "query",
  "documents": [str | {"text"}], "top_n"?, "return_documents"?}`` -> ``{"id", "model",
  "results": [{"index", "relevance_score", "document": {"text"}}], "usage", "meta"}``,
  most relevant first, ``top_n`` of them (0 or absent: all).

Texts longer than the model takes are cut to its limit (longest first, as
sentence-transformers does); a reply lists the pairs that were cut in ``truncated``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.http import context_of, json_response, read_json
from inferd.api.state import gateway_of
from inferd.api.v1 import check_texts, score_pairs
from inferd.errors import BadRequest, InvalidInput

router = APIRouter(tags=["openai"])

SCORE_FIELDS = frozenset({"model", "text_1", "text_2", "truncate_prompt_tokens", "user"})
RERANK_FIELDS = frozenset({
    "model", "query", "documents", "top_n", "return_documents", "max_tokens_per_doc",
    "truncate_prompt_tokens", "user",
})  # fmt: skip


async def _body(request: Request, known: frozenset[str]) -> tuple[dict[str, Any], str]:
    body = await read_json(request, gateway_of(request).settings.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name in body:
        if name not in known:
            raise InvalidInput(
                f"unknown field {name!r}; this route takes {sorted(known)}", param=name
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("'model' is required: the name of a cross-encoder", param="model")
    context_of(request.scope).model = model
    for name in ("truncate_prompt_tokens", "max_tokens_per_doc"):
        if body.get(name) is not None:
            raise InvalidInput(
                f"'{name}' is not supported: texts are cut to the model's own limit, and "
                "the reply's 'truncated' lists the pairs that were",
                param=name,
            )
    return body, model


def _texts(value: Any, field: str) -> list[str]:
    """A string or a non-empty list of non-empty strings."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise InvalidInput(
            f"'{field}' must be a string or a non-empty list of strings", param=field
        )
    check_texts(texts, field)
    return texts


def _truncated(outcome: Any) -> list[int]:
    cut = outcome.outputs.get("truncated")
    return [int(i) for i in cut.nonzero()[0]] if cut is not None else []


@router.post("/v1/score")
async def score(request: Request) -> Response:
    """Score text pairs with a cross-encoder: one ``text_1`` against each ``text_2``, or
    two lists of the same length pairwise (vLLM's score API)."""
    body, model = await _body(request, SCORE_FIELDS)
    firsts, seconds = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise InvalidInput(
            f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one text_1, "
            "or as many as text_2",
            param="text_2",
        )
    scores, used, outcome, rid = await score_pairs(request, model, firsts, seconds)
    reply: dict[str, Any] = {
        "id": f"score-{uuid.uuid4().hex[:24]}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0},
    }
    if cut := _truncated(outcome):
        reply["truncated"] = cut
    return json_response(reply, headers={"x-request-id": rid})


def _documents(value: Any) -> list[str]:
    """Documents as strings or ``{"text": ...}`` objects (Cohere's v1, Jina)."""
    if not isinstance(value, list) or not value:
        raise InvalidInput("'documents' must be a non-empty list", param="documents")
    texts = [d.get("text") if isinstance(d, dict) else d for d in value]
    check_texts(texts, "documents")
    return [str(t) for t in texts]


def _top_n(value: Any, documents: int) -> int:
    if value is None or value == 0:
        return documents
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput("'top_n' must be a positive integer", param="top_n")
    return min(value, documents)


@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> Response:
    """Rank documents by relevance to a query with a cross-encoder, most relevant first."""
    body, model = await _body(request, RERANK_FIELDS)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise InvalidInput("'query' must be a non-empty string", param="query")
    documents = _documents(body.get("documents"))
    top_n = _top_n(body.get("top_n"), len(documents))
    with_documents = body.get("return_documents", True)
    if not isinstance(with_documents, bool):
        raise InvalidInput("'return_documents' must be true or false", param="return_documents")
    scores, used, outcome, rid = await score_pairs(
        request, model, [query] * len(documents), documents
    )
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if with_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    version = "2" if request.url.path.startswith("/v2/") else "1"
    reply: dict[str, Any] = {
        "id": f"rerank-{uuid.uuid4().hex[:24]}",
        "model": model,
        "results": results,
        "usage": {"total_tokens": used},
        "meta": {
            "api_version": {"version": version},
            "tokens": {"input_tokens": used, "output_tokens": 0},
        },
    }
    if cut := _truncated(outcome):
        reply["truncated"] = cut
    return json_response(reply, headers={"x-request-id": rid})
