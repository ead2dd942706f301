"""The engine on an NVIDIA GPU: paged decode attention as a Triton kernel, and decode
steps replayed from CUDA graphs.

Why a kernel: PyTorch's path (:mod:`inferd.llm.attention`) first copies every decoding
sequence's keys and values out of the paged cache into a padded batch and then runs SDPA
over the copy, so the cache is read twice and the copy written once; the kernel reads
each key and value once, through the block table. It also takes fixed-shape inputs (a
``[B, max_blocks]`` table and ``[B]`` lengths), which is what lets a decode step be
captured in a CUDA graph whatever the sequences' lengths.

Why graphs: a decode step of GPT-2 small is ~250 small kernels; launched one by one from
Python, the launches, not the GPU, set the step time at small batches. A pure-decode
step (every scheduled sequence has one new token, the common case) is replayed from a
graph captured for the next batch size up (:data:`BUCKETS`); padding rows decode
nothing into a scratch block. Steps with prefill chunks run eagerly.

Triton is imported on first use: the CPU path never needs it. ``TRITON_INTERPRET=1``
runs the kernel on CPU tensors (slowly), which is how it is tested without a GPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from inferd.llm.batch import KVCache, ModelInput
    from inferd.llm.lora import LoRABank

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
"""Batch sizes a decode graph is captured for (up to ``max_num_seqs``, which is added)."""
CHUNK = 64
"""Keys a kernel program reads per iteration (several cache blocks)."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        Q, K, V, Out, Tables, Lens, scale,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr, DPAD: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, head): online softmax over the sequence's keys,
        # CHUNK at a time, each key found through the block table.
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(Lens + b)
        d = tl.arange(0, DPAD)
        dmask = d < D
        q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0)
        q = q.to(tl.float32) * scale
        t = tl.arange(0, CHUNK)
        top = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
        acc = tl.zeros([DPAD], tl.float32)
        for start in tl.range(0, length, CHUNK):
            pos = start + t
            live = pos < length
            block = tl.load(Tables + b * stride_tb + pos // BLOCK, mask=live, other=0)
            slot = block.to(tl.int64) * BLOCK + pos % BLOCK
            where = slot[:, None] * stride_ks + h * stride_kh + d[None, :]
            both = live[:, None] & dmask[None, :]
            k = tl.load(K + where, mask=both, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1)
            s = tl.where(live, s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, axis=0))
            p = tl.exp(s - new_top)
            fade = tl.exp(top - new_top)
            v = tl.load(V + where, mask=both, other=0.0).to(tl.float32)
            total = total * fade + tl.sum(p, axis=0)
            acc = acc * fade + tl.sum(p[:, None] * v, axis=0)
            top = new_top
        out = acc / total
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)

    return paged_decode


def available() -> bool:
    """Can the Triton kernel run here (Triton importable)?"""
    try:
        _kernel()
    except ImportError:
        return False
    return True


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each row of ``q`` ([B, H, D], one new token per sequence) over its
    sequence's ``lens[b]`` keys/values in ``kv_layer`` ([2, slots, H, D]), found through
    ``tables`` ([B, n] cache blocks). Returns ``[B, H, D]`` in ``q``'s dtype."""
    batch, heads, dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    keys, vals = kv_layer[0], kv_layer[1]
    assert keys.stride(2) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    chunk = max(CHUNK, block_size)
    kernel = _kernel()  # imports triton
    import triton

    kernel[(batch, heads)](
        q, keys, vals, out, tables, lens, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK=block_size, CHUNK=chunk, D=dim, DPAD=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out


class DecodeGraphs:
    """CUDA graphs of a model's pure-decode step, one per batch bucket (with and without
    LoRA), sharing one set of static input buffers and one memory pool.

    ``forward(ids, positions, slots, tables, lens, lora_rows)`` must be the model's
    fixed-shape decode pass (:meth:`inferd.llm.model.GPT2.decode`); it is captured as is.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        cache: KVCache,
        max_batch: int,
        max_blocks: int,
        lora: LoRABank | None,
        scratch_block: int,
    ) -> None:
        device = cache.tensor.device
        self.forward, self.cache, self.lora = forward, cache, lora
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.scratch_block = scratch_block
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        i64: dict[str, Any] = {"dtype": torch.int64, "device": device}
        self.ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slots = torch.zeros(max_batch, **i64)
        self.tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.lora_rows = torch.full((max_batch,), -1, **i64)
        # One pinned host buffer for all inputs: one copy to the device per step.
        self._host = torch.zeros((max_batch, 5 + max_blocks), dtype=torch.int64)
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self._staged = torch.zeros((max_batch, 5 + max_blocks), **i64)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory)."""
        self._fill_padding(0)  # the warm-up and capture run on padding rows only
        variants = [False, True] if self.lora is not None else [False]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for with_lora in variants:  # warm-up: Triton compiles, cuBLAS picks kernels
                for bucket in self.buckets[-1:] + self.buckets[:1]:
                    vocab = self._call(bucket, with_lora).shape[-1]
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # Every graph writes its logits into this one buffer: a graph's own output would
        # stay allocated for the graph's life, and 36 graphs' outputs at 512 sequences
        # were ~1 GB of GPT-2's 50257-wide float32 rows.
        out = torch.empty((self.max_batch, vocab), dtype=torch.float32, device=self.ids.device)
        for with_lora in variants:
            for bucket in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out[:bucket].copy_(self._call(bucket, with_lora))
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bucket, with_lora] = (graph, out[:bucket])
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batches %s)", len(self.graphs), self.buckets)

    def _call(self, bucket: int, with_lora: bool) -> torch.Tensor:
        return self.forward(
            self.ids[:bucket],
            self.positions[:bucket],
            self.slots[:bucket],
            self.tables[:bucket],
            self.lens[:bucket],
            self.lora_rows[:bucket] if with_lora else None,
        )

    def _fill_padding(self, batch: int) -> None:
        """Rows past ``batch`` decode position 0 into the scratch block."""
        self.ids[batch:] = 0
        self.positions[batch:] = 0
        self.slots[batch:] = self.scratch_block * self.cache.block_size
        self.tables[batch:] = self.scratch_block
        self.lens[batch:] = 1
        self.lora_rows[batch:] = -1

    def fits(self, inp: ModelInput) -> bool:
        """Is ``inp`` a decode step a graph holds: one new token per sequence, each
        sampled, within the captured batch and context sizes?"""
        n = len(inp.new_lens)
        return (
            n <= self.max_batch
            and inp.logits_indices.numel() == n
            and all(k == 1 for k in inp.new_lens)
            and all(len(t) <= self.max_blocks for t in inp.block_tables)
        )

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a pure-decode step (:meth:`fits`), from a graph."""
        bucket, with_lora = self.stage(inp)
        graph, logits = self.graphs[bucket, with_lora]
        graph.replay()
        return logits[: len(inp.new_lens)]

    def stage(self, inp: ModelInput) -> tuple[int, bool]:
        """Copy ``inp`` into the static buffers; returns the graph's (bucket, with LoRA)."""
        n = len(inp.new_lens)
        bucket = next(b for b in self.buckets if b >= n)
        with_lora = self.lora is not None and any(s >= 0 for s in inp.adapter_slots)
        # Columns: ids, positions, slots, lens, adapter slots, then the block table;
        # padding rows (n..bucket) decode into the scratch block.
        host = self._host.numpy()
        host[:bucket] = 0
        host[:n, 0] = inp.input_ids.numpy()
        host[:n, 1] = inp.positions.numpy()
        host[:n, 2] = inp.slot_mapping.numpy()
        host[n:bucket, 2] = self.scratch_block * self.cache.block_size
        host[:n, 3] = inp.context_lens
        host[:bucket, 3] += 1
        host[:n, 4] = inp.adapter_slots
        host[n:bucket, 4] = -1
        host[n:bucket, 5:] = self.scratch_block
        for row, table in enumerate(inp.block_tables):
            host[row, 5 : 5 + len(table)] = table
        staged = self._staged[:bucket]
        staged.copy_(self._host[:bucket], non_blocking=True)
        self.ids[:bucket].copy_(staged[:, 0])
        self.positions[:bucket].copy_(staged[:, 1])
        self.slots[:bucket].copy_(staged[:, 2])
        self.lens[:bucket].copy_(staged[:, 3])
        self.lora_rows[:bucket].copy_(staged[:, 4])
        self.tables[:bucket].copy_(staged[:, 5:])
        return bucket, with_lora
