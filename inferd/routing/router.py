"""Choosing a replica for each request, in every gateway process.

The router follows the controller's routing table (pushed over a Unix socket), keeps
one multiplexed :class:`ReplicaClient` per replica, and sends each request to the
ready replica of the chosen version with the fewest outstanding requests. Predict is
idempotent, so a request whose replica dies mid-flight is retried once on another one.

When a version has no ready replica but one is coming (a crash restart, a first load),
requests are held, not refused: they wait for the table that shows it ready, within
their deadline, ``hold_timeout_s`` and ``hold_max_requests`` held at once per gateway
process (like Knative's activator). A replica whose loads keep failing is not waited for.

Callers that wait for the controller to act (load, unload) await :meth:`Router.wait_for`,
which re-checks on every applied table instead of polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from inferd.errors import InferdError, ModelNotFound, ModelNotReady
from inferd.observability.log_rows import COUNTERS
from inferd.routing.prefix import BYTES_PER_TOKEN, PrefixIndex, prompt_bytes, prompt_keys
from inferd.routing.server_link import ServerLink
from inferd.serving.client import ReplicaClient, ReplicaGone
from inferd.shapes import replica as p
from inferd.shapes.control import ModelRoute, ReplicaRoute, RoutingTable, VersionRoute
from inferd.shapes.graph import GRAPH_FRAMEWORK as GRAPH
from inferd.shapes.tensors import Signature

logger = logging.getLogger(__name__)
T = TypeVar("T")
COLD_START: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "inferd_cold_start", default=None
)
"""Set (``time.perf_counter()``) when the current request waited for a version scaled to
zero to start: the data plane reports how long it waited (``x-inferd-cold-start-ms``)."""


@dataclass(frozen=True, slots=True)
class Routed:
    """How a generation's replica was chosen among several (its inference log row)."""

    decision: str
    """``prefix``: where its longest known prefix went; ``balance``: a less loaded
    replica that lacks little more of it (``llm.prefix_routing_move_tokens``);
    ``overloaded``: that replica (or every one holding a prefix of it) was over its
    share, so the least loaded; ``new``: no replica was sent any of it, so the least
    loaded; ``adapter``: one with its LoRA adapter loaded; ``adapter-load``: none had it
    (within the margin), so one with room to load it."""
    expected: float
    """The share of the prompt expected in the chosen replica's prefix cache (0 to 1)."""


ROUTED: contextvars.ContextVar[Routed | None] = contextvars.ContextVar(
    "inferd_routed", default=None
)
"""Set for the current generation when its replica was chosen by prefix."""


class Split:
    """A traffic split over versions with ready replicas: cumulative shares in a fixed
    order (newest version first). A request falls at a point in [0, total): a random one,
    or, with a user key, a hash of it, so a user keeps a version, and moving the split
    by x % moves only the users in that x % (the ranges grow or shrink at their ends)."""

    __slots__ = ("bounds", "targets", "total")

    def __init__(self, shares: list[tuple[int, Target]]) -> None:
        bounds, total = [], 0
        for pct, _ in shares:
            total += pct
            bounds.append(total)
        self.bounds = bounds
        self.targets = [t for _, t in shares]
        self.total = total

    def choose(self, user: str | None = None) -> Target:
        point = (random.random() if user is None else user_point(user)) * self.total
        for bound, target in zip(self.bounds, self.targets, strict=True):
            if point < bound:
                return target
        return self.targets[-1]


def user_point(user: str) -> float:
    """A user's fixed point in [0, 1)."""
    digest = hashlib.blake2b(user.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _split(
    route: ModelRoute,
    ready: dict[tuple[str, str], list[ReplicaClient]],
    targets: dict[tuple[str, str], Target],
) -> Split | None:
    """The model's split over its versions that have ready replicas (None: no split,
    requests go to the serving version)."""
    shares = [
        (pct, targets[(route.name, version)])
        for version, pct in route.traffic.items()
        if pct > 0
        and (route.name, version) in targets
        and (ready.get((route.name, version)) or targets[(route.name, version)].framework == GRAPH)
    ]
    if len(shares) < 2:
        return None
    return Split(shares)


@dataclass(frozen=True, slots=True)
class Target:
    """A model version that can receive a request, with its decoded signature."""

    model: str
    version: str
    signature: Signature
    framework: str
    allow_non_finite: bool = False
    """Float inputs may be NaN or ±Infinity (the version's metadata says so)."""


@dataclass(frozen=True, slots=True)
class Shadow:
    """Where a model's requests are mirrored: ``fraction`` of them, compared with the live
    answers within ``tolerance``."""

    target: Target
    fraction: float
    tolerance: float


MAX_TRIES = 3
"""Replicas a generation may be sent to before its error is the caller's."""
KV_FULL = 0.9
"""A generation replica whose KV cache is fuller than this is chosen last: a sequence
sent there would wait for blocks, or preempt one that runs."""


def outstanding(client: ReplicaClient) -> int:
    """A predict replica's load: this gateway's requests in flight to it."""
    return client.outstanding


def generation_load(client: ReplicaClient) -> tuple[float, float, int]:
    """A generation replica's load: :func:`engine_load`, then this gateway's
    outstanding requests among equals."""
    return (*engine_load(client), client.outstanding)


def engine_load(client: ReplicaClient) -> tuple[float, float]:
    """How busy a generation replica is, as its engine says (``Load`` frames): whether
    its KV cache is nearly full, then the sequences it runs and queues for every gateway
    plus those this gateway sent since that report. Before any report, this gateway's
    own outstanding requests."""
    report = client.engine
    if report is None:
        return (0.0, float(client.outstanding))
    full = 1.0 if report.kv_used > KV_FULL else 0.0
    return (full, float(report.running + report.waiting + client.sent_since_load))


def coming_back(replica: ReplicaRoute) -> bool:
    """A replica that should be ready soon: a first start, or a restart of one that
    served (not one whose loads keep failing)."""
    if replica.state in ("starting", "loading"):
        return replica.restarts == 0 or replica.ever_ready
    return replica.state == "failed" and replica.ever_ready


class Router:
    def __init__(
        self,
        hold_timeout_s: float = 0.0,
        hold_max_requests: int = 0,
        prefix_block_bytes: int = 0,
        prefix_margin: float = 0.5,
        prefix_move_tokens: int = 0,
    ) -> None:
        self.hold_timeout_s = hold_timeout_s
        self.hold_max_requests = hold_max_requests
        self.prefix_block_bytes = prefix_block_bytes
        """Bytes of a prompt block for prefix-aware choice (0: off; see
        :mod:`inferd.routing.prefix`)."""
        self.prefix_margin = prefix_margin
        self.prefix_move_blocks = (
            prefix_move_tokens * BYTES_PER_TOKEN // prefix_block_bytes if prefix_block_bytes else 0
        )
        """Blocks of prompt a less loaded replica may lack beyond the preferred one's and
        still be chosen instead (``llm.prefix_routing_move_tokens``)."""
        self.prefix = PrefixIndex()
        """Where each prompt key went, as this gateway sent it and replicas report it."""
        self.holding = 0
        """Requests waiting now for a replica that is coming."""
        self._asked: dict[tuple[str, str], float] = {}
        self.table = RoutingTable(0, {})
        self._clients: dict[str, ReplicaClient] = {}
        self._ready: dict[tuple[str, str], list[ReplicaClient]] = {}
        self._targets: dict[tuple[str, str], Target] = {}
        self._splits: dict[str, Split] = {}
        """Models whose unpinned requests are split between versions."""
        self._shadows: dict[str, Shadow] = {}
        """Models with a shadow version that has ready replicas."""
        self.deployed: Callable[[str, str | None], bool] | None = None
        """Asks the registry whether a version is deployed, or (version None) whether a
        model is registered (set by the gateway): what the table does not list yet is
        waited for when it is (see :meth:`arriving`)."""
        self._not_deployed: dict[tuple[str, str | None], float] = {}
        self.received = asyncio.Event()
        self._applied = asyncio.Event()  # replaced after each table; set = "look again"
        self.server = ServerLink()
        """The control channel to the server: tables down; reconcile requests, log rows
        and /metrics queries up."""

    async def follow(self, control: str | Path) -> None:
        """Subscribe to the controller's table; returns once the first one arrived."""
        await self.server.connect(control, self.apply)
        await self.received.wait()

    async def apply(self, table: RoutingTable) -> None:
        if table.epoch == self.table.epoch and table.generation <= self.table.generation:
            return  # an older table of the same controller
        wanted: dict[str, str] = {}
        targets: dict[tuple[str, str], Target] = {}
        for model in table.models.values():
            for vroute in model.versions.values():
                key = (model.name, vroute.version)
                known = self._targets.get(key)
                if known is None or known.allow_non_finite != vroute.allow_non_finite:
                    known = Target(
                        model.name,
                        vroute.version,
                        vroute.signature,
                        vroute.framework,
                        vroute.allow_non_finite,
                    )
                targets[key] = known
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
                if self.prefix_block_bytes:
                    self.prefix.forget(rid)
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
        splits = {
            model.name: split
            for model in table.models.values()
            if (split := _split(model, ready, targets)) is not None
        }
        shadows = {
            model.name: Shadow(targets[(model.name, v.version)], v.mirror_pct / 100, v.tolerance)
            for model in table.models.values()
            for v in model.versions.values()
            if v.mirror_pct > 0 and ready.get((model.name, v.version))
        }
        # Swapped together, with no await between, so lookups always see one table.
        self._ready, self._targets, self._splits, self.table = ready, targets, splits, table
        self._shadows = shadows
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
        if self.prefix_block_bytes:
            client.on_prefix = self.prefix.add
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
        route = self.table.models.get(name)
        if route is None:
            raise ModelNotFound(f"model {name!r} not found", model=name)
        return route

    def target(self, model: str, version: str | None = None, user: str | None = None) -> Target:
        """The version a request goes to: ``version`` when pinned, else by the model's
        traffic split (the same ``user`` always lands on the same version while the split
        holds), else the serving version."""
        if version is None and (split := self._splits.get(model)) is not None:
            return split.choose(user)
        route = self.model(model)
        if version is None:
            version = route.default_version
            if version is None and not route.loaded:
                raise ModelNotReady(
                    f"model {model!r} is unloaded; load it with "
                    f"POST /v2/repository/models/{model}/load",
                    model=model,
                )
            if version is None:
                version = self._coming_version(route)
            if version is None:
                raise ModelNotReady(f"model {model!r} has no ready version yet", model=model)
        elif version not in route.versions:
            raise ModelNotFound(
                f"version {version!r} of model {model!r} is not deployed",
                model=model,
                version=version,
            )
        return self._targets[(model, version)]

    async def arriving(
        self, model: str, version: str | None, until: float, missing: Exception
    ) -> Target:
        """The target of a request for what the table does not list (``target`` raised
        ``missing``): a pinned ``version`` whose deployment was just written, or (no
        version) a model just registered — the registry knows it, the controller has not
        published it yet, and another gateway process may already have said it serves.
        It is waited for, like a replica that is starting: until a table lists it (then
        the request is held for its replica as usual) or ``until``
        (``time.perf_counter()``, within ``hold_timeout_s``): 503 with Retry-After,
        never 404. Anything else: ``missing`` (404) at once; "not there" answers are kept
        a second, so unknown names cost one registry read a second, not one per
        request."""
        key = (model, version)
        now = time.monotonic()
        if self.deployed is None or self.hold_timeout_s <= 0:
            raise missing
        if self._not_deployed.get(key, 0.0) > now:
            raise missing
        try:
            known = await asyncio.to_thread(self.deployed, model, version)
        except Exception:  # the registry unreachable: answer as before it was asked
            logger.warning("cannot ask the registry about %s:%s", model, version, exc_info=True)
            known = False
        if not known:
            if len(self._not_deployed) > 10_000:
                self._not_deployed.clear()
            self._not_deployed[key] = now + 1.0
            raise missing
        until = min(until, time.perf_counter() + self.hold_timeout_s)

        def listed(table: RoutingTable) -> bool | None:
            route = table.models.get(model)
            if route is None or (version is not None and version not in route.versions):
                return None
            return True

        if await self.wait_for(listed, until - time.perf_counter()):
            return self.target(model, version)
        if version is None:
            raise ModelNotReady(
                f"model {model!r} is registered but not started yet", retry_after_s=2, model=model
            )
        raise ModelNotReady(
            f"version {version!r} of model {model!r} is deployed but not started yet",
            retry_after_s=2,
            model=model,
            version=version,
        )

    def _coming_version(self, route: ModelRoute) -> str | None:
        """With no version ready: the one a request should wait for (the largest share of
        the traffic, else any) when it has a replica coming or can start one; else None."""
        if self.hold_timeout_s <= 0:
            return None
        coming = [
            v
            for v, vroute in route.versions.items()
            if vroute.scale_from_zero or any(map(coming_back, vroute.replicas))
        ]
        if not coming:
            return None
        return max(coming, key=lambda v: route.traffic.get(v, 0))

    def _coming(self, target: Target) -> bool:
        route = self.table.models.get(target.model)
        vroute = route.versions.get(target.version) if route and route.loaded else None
        if vroute is None:
            return False
        connected = self._ready.get((target.model, target.version), ())
        if vroute.scale_from_zero and all(c.closed for c in connected):
            # scaled to zero, on its way up, or just unloaded under a memory budget (its
            # table may still say ready): the controller starts one
            self._ask_for(target)
            return True
        for replica in vroute.replicas:
            if coming_back(replica):
                return True
            # Its connection dropped before the controller saw it die: it will restart.
            client = self._clients.get(replica.id)
            if replica.state == "ready" and (client is None or client.closed):
                return True
        return False

    def _hold_until(self, target: Target, deadline: float) -> float:
        """When a request finding no ready replica stops waiting for one (counted as held
        when one is coming)."""
        if self._coming(target):
            COUNTERS["held"] += 1
        return min(deadline, time.perf_counter() + self.hold_timeout_s)

    def _ask_for(self, target: Target) -> None:
        """Ask the controller for a replica of a version scaled to zero (once a second
        per version, whatever the number of requests held)."""
        key = (target.model, target.version)
        now = time.monotonic()
        if now - self._asked.get(key, -1.0) >= 1.0:
            self._asked[key] = now
            self.server.send_demand(target.model, target.version)
        if COLD_START.get() is None:
            COLD_START.set(time.perf_counter())

    async def _hold(self, target: Target, until: float) -> bool:
        """Wait for the next table while ``target`` has a replica coming, until ``until``
        (``time.perf_counter()``); False when the request must not wait (nothing is
        coming, too many are held, no time is left)."""
        left = until - time.perf_counter()
        if left <= 0 or self.holding >= self.hold_max_requests or not self._coming(target):
            return False
        self.holding += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._applied.wait(), left)
        finally:
            self.holding -= 1
        return True

    def shadow_of(self, model: str) -> Shadow | None:
        """The model's shadow version, when it has one that can take mirrored requests."""
        return self._shadows.get(model) if self._shadows else None

    def fallback_for(self, target: Target) -> Target | None:
        """Where a request ``target`` failed goes next: the model's serving version, if
        it is another one, has ready replicas, and ``target``'s deployment allows it."""
        route = self.table.models.get(target.model)
        if route is None or route.default_version in (None, target.version):
            return None
        failed = route.versions.get(target.version)
        if failed is None or not failed.fallback:
            return None
        key = (target.model, route.default_version)
        found = self._targets.get(key)
        ready = self._ready.get(key) or (found is not None and found.framework == GRAPH)
        return found if ready else None

    def overflow_for(self, target: Target) -> Target | None:
        """Where a request goes while ``target`` is saturated: its version's overflow
        model (serving version), if it is served and takes the same inputs."""
        route = self.version_route(target.model, target.version)
        name = None if route is None else route.overflow_model
        if name is None:
            return None
        try:
            overflow = self.target(name)
        except InferdError:
            return None
        mine = {(t.name, t.datatype) for t in target.signature.inputs}
        if {(t.name, t.datatype) for t in overflow.signature.inputs} != mine:
            logger.warning(
                "overflow model %s of %s:%s takes other inputs; not used",
                name, target.model, target.version,
            )  # fmt: skip
            return None
        return overflow if self._ready.get((overflow.model, overflow.version)) else None

    def resolve(self, name: str, version: str | None = None) -> tuple[Target, str | None]:
        """A model name, an adapter name registered with a model, or ``base:adapter``
        (an adapter loaded at run time) -> the serving target and the adapter."""
        if name in self.table.models:
            return self.target(name, version), None
        base, sep, adapter = name.partition(":")
        if sep and base in self.table.models and adapter:
            return self.target(base, version), adapter
        for model in self.table.models.values():
            serving = model.versions.get(model.default_version or "")
            if serving is not None and name in serving.adapters:
                return self.target(model.name, version), name
        raise ModelNotFound(f"model {name!r} not found", model=name)

    async def resolve_arriving(
        self, name: str, version: str | None, until: float
    ) -> tuple[Target, str | None]:
        """:meth:`resolve`, waiting (until ``until``, ``time.perf_counter()``) for a
        model or version the table does not list yet but the registry does
        (:meth:`arriving`)."""
        try:
            return self.resolve(name, version)
        except ModelNotFound as missing:
            await self.arriving(name, version, until, missing)
        return self.resolve(name, version)

    def version_route(self, model: str, version: str) -> VersionRoute | None:
        route = self.table.models.get(model)
        return route.versions.get(version) if route else None

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
            client = self._pick(target, tried)
            if client is None:
                if until is None:
                    until = self._hold_until(target, request.started + request.timeout_s)
                if await self._hold(target, until):
                    continue
                raise self._not_ready(target)
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
            client, keys = self._pick_generation(target, tried, request)
            if client is None:  # none (left): wait for one coming, a restart of the lost one too
                if until is None:
                    wait = request.first_timeout_s or request.idle_timeout_s
                    until = self._hold_until(target, time.perf_counter() + wait)
                if await self._hold(target, until):
                    continue
                raise lost or self._not_ready(target)
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

    def _pick_generation(
        self,
        target: Target,
        exclude: set[ReplicaClient],
        request: p.GenerateRequest,
    ) -> tuple[ReplicaClient | None, list[int] | None]:
        """The replica for a generation and, when it was chosen by prefix, the prompt's
        keys (see :mod:`inferd.routing.prefix`). With several replicas, one that has
        the request's LoRA adapter loaded first (else one with room to load it), then
        where its prompt's longest prefix went, each within the load margin."""
        candidates = [
            c
            for c in self._ready.get((target.model, target.version), ())
            if not c.closed and c not in exclude
        ]
        adapter = request.adapter
        if len(candidates) < 2 or (not self.prefix_block_bytes and adapter is None):
            return self._pick(target, exclude, generation_load), None
        fits = self._fits(candidates)
        decision = None
        if adapter is not None:
            candidates, decision = self._for_adapter(candidates, adapter, fits)
        keys, expected = None, 0.0
        if self.prefix_block_bytes and len(candidates) > 1:
            data = prompt_bytes(request.prompt, adapter)
            keys = prompt_keys(data, self.prefix_block_bytes)
            client, depth, by_prefix = self._by_prefix(candidates, keys, fits)
            self.prefix.add(keys, client.replica_id)
            expected = round(depth * self.prefix_block_bytes / len(data), 3) if depth else 0.0
            decision = decision or by_prefix
        else:
            client = min(candidates, key=generation_load)
        if adapter is not None:
            client.sent_adapter(adapter)
        ROUTED.set(Routed(decision or "new", expected))
        return client, keys

    def _fits(self, candidates: list[ReplicaClient]) -> set[ReplicaClient]:
        """The replicas a preference (a loaded adapter, a cached prefix) may send one
        more generation to: not over their fair share of the load (this request
        counted) by more than ``prefix_margin`` of it, or one sequence, whichever is
        more, and with room in their KV cache. Near idle, one replica must not take
        every new chat because it was the first to compute their common system prompt
        while another waits with nothing to do."""
        loads = {c: engine_load(c) for c in candidates}
        fair = (sum(load for _, load in loads.values()) + 1) / len(candidates)
        limit = fair + max(1.0, self.prefix_margin * fair) - 1
        return {c for c, (full, load) in loads.items() if full == 0.0 and load <= limit}

    def _for_adapter(
        self, candidates: list[ReplicaClient], adapter: str, fits: set[ReplicaClient]
    ) -> tuple[list[ReplicaClient], str]:
        """The replicas a request for ``adapter`` may go to: those with it loaded (or
        sent a request for it a moment ago, before their report says so) that fit;
        else those with room to load it; else all."""
        holders = [c for c in candidates if c in fits and c.has_adapter(adapter)]
        if holders:
            return holders, "adapter"
        room = [c for c in candidates if c.engine is None or c.engine.adapter_room > 0]
        return room or candidates, "adapter-load"

    def _by_prefix(
        self, candidates: list[ReplicaClient], keys: list[int], fits: set[ReplicaClient]
    ) -> tuple[ReplicaClient, int, str]:
        """Among ``candidates``: the least loaded of those sent the prompt's longest
        known prefix that ``fits`` -- or a less loaded one that fits and lacks at most
        ``prefix_move_blocks`` more of it; else the least loaded. With how many of
        ``keys`` it was sent, and why it was chosen (:class:`Routed`)."""
        depth = self._depths(candidates, keys)
        fit = [c for c in candidates if c in fits]
        if fit:
            best = min(fit, key=lambda c: (-depth[c], generation_load(c)))
            if depth[best]:
                lightest = min(fit, key=generation_load)
                busy = engine_load(best)[1]
                # one sequence or none is not busy, and may be a report 20 ms old of one
                # that just ended (this chat's previous turn): no reason to move
                if (
                    busy >= 2
                    and engine_load(lightest)[1] < busy
                    and depth[best] - depth[lightest] <= self.prefix_move_blocks
                ):
                    return lightest, depth[lightest], "balance"
                return best, depth[best], "prefix"
        best = min(candidates, key=generation_load)
        decision = "overloaded" if any(depth.values()) else "new"
        return best, depth[best], decision

    def _depths(self, candidates: list[ReplicaClient], keys: list[int]) -> dict[ReplicaClient, int]:
        """How many of ``keys`` (from the first) each candidate was sent, as far as the
        index knows: the deepest key that lists it."""
        by_id = {c.replica_id: c for c in candidates}
        depth = dict.fromkeys(candidates, 0)
        left = len(candidates)
        for at in range(len(keys), 0, -1):
            for replica in self.prefix.holders(keys[at - 1]):
                client = by_id.get(replica)
                if client is not None and not depth[client]:
                    depth[client] = at
                    left -= 1
            if not left:
                break
        return depth

    def _pick(
        self,
        target: Target,
        exclude: set[ReplicaClient],
        load: Callable[[ReplicaClient], Any] = outstanding,
    ) -> ReplicaClient | None:
        """The connected ready replica of ``target`` with the least ``load`` (predict:
        this gateway's outstanding requests; generation: :func:`generation_load`)."""
        candidates = self._ready.get((target.model, target.version), ())
        best: ReplicaClient | None = None
        best_load: Any = None
        for client in candidates:
            if client.closed or client in exclude:
                continue
            weight = load(client)
            if best is None or weight < best_load:
                best, best_load = client, weight
        return best

    def _not_ready(self, target: Target) -> ModelNotReady:
        if self._coming(target):
            COUNTERS["held_expired"] += 1
            why = "a replica is starting but was not ready within the request's deadline"
        else:
            why = "no ready replica"
        return ModelNotReady(
            f"{why} for {target.model}:{target.version}",
            model=target.model,
            version=target.version,
        )

    def clients_of(self, model: str, version: str) -> list[ReplicaClient]:
        route = self.version_route(model, version)
        if route is None:
            return []
        return [self._clients[r.id] for r in route.replicas if r.id in self._clients]

    def close(self) -> None:
        self.server.close()
        for client in self._clients.values():
            client.close()
