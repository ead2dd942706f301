"""What a generation carries across layers: its sampling parameters (from the gateway's
checks to either engine) and each engine's outputs (to the replica's core, which turns
them into :class:`~inferd.shapes.replica.TokenChunk` frames). No torch here: the
engine's use of them is :mod:`inferd.llm`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a generation samples: checked by the gateway
    (:func:`inferd.routing.generation.sampling_params`), carried in the
    :class:`~inferd.shapes.replica.Generate` frame (as a map of the fields that are not
    their defaults) to either engine. Invalid values raise ValueError when it is made
    (and fail a frame's decoding: the gateway never sends them)."""

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
        msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))

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


@dataclass(frozen=True, slots=True)
class TokenOutput:
    request_id: str
    text: str
    token_id: int | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprob: float | None = None
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache."""
    replayed: int = 0
    """Characters at the start of ``text`` that are a resumed request's text so far."""
    token_ids: list[int] | None = None
    """All the tokens of an output that has several (vLLM's, to a slow reader); None:
    ``token_id`` alone."""
    logprobs: list[float] | None = None
    """Their log-probabilities, when asked for."""
