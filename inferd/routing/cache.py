"""The result cache: answers of deterministic predict requests, reused.

Key: BLAKE2b over the model, the version that was actually chosen (so a new version, or
another arm of a split, never serves an old version's answer), and the request's input
tensors in their wire form (name, datatype, shape, bytes: the same values sent as JSON
or binary give the same key). Values: the output arrays.

Embedded: an LRU bounded in bytes (``cache.max_bytes``) in each gateway process.
With ``redis_url``: Redis, shared by every gateway process, entries msgpack-encoded with
a TTL. Per model version, ``metadata.cache_ttl_s`` overrides the TTL and 0 turns caching
off for it (a model with randomness, or one reading outside state). Only answers are
cached, never errors, and never an answer a fallback version gave.

Generations are cached too when they are deterministic (temperature 0, top_k 1, or a
seed), whole (finished by a stop or the length), and on the base model or an adapter
registered with its version (an adapter loaded at run time may change under its name:
never cached). A hit answers the whole text as one chunk.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any, Protocol

import msgspec
import numpy as np

from inferd.routing.table import VersionRoute
from inferd.serving import protocol as p
from inferd.serving.protocol import Columns

logger = logging.getLogger(__name__)


def cache_key(model: str, version: str, inputs: dict[str, p.Tensor]) -> bytes:
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{model}\0{version}\0".encode())
    for name in sorted(inputs):
        tensor = inputs[name]
        digest.update(f"{name}\0{tensor.datatype}\0{tensor.shape}\0".encode())
        data = tensor.data
        digest.update(data if isinstance(data, bytes) else msgspec.msgpack.encode(data))
    return digest.digest()


def version_ttl(route: VersionRoute | None, default_s: float) -> float:
    """How long a version's answers are kept: its own ``cache_ttl_s``, else the default."""
    return default_s if route is None or route.cache_ttl_s is None else route.cache_ttl_s


def deterministic(params: dict[str, Any]) -> bool:
    """A generation with these sampling parameters always makes the same text: greedy
    (temperature 0, or top_k 1) or seeded (the sequence's own generator)."""
    return (
        params.get("temperature", 1.0) == 0
        or params.get("top_k") == 1
        or params.get("seed") is not None
    )


def generation_key(
    model: str,
    version: str,
    digest: str,
    adapter: str | None,
    prompt: str | list[int] | dict[str, Any],
    params: dict[str, Any],
) -> bytes:
    """The key of a deterministic generation: the version (and its artifact's sha256,
    which covers the adapters registered with it), the adapter, the prompt and every
    sampling parameter (the length, the stops and logprobs change the answer too; the
    priority does not)."""
    hashed = hashlib.blake2b(digest_size=20)
    hashed.update(f"gen\0{model}\0{version}\0{digest}\0{adapter or ''}\0".encode())
    shaping = sorted((k, v) for k, v in params.items() if k != "priority")
    hashed.update(msgspec.msgpack.encode([prompt, shaping]))
    return hashed.digest()


def chunk_columns(chunk: p.TokenChunk) -> Columns:
    """A whole generation (one finished chunk) as a cache value."""
    return {"generation": np.frombuffer(msgspec.msgpack.encode(chunk), dtype=np.uint8)}


def columns_chunk(columns: Columns) -> p.TokenChunk:
    return msgspec.msgpack.decode(columns["generation"].tobytes(), type=p.TokenChunk)


class ResultCache(Protocol):
    hits: int
    misses: int

    async def get(self, key: bytes) -> Columns | None: ...

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None: ...

    async def close(self) -> None: ...


class LocalCache:
    """An LRU of answers in this process, bounded by the bytes of their arrays."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, tuple[float, Columns, int]] = OrderedDict()

    async def get(self, key: bytes) -> Columns | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            if entry is not None:
                self._drop(key)
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None:
        size = sum(a.nbytes for a in outputs.values()) + 200  # + the entry's own overhead
        if size > self.max_bytes // 8:
            return  # one answer may not evict an eighth of the cache
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (time.monotonic() + ttl_s, outputs, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: bytes) -> None:
        _, _, size = self._entries.pop(key)
        self.bytes -= size

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        self._entries.clear()
        self.bytes = 0


class RedisCache:
    """Answers in Redis (``inferd:rc:<key hex>``), shared by every gateway process."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as redis

        # RESP2 (see inferd.jobs.queue): a request cancelled mid-command (its client went
        # away) must not leave redis-py 8's RESP3 parser spinning on the connection.
        self._redis = redis.from_url(url, protocol=2)
        self.hits = 0
        self.misses = 0

    async def get(self, key: bytes) -> Columns | None:
        try:
            raw = await self._redis.get(b"inferd:rc:" + key.hex().encode())
        except Exception as exc:  # the cache is an optimisation: never fail a request
            logger.warning("result cache: Redis get failed: %s", exc)
            raw = None
        if raw is None:
            self.misses += 1
            return None
        self.hits += 1
        body = raw.encode() if isinstance(raw, str) else raw  # bytes: no decode_responses
        tensors = msgspec.msgpack.decode(body, type=dict[str, p.Tensor])
        return {name: p.from_tensor(t) for name, t in tensors.items()}

    async def put(self, key: bytes, outputs: Columns, ttl_s: float) -> None:
        body = msgspec.msgpack.encode({n: p.to_tensor(np.asarray(a)) for n, a in outputs.items()})
        try:
            await self._redis.set(b"inferd:rc:" + key.hex().encode(), body, px=int(ttl_s * 1000))
        except Exception as exc:
            logger.warning("result cache: Redis set failed: %s", exc)

    async def close(self) -> None:
        await self._redis.aclose()


def cache_for(max_bytes: int, redis_url: str | None) -> ResultCache:
    return RedisCache(redis_url) if redis_url else LocalCache(max_bytes)
