"""What one engine step hands the model, and where the model keeps keys and values.

The KV cache is paged: a sequence's keys/values live in fixed-size blocks anywhere in
one preallocated tensor, found through the sequence's block table, so memory is
allocated a block at a time as sequences grow and never fragments. A *slot* is one
token position in that tensor: ``slot = block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Keys and values of all layers: ``[n_layer, 2, num_blocks*block_size, n_head, head_dim]``."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensor = torch.zeros(
            (n_layer, 2, num_blocks * block_size, n_head, head_dim), dtype=dtype, device=device
        )

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slots of token positions ``start..end-1`` of a sequence with this block table."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]


@dataclass
class ModelInput:
    """One forward pass over the new tokens of several sequences (chunked prefill and
    decode mixed). Sequences appear in the same order in every per-sequence list."""

    input_ids: torch.Tensor
    """[T] int64: the new tokens of all sequences, concatenated."""
    positions: torch.Tensor
    """[T] int64: absolute position of each new token in its sequence."""
    slot_mapping: torch.Tensor
    """[T] int64: the cache slot each new token's key/value is written to."""
    new_lens: list[int]
    """Per sequence: how many new tokens it has in ``input_ids`` (sum = T)."""
    context_lens: list[int]
    """Per sequence: tokens already in the cache before this step."""
    block_tables: list[list[int]]
    """Per sequence: physical blocks covering positions 0 .. context_len + new_len - 1."""
    logits_indices: torch.Tensor
    """[S] int64: indices into the T new tokens whose next-token logits are wanted
    (the last new token of each sequence that ends its prefill or decodes)."""
    adapter_slots: list[int]
    """Per sequence: the LoRA adapter slot it uses, -1 for the base model."""
