"""Rate limits for the gRPC service: the HTTP budgets (:mod:`inferd.api.limits`), on the
gateway process's one :class:`RateLimits`, for the same client (the principal the auth
interceptor found, else the peer's address).

Every unary call but ServerLive/ServerReady takes one request from ``rate_limits.default``;
ModelInfer, ModelMetadata and ModelReady also from ``rate_limits.models`` of the model
their message names (a ``base:adapter`` name counts as its base model). A stream costs
nothing itself: each request in it is counted when it is read (see
:meth:`inferd.grpc.service.InferenceService.ModelStreamInfer`). Over a limit the call ends
with RESOURCE_EXHAUSTED and the HTTP headers as trailing metadata (``retry-after``,
``x-ratelimit-limit``, ``-remaining``, ``-reset``); a call let through carries the
``x-ratelimit-*`` ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import grpc

from inferd.api.limits import RateLimits, client_key
from inferd.errors import RateLimited
from inferd.grpc.auth import PRINCIPAL, PUBLIC

MODEL_FIELD = {"ModelInfer": "model_name", "ModelMetadata": "name", "ModelReady": "name"}
"""The RPCs that name a model, and the field of their message that does."""


def grpc_client(context: grpc.aio.ServicerContext) -> str:
    """The budget key of the caller (same as over HTTP, see :func:`client_key`)."""
    return client_key(PRINCIPAL.get(), peer_address(context.peer()))


def peer_address(peer: str) -> str | None:
    """``ipv4:10.0.0.1:5000`` or ``ipv6:%5B::1%5D:5000`` -> the address, as HTTP sees
    it; None for other transports (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return unquote(rest).rpartition(":")[0].strip("[]")


def metadata(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((name.lower(), value) for name, value in headers.items())


class RateLimitInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Installed after :class:`inferd.grpc.auth.AuthInterceptor`: its handler runs inside
    auth's, so the principal is known, and a refused credential costs no token."""

    def __init__(self, limits: RateLimits) -> None:
        self.limits = limits

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        name = details.method.rsplit("/", 1)[-1]
        if handler is None or name in PUBLIC or handler.unary_unary is None:
            return handler
        inner, field, limits = handler.unary_unary, MODEL_FIELD.get(name), self.limits

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            model = None
            if field is not None:
                model = getattr(request, field).partition(":")[0] or None
            try:
                headers = await limits.take_request(grpc_client(context), model)
            except RateLimited as exc:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    exc.message,
                    trailing_metadata=metadata(exc.limit_headers),
                )
            if headers is not None:
                context.set_trailing_metadata(metadata(headers))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
