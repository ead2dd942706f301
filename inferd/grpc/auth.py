"""Authentication for the gRPC service, with the same credentials and scopes as HTTP
(:mod:`inferd.api.auth`): metadata ``authorization: Bearer <key or JWT>`` or
``x-api-key``. ServerLive/ServerReady are public; the repository RPCs need admin; the
rest infer. The caller's :class:`Principal` rides in a context variable, so RPCs check
the model a request names (``allowed``)."""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from inferd.api.auth import Authenticator, Principal, credential_of
from inferd.errors import InferdError

PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "grpc_principal", default=None
)
PUBLIC = frozenset({"ServerLive", "ServerReady"})


def allowed(model: str) -> None:
    """Raise Forbidden when the caller may not use ``model`` (no-op without auth)."""
    principal = PRINCIPAL.get()
    if principal is not None:
        principal.allow_model(model)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, authenticator: Authenticator, codes: Callable[[InferdError], Any]) -> None:
        self.auth = authenticator
        self.codes = codes

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: Any,
    ) -> Any:
        handler = await continuation(details)
        name = details.method.rsplit("/", 1)[-1]
        if handler is None or name in PUBLIC:
            return handler
        need = "admin" if name.startswith("Repository") else "infer"
        try:
            metadata = ((str(k), str(v)) for k, v in details.invocation_metadata or ())
            principal = await self.auth.authenticate(credential_of(metadata))
            principal.require(need)
        except InferdError as exc:
            return self._refusal(handler, exc)
        return _with_principal(handler, principal)

    def _refusal(self, handler: Any, exc: InferdError) -> Any:
        code = self.codes(exc)

        if handler.unary_unary is not None:

            async def unary(request: Any, context: Any) -> Any:
                await context.abort(code, exc.message)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )

        async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            await context.abort(code, exc.message)
            yield  # pragma: no cover -- abort raises

        return grpc.stream_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )


def _with_principal(handler: Any, principal: Principal) -> Any:
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            PRINCIPAL.set(principal)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
    inner_stream = handler.stream_stream

    async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
        PRINCIPAL.set(principal)
        async for response in inner_stream(requests, context):
            yield response

    return grpc.stream_stream_rpc_method_handler(
        stream, handler.request_deserializer, handler.response_serializer
    )
