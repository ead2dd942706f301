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

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

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

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Known tokens not yet in the cache (prompt left to prefill, or the last token)."""
        return len(self) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
