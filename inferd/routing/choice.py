"""Which ready replica takes a request.

A predict goes to the replica with the fewest of this gateway's requests in flight
(:func:`least_loaded` with :func:`outstanding`). A generation, among several replicas,
goes through :class:`GenerationChoice`: filters (the replicas that fit one more
sequence, those with the request's LoRA adapter loaded or room to load it) and a scorer
(where the prompt's longest known prefix went, see :mod:`inferd.routing.prefix`), each
within the load margin; the least engine-loaded replica (:func:`generation_load`)
otherwise. Every choice reads the replicas' own reports (``Load`` frames) and this
gateway's counts; none waits."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from inferd.routing.prefix import BYTES_PER_TOKEN, PrefixIndex, prompt_bytes, prompt_keys
from inferd.serving.client import ReplicaClient
from inferd.shapes import replica as p


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


def least_loaded(
    candidates: Iterable[ReplicaClient],
    exclude: set[ReplicaClient],
    load: Callable[[ReplicaClient], Any] = outstanding,
) -> ReplicaClient | None:
    """The connected replica of ``candidates``, not in ``exclude``, with the least
    ``load`` (predict: this gateway's outstanding requests; generation:
    :func:`generation_load`)."""
    best: ReplicaClient | None = None
    best_load: Any = None
    for client in candidates:
        if client.closed or client in exclude:
            continue
        weight = load(client)
        if best is None or weight < best_load:
            best, best_load = client, weight
    return best


class GenerationChoice:
    """A generation's replica among several: adapter and prefix preferences within the
    load margin (``llm.prefix_routing_*``)."""

    def __init__(
        self, prefix_block_bytes: int = 0, prefix_margin: float = 0.5, prefix_move_tokens: int = 0
    ) -> None:
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

    def wanted(self, candidates: list[ReplicaClient], request: p.GenerateRequest) -> bool:
        """Whether the choice has anything to prefer among ``candidates`` (else the least
        loaded will do)."""
        return len(candidates) > 1 and (
            bool(self.prefix_block_bytes) or request.adapter is not None
        )

    def choose(
        self, candidates: list[ReplicaClient], request: p.GenerateRequest
    ) -> tuple[ReplicaClient, list[int] | None]:
        """The replica for a generation among ``candidates`` (two or more, connected)
        and, when it was chosen by prefix, the prompt's keys: one that has the request's
        LoRA adapter loaded first (else one with room to load it), then where its
        prompt's longest prefix went, each within the load margin."""
        adapter = request.adapter
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
