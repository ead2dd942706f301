"""Authentication for the gRPC service, with the same credentials and scopes as HTTP
(:mod:`inferd.access`): metadata ``authorization: Bearer <key or JWT>`` or
``x-api-key``. ServerLive/ServerReady are public; the repository RPCs need admin; the
rest infer.

A call is admitted at its HEADERS (:func:`admit`, the HTTP/2 server's ``Service.admit``),
before any of its message is kept: a missing, unknown or revoked credential ends it
UNAUTHENTICATED, one without the scope PERMISSION_DENIED, at once. Its principal stays on
the call (``call.user``) and rides in a context variable while its handler runs, so RPCs
check the model a request names (:func:`allowed`)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable

from inferd.access.authenticator import Authenticator, credential_of
from inferd.access.principal import Principal
from inferd.errors import InferdError, Unauthorized
from inferd.grpc.http2 import Abort, Call

PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "grpc_principal", default=None
)
PUBLIC = frozenset({"ServerLive", "ServerReady"})
LOOKUP_TIMEOUT_S = 10.0
"""Longest an API key's lookup may hold a connection's reading (the registry is slow)."""


def allowed(model: str) -> None:
    """Raise Forbidden when the caller may not use ``model`` (no-op without auth)."""
    principal = PRINCIPAL.get()
    if principal is not None:
        principal.allow_model(model)


def admit(
    auth: Authenticator, call: Call, abort: Callable[[InferdError], Abort]
) -> Awaitable[None] | None:
    """Admit ``call`` now (None), refuse it (raises the :class:`Abort` ``abort`` makes of
    the refusal), or decide once its API key is read (the awaitable)."""
    if call.method.name in PUBLIC:
        return None
    try:
        credential = credential_of(call.metadata)
        principal = auth.known(credential)
        if principal is None:
            return _look_up(auth, call, credential, abort)
        _require(call, principal)
    except InferdError as exc:
        raise abort(exc) from None
    return None


async def _look_up(
    auth: Authenticator, call: Call, credential: str | None, abort: Callable[[InferdError], Abort]
) -> None:
    try:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            _require(call, await auth.authenticate(credential))
    except InferdError as exc:
        raise abort(exc) from None


def _require(call: Call, principal: Principal) -> None:
    principal.require("admin" if call.method.name.startswith("Repository") else "infer")
    call.user = principal


def principal_of(call: Call) -> Principal:
    """The admitted caller of a call that needs one (fails closed when there is none)."""
    if not isinstance(call.user, Principal):
        raise Unauthorized("this call was not admitted")
    return call.user
