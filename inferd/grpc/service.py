"""``inference.GRPCInferenceService``: the Open Inference Protocol over gRPC.

Served by every gateway process (inferd's own HTTP/2 server, :mod:`inferd.grpc.http2`,
on ``grpc_port``, shared with SO_REUSEPORT like the HTTP port) on the same router and
data plane as the REST APIs, so versions, batching and replicas behave the same whichever
protocol a request used. The checks of inputs against the model's signature are the
protocol's (:mod:`inferd.protocols.v2`, shared with REST); messages are decoded in
:mod:`inferd.grpc.tensors`.

Tensors: inputs come either as ``raw_input_contents`` (one little-endian byte string per
input, read without copying) or as typed ``contents``; outputs always go back as
``raw_output_contents``, as Triton does. Errors map to gRPC status codes (bad input
INVALID_ARGUMENT, unknown model NOT_FOUND, not ready or overloaded UNAVAILABLE, deadline
DEADLINE_EXCEEDED, over a rate limit RESOURCE_EXHAUSTED: see :mod:`inferd.grpc.limits`).
Each call is authenticated (:mod:`inferd.grpc.auth`), then counted against the rate limits,
then handled, inside its trace span when tracing is on.
``ModelStreamInfer`` serves a stream of requests concurrently; a generative model answers
a request with one response per chunk of text (``text_output``) and marks the last with
the ``triton_final_response`` parameter, the way Triton's decoupled models do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from inferd import __version__, transport
from inferd.access.limits import RateLimits, TokenBudget
from inferd.access.policy import RequestPolicy
from inferd.config import Settings
from inferd.errors import InferdError, InvalidInput, ModelNotReady, RateLimited
from inferd.grpc import auth as grpc_auth
from inferd.grpc import grpc_service_pb2 as pb
from inferd.grpc import limits as grpc_limits
from inferd.grpc.auth import PRINCIPAL, PUBLIC, allowed
from inferd.grpc.bounds import Bounds, MiB
from inferd.grpc.http2 import Abort, Call, GrpcServer, Method, StatusCode
from inferd.grpc.limits import grpc_client
from inferd.grpc.tensors import decode_inputs, generation_body, parameters
from inferd.protocols import repository as repo
from inferd.protocols import v2
from inferd.routing.context import RequestContext, new_request_id
from inferd.routing.dataplane import DataPlane
from inferd.routing.generation import GenerationStart, start_generation
from inferd.routing.router import Router
from inferd.routing.targets import Target
from inferd.runtimes import GENERATIVE
from inferd.shapes.tensors import datatype_of
from inferd.telemetry import tracing
from inferd.telemetry.log_rows import RowBuffer
from inferd.telemetry.logging import request_id_var

if TYPE_CHECKING:
    from inferd.access.authenticator import Authenticator
    from inferd.registry import Registry

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
_CODES = {
    400: StatusCode.INVALID_ARGUMENT,
    404: StatusCode.NOT_FOUND,
    409: StatusCode.ALREADY_EXISTS,
    413: StatusCode.RESOURCE_EXHAUSTED,
    422: StatusCode.INVALID_ARGUMENT,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    429: StatusCode.RESOURCE_EXHAUSTED,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.DEADLINE_EXCEEDED,
}


STREAM_CONCURRENCY = 64
"""Requests of one ModelStreamInfer stream in progress at once."""


def status_code(exc: InferdError) -> StatusCode:
    return _CODES.get(exc.status_code, StatusCode.INTERNAL)


def abort(exc: InferdError) -> Abort:
    """The gRPC ending of an inferd error (a rate limit's headers as trailers)."""
    trailers = grpc_limits.metadata(exc.limit_headers) if isinstance(exc, RateLimited) else ()
    return Abort(status_code(exc), exc.message, trailers)


def methods() -> dict[str, Method]:
    """The service's methods by path, from its descriptor: those InferenceService does not
    have answer UNIMPLEMENTED, as the path of a method nobody serves does."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return {
        f"/{SERVICE}/{m.name}": Method(m.name, getattr(pb, m.input_type.name), m.client_streaming)
        for m in service.methods
        if hasattr(InferenceService, m.name)
    }


class InferenceService:
    def __init__(
        self,
        router: Router,
        registry: Registry,
        settings: Settings,
        plane: DataPlane,
        inference_log: RowBuffer | None = None,
        limits: RateLimits | None = None,
    ) -> None:
        self.router = router
        self.registry = registry
        self.settings = settings
        self.plane = plane  # the gateway process's, shared with its HTTP app
        self.inference_log = inference_log
        self.limits = limits

    # -- health and metadata -----------------------------------------------------------

    async def ServerLive(self, request: Any, call: Call) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, call: Call) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=v2.is_server_ready(self.router))

    async def ModelReady(self, request: Any, call: Call) -> pb.ModelReadyResponse:
        allowed(request.name)
        try:
            self.router.target(request.name, request.version or None)
        except ModelNotReady:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, call: Call) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="inferd", version=__version__, extensions=v2.EXTENSIONS
        )

    async def ModelMetadata(self, request: Any, call: Call) -> pb.ModelMetadataResponse:
        allowed(request.name)
        meta = v2.metadata_of(self.router, request.name, request.version or None)
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["outputs"]],
        )

    # -- inference ---------------------------------------------------------------------

    async def ModelInfer(self, request: Any, call: Call) -> pb.ModelInferResponse:
        deadline_s = call.time_remaining()  # the client's gRPC deadline, if it set one
        context = RequestContext()
        who = grpc_client(call)
        if self.inference_log is None:
            return await self._infer(request, who, context, deadline_s)
        started = time.perf_counter()
        try:
            response = await self._infer(request, who, context, deadline_s)
        except InferdError as exc:
            self._log(request, context, started, exc.status_code)
            raise
        except Exception:
            self._log(request, context, started, 500)
            raise
        self._log(request, context, started, 200)
        return response

    def _log(self, request: Any, call: RequestContext, started: float, status: int) -> None:
        """An inference log row for a ModelInfer call (HTTP status codes, as for REST)."""
        assert self.inference_log is not None
        if call.request_id is None:  # refused before it had one
            rid = request.id or request_id_var.get()
            call.request_id = "" if rid == "-" else rid
        if call.user is None:
            call.user = v2.user_of(parameters(request.parameters))
        ms = (time.perf_counter() - started) * 1000
        keep = self.inference_log.keep_predictions
        self.inference_log.record(call.log_row("grpc", request.model_name, status, ms, None, keep))

    async def _infer(
        self,
        request: Any,
        who: str,
        call: RequestContext | None = None,
        deadline_s: float | None = None,
    ) -> pb.ModelInferResponse:
        """The response; ``who``: the caller's budget key; ``call`` (when given) learns
        the request id, the user and the outcome. ``deadline_s``: the call's gRPC
        deadline, bounding the ``timeout`` parameter."""
        started = time.perf_counter()
        call = RequestContext() if call is None else call
        rid = call.request_id = request.id or new_request_id()
        request_id_var.set(rid)
        params = parameters(request.parameters)
        call.user = v2.user_of(params)
        version = request.model_version or None
        target = await self.plane.resolve(
            request.model_name,
            version,
            started=started,
            timeout_s=lambda: v2.schedule_policy(params)[1] or deadline_s,
            user=call.user,
        )  # the policy admits it below, once its inputs are read
        allowed(target.model)
        if target.framework in GENERATIVE:
            raise InvalidInput(
                f"model {target.model!r} generates text: call ModelStreamInfer with a "
                "'text_input' BYTES input"
            )
        columns, rows = decode_inputs(request, target)
        wanted = v2.requested_outputs(
            [{"name": o.name} for o in request.outputs] or None, target.signature
        )
        priority, timeout_s = v2.schedule_policy(params)
        if deadline_s is not None:
            timeout_s = deadline_s if timeout_s is None else min(timeout_s, deadline_s)
        if timeout_s is not None:
            timeout_s = min(timeout_s, self.settings.max_request_timeout_s)
        policy = self._policy(who, request.model_name)
        if policy is not None:  # a graph's models (the named one is checked: the call's)
            await policy.admit(target, self.plane.graphs)
        pinned = bool(request.model_version)
        infer = self.plane.request(rid, started, timeout_s, priority, pinned, policy)
        outcome = call.outcome = await self.plane.infer(target, columns, rows, infer)
        target = outcome.target  # the fallback version, if the chosen one failed
        response = pb.ModelInferResponse(
            model_name=target.model, model_version=target.version, id=request.id
        )
        for name, array in outcome.outputs.items():
            if wanted is None or name in wanted:
                output = response.outputs.add()
                output.name = name
                output.datatype = datatype_of(array)
                output.shape.extend(array.shape)
                response.raw_output_contents.append(v2.to_binary(array))
        return response

    def _policy(self, who: str, model: str) -> RequestPolicy | None:
        """The caller's policy for the models a request reaches (None: nothing applies);
        the model it named took from its rate limit with the call (or stream request)."""
        principal = PRINCIPAL.get()
        limits = self.limits if self.limits is not None and self.limits.config.models else None
        if principal is None and limits is None:
            return None
        return RequestPolicy(principal, limits, who, {model.partition(":")[0]})

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], call: Call
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request runs as its own task, up to :data:`STREAM_CONCURRENCY` at once (the
        next ones are read as they end: the client's uploads wait under flow control);
        responses go out as they are ready (match them by ``id``). A failed request
        answers ``error_message``; the stream goes on. Each request counts against the
        caller's rate limits as a unary call would."""
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        who = grpc_client(call)
        room = asyncio.Semaphore(STREAM_CONCURRENCY)

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            room.release()

        async def read() -> None:
            try:
                async for request in requests:
                    await room.acquire()  # a full stream reads on as its requests end
                    task = asyncio.create_task(self._stream_one(request, out.put_nowait, who))
                    tasks.add(task)
                    task.add_done_callback(done)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _stream_one(
        self, request: Any, send: Callable[[pb.ModelStreamInferResponse], None], who: str
    ) -> None:
        try:
            budget = None
            if self.limits is not None:
                await self.limits.take_request(who, request.model_name.partition(":")[0])
                budget = self.limits.budget(who)
            target = self.plane.target(request.model_name, request.model_version or None)
            allowed(target.model)
            if target.framework in GENERATIVE:
                await self._generate(request, target, send, budget)
            else:
                send(pb.ModelStreamInferResponse(infer_response=await self._infer(request, who)))
        except InferdError as exc:
            send(pb.ModelStreamInferResponse(error_message=exc.message))
        except Exception:
            logger.exception("stream request %r failed", request.id)
            send(pb.ModelStreamInferResponse(error_message="internal error; see the server log"))

    async def _generate(
        self,
        request: Any,
        target: Target,
        send: Callable[[pb.ModelStreamInferResponse], None],
        budget: TokenBudget | None = None,
    ) -> None:
        """Text generation: ``text_input`` (BYTES, one element) and sampling options as
        request parameters (or a ``sampling_parameters`` JSON input, like Triton's vLLM
        backend) -> a response per chunk of text, the last one final."""
        body = generation_body(request)
        rid = request.id or new_request_id()
        start = GenerationStart(request.model_name, body, target.version, rid, budget)
        chunks, target, _, _ = await start_generation(
            self.router, self.settings, start, self.plane.cache
        )
        stream = bool(body.get("stream", True))
        text: list[str] = []
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if not stream:
                    text.append(chunk.text)
                    if not chunk.finished:
                        continue
                response = pb.ModelInferResponse(
                    model_name=target.model, model_version=target.version, id=request.id
                )
                output = response.outputs.add()
                output.name, output.datatype = "text_output", "BYTES"
                output.shape.append(1)
                data = ("".join(text) if not stream else chunk.text).encode()
                response.raw_output_contents.append(len(data).to_bytes(4, "little") + data)
                if chunk.finished:
                    response.parameters["triton_final_response"].bool_param = True
                    response.parameters["finish_reason"].string_param = chunk.finish_reason
                    response.parameters["prompt_tokens"].int64_param = chunk.prompt_tokens
                    response.parameters["completion_tokens"].int64_param = chunk.completion_tokens
                send(pb.ModelStreamInferResponse(infer_response=response))

    # -- model repository ----------------------------------------------------------------

    async def RepositoryIndex(self, request: Any, call: Call) -> pb.RepositoryIndexResponse:
        models = await repo.repository_index(self.registry, self.router, request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=m.name, version=m.version, state=m.state, reason=m.reason
                )
                for m in models
            ]
        )

    async def RepositoryModelLoad(self, request: Any, call: Call) -> pb.RepositoryModelLoadResponse:
        if request.parameters:  # Triton's "config" / "file:" overrides: not for inferd
            raise InvalidInput(f"load parameters are not supported: {sorted(request.parameters)}")
        await repo.load_model(self.registry, self.router, self.settings, request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: Any, call: Call
    ) -> pb.RepositoryModelUnloadResponse:
        await repo.unload_model(self.registry, self.router, self.settings, request.model_name)
        return pb.RepositoryModelUnloadResponse()


class GrpcCalls:
    """Every call's way to its handler: trace span, authentication, rate limits, then
    the :class:`InferenceService` method, an :class:`InferdError` ending the call with
    its status."""

    def __init__(
        self,
        service: InferenceService,
        table: dict[str, Method],
        auth: Authenticator | None,
        limits: RateLimits | None,
        tracer: Any,
    ) -> None:
        self.auth = auth
        self.limits = limits
        """Taken from by every call but the public ones (None: no request limit)."""
        self.tracer = tracer
        self._handlers = {m.name: getattr(service, m.name) for m in table.values()}

    def admit(self, call: Call) -> Awaitable[None] | None:
        """At the call's HEADERS: authenticated and authorised for its method, or
        refused before any of its message is read (see :func:`inferd.grpc.auth.admit`)."""
        if self.auth is None:
            return None
        return grpc_auth.admit(self.auth, call, abort)

    async def unary(self, call: Call, request: Any) -> Any:
        if self.tracer is None:
            return await self._unary(call, request)
        from inferd.grpc.tracing import server_span

        with server_span(self.tracer, call, SERVICE):
            return await self._unary(call, request)

    async def _unary(self, call: Call, request: Any) -> Any:
        name = call.method.name
        try:
            if name not in PUBLIC:
                if self.auth is not None:
                    PRINCIPAL.set(grpc_auth.principal_of(call))
                if self.limits is not None:
                    await grpc_limits.take(self.limits, call, request)
            return await self._handlers[name](request, call)
        except InferdError as exc:
            raise abort(exc) from None

    async def stream(self, call: Call, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        if self.tracer is None:
            async for response in self._stream(call, requests):
                yield response
            return
        from inferd.grpc.tracing import server_span

        with server_span(self.tracer, call, SERVICE):
            async for response in self._stream(call, requests):
                yield response

    async def _stream(self, call: Call, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            if self.auth is not None:
                PRINCIPAL.set(grpc_auth.principal_of(call))
        except InferdError as exc:
            raise abort(exc) from None
        async for response in self._handlers[call.method.name](requests, call):
            yield response


def bounds_of(settings: Settings) -> Bounds:
    """The HTTP/2 server's limits, from ``connections.*``."""
    c = settings.connections
    return Bounds(
        max_connections=c.max_per_process,
        max_streams=c.grpc_max_streams,
        header_timeout_s=c.header_timeout_s,
        body_timeout_s=c.body_timeout_s,
        idle_s=c.idle_s,
        max_header_list=c.max_header_bytes,
        connection_buffer=int(c.grpc_connection_buffer_mb * MiB),
        process_buffer=int(c.grpc_buffer_mb * MiB),
    )


async def start_server(
    router: Router,
    registry: Registry,
    settings: Settings,
    plane: DataPlane,
    inference_log: RowBuffer | None = None,
    limits: RateLimits | None = None,
) -> GrpcServer:
    """Listen on ``settings.host:settings.grpc_port`` (port shared across gateway
    processes with SO_REUSEPORT). ``plane`` and ``limits``: the gateway process's data
    plane (its result cache) and rate limits, the objects its HTTP app uses."""
    authenticator = None
    if settings.auth.enabled:
        from inferd.access.authenticator import Authenticator

        authenticator = Authenticator(settings.auth, registry.keys)
    # The service keeps the limits for its streams' requests and token budgets; each call
    # takes a request from them only when a request limit is set.
    service = InferenceService(router, registry, settings, plane, inference_log, limits)
    per_call = limits if settings.rate_limits.limits_requests else None
    table = methods()
    calls = GrpcCalls(service, table, authenticator, per_call, tracing.tracer)
    server = GrpcServer(calls, table, settings.max_body_bytes, bounds_of(settings))
    sock = transport.bind_socket(settings.host, settings.grpc_port)
    sock.listen(4096)
    context = None
    if settings.tls.cert_file is not None:
        from inferd.tls import server_context

        context = server_context(settings.tls, alpn=["h2"])
    await server.start(sock, context)
    return server
