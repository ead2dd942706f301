"""Batch jobs (``/api/v1/batch``) and asynchronous requests (``/api/v1/requests``).

- ``POST /api/v1/batch`` ``{"model", "version"?, "inputs": [...] | "input_uri": "...",
  "callback_url"?, "priority"?}`` -> 202 ``{"batch_id", "status": "queued",
  "estimated_time", ...}``; ``GET /api/v1/batch/{id}`` (status, progress, ETA, callback
  attempts); ``GET /api/v1/batch/{id}/results`` (JSON Lines in input order, streamed:
  ``{"index", "output"}`` or ``{"index", "status", "error"}``); ``DELETE`` cancels.
- A predict, generate or embed request (``/api/v1``, V2 infer/generate, OpenAI
  completions and embeddings) with ``?async=true`` or ``Prefer: respond-async`` -> 202
  ``{"id", "status": "queued", "status_url"}``; ``GET /api/v1/requests/{id}`` -> its
  status and, once done, its answer.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.api.estimates import estimate_job
from inferd.api.http import (
    context_of,
    error_response,
    json_response,
    parse_json,
    parse_tensor_json,
    read_body,
    request_id_of,
)
from inferd.api.policy import admit
from inferd.api.state import gateway_of
from inferd.errors import Conflict, InvalidInput, NotFound
from inferd.jobs import TERMINAL, Jobs, describe
from inferd.jobs.inputs import inline_items, read_items
from inferd.priority import NAMED_PRIORITIES
from inferd.runtimes import GENERATIVE

router = APIRouter(prefix="/api/v1", tags=["jobs"])


def jobs_of(request: Request) -> Jobs:
    jobs: Jobs | None = gateway_of(request).jobs
    if jobs is None:
        raise NotFound("jobs are not enabled on this server")
    return jobs


def owner_of(scope: Scope) -> str | None:
    principal = context_of(scope).principal
    return None if principal is None else f"{principal.kind}:{principal.subject}"


def visible_job(job: dict[str, Any] | None, scope: Scope, job_id: str) -> dict[str, Any]:
    """The job, if it exists and the caller may see it (its owner, or an admin)."""
    principal = context_of(scope).principal
    if job is not None and (
        principal is None or "admin" in principal.scopes or job["owner"] == owner_of(scope)
    ):
        return job
    raise NotFound(f"no job {job_id!r}")


def _priority(value: Any, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, str) and value in NAMED_PRIORITIES:
        return value
    raise InvalidInput(f"'priority' must be one of {', '.join(NAMED_PRIORITIES)}, not {value!r}")


def _callback(value: Any) -> str | None:
    if value is None:
        return None
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidInput(f"'callback_url' must be an http(s) URL, not {value!r}")
    return str(value)


@router.post("/batch", status_code=202)
async def submit_batch(request: Request) -> Response:
    """Queue a batch job over many inputs (inline, or a file: ``input_uri``)."""
    jobs = jobs_of(request)
    settings = gateway_of(request).settings
    body, non_finite = parse_tensor_json(await read_body(request, settings.jobs.max_body_bytes))
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    model, version = body.get("model"), body.get("version")
    if not isinstance(model, str):
        raise InvalidInput("missing 'model': the name of the model to run")
    if version is not None and not isinstance(version, str):
        raise InvalidInput("'version' must be a string")
    target, _ = gateway_of(request).router.resolve(model, version)  # 404 now, not a failed job
    await admit(request, target)  # its caller, its graph's models, its rate limit
    priority = _priority(body.get("priority"), "batch")
    callback_url = _callback(body.get("callback_url"))
    limit = settings.jobs.max_items
    if ("inputs" in body) == ("input_uri" in body):
        raise InvalidInput("give either 'inputs' (a list) or 'input_uri' (a file or URL)")
    if "inputs" in body:
        items = inline_items(body["inputs"], limit, non_finite)
        source = None
    else:
        uri = body["input_uri"]
        if not isinstance(uri, str) or not uri:
            raise InvalidInput("'input_uri' must be a path or URL")
        names = [spec.name for spec in target.signature.inputs]
        items = await asyncio.to_thread(read_items, uri, settings.job_input_roots, limit, names)
        source = uri
    generative = target.framework in GENERATIVE
    state = gateway_of(request)
    estimate = await estimate_job(
        state.router, state.dataplane, settings, target, items,
        await jobs.recent_rate(model), generative,
    )  # fmt: skip
    job = await jobs.submit(
        "batch", model, version, items,
        {"route": "generate" if generative else "predict", "input_uri": source,
         "estimate": estimate.to_dict()},
        priority, callback_url, owner_of(request.scope),
    )  # fmt: skip
    reply = describe(job)
    location = f"/api/v1/batch/{job['id']}"
    return json_response(reply, status_code=202, headers={"location": location})


@router.get("/batch")
async def list_batches(
    request: Request, status: str | None = None, model: str | None = None, limit: int = 100
) -> Response:
    """Batch jobs, newest first (the caller's own; an admin sees all)."""
    if status is not None and status not in (*TERMINAL, "accepting", "queued", "running"):
        raise InvalidInput(f"unknown status {status!r}")
    if not 1 <= limit <= 1000:
        raise InvalidInput("'limit' must be 1 to 1000")
    principal = context_of(request.scope).principal
    owner = None if principal is None or "admin" in principal.scopes else owner_of(request.scope)
    found = await asyncio.to_thread(
        jobs_of(request).store.find, "batch", status, model, owner, limit
    )
    return json_response({"jobs": [describe(job) for job in found], "count": len(found)})


@router.get("/batch/{batch_id}")
async def batch_status(batch_id: str, request: Request) -> Response:
    """A batch job's status, progress (items done, failed), throughput and ETA."""
    job = visible_job(await jobs_of(request).get(batch_id), request.scope, batch_id)
    return json_response(describe(job))


@router.get("/batch/{batch_id}/results")
async def batch_results(batch_id: str, request: Request) -> Response:
    """The results so far, in input order, as JSON Lines (streamed)."""
    jobs = jobs_of(request)
    visible_job(await jobs.get(batch_id), request.scope, batch_id)
    return StreamingResponse(
        _result_lines(jobs, batch_id), media_type="application/x-ndjson",
        headers={"x-inferd-batch-id": batch_id},
    )  # fmt: skip


async def _result_lines(jobs: Jobs, batch_id: str) -> AsyncIterator[bytes]:
    after, page = -1, 2000
    while True:
        rows = await asyncio.to_thread(jobs.store.results_page, batch_id, after, page)
        if not rows:
            return
        out = []
        for item, status, output in rows:
            if status == 200:
                out.append(b'{"index":%d,"output":%s}\n' % (item, output.encode()))
            else:
                error = orjson.loads(output).get("error", output)
                out.append(orjson.dumps({"index": item, "status": status, "error": error}) + b"\n")
        yield b"".join(out)
        after = rows[-1][0]
        if len(rows) < page:
            return


@router.delete("/batch/{batch_id}")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    """Cancel a job: items not yet run never run (results already in stay)."""
    jobs = jobs_of(request)
    job = visible_job(await jobs.get(batch_id), request.scope, batch_id)
    if job["status"] in TERMINAL:
        raise Conflict(f"job {batch_id} already {job['status']}")
    if not await asyncio.to_thread(
        jobs.store.finish, batch_id, "cancelled", "cancelled by the client"
    ):  # it ended meanwhile
        ended = await jobs.get(batch_id) or job
        raise Conflict(f"job {batch_id} already {ended['status']}")
    return json_response(describe(await jobs.get(batch_id) or job))


@router.get("/requests/{request_id}")
async def async_status(request_id: str, request: Request) -> Response:
    """An asynchronous request: its status, and once done its status code and answer."""
    jobs = jobs_of(request)
    job = visible_job(await jobs.get(request_id), request.scope, request_id)
    shown = describe(job)
    reply: dict[str, Any] = {
        "id": job["id"],
        "request_id": job["request"].get("headers", {}).get("x-request-id"),
        "model": job["model_name"],
        "status": job["status"],
        "created_at": shown["created_at"],
        "finished_at": shown["finished_at"],
    }
    if job["status"] == "succeeded":
        rows = await asyncio.to_thread(jobs.store.results_page, request_id, -1, 1)
        if rows:
            reply["status_code"] = rows[0][1]
            try:
                reply["result"] = orjson.loads(rows[0][2])
            except orjson.JSONDecodeError:  # not JSON (a proxy's error page): as text
                reply["result"] = rows[0][2]
    if job["error"]:
        reply["error"] = job["error"]
    return json_response(reply)


# -- asynchronous requests -------------------------------------------------------------------

ASYNC_PATHS = re.compile(
    r"^/(api/v1/(models/(?P<model>[^/]+)/)?(predict|generate)|api/v1/embed"
    r"|v2/models/(?P<v2model>[^/]+)(/versions/(?P<v2version>[^/]+))?/(infer|generate)"
    r"|v1/(chat/)?completions|v1/embeddings|v1/score|v1/rerank)$"
)
"""The requests that may be sent asynchronously: predict, generate and embed on
``/api/v1``, V2 infer and generate (JSON bodies), OpenAI completions, chat completions
and embeddings, score and rerank."""


def wants_async(scope: Scope) -> bool:
    """``?async=true`` (or 1) or ``Prefer: respond-async`` on a predict/generate route."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    query = scope.get("query_string", b"")
    asked = False
    if query and b"async" in query:
        values = parse_qs(query.decode("latin-1")).get("async", [])
        asked = any(v.lower() in ("true", "1", "yes") for v in values)
    if not asked:
        for name, value in scope["headers"]:
            if name == b"prefer" and b"respond-async" in value.lower():
                asked = True
                break
    return asked and ASYNC_PATHS.match(scope["path"]) is not None


class AsyncGate:
    """In front of the routes: an asynchronous predict/generate request is checked
    (JSON, a known model), queued and answered 202; the rest goes on untouched."""

    def __init__(self, app: ASGIApp, fastapi_app: Any) -> None:
        self.app = app
        self.fastapi_app = fastapi_app
        self.state = fastapi_app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not wants_async(scope):
            await self.app(scope, receive, send)
            return
        scope["app"] = self.fastapi_app
        request = Request(scope, receive)
        try:
            response = await _submit_async(request)
        except Exception as exc:
            response = error_response(request, exc)
        await response(scope, receive, send)


async def _submit_async(request: Request) -> Response:
    jobs = jobs_of(request)
    state = gateway_of(request)
    if request.headers.get("inference-header-content-length") is not None:
        raise InvalidInput("an asynchronous V2 request takes a JSON body, not the binary extension")
    raw = await read_body(request, state.settings.max_body_bytes)
    body = parse_json(raw, non_finite=True)  # queued as it came: the route checks tensors
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    match = ASYNC_PATHS.match(request.url.path)
    assert match is not None
    model = match.group("model") or match.group("v2model") or body.get("model")
    if not isinstance(model, str):
        raise InvalidInput("missing 'model': the name of the model to call")
    if body.get("stream") or request.url.path.endswith("_stream"):
        raise InvalidInput("an asynchronous request cannot stream: drop 'stream' or '?async'")
    params = body.get("params")
    version = match.group("v2version") or (
        params.get("version") if isinstance(params, dict) else body.get("version")
    )
    target, _ = state.router.resolve(model, version if isinstance(version, str) else None)
    await admit(request, target)  # its caller, its graph's models, its rate limit
    rid = request_id_of(request)
    headers = {"x-request-id": rid}
    if (user := request.headers.get("x-user-id")) is not None:
        headers["x-user-id"] = user
    priority = params.get("priority", "normal") if isinstance(params, dict) else "normal"
    job = await jobs.submit(
        "request", model, None, [raw], {"path": request.url.path, "headers": headers},
        priority if isinstance(priority, str) else "normal", None, owner_of(request.scope),
    )  # fmt: skip
    url = f"/api/v1/requests/{job['id']}"
    return json_response(
        {"id": job["id"], "request_id": rid, "status": "queued", "status_url": url},
        status_code=202,
        headers={"location": url, "preference-applied": "respond-async", "x-request-id": rid},
    )
