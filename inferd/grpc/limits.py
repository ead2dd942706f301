"""Rate limits for the gRPC service: the HTTP budgets (:mod:`inferd.access.limits`), on the
gateway process's one :class:`RateLimits`, for the same client (the principal auth found,
else the peer's address).

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

from typing import Any

from inferd.access.limits import RateLimits, client_key
from inferd.grpc.auth import PRINCIPAL
from inferd.grpc.http2 import Call

MODEL_FIELD = {"ModelInfer": "model_name", "ModelMetadata": "name", "ModelReady": "name"}
"""The RPCs that name a model, and the field of their message that does."""


def grpc_client(call: Call) -> str:
    """The budget key of the caller (same as over HTTP, see :func:`client_key`)."""
    return client_key(PRINCIPAL.get(), call.peer)


def metadata(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((name.lower(), value) for name, value in headers.items())


async def take(limits: RateLimits, call: Call, request: Any) -> None:
    """One request from the caller's budgets (raises RateLimited); the headers saying
    what is left go in the call's trailers."""
    field = MODEL_FIELD.get(call.method.name)
    model = None if field is None else getattr(request, field).partition(":")[0] or None
    headers = await limits.take_request(grpc_client(call), model)
    if headers is not None:
        call.set_trailing_metadata(metadata(headers))
