"""Rate limits: token buckets per client, of requests and of generation tokens.

A client is its API key id or JWT subject when authenticated, else its address; HTTP and
gRPC name it the same (:func:`client_key`), so one client's calls over both draw from the
same buckets.

Requests. Each request (an HTTP request, a gRPC call, a request inside a gRPC stream)
takes one token from the client's bucket for all routes (``rate_limits.default``) and,
when it names a model with a limit (``rate_limits.models``; in the path, or in the gRPC
message), from that one too. A bucket holds ``burst`` tokens and refills at
``requests_per_s``. Probes (``/health/*``, ``/metrics``, ServerLive, ServerReady) are
never limited.

Generation tokens. ``rate_limits.tokens`` (all generative models together) and
``rate_limits.model_tokens`` (per model) are budgets of prompt + completion tokens per
client, refilled at ``tokens_per_minute / 60`` per second up to ``burst`` (default one
minute's worth). What a generation costs is known only once it ends, so the policy is
admit, then charge: a generation starts only while each of its budgets is not in debt
(>= 0 tokens); when it ends (finished, failed or cancelled after its first token) its
actual ``prompt_tokens + completion_tokens`` are charged, which may drive a budget into
debt, and until the debt is repaid every generation of that client is refused, with
``Retry-After`` the seconds until it is. Nothing is reserved at admission: generations
admitted together may overshoot by what they make (at most their ``max_tokens``), and
the overshoot is repaid before the next one starts. A failure before the first token
costs nothing.

Storage. Embedded, buckets live in each gateway process (with several gateway processes a
client may get up to that many times the budget; one process, or Redis, makes it exact).
With ``redis_url`` they live in Redis and every gateway process draws from the same ones:
one Lua script reads, refills and takes atomically on Redis's own clock, the same for a
request (take 1 if 1 is there), an admission (take 0 if not in debt) and a charge (take
n, into debt if need be).

Every request-limited HTTP reply carries ``X-RateLimit-Limit`` (the burst),
``X-RateLimit-Remaining`` and ``X-RateLimit-Reset`` (seconds until the bucket is full
again); over a limit the answer is 429 with ``Retry-After`` (seconds until the request
would pass) and those headers, counted in tokens for a token budget. gRPC answers
RESOURCE_EXHAUSTED with the same as trailing metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Protocol

from inferd.config import RateLimitConfig, Settings, TokenLimit
from inferd.errors import RateLimited
from inferd.telemetry.log_rows import COUNTERS

if TYPE_CHECKING:
    from inferd.access.principal import Principal
    from inferd.shapes.replica import TokenChunk

logger = logging.getLogger(__name__)
MAX_LOCAL_BUCKETS = 100_000


class Bucket(Protocol):
    """The shape of a bucket: :class:`inferd.config.Limit` or :class:`TokenLimit`."""

    @property
    def rate_per_s(self) -> float: ...

    @property
    def capacity(self) -> int: ...


class Limiter(Protocol):
    async def take(
        self, key: str, bucket: Bucket, cost: float = 1.0, need: float = 1.0
    ) -> tuple[bool, float]:
        """Refill ``key``'s bucket, then take ``cost`` tokens if at least ``need`` are
        there (``need=-inf``: take them anyway, into debt); (taken, tokens left)."""
        ...

    async def close(self) -> None: ...


class LocalLimiter:
    """Buckets in this process: key -> (tokens, time of the last refill)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    async def take(
        self, key: str, bucket: Bucket, cost: float = 1.0, need: float = 1.0
    ) -> tuple[bool, float]:
        return self.take_now(key, bucket, time.monotonic(), cost, need)

    def take_now(
        self, key: str, bucket: Bucket, now: float, cost: float = 1.0, need: float = 1.0
    ) -> tuple[bool, float]:
        capacity = float(bucket.capacity)
        tokens, last = self._buckets.get(key, (capacity, now))
        tokens = min(capacity, tokens + (now - last) * bucket.rate_per_s)
        taken = tokens >= need
        if taken:
            tokens -= cost
        if len(self._buckets) >= MAX_LOCAL_BUCKETS and key not in self._buckets:
            self._buckets.clear()  # bounded memory: forgets full buckets (and rare debts)
        self._buckets[key] = (tokens, now)
        return taken, tokens

    async def close(self) -> None:
        pass


_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local need = tonumber(ARGV[4])
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
local taken = 0
if tokens >= need then
  tokens = tokens - cost
  taken = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {taken, tostring(tokens)}
"""
"""The key expires once it would be full again (a debt included): a full bucket is
the same as none."""


class RedisLimiter:
    """Buckets in Redis, shared by every gateway process (one atomic script each)."""

    def __init__(self, url: str, prefix: str = "inferd:rl:") -> None:
        import redis.asyncio as redis

        # RESP2 (see inferd.jobs.queue): a request cancelled mid-command (its client went
        # away) must not leave redis-py 8's RESP3 parser spinning on the connection.
        self._redis = redis.from_url(url, protocol=2)
        self._script = self._redis.register_script(_TAKE)
        self._prefix = prefix

    async def take(
        self, key: str, bucket: Bucket, cost: float = 1.0, need: float = 1.0
    ) -> tuple[bool, float]:
        taken, tokens = await self._script(
            keys=[self._prefix + key],
            args=[bucket.rate_per_s, bucket.capacity, cost, "-inf" if need == -math.inf else need],
        )
        return bool(int(taken)), float(tokens)

    async def close(self) -> None:
        await self._redis.aclose()


Check = tuple[str, Bucket, str]
"""A bucket to take from: its key, its shape, and what it covers (for the message)."""


class RateLimits:
    """``rate_limits`` on one limiter: what the HTTP gate, the gRPC calls (grpc/limits.py) and
    generation (:class:`TokenBudget`) call. One per gateway process, shared by HTTP and
    gRPC, so a client's budget is one whichever protocol it uses."""

    def __init__(self, config: RateLimitConfig, limiter: Limiter) -> None:
        self.config = config
        self.limiter = limiter

    async def take_request(self, who: str, model: str | None = None) -> dict[str, str] | None:
        """One request of client ``who``, naming ``model`` or none: the X-RateLimit-*
        headers of its tightest bucket (None: no limit applies). Raises
        :class:`RateLimited` when a bucket is empty."""
        checks: list[Check] = []
        if self.config.default is not None:
            checks.append((f"all:{who}", self.config.default, "all routes"))
        if model is not None and (limit := self.config.models.get(model)) is not None:
            checks.append((f"model:{model}:{who}", limit, "this model"))
        return await self.take(checks, 1.0, 1.0)

    async def take_model(self, who: str, model: str) -> None:
        """One request of client ``who`` from ``model``'s limit alone (a model named in
        a body, or called by a graph: the request took from ``default`` already)."""
        if (limit := self.config.models.get(model)) is not None:
            await self.take([(f"model:{model}:{who}", limit, "this model")], 1.0, 1.0)

    def budget(self, who: str) -> TokenBudget | None:
        """Client ``who``'s generation token budgets; None when none is set."""
        return TokenBudget(self, who) if self.config.limits_tokens else None

    async def take(self, checks: list[Check], cost: float, need: float) -> dict[str, str] | None:
        """Take ``cost`` from each bucket of ``checks`` holding at least ``need``: the
        X-RateLimit-* headers of the tightest; raises :class:`RateLimited` at the first
        that does not."""
        tightest: dict[str, str] | None = None
        for key, bucket, covers in checks:
            taken, tokens = await self.limiter.take(key, bucket, cost, need)
            headers = _headers(bucket, tokens)
            if not taken:
                raise _refusal(bucket, tokens, need, covers, headers)
            if tightest is None or int(headers["X-RateLimit-Remaining"]) < int(
                tightest["X-RateLimit-Remaining"]
            ):
                tightest = headers
        return tightest

    async def close(self) -> None:
        await self.limiter.close()


class TokenBudget:
    """One client's generation token budgets: :meth:`admit` before a generation starts,
    its chunks through :meth:`charged` (see the module docstring for the policy)."""

    def __init__(self, limits: RateLimits, who: str) -> None:
        self.limits = limits
        self.who = who

    def _checks(self, model: str) -> list[Check]:
        config, who = self.limits.config, self.who
        checks: list[Check] = []
        if config.tokens is not None:
            checks.append((f"tokens:{who}", config.tokens, "all generative models"))
        if (limit := config.model_tokens.get(model)) is not None:
            checks.append((f"tokens:{model}:{who}", limit, "this model"))
        return checks

    async def admit(self, model: str) -> None:
        """Raise :class:`RateLimited` when a budget of ``model`` is in debt."""
        await self.limits.take(self._checks(model), 0.0, 0.0)

    async def charged(
        self, chunks: AsyncGenerator[TokenChunk, None], model: str
    ) -> AsyncGenerator[TokenChunk, None]:
        """``chunks``, and once they end (or are closed) the tokens of the last one
        (counts are cumulative) charged to ``model``'s budgets."""
        last = None
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    last = chunk
                    yield chunk
        finally:
            if last is not None and (used := last.prompt_tokens + last.completion_tokens):
                # A task, awaited through a shield: a cancelled stream still pays.
                task = asyncio.ensure_future(self._charge(model, used))
                _CHARGING.add(task)
                task.add_done_callback(_CHARGING.discard)
                await asyncio.shield(task)

    async def _charge(self, model: str, used: int) -> None:
        try:
            for key, bucket, _ in self._checks(model):
                await self.limits.limiter.take(key, bucket, used, -math.inf)
        except Exception:
            logger.exception("charging %d tokens to %s failed", used, self.who)


_CHARGING: set[asyncio.Future[None]] = set()
"""Charges in flight: the event loop keeps only weak references to tasks."""


def _headers(bucket: Bucket, tokens: float) -> dict[str, str]:
    reset = (bucket.capacity - tokens) / bucket.rate_per_s
    return {
        "X-RateLimit-Limit": str(bucket.capacity),
        "X-RateLimit-Remaining": str(max(0, math.floor(tokens))),
        "X-RateLimit-Reset": str(math.ceil(reset)),
    }


def _refusal(
    bucket: Bucket, tokens: float, need: float, covers: str, headers: dict[str, str]
) -> RateLimited:
    wait = (need - tokens) / bucket.rate_per_s
    headers["Retry-After"] = str(max(1, math.ceil(wait)))
    if isinstance(bucket, TokenLimit):
        COUNTERS["rate_limited:tokens"] += 1
        what = (
            f"token limit exceeded ({bucket.capacity} tokens at once, "
            f"{bucket.tokens_per_minute} per minute sustained, for {covers})"
        )
    else:
        COUNTERS["rate_limited:requests"] += 1
        what = (
            f"rate limit exceeded ({bucket.capacity} requests at once, "
            f"{bucket.rate_per_s:g}/s sustained, for {covers})"
        )
    return RateLimited(f"{what}; retry in {wait:.1f}s", headers)


def client_key(principal: Principal | None, address: str | None) -> str:
    """Whose budgets: ``k:<key id>`` or ``j:<JWT subject>`` when authenticated, else
    ``ip:<address>`` (an IPv4-mapped IPv6 address as plain IPv4, as either protocol may
    see it)."""
    if principal is not None:
        return f"{principal.kind[0]}:{principal.subject}"
    if address is None:
        return "ip:unknown"
    return f"ip:{address.removeprefix('::ffff:') if '.' in address else address}"


def rate_limits_for(settings: Settings) -> RateLimits | None:
    """The gateway process's rate limits (None when none is set): in process, or in
    Redis with ``redis_url``."""
    config = settings.rate_limits
    if not (config.limits_requests or config.limits_tokens):
        return None
    url = settings.redis_url
    return RateLimits(config, RedisLimiter(url) if url else LocalLimiter())
