"""OpenAI's Batch API on inferd's durable jobs: ``/v1/files`` and ``/v1/batches``.

- ``POST /v1/files`` (multipart: ``file``, ``purpose: batch``, ``expires_after[anchor]``
  and ``expires_after[seconds]``) streams a JSON Lines file to the file store
  (:mod:`inferd.jobs.files`), admitted against its owner's quota before its body is read
  (413 ``jobs.max_file_bytes`` / ``jobs.max_file_bytes_per_owner``, 409
  ``jobs.max_files_per_owner``; a refusal before the body's end closes the connection,
  so the rest is never read); kept ``jobs.file_keep_s`` unless ``expires_after`` says.
  ``GET /v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content`` (streamed),
  ``DELETE /v1/files/{id}`` (its bytes with it); an expired file is gone (404).
- ``POST /v1/batches`` ``{"input_file_id", "endpoint", "completion_window": "24h",
  "metadata"?}`` checks every line of the file (``custom_id`` unique, ``method`` POST,
  ``url`` the batch's endpoint, a ``body`` naming one model for the whole file, no
  streaming) and answers 400 naming the lines that are wrong, or queues one job item
  per line. The job runner sends each line's body to its route at the ``batch``
  priority (``X-Inferd-Priority``), so the lines take the online path (batching, result
  cache, inference log) without crowding online traffic; its answer becomes the line's
  output line ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
  "error"}``, in the batch's output file (answered 200) or error file (the rest).
- ``GET /v1/batches`` (newest first, ``after``/``limit``), ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel`` (lines not yet sent never run; the output so far
  stays readable).

A batch is never expired: it runs to the end however long that takes (``expires_at``
is null). Files and batches are their owner's (an admin sees all), as jobs are.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from inferd.api.http import context_of, error_response, header, json_response, read_json
from inferd.api.jobs import jobs_of, owner_of, visible_job
from inferd.api.openai_schema import check_known
from inferd.api.policy import admit
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, Conflict, InvalidInput, NotFound
from inferd.jobs import OPENAI_BATCH, TERMINAL, Jobs, output_file_id, output_of
from inferd.registry.uploads import UPLOADS

if TYPE_CHECKING:  # SQLAlchemy: a gateway opens the database layer on first use
    from inferd.jobs.files import FileStore, Upload

router = APIRouter(prefix="/v1", tags=["openai"])

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score",
             "/v1/rerank")  # fmt: skip
BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
UPLOAD_FIELDS = frozenset({"purpose", "expires_after[anchor]", "expires_after[seconds]"})
EXPIRY_MAX_S = 30 * 86400
READ_BYTES = 1 << 20
SHOWN_ERRORS = 10
STATUS = {
    "accepting": "validating", "queued": "in_progress", "running": "in_progress",
    "succeeded": "completed", "failed": "failed", "cancelled": "cancelled",
}  # fmt: skip
"""A job's status as a batch's."""


# -- files ---------------------------------------------------------------------------------


def _file_object(row: dict[str, Any]) -> dict[str, Any]:
    expires = row.get("expires_at")
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": int(row["created_at"].timestamp()),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None if expires is None else int(expires.timestamp()),
    }


async def _uploaded(request: Request, file_id: str, **details: Any) -> dict[str, Any]:
    """An uploaded file's record, if it exists (not expired nor deleted) and the caller
    may see it (its owner, or an admin), else 404."""
    row = await asyncio.to_thread(jobs_of(request).files.get, file_id)
    principal = context_of(request.scope).principal
    if row is None or not (
        principal is None or principal.admin or row["owner"] == owner_of(request.scope)
    ):
        raise NotFound(f"No such File object: {file_id}", **details)
    return row


def _keep_s(fields: dict[str, str], default_s: float) -> float:
    """How long the file is kept: OpenAI's ``expires_after`` (anchor ``created_at``,
    ``seconds`` 3600 to 2592000), else ``jobs.file_keep_s``."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_s
    if anchor != "created_at":
        raise InvalidInput(
            f"'expires_after[anchor]' must be 'created_at', not {anchor!r}",
            param="expires_after.anchor",
        )
    if seconds is None or not seconds.isdigit() or not 3600 <= int(seconds) <= EXPIRY_MAX_S:
        raise InvalidInput(
            f"'expires_after[seconds]' must be 3600 to {EXPIRY_MAX_S} (an hour to 30 days), "
            f"not {seconds!r}",
            param="expires_after.seconds",
        )
    return float(seconds)


def _check_fields(fields: dict[str, str], default_keep_s: float) -> float:
    """The form's fields checked (as far as they came); how long the file is kept."""
    unknown = sorted(set(fields) - UPLOAD_FIELDS)
    if unknown:
        raise InvalidInput(f"Unrecognized form field(s): {', '.join(unknown)}", param=unknown[0])
    purpose = fields.get("purpose", "batch")
    if purpose != "batch":
        raise InvalidInput(
            f"'purpose' must be 'batch', not {purpose!r}: inferd keeps files for its Batch API",
            param="purpose",
        )
    return _keep_s(fields, default_keep_s)


def _checked(upload: Upload, default_keep_s: float) -> float:
    """The whole upload checked; how long its file is kept."""
    keep_s = _check_fields(upload.fields, default_keep_s)
    if "purpose" not in upload.fields:
        raise InvalidInput("'purpose' is required: 'batch'", param="purpose")
    if upload.filename is None:
        raise InvalidInput("'file' is required: the batch's JSON Lines", param="file")
    if upload.blank:
        raise InvalidInput("the file is empty", param="file")
    upload.filename = upload.filename or "upload.jsonl"
    return keep_s


async def _store_upload(request: Request) -> dict[str, Any]:
    """Admit, receive and record one upload: refused before its body is read when its
    owner has no room left (or its declared length is over), as soon as it passes what
    is left while it streams, and once it is in (quota checked again as it is recorded)."""
    from inferd.jobs.files import files_root, receive  # the database layer, on first use

    settings = gateway_of(request).settings
    files, owner = jobs_of(request).files, owner_of(request.scope)
    content_type = header(request, b"content-type") or ""
    if not content_type.startswith("multipart/form-data"):
        raise InvalidInput("upload the file as multipart/form-data ('file' and 'purpose')")
    length = header(request, b"content-length")
    if length is not None and not length.isdigit():
        raise BadRequest("invalid Content-Length header")
    declared = None if length is None else int(length)
    room = await asyncio.to_thread(files.room, owner, settings.jobs, declared)
    scratch = Path(settings.data_dir).resolve() / UPLOADS / uuid.uuid4().hex
    keep_s = settings.jobs.file_keep_s
    try:
        upload = await receive(
            content_type, request.stream(), scratch / "file", room,
            lambda fields: _check_fields(fields, keep_s),
        )  # fmt: skip
        context_of(request.scope).body_read = True
        keep_s = _checked(upload, keep_s)
        return await asyncio.to_thread(
            files.create, upload, "batch", owner, keep_s, files_root(settings), settings.jobs
        )
    except ClientDisconnect:
        raise BadRequest("the client went away before the upload ended") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)


@router.post("/files")
async def create_file(request: Request) -> Response:
    """Upload a batch's input: JSON Lines, one request per line (multipart: ``file``,
    ``purpose``, optionally ``expires_after[anchor]`` and ``expires_after[seconds]``)."""
    try:
        row = await _store_upload(request)
    except Exception as exc:
        if context_of(request.scope).body_read:
            raise
        response = error_response(request, exc)
        response.headers["connection"] = "close"  # the rest of the body is never read
        return response
    return json_response(_file_object(row))


@router.get("/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = 10000,
    order: str = "desc",
    after: str | None = None,
) -> Response:
    """Uploaded files the caller may see (a batch's output files are its own)."""
    if order not in ("asc", "desc"):
        raise InvalidInput("'order' must be asc or desc", param="order")
    if not 1 <= limit <= 10000:
        raise InvalidInput("'limit' must be 1 to 10000", param="limit")
    principal = context_of(request.scope).principal
    owner = None if principal is None or principal.admin else owner_of(request.scope)
    files = jobs_of(request).files
    rows = await asyncio.to_thread(files.find, purpose, owner, after, limit + 1, order == "desc")
    data = [_file_object(r) for r in rows[:limit]]
    return json_response(_page(data, len(rows) > limit))


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


async def _output_file(request: Request, file_id: str) -> tuple[dict[str, Any], bool] | None:
    """A batch's output or error file: (its job, errors?), or None for other ids."""
    found = output_of(file_id)
    if found is None:
        return None
    job_id, errors = found
    job = await jobs_of(request).get(job_id)
    if job is None or job["kind"] != OPENAI_BATCH or job["status"] not in TERMINAL:
        raise NotFound(f"No such File object: {file_id}")
    return visible_job(job, request.scope, file_id), errors


@router.get("/files/{file_id}")
async def get_file(file_id: str, request: Request) -> Response:
    jobs = jobs_of(request)
    output = await _output_file(request, file_id)
    if output is not None:
        job, errors = output
        from inferd.jobs.files import output_size  # the database layer, on first use

        size = await asyncio.to_thread(output_size, jobs.store, job["id"], errors)
        kind = "errors" if errors else "output"
        return json_response(
            _file_object({
                "id": file_id, "bytes": size, "created_at": job["finished_at"],
                "filename": f"{job['id']}_{kind}.jsonl", "purpose": "batch_output",
            })
        )  # fmt: skip
    return json_response(_file_object(await _uploaded(request, file_id)))


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    jobs = jobs_of(request)
    output = await _output_file(request, file_id)
    if output is not None:
        job, errors = output
        return StreamingResponse(
            _stream(jobs, job["id"], errors), media_type="application/octet-stream"
        )
    row = await _uploaded(request, file_id)
    opened = await asyncio.to_thread(jobs.files.open, file_id)
    return StreamingResponse(
        _read(opened), media_type="application/octet-stream",
        headers={"content-length": str(row["bytes"])},
    )  # fmt: skip


async def _read(opened: IO[bytes]) -> AsyncIterator[bytes]:
    try:
        while piece := await asyncio.to_thread(opened.read, READ_BYTES):
            yield piece
    finally:
        await asyncio.to_thread(opened.close)


async def _stream(jobs: Jobs, job_id: str, errors: bool) -> AsyncIterator[bytes]:
    from inferd.jobs.files import output_lines  # the database layer, on first use

    lines = output_lines(jobs.store, job_id, errors)
    while (part := await asyncio.to_thread(next, lines, None)) is not None:
        yield part


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> Response:
    jobs = jobs_of(request)
    if await _output_file(request, file_id) is not None:
        raise InvalidInput(
            f"{file_id} is a batch's output: it is kept as long as its batch is", param="file_id"
        )
    await _uploaded(request, file_id)
    if not await asyncio.to_thread(jobs.files.delete, file_id):  # deleted meanwhile
        raise NotFound(f"No such File object: {file_id}")
    return json_response({"id": file_id, "object": "file", "deleted": True})


# -- batches -------------------------------------------------------------------------------


def _timestamp(value: Any) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_object(job: dict[str, Any]) -> dict[str, Any]:
    """A job as OpenAI's Batch object."""
    request = job["request"]
    status = STATUS[job["status"]]
    ended = job["status"] in TERMINAL
    finished = _timestamp(job["finished_at"])
    errors = None
    if job["status"] == "failed" and job["error"]:
        failure = {"code": "failed", "message": job["error"], "param": None, "line": None}
        errors = {"object": "list", "data": [failure]}
    return {
        "id": job["id"],
        "object": "batch",
        "endpoint": request["endpoint"],
        "errors": errors,
        "input_file_id": request["input_file_id"],
        "completion_window": request["completion_window"],
        "status": status,
        "output_file_id": output_file_id(job["id"], False) if ended and job["succeeded"] else None,
        "error_file_id": output_file_id(job["id"], True) if ended and job["failed"] else None,
        "created_at": _timestamp(job["created_at"]),
        "in_progress_at": _timestamp(job["started_at"]),
        "expires_at": None,
        "finalizing_at": finished if status == "completed" else None,
        "completed_at": finished if status == "completed" else None,
        "failed_at": finished if status == "failed" else None,
        "expired_at": None,
        "cancelling_at": finished if status == "cancelled" else None,
        "cancelled_at": finished if status == "cancelled" else None,
        "request_counts": {
            "total": job["total"],
            "completed": job["succeeded"],
            "failed": job["failed"],
        },
        "metadata": request.get("metadata"),
    }


def _batch_fields(body: Any) -> tuple[str, str, str, dict[str, str] | None]:
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    check_known(body, BATCH_FIELDS)
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidInput("'input_file_id' is required", param="input_file_id")
    if endpoint not in ENDPOINTS:
        raise InvalidInput(
            f"'endpoint' must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}", param="endpoint"
        )
    window = body.get("completion_window", "24h")
    if window != "24h":
        raise InvalidInput("'completion_window' must be '24h'", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise InvalidInput(
            "'metadata' must be at most 16 string pairs (keys up to 64 characters, values "
            "up to 512)",
            param="metadata",
        )
    return file_id, str(endpoint), window, metadata


def _read_batch(
    files: FileStore, file_id: str, endpoint: str, limit: int
) -> tuple[list[bytes], str]:
    with files.open(file_id) as opened:
        return batch_lines(opened, endpoint, limit)


def batch_lines(lines: Iterable[bytes], endpoint: str, limit: int) -> tuple[list[bytes], str]:
    """Each line of a batch's input as a job item (``{"custom_id", "url", "body"}``), and
    the one model they name; InvalidInput listing the first wrong lines."""
    items: list[bytes] = []
    models: dict[str, int] = {}
    seen: set[str] = set()
    wrong: list[str] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if len(items) >= limit:
            raise InvalidInput(f"the file has more than {limit} requests (jobs.max_items)")
        try:
            line = orjson.loads(raw)
            problem = _line_problem(line, endpoint, seen)
        except orjson.JSONDecodeError:
            problem = "is not JSON"
        if problem is not None:
            wrong.append(f"line {number} {problem}")
            continue
        seen.add(line["custom_id"])
        models.setdefault(line["body"]["model"], number)
        items.append(orjson.dumps({k: line[k] for k in ("custom_id", "url", "body")}))
    if len(models) > 1:
        (first, _), (second, at) = list(models.items())[:2]
        wrong.append(f"line {at} names model {second!r}, an earlier line {first!r}: one model "
                     "per batch")  # fmt: skip
    if wrong:
        shown = "; ".join(wrong[:SHOWN_ERRORS])
        more = f" (and {len(wrong) - SHOWN_ERRORS} more)" if len(wrong) > SHOWN_ERRORS else ""
        raise InvalidInput(f"the batch's input file is not valid: {shown}{more}", lines=wrong)
    if not items:
        raise InvalidInput("the batch's input file has no requests")
    return items, next(iter(models))


def _line_problem(line: Any, endpoint: str, seen: set[str]) -> str | None:
    """What is wrong with one input line, or None."""
    if not isinstance(line, dict):
        return "is not a JSON object"
    unknown = sorted(set(line) - LINE_FIELDS)
    if unknown:
        return f"has unknown field(s) {unknown}"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "needs a 'custom_id' (a non-empty string)"
    if custom_id in seen:
        return f"repeats custom_id {custom_id!r}"
    if line.get("method", "POST") != "POST":
        return "has a 'method' other than POST"
    if line.get("url") != endpoint:
        return f"has url {line.get('url')!r}, not the batch's endpoint {endpoint}"
    body = line.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return "needs a 'body' object naming its 'model'"
    if body.get("stream"):
        return "asks for a stream: a batch's answers are whole"
    return None


@router.post("/batches")
async def create_batch(request: Request) -> Response:
    """Create a batch from an uploaded JSON Lines file; every line is checked first."""
    jobs = jobs_of(request)
    settings = gateway_of(request).settings
    file_id, endpoint, window, metadata = _batch_fields(
        await read_json(request, settings.max_body_bytes)
    )
    row = await _uploaded(request, file_id, param="input_file_id")
    if row["purpose"] != "batch":
        raise InvalidInput(f"{file_id} was not uploaded for a batch", param="input_file_id")
    items, model = await asyncio.to_thread(
        _read_batch, jobs.files, file_id, endpoint, settings.jobs.max_items
    )
    context_of(request.scope).model = model
    target, _ = gateway_of(request).router.resolve(model, None)  # 404 now, not a failed batch
    await admit(request, target)  # its caller, its graph's models, its rate limit
    job = await jobs.submit(
        OPENAI_BATCH, model, None, items,
        {"endpoint": endpoint, "input_file_id": file_id, "completion_window": window,
         "metadata": metadata},
        "batch", None, owner_of(request.scope),
    )  # fmt: skip
    return json_response(batch_object(job))


async def _batch(request: Request, batch_id: str) -> dict[str, Any]:
    job = await jobs_of(request).get(batch_id)
    if job is None or job["kind"] != OPENAI_BATCH:
        raise NotFound(f"No such Batch object: {batch_id}")
    return visible_job(job, request.scope, batch_id)


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> Response:
    return json_response(batch_object(await _batch(request, batch_id)))


@router.get("/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
    """The caller's batches (an admin: all), newest first."""
    if not 1 <= limit <= 100:
        raise InvalidInput("'limit' must be 1 to 100", param="limit")
    principal = context_of(request.scope).principal
    owner = None if principal is None or principal.admin else owner_of(request.scope)
    store = jobs_of(request).store
    found = await asyncio.to_thread(store.find, OPENAI_BATCH, None, None, owner, limit + 1, after)
    data = [batch_object(job) for job in found[:limit]]
    return json_response(_page(data, len(found) > limit))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    """Cancel a batch: lines not yet sent never run; what came back stays readable."""
    jobs = jobs_of(request)
    job = await _batch(request, batch_id)
    if job["status"] in TERMINAL or not await asyncio.to_thread(
        jobs.store.finish, batch_id, "cancelled", "cancelled by the client"
    ):
        ended = await jobs.get(batch_id) or job
        raise Conflict(f"batch {batch_id} is already {STATUS[ended['status']]}")
    return json_response(batch_object(await jobs.get(batch_id) or job))
