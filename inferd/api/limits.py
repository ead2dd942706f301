"""Rate limits over HTTP: the gate that takes each request's tokens before its route
runs (429 over a limit, the X-RateLimit-* headers on what it lets through), and an HTTP
request's client and generation token budget. The budgets, their policy and their
storage are :mod:`inferd.access.limits` (shared with gRPC).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.access.limits import RateLimits, TokenBudget, client_key
from inferd.api.auth import internal_caller
from inferd.api.http import PUBLIC_PATHS, context_of, model_in_path, refuse
from inferd.api.state import gateway_of
from inferd.errors import RateLimited

if TYPE_CHECKING:
    from starlette.requests import Request


def http_client(scope: Scope) -> str:
    client = scope.get("client")
    return client_key(context_of(scope).principal, client[0] if client else None)


def budget_of(request: Request) -> TokenBudget | None:
    """The generation token budget of an HTTP request's client; None without one."""
    limits: RateLimits | None = gateway_of(request).limits
    if limits is None or internal_caller(
        request.scope, gateway_of(request).settings.auth.internal_token
    ):
        return None
    return limits.budget(http_client(request.scope))


class RateLimitGate:
    """ASGI middleware: takes a request's tokens before it runs; refuses with 429."""

    def __init__(self, app: ASGIApp, limits: RateLimits, internal_token: str | None = None) -> None:
        self.app = app
        self.limits = limits
        self.state = getattr(app, "state", None)
        self.internal_token = internal_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or PUBLIC_PATHS.match(scope["path"])
            or internal_caller(scope, self.internal_token)
        ):
            await self.app(scope, receive, send)
            return
        model = model_in_path(scope["path"]) if self.limits.config.models else None
        try:
            headers = await self.limits.take_request(http_client(scope), model)
        except RateLimited as exc:
            await refuse(exc, scope, receive, send)
            return
        if model is not None:
            context_of(scope).limited = model.partition(":")[0]
        if headers is None:
            await self.app(scope, receive, send)
            return
        extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                own: list[Any] = message.get("headers", [])
                if not any(name == b"x-ratelimit-limit" for name, _ in own):
                    # (a refused generation carries its token budget's figures instead)
                    message = {**message, "headers": [*own, *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
