"""Rate limits: token buckets per client, for all routes and per model.

A client is its API key id or JWT subject when authenticated, else its address. Each
request takes one token from the client's bucket for all routes (``rate_limits.default``)
and, when its path names a model with a limit (``rate_limits.models``), from that one
too. A bucket holds ``burst`` tokens and refills at ``requests_per_s``.

Embedded, buckets live in each gateway process (with several gateway processes a client
may get up to that many times the budget; one process, or Redis, makes it exact). With
``redis_url`` they live in Redis and every gateway process draws from the same ones: one
Lua script per bucket reads, refills and takes atomically on Redis's own clock.

Every limited reply carries ``X-RateLimit-Limit`` (the burst), ``X-RateLimit-Remaining``
and ``X-RateLimit-Reset`` (seconds until the bucket is full again); over the limit the
answer is 429 with ``Retry-After`` (seconds until a token is there).
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.api.http import PUBLIC_PATHS, model_in_path, refuse
from inferd.config import Limit, RateLimitConfig
from inferd.errors import RateLimited

MAX_LOCAL_BUCKETS = 100_000


class Limiter(Protocol):
    async def take(self, key: str, limit: Limit) -> tuple[bool, float]:
        """(allowed, tokens left after this request)."""
        ...

    async def close(self) -> None: ...


class LocalLimiter:
    """Buckets in this process: key -> (tokens, time of the last refill)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    async def take(self, key: str, limit: Limit) -> tuple[bool, float]:
        return self.take_now(key, limit, time.monotonic())

    def take_now(self, key: str, limit: Limit, now: float) -> tuple[bool, float]:
        tokens, last = self._buckets.get(key, (float(limit.burst), now))
        tokens = min(float(limit.burst), tokens + (now - last) * limit.requests_per_s)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        if len(self._buckets) >= MAX_LOCAL_BUCKETS and key not in self._buckets:
            self._buckets.clear()  # bounded memory: forgetting full buckets is harmless
        self._buckets[key] = (tokens, now)
        return allowed, tokens

    async def close(self) -> None:
        pass


_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil then
  tokens = burst
  ts = now
end
tokens = math.min(burst, tokens + (now - ts) * rate)
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(tokens)}
"""


class RedisLimiter:
    """Buckets in Redis, shared by every gateway process (one atomic script each)."""

    def __init__(self, url: str, prefix: str = "inferd:rl:") -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(url)
        self._script = self._redis.register_script(_TAKE)
        self._prefix = prefix

    async def take(self, key: str, limit: Limit) -> tuple[bool, float]:
        allowed, tokens = await self._script(
            keys=[self._prefix + key], args=[limit.requests_per_s, limit.burst]
        )
        return bool(int(allowed)), float(tokens)

    async def close(self) -> None:
        await self._redis.aclose()


def _headers(limit: Limit, tokens: float) -> dict[str, str]:
    reset = (limit.burst - tokens) / limit.requests_per_s
    return {
        "X-RateLimit-Limit": str(limit.burst),
        "X-RateLimit-Remaining": str(max(0, math.floor(tokens))),
        "X-RateLimit-Reset": str(math.ceil(reset)),
    }


class RateLimitGate:
    """ASGI middleware: takes tokens before the request runs; refuses with 429."""

    def __init__(self, app: ASGIApp, config: RateLimitConfig, limiter: Limiter) -> None:
        self.app = app
        self.config = config
        self.limiter = limiter
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or PUBLIC_PATHS.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        who = _client(scope)
        checks: list[tuple[str, Limit]] = []
        if self.config.default is not None:
            checks.append((f"all:{who}", self.config.default))
        if self.config.models and (model := model_in_path(scope["path"])) is not None:
            model_limit = self.config.models.get(model)
            if model_limit is not None:
                checks.append((f"model:{model}:{who}", model_limit))
        tightest: dict[str, str] | None = None
        for key, limit in checks:
            allowed, tokens = await self.limiter.take(key, limit)
            headers = _headers(limit, tokens)
            if not allowed:
                wait = (1.0 - tokens) / limit.requests_per_s
                headers["Retry-After"] = str(max(1, math.ceil(wait)))
                scope_name = "this model" if key.startswith("model:") else "all routes"
                error = RateLimited(
                    f"rate limit exceeded ({limit.burst} requests at once, "
                    f"{limit.requests_per_s:g}/s sustained, for {scope_name}); "
                    f"retry in {wait:.1f}s",
                    headers,
                )
                await refuse(error, scope, receive, send)
                return
            if tightest is None or int(headers["X-RateLimit-Remaining"]) < int(
                tightest["X-RateLimit-Remaining"]
            ):
                tightest = headers
        if tightest is None:
            await self.app(scope, receive, send)
            return
        extra = [(k.lower().encode(), v.encode()) for k, v in tightest.items()]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _client(scope: Scope) -> str:
    principal: Any = scope.get("inferd.principal")
    if principal is not None:
        return f"{principal.kind[0]}:{principal.subject}"
    client = scope.get("client")
    return f"ip:{client[0]}" if client else "ip:unknown"


def limiter_for(redis_url: str | None) -> Limiter:
    return RedisLimiter(redis_url) if redis_url else LocalLimiter()
