"""Iteration-level scheduling: which sequences run how many tokens in the next step.

Policy, in order, within a token budget per step (``max_batched_tokens``):
1. Running sequences first, oldest first: each decodes one token or continues its
   prefill with the next chunk. A long prompt is cut into chunks, so it never stalls
   everyone else's decoding for more than one step.
2. Then waiting sequences are admitted, best priority first (``params.priority``, 1 is
   high), oldest first within one, while budget, a running slot (``max_num_seqs``) and
   blocks for their first chunk are available (with ``whole_prompts``, only the step's
   first admission may be cut to the budget; a later one that does not fit waits).
When a running sequence needs a block and none is free, the youngest running sequence
of the worst priority is preempted: its blocks are freed and it goes back to the front
of its priority in the queue, to be recomputed later (prompt and the tokens it already
produced) rather than failing.
A finished or aborted sequence gives its blocks back at once.

With prefix caching (``prefix_caching``), a sequence admitted from the queue first takes
the cached blocks of its longest known prefix (never its last token, whose logits it
needs) and computes only the rest; a block becomes known once all its tokens are
computed (its key is registered when the sequence is next scheduled, preempted or
finished), so later turns of a conversation and prompts that share a system prompt
skip what was computed before (:mod:`inferd.llm.blocks`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.llm.blocks import BlockAllocator, block_key, blocks_needed
from inferd.llm.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_model_len: int = 1024
    max_waiting: int = 1024
    prefix_caching: bool = True
    whole_prompts: bool = False
    """Admit a waiting sequence only whole when it is not the step's first admission
    (the first may be cut, so every step moves the queue on): on a GPU, where first
    chunks are batched and a later chunk runs alone with a mask, a prompt cut at the
    end of a step's budget cost a per-sequence pass in every layer of the next step."""


@dataclass(frozen=True, slots=True)
class Scheduled:
    seq: Sequence
    num_tokens: int
    draft: int = 0
    """Of ``num_tokens``, how many are the sequence's draft (guessed tokens after its
    last known one, checked in this step)."""

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the known tokens (so a new token is sampled)?"""
        return self.seq.num_computed + self.num_tokens - self.draft == len(self.seq)


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_id: int | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.allocator = BlockAllocator(config.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.admitted: list[Sequence] = []
        """The sequences the last :meth:`schedule` took from the queue."""
        self.prefix_queries = 0
        """Tokens of admitted sequences looked up in the prefix cache, and of them found."""
        self.prefix_hits = 0

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue ``seq`` behind the waiting sequences of its priority or a better one
        (``first``: ahead of those of its own priority, as a preempted one goes back)."""
        waiting = self.waiting
        level = seq.params.priority
        if not first and (not waiting or waiting[-1].params.priority <= level):
            waiting.append(seq)
            return
        for at, other in enumerate(waiting):
            if other.params.priority > level or (first and other.params.priority == level):
                waiting.insert(at, seq)
                return
        waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_batched_tokens
        caching = self.config.prefix_caching
        out: list[Scheduled] = []
        self.admitted = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if caching:
                self._register(seq)
            draft = seq.draft
            n = min(seq.remaining + len(draft), budget)
            if draft and not self._reserve(seq, seq.num_computed + n):
                draft.clear()  # guesses get free blocks only: they preempt nobody
                n = min(seq.remaining, budget)
            if not self._reserve(seq, seq.num_computed + n):
                self._preempt(self._victim(i))
                continue  # retry this sequence (or the next one, if it was the victim)
            del draft[max(0, n - seq.remaining) :]  # what the budget left of the draft
            out.append(Scheduled(seq, n, len(draft)))
            budget -= n
            i += 1
        first = True
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if caching:
                self._reuse(seq)
            n = min(seq.remaining, budget)
            if (n < seq.remaining and not first and self.config.whole_prompts) or (
                not self._reserve(seq, seq.num_computed + n)
            ):
                self._release(seq)
                break  # it goes first in the next step
            first = False
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.admitted.append(seq)
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_computed
            seq.cached_tokens = seq.num_computed
            out.append(Scheduled(seq, n))
            budget -= n
        self._check_invariants()
        return out

    def _keys(self, seq: Sequence, n: int) -> list[bytes]:
        """The keys of ``seq``'s first ``n`` full blocks (computed once, then kept)."""
        keys = seq.block_keys
        if len(keys) < n:
            size = self.config.block_size
            parent = keys[-1] if keys else b""
            for at in range(len(keys) * size, n * size, size):
                parent = block_key(parent, seq.span(at, at + size), seq.cache_salt)
                keys.append(parent)
        return keys

    def _reuse(self, seq: Sequence) -> None:
        """A waiting sequence takes the cached blocks of its longest cached prefix."""
        usable = (len(seq) - 1) // self.config.block_size  # its last token is computed
        if usable == 0 or seq.block_table:
            return
        found = self.allocator.lookup(self._keys(seq, usable))
        seq.block_table = found
        seq.num_computed = len(found) * self.config.block_size
        seq.registered = len(found)

    def _release(self, seq: Sequence) -> None:
        """A waiting sequence that is not admitted gives back the cached blocks it took."""
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
            seq.num_computed = seq.registered = 0

    def _register(self, seq: Sequence) -> None:
        """``seq``'s blocks whose tokens are all computed become reusable prefixes."""
        full = min(seq.num_computed, len(seq)) // self.config.block_size
        if full <= seq.registered:
            return
        keys, table = self._keys(seq, full), seq.block_table
        for at in range(seq.registered, full):
            self.allocator.register(table[at], keys[at])
        seq.registered = full

    def _reserve(self, seq: Sequence, tokens: int) -> bool:
        missing = blocks_needed(tokens, self.config.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        blocks = self.allocator.allocate(missing)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def _victim(self, start: int) -> Sequence:
        """The youngest sequence of the worst priority among ``running[start:]`` (those
        not scheduled in this step yet)."""
        candidates = self.running[start:]
        worst = max(s.params.priority for s in candidates)
        return next(s for s in reversed(candidates) if s.params.priority == worst)

    def _preempt(self, seq: Sequence) -> None:
        seq.draft = []
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq, first=True)

    def update(
        self,
        step: list[Scheduled],
        sampled: dict[Sequence, int],
        accepted: dict[Sequence, int] | None = None,
    ) -> None:
        """Advance the sequences of a step; append sampled tokens; finish what is done.
        A sequence that checked a draft keeps the keys and values of the draft tokens
        ``accepted`` (its tokens are appended by the caller, one by one, :meth:`append`)."""
        for item in step:
            seq = item.seq
            seq.num_computed += item.num_tokens
            if item.draft:
                seq.num_computed -= item.draft - (accepted or {}).get(seq, 0)
                seq.draft = []
            token = sampled.get(seq)
            if token is not None:
                self.append(seq, token)

    def append(self, seq: Sequence, token: int) -> None:
        """One more output token; finish the sequence when it ends it."""
        seq.output_ids.append(token)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= params.max_tokens:
            return "length"
        if len(seq) >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _free(self, seq: Sequence) -> None:
        """``seq`` gives its blocks back (what it computed stays cached, reusable)."""
        if self.config.prefix_caching and seq.block_table:
            self._register(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.registered = 0

    def _check_invariants(self) -> None:
        held = sum(len(s.block_table) for s in self.running)
        assert held == self.allocator.references, (held, self.allocator.references)
        assert all(not s.block_table for s in self.waiting)
        assert len(self.running) <= self.config.max_num_seqs
