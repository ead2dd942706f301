"""Small HTTP helpers shared by the route modules: body limits, JSON, request ids, and
the one place errors become HTTP responses (:func:`error_response`)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from inferd import nonfinite_json
from inferd.api.state import gateway_of
from inferd.errors import BadRequest, InferdError, InvalidInput, PayloadTooLarge, PromptTooLong
from inferd.routing.context import RequestContext, new_request_id

if TYPE_CHECKING:
    from inferd.routing.dataplane import InferOutcome

logger = logging.getLogger(__name__)
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY

PUBLIC_PATHS = re.compile(
    r"^/(health(/live|/ready(/[^/]+)?)?|v2/health/(live|ready)|metrics|ui(/.*)?|)$"
)
"""Routes no credential or rate limit ever applies to: probes, scrapes, and the console's
files and the index at ``/`` (they hold no data; the console asks the API for it with
the person's credential)."""
_MODEL_PATH = re.compile(r"^/(?:api/v1|v2)/models/([^/:]+)")


def model_in_path(path: str) -> str | None:
    """The model a path names (``/api/v1/models/{m}/...``, ``/v2/models/{m}/...``; a
    ``base:adapter`` name counts as its base model)."""
    match = _MODEL_PATH.match(path)
    return match.group(1) if match else None


async def refuse(exc: InferdError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer from an ASGI middleware with the app's JSON error for ``exc``."""
    await error_response(Request(scope, receive), exc)(scope, receive, send)


def _fallback(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # object (BYTES) arrays orjson cannot take natively
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"cannot serialise {type(value).__name__}")


CONTEXT = "inferd"
"""The scope key of a request's :class:`RequestContext` (the only one inferd adds)."""


def context_of(scope: Scope) -> RequestContext:
    """The request's context, made by the first that asks (a middleware or a handler)."""
    context: RequestContext | None = scope.get(CONTEXT)
    if context is None:
        context = scope[CONTEXT] = RequestContext()
    return context


def header(request: Request, name: bytes) -> str | None:
    """A request header's value (``name`` in lower case): read from the scope's list,
    without the parsed headers object Starlette makes on first use."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")  # type: ignore[no-any-return]
    return None


def request_id_of(request: Request) -> str:
    """The client's ``X-Request-Id`` (up to 128 characters), else a new one; the same
    for every call on one request (its handler, its error response, its log row)."""
    context = context_of(request.scope)
    rid = context.request_id
    if rid is None:
        rid = header(request, b"x-request-id")
        if not rid or len(rid) > 128:
            rid = new_request_id()
        context.request_id = rid
    return rid


PRIORITY_HEADER = b"x-inferd-priority"
"""A request's priority (a name or level) where its body gives none: OpenAI's bodies
have no field for it on embeddings, scores and reranks."""

_TIMEOUT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)?\s*$")


def request_timeout(request: Request, from_body: float | None) -> float | None:
    """The request's deadline in seconds: its body's (``params.timeout_ms``, V2
    ``timeout``) or its ``X-Request-Timeout`` header (seconds, or with a unit: ``250ms``,
    ``2s``), at most the server's ``max_request_timeout_s``; None: the server's default."""
    timeout_s = from_body
    if timeout_s is None and (value := header(request, b"x-request-timeout")) is not None:
        match = _TIMEOUT.match(value)
        if match is None or float(match.group(1)) <= 0:
            raise BadRequest(
                f"X-Request-Timeout {value[:40]!r} is not a positive duration "
                "(seconds, or with a unit: 250ms, 2s)"
            )
        timeout_s = float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)
    if timeout_s is None:
        return None
    return min(timeout_s, gateway_of(request).settings.max_request_timeout_s)


WATCH_AFTER_S = 0.05
"""How long a request runs before its client's connection is watched: most answer
sooner, and never pay for the watch (a task each)."""


class DisconnectWatch:
    """Cancels the task handling a request when its client goes away, so the request
    leaves the replica's queue (the cancel reaches it) instead of being computed for
    nobody. Watching starts once the request ran ``WATCH_AFTER_S`` and its body was
    read (``read_body`` marks the scope); :meth:`stop` once the answer is ready. Until
    then a watch costs a dict entry: one sweep per ``WATCH_AFTER_S`` starts the due ones."""

    __slots__ = (
        "_born", "_context", "_receive", "_sweeper", "_task", "_watcher", "disconnected"
    )  # fmt: skip

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._context = context_of(scope)
        self._receive = receive
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task[None] | None = None
        self.disconnected = False
        self._sweeper = _sweeper()
        self._born = self._sweeper.add(self)

    def _due(self) -> bool:
        """Start watching if the body was read (True: leave the sweep)."""
        if not self._context.body_read:
            return False
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return True

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self.disconnected = True
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        self._sweeper.pending.pop(id(self), None)
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def absorb(self) -> bool:
        """After a CancelledError: True (and the task no longer cancelling) when this
        watch caused it; False when something else cancels the task (shutdown)."""
        if not self.disconnected or self._task is None:
            return False
        self._task.uncancel()
        return True


class _Sweeper:
    """The watches of one event loop not watching yet; a timer runs while there are any."""

    __slots__ = ("loop", "pending", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: dict[int, DisconnectWatch] = {}
        self.timer: asyncio.TimerHandle | None = None

    def add(self, watch: DisconnectWatch) -> float:
        self.pending[id(watch)] = watch
        if self.timer is None:
            self.timer = self.loop.call_later(WATCH_AFTER_S, self.sweep)
        return self.loop.time()

    def sweep(self) -> None:
        self.timer = None
        due = self.loop.time() - WATCH_AFTER_S
        for key, watch in list(self.pending.items()):
            if watch._born <= due and watch._due():
                del self.pending[key]
        if self.pending:
            self.timer = self.loop.call_later(WATCH_AFTER_S, self.sweep)


_SWEEPER: _Sweeper | None = None


def _sweeper() -> _Sweeper:
    global _SWEEPER
    loop = asyncio.get_running_loop()
    if _SWEEPER is None or _SWEEPER.loop is not loop:
        _SWEEPER = _Sweeper(loop)
    return _SWEEPER


async def read_json(request: Request, limit: int, non_finite: bool = False) -> Any:
    return parse_json(await read_body(request, limit), non_finite)


def parse_json(body: bytes, non_finite: bool = False) -> Any:
    """The JSON value of ``body``; 400 when it is not JSON. ``non_finite``: a body of
    tensors may hold the literals NaN, Infinity and -Infinity (see
    :mod:`inferd.nonfinite_json`), so that the tensor check names them."""
    return parse_tensor_json(body)[0] if non_finite else _parse(body, orjson.loads)


def parse_tensor_json(body: bytes) -> tuple[Any, bool]:
    """A body of tensors (NaN and ±Infinity literals allowed), and whether it held any."""
    value: tuple[Any, bool] = _parse(body, nonfinite_json.loads)
    return value


def _parse(body: bytes, loads: Callable[[bytes], Any]) -> Any:
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        return loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 past ``limit`` bytes (declared or streamed)."""
    length = header(request, b"content-length")
    if length is not None:
        if not length.isdigit():
            raise BadRequest("invalid Content-Length header")
        if int(length) > limit:
            raise PayloadTooLarge(
                f"request body of {length} bytes exceeds the limit of {limit}", limit_bytes=limit
            )
        body = await _whole_body(request)
    else:
        chunks = bytearray()
        async for chunk in request.stream():
            chunks += chunk
            if len(chunks) > limit:
                raise PayloadTooLarge(
                    f"request body exceeds the limit of {limit} bytes", limit_bytes=limit
                )
        body = bytes(chunks)
    context = context_of(request.scope)
    context.body_read = True  # a DisconnectWatch may listen now
    context.body = body  # a reference: payload logging may ship it as it came
    return body


async def _whole_body(request: Request) -> bytes:
    """The body, from the ASGI messages themselves (a body read whole in one message, as
    most are, skips Starlette's stream); kept on the request as ``request.body()`` keeps
    it, for a later reader."""
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = body  # what Request.body() returns from now on
    return body


def outcome_headers(outcome: InferOutcome, rid: str) -> dict[str, str]:
    """The headers of a predict reply: request id, the version that answered, and, when
    they apply, the fallback, the cache result and the degradation to an overflow model."""
    headers = {"x-request-id": rid, "x-inferd-model-version": outcome.target.version}
    if outcome.fallback_from is not None:
        headers["x-inferd-fallback-from"] = outcome.fallback_from
    if outcome.cache_hit is not None:
        headers["x-cache"] = "hit" if outcome.cache_hit else "miss"
    if outcome.degraded_from is not None:
        headers["x-inferd-degraded-from"] = outcome.degraded_from
        headers["x-inferd-model"] = outcome.target.model
    if outcome.cold_start_ms is not None:
        headers["x-inferd-cold-start-ms"] = f"{outcome.cold_start_ms:.1f}"
    if outcome.timing is not None:
        headers["server-timing"] = server_timing(outcome)
    return headers


def server_timing(outcome: InferOutcome) -> str:
    """The ``Server-Timing`` header of a predict reply (ms): ``gateway`` (parsing,
    checks, routing, encoding: the rest of ``total``), ``cache`` (the result cache,
    when the version is cached), the replica's ``queue`` (waiting for its batch to
    start), ``batch`` (frames to and from the replica, assembling and splitting the
    batch; its rows in ``desc``) and ``compute`` (the batch's ``predict_batch``), and
    ``total``: ``latency_ms`` of the body, which the parts add up to."""
    t = outcome.timing
    assert t is not None
    total = outcome.latency_ms
    parts = [f"gateway;dur={max(0.0, total - t.replica_ms - t.cache_ms):.3f}"]
    if outcome.cache_hit is not None:
        parts.append(f"cache;dur={t.cache_ms:.3f};desc={'hit' if outcome.cache_hit else 'miss'}")
    if t.replica_ms:
        parts.append(f"queue;dur={t.queue_ms:.3f}")
        parts.append(f'batch;dur={t.batch_ms:.3f};desc="rows={t.batch_rows}"')
        parts.append(f"compute;dur={t.compute_ms:.3f}")
    parts.append(f"total;dur={total:.3f}")
    return ", ".join(parts)


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(content, default=_fallback, option=_JSON_OPTIONS),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


def error_response(request: Request, exc: Exception) -> Response:
    """The JSON error for any exception, in the shape of the API family its path belongs
    to (OpenAI's under ``/v1/``, the Open Inference Protocol's under ``/v2/``, inferd's
    elsewhere); tracebacks only ever go to the log."""
    error = _as_inferd_error(request, exc)
    if error.status_code >= 500:
        logger.warning(
            "%s %s -> %d %s: %s",
            request.method, request.url.path, error.status_code, error.code, error.message,
        )  # fmt: skip
    rid = request_id_of(request)
    path = request.url.path
    if path.startswith("/v1/"):
        response = openai_error(error)
    elif path.startswith("/v2/"):
        response = protocol_error(error)
    else:
        body = {"error": {"code": error.code, "message": error.message, **error.details}}
        body["error"]["request_id"] = rid
        response = json_response(body, status_code=error.status_code, headers=error.headers())
    response.headers["x-request-id"] = rid
    return response


def _as_inferd_error(request: Request, exc: Exception) -> InferdError:
    if isinstance(exc, InferdError):
        return exc
    if isinstance(exc, RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        return InvalidInput("request does not match the API schema", errors=errors)
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        error = InferdError(message)
        error.status_code, error.code = exc.status_code, code
        return error
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return InferdError("internal server error; the server log has the details")


def openai_error(exc: InferdError) -> Response:
    """OpenAI's error shape and statuses: a request OpenAI would call invalid is a 400
    (inferd's 422s; a prompt too long is ``context_length_exceeded``, as OpenAI says)."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    param = exc.details.get("param", exc.details.get("field"))
    status, code = exc.status_code, exc.code
    if isinstance(exc, PromptTooLong):
        status, code, param = 400, "context_length_exceeded", param or "messages"
    elif status == 422:
        status = 400
    body = {"error": {"message": exc.message, "type": kind, "param": param, "code": code}}
    return json_response(body, status_code=status, headers=exc.headers())


def protocol_error(exc: InferdError) -> Response:
    """The protocol's error body, ``{"error": message}``; bad input is 400 here. Every
    ``/v2/`` failure answers so (:func:`error_response`)."""
    status = 400 if isinstance(exc, InvalidInput) else exc.status_code
    return json_response({"error": exc.message}, status_code=status, headers=exc.headers())
