"""A request inside the engine: its tokens, sampling parameters, blocks and state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """0 means no top-k cut."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    priority: int = 2
    """1 (high) to 4 (batch): waiting sequences start best level first, and a preemption
    takes the worst level's youngest running sequence."""
    guide: dict[str, Any] | None = None
    """Constrained output: ``{"json": schema}`` or ``{"json_object": True}``
    (see :mod:`inferd.api.structured`)."""
    # vLLM's sampling extensions (and OpenAI's penalties), as vLLM defines them:
    repetition_penalty: float = 1.0
    """Tokens of the prompt and the output so far: positive logits divided by it,
    negative ones multiplied (1: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds."""
    frequency_penalty: float = 0.0
    """Subtracted once per time the output already holds the token."""
    min_p: float = 0.0
    """Sampled rows keep only tokens at least this share of the likeliest one's
    probability (0: off)."""
    min_tokens: int = 0
    """Until the output holds this many tokens, EOS and ``stop_token_ids`` cannot be
    chosen (stop strings still stop)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the generation (``stop``), like EOS."""
    include_stop_str_in_output: bool = False
    """The stop string or stop token that ended it is part of the text."""
    skip_special_tokens: bool = True
    """Special tokens (EOS) add no text."""
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be from 0 to max_tokens")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a minimum length change its logits before the choice."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
