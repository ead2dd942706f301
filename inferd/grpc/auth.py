"""Authentication for the gRPC service, with the same credentials and scopes as HTTP
(:mod:`inferd.api.auth`): metadata ``authorization: Bearer <key or JWT>`` or
``x-api-key``. ServerLive/ServerReady are public; the repository RPCs need admin; the
rest infer. The caller's :class:`Principal` rides in a context variable (each call runs
in its own task), so RPCs check the model a request names (``allowed``)."""

from __future__ import annotations

import contextvars

from inferd.api.auth import Authenticator, Principal, credential_of
from inferd.grpc.http2 import Call

PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "grpc_principal", default=None
)
PUBLIC = frozenset({"ServerLive", "ServerReady"})


def allowed(model: str) -> None:
    """Raise Forbidden when the caller may not use ``model`` (no-op without auth)."""
    principal = PRINCIPAL.get()
    if principal is not None:
        principal.allow_model(model)


async def authenticate(auth: Authenticator, call: Call) -> None:
    """The caller's principal, from the call's metadata, into :data:`PRINCIPAL`; raises
    the :class:`~inferd.errors.InferdError` refusing it."""
    principal = await auth.authenticate(credential_of(call.metadata))
    principal.require("admin" if call.method.name.startswith("Repository") else "infer")
    PRINCIPAL.set(principal)
