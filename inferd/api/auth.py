"""Who is calling over HTTP, and may they: the scope each route needs, the gate in front
of every route, and the checks of handlers and listings. Who a credential names is
:mod:`inferd.access` (API keys and JWTs, shared with gRPC).

Off by default (a laptop); with ``auth.enabled`` every route but health and metrics
needs a credential: ``Authorization: Bearer <key or JWT>`` (what the ``openai`` client
sends as its api_key) or ``X-API-Key: <key>``.

Scopes: ``admin`` (control plane: registry writes and artifact downloads, deployments,
keys, logs, repository; includes infer) and ``infer`` (predict, infer, generate, OpenAI,
model metadata). No or bad credential → 401 with ``WWW-Authenticate``; a valid one
without the scope or the model → 403. Credentials never reach a log line.

What a caller may call is what it may see:
:meth:`~inferd.access.principal.Principal.may_use` is the one rule behind both the 403
(:meth:`~inferd.access.principal.Principal.allow_model`) and every model listing
(:func:`visible_models`), so a key limited to ``fraud`` neither calls nor lists ``iris``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.access.authenticator import Authenticator, credential_of
from inferd.access.principal import INTERNAL, is_internal_token
from inferd.api.http import PUBLIC_PATHS, context_of, model_in_path, refuse
from inferd.errors import InferdError

_ADMIN_PREFIXES = (
    "/api/v1/deployments",
    "/api/v1/keys",
    "/api/v1/logs",
    "/v2/repository",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
_INFER_WRITES = re.compile(r"^/api/v1/models/[^/]+/((versions/[^/]+/)?explain|predict|generate)$")
"""POSTs under ``/api/v1/models`` that run a model (the rest change the registry)."""


def required_scope(method: str, path: str) -> str | None:
    """The scope a request needs: None (public), "infer" or "admin"."""
    if PUBLIC_PATHS.match(path):
        return None
    if path.startswith(_ADMIN_PREFIXES):
        return "admin"
    if path.startswith("/api/v1/models") and (
        (method not in ("GET", "HEAD") and not _INFER_WRITES.match(path))
        or path.endswith("/artifact")
    ):
        return "admin"  # pushing, changing or deleting models; downloading their files
    return "infer"


def internal_caller(scope: Scope, token: str | None) -> bool:
    """Whether the server's job runner sent this request (with auth on or off): its
    requests are not rate limited (the job was, when it was submitted)."""
    if token is None:
        return False
    principal = context_of(scope).principal
    if principal is not None:
        return principal is INTERNAL
    for name, value in scope["headers"]:
        if name == b"authorization":
            return is_internal_token(value.decode("latin-1").removeprefix("Bearer "), token)
    return False


def _any_model(model: str) -> bool:
    return True


def visible_models(scope: Scope) -> Callable[[str], bool]:
    """Which models a listing shows this request's caller: those it may call (an
    adapter goes with its base model), every one when auth is off."""
    principal = context_of(scope).principal
    return _any_model if principal is None else principal.may_use


def authorize_model(scope: Scope, model: str) -> None:
    """A handler's check for a model named in the body (no-op when auth is off)."""
    principal = context_of(scope).principal
    if principal is not None:
        principal.allow_model(model)


class AuthGate:
    """ASGI middleware in front of every HTTP route (installed only when auth is on)."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.auth = authenticator
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        need = required_scope(scope["method"], path)
        if need is not None:
            try:
                headers = ((n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"])
                principal = await self.auth.authenticate(credential_of(headers))
                principal.require(need)
                if (model := model_in_path(path)) is not None:
                    principal.allow_model(model)
            except InferdError as exc:
                await refuse(exc, scope, receive, send)
                return
            context_of(scope).principal = principal
        await self.app(scope, receive, send)
