"""Choosing a replica for each request, in every gateway process.

The router follows the controller's routing table (pushed over a Unix socket), keeps
one multiplexed :class:`ReplicaClient` per replica, resolves each request's target
(:mod:`inferd.routing.targets`: a pinned version, the model's traffic split, its
serving version) and sends it to a ready replica of it (:mod:`inferd.routing.choice`).
Predict is idempotent, so a request whose replica dies mid-flight is retried once on
another one; a generation lost mid-stream is resumed on another.

When a version has no ready replica but one is coming, requests are held, not refused
(:mod:`inferd.routing.holds`).

Callers that wait for the controller to act (load, unload) await :meth:`Router.wait_for`,
which re-checks on every applied table instead of polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec

from inferd.errors import ModelNotFound
from inferd.routing.choice import (
    GenerationChoice,
    generation_load,
    least_loaded,
)
from inferd.routing.holds import Holds
from inferd.routing.server_link import ServerLink
from inferd.routing.targets import Routes, Shadow, Target
from inferd.serving.client import ReplicaClient, ReplicaGone
from inferd.shapes import replica as p
from inferd.shapes.control import ModelRoute, RoutingTable, VersionRoute
from inferd.telemetry.log_rows import COUNTERS

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_TRIES = 3
"""Replicas a generation may be sent to before its error is the caller's."""


class Router:
    def __init__(
        self,
        hold_timeout_s: float = 0.0,
        hold_max_requests: int = 0,
        prefix_block_bytes: int = 0,
        prefix_margin: float = 0.5,
        prefix_move_tokens: int = 0,
    ) -> None:
        self.choice = GenerationChoice(prefix_block_bytes, prefix_margin, prefix_move_tokens)
        self.holds = Holds(self, hold_timeout_s, hold_max_requests)
        self.routes = Routes(RoutingTable(0, {}), {})
        self._clients: dict[str, ReplicaClient] = {}
        self.received = asyncio.Event()
        self._applied = asyncio.Event()  # replaced after each table; set = "look again"
        self.server = ServerLink()
        """The control channel to the server: tables down; reconcile requests, log rows
        and /metrics queries up."""

    @property
    def table(self) -> RoutingTable:
        return self.routes.table

    async def follow(self, control: str | Path) -> None:
        """Subscribe to the controller's table; returns once the first one arrived."""
        await self.server.connect(control, self.apply)
        await self.received.wait()

    async def apply(self, table: RoutingTable) -> None:
        if table.epoch == self.table.epoch and table.generation <= self.table.generation:
            return  # an older table of the same controller
        wanted: dict[str, str] = {}
        for model in table.models.values():
            for vroute in model.versions.values():
                for r in vroute.replicas:
                    # a draining replica takes no new request: keep a connection to it
                    # for the answers still due, never open one (it may be gone already)
                    kept = self._clients.get(r.id)
                    if r.state == "ready" or (
                        r.state == "draining" and kept is not None and not kept.closed
                    ):
                        wanted[r.id] = r.address
        for rid in list(self._clients):
            if rid not in wanted:
                self._clients.pop(rid).close()
                if self.choice.prefix_block_bytes:
                    self.choice.prefix.forget(rid)
        await asyncio.gather(
            *(
                self._connect(rid, addr)
                for rid, addr in wanted.items()
                if rid not in self._clients or self._clients[rid].closed
            )
        )
        ready: dict[tuple[str, str], list[ReplicaClient]] = {}
        for model in table.models.values():
            for vroute in model.versions.values():
                ready[(model.name, vroute.version)] = [
                    self._clients[r.id]
                    for r in vroute.replicas
                    if r.state == "ready" and r.id in self._clients
                ]
        # Swapped whole, with no await between, so lookups always see one table.
        self.routes = Routes(table, ready, self.routes, self.holds.coming_version)
        self.received.set()
        self._applied.set()
        self._applied = asyncio.Event()

    async def wait_for(
        self, check: Callable[[RoutingTable], T | None], timeout_s: float
    ) -> T | None:
        """The first result of ``check`` that is not None, on the current table or one
        applied later; None if none came within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (result := check(self.table)) is None:
            applied = self._applied
            try:
                await asyncio.wait_for(applied.wait(), deadline - loop.time())
            except TimeoutError:
                return check(self.table)
        return result

    def waiting_for(self) -> list[str]:
        """Loaded models that have no serving version yet (what readiness waits for)."""
        return sorted(
            name
            for name, route in self.table.models.items()
            if route.loaded and route.default_version is None
        )

    async def _connect(self, rid: str, address: str) -> None:
        client = ReplicaClient(address, rid)
        if self.choice.prefix_block_bytes:
            client.on_prefix = self.choice.prefix.add
        for attempt in range(3):
            try:
                await client.connect()
            except FileNotFoundError:
                # A Unix socket that is not there: the replica is gone (a table this
                # gateway applies late still lists it); no wait, or tables pile up.
                logger.debug("replica %s is gone (%s)", rid, address)
                return
            except (OSError, TimeoutError) as exc:
                logger.warning("cannot connect to replica %s (try %d): %s", rid, attempt + 1, exc)
                await asyncio.sleep(0.05 * (attempt + 1))
            else:
                self._clients[rid] = client
                return

    def model(self, name: str) -> ModelRoute:
        return self.routes.model(name)

    def version_route(self, model: str, version: str) -> VersionRoute | None:
        return self.routes.version_route(model, version)

    def target(self, model: str, version: str | None = None, user: str | None = None) -> Target:
        """:meth:`Routes.target <inferd.routing.targets.Routes.target>` on the table now."""
        return self.routes.target(model, version, user)

    def resolve(self, name: str, version: str | None = None) -> tuple[Target, str | None]:
        return self.routes.resolve(name, version)

    def shadow_of(self, model: str) -> Shadow | None:
        return self.routes.shadow_of(model)

    def fallback_for(self, target: Target) -> Target | None:
        return self.routes.fallback_for(target)

    def overflow_for(self, target: Target) -> Target | None:
        return self.routes.overflow_for(target)

    async def resolve_arriving(
        self, name: str, version: str | None, until: float
    ) -> tuple[Target, str | None]:
        """:meth:`resolve`, waiting (until ``until``, ``time.perf_counter()``) for a
        model or version the table does not list yet but the registry does
        (:meth:`Holds.arriving <inferd.routing.holds.Holds.arriving>`)."""
        try:
            return self.resolve(name, version)
        except ModelNotFound as missing:
            await self.holds.arriving(name, version, until, missing)
        return self.resolve(name, version)

    async def infer(
        self,
        target: Target,
        inputs: dict[str, p.Tensor],
        rows: int,
        request: p.InferRequest,
        reference: dict[str, p.Tensor] | None = None,
        tolerance: float = 0.0,
    ) -> p.Answer:
        """One predict on the least busy ready replica of ``target``; one whose
        connection drops is retried once on another (predict is idempotent), and with
        none ready the request is held while one is coming."""
        return await self._on_replica(
            target, request, lambda c: c.infer(inputs, rows, request, reference, tolerance)
        )

    async def explain(
        self, target: Target, inputs: dict[str, p.Tensor], rows: int, request: p.InferRequest
    ) -> p.Explained:
        """Attributions of one request's predictions, from a replica of ``target`` chosen
        (held for, retried) as a predict's."""
        return await self._on_replica(target, request, lambda c: c.explain(inputs, rows, request))

    async def _on_replica(
        self,
        target: Target,
        request: p.InferRequest,
        call: Callable[[ReplicaClient], Awaitable[T]],
    ) -> T:
        tried: set[ReplicaClient] = set()
        until: float | None = None
        while True:
            client = least_loaded(self.connected(target.model, target.version), tried)
            if client is None:
                if until is None:
                    until = self.holds.until(target, request.started + request.timeout_s, tried)
                if await self.holds.hold(target, until, tried):
                    continue
                raise self.holds.not_ready(target, tried)
            try:
                return await call(client)
            except ReplicaGone:
                tried.add(client)  # a restarted replica is a new client: not excluded
                if len(tried) >= 2:
                    raise

    async def generate(
        self, target: Target, request: p.GenerateRequest
    ) -> AsyncGenerator[p.TokenChunk, None]:
        """Stream a generation. A replica lost before the first token is tried again on
        another; one lost mid-stream (killed, or drained past its grace) is resumed on
        another: sent the prompt and the tokens already streamed, it goes on after them
        (seeded draws depend on the position only, so it draws what the lost one would
        have); where its first chunk's text starts with the text so far, as it would have
        streamed it (``replayed``, inferd's engine), what the client has is cut: no
        token repeated, none missing (vLLM's engine streams the new tokens' text only)."""
        tried: set[ReplicaClient] = set()
        until: float | None = None
        sent: list[int] = []  # token ids the caller got
        chars = 0  # and the length of their text
        lost: ReplicaGone | None = None
        while True:
            client, keys = self.pick_generation(target, tried, request)
            if client is None:  # none (left): wait for one coming, a restart of the lost one too
                if until is None:
                    wait = request.first_timeout_s or request.idle_timeout_s
                    until = self.holds.until(target, time.perf_counter() + wait, tried)
                if await self.holds.hold(target, until, tried):
                    continue
                raise lost or self.holds.not_ready(target, tried)
            attempt = msgspec.structs.replace(request, resume=list(sent)) if sent else request
            skip = chars
            try:
                async with contextlib.aclosing(client.generate(attempt, keys)) as stream:
                    async for chunk in stream:
                        if skip and chunk.replayed:  # inferd's engine: the text so far first
                            chunk.text, skip = chunk.text[min(skip, chunk.replayed) :], 0
                        sent += chunk.token_ids
                        chars += len(chunk.text)
                        yield chunk
                    return
            except ReplicaGone as exc:
                tried.add(client)  # a restarted replica is a new client: not excluded
                if len(tried) >= MAX_TRIES:
                    raise
                if sent:
                    lost = exc
                    COUNTERS["resumed"] += 1

    def pick_generation(
        self, target: Target, exclude: set[ReplicaClient], request: p.GenerateRequest
    ) -> tuple[ReplicaClient | None, list[int] | None]:
        """The replica for a generation (:class:`~inferd.routing.choice.GenerationChoice`
        among several) and, when it was chosen by prefix, the prompt's keys."""
        candidates = [
            c
            for c in self.routes.ready.get((target.model, target.version), ())
            if not c.closed and c not in exclude
        ]
        if not self.choice.wanted(candidates, request):
            return least_loaded(candidates, exclude, generation_load), None
        return self.choice.choose(candidates, request)

    def connected(self, model: str, version: str) -> Sequence[ReplicaClient]:
        """The ready replicas of a version this gateway is connected to."""
        return self.routes.ready.get((model, version), ())

    def client(self, replica_id: str) -> ReplicaClient | None:
        return self._clients.get(replica_id)

    async def next_table(self, timeout_s: float) -> None:
        """Until the next table is applied (TimeoutError after ``timeout_s``)."""
        await asyncio.wait_for(self._applied.wait(), timeout_s)

    def clients_of(self, model: str, version: str) -> list[ReplicaClient]:
        route = self.version_route(model, version)
        if route is None:
            return []
        return [self._clients[r.id] for r in route.replicas if r.id in self._clients]

    def close(self) -> None:
        self.server.close()
        for client in self._clients.values():
            client.close()
