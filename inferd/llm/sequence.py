"""A request inside the engine: its tokens, sampling parameters, blocks and state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from inferd.shapes.llm import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter_slot: int = -1
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose keys/values are in the cache."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    generator: torch.Generator | None = None
    draft_limit: int | None = None
    """Draft tokens its next guess may have (None: the configured number)."""
    draft_misses: int = 0
    """Guesses in a row of which no token was kept."""
    draft_pause: int = 0
    """Steps to go before it guesses again (after misses: 1, 2, 4 ... 16 steps)."""
    cache_salt: bytes = b""
    """Part of its blocks' prefix-cache keys: what else than its tokens its keys and
    values depend on (the LoRA adapter that computes them)."""
    block_keys: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of its first full blocks (:mod:`inferd.llm.blocks`)."""
    registered: int = 0
    """Its first blocks (of ``block_table``) that the prefix cache knows."""
    cached_tokens: int = 0
    """Tokens found in the prefix cache when it was last admitted."""
    draft: list[int] = field(default_factory=list)
    """Tokens guessed to follow (speculative decoding), computed in the next step after
    the last known token and kept as far as the model agrees (:mod:`inferd.llm.speculation`)."""

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def span(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building ``tokens`` (a decode step asks every
        sequence for its last token)."""
        cut = len(self.prompt_ids)
        if start >= cut:
            return self.output_ids[start - cut : end - cut]
        if end <= cut:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - cut]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Known tokens not yet in the cache (prompt left to prefill, or the last token)."""
        return len(self) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
