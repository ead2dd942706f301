"""Paged causal attention for one engine step: decode tokens batched, prefill chunks per sequence.

Design rule: everything that depends only on the step's shape (which tokens decode, which
cache slots each sequence reads, the masks) is computed once in :meth:`AttentionPlan.build`
and reused by every layer; a layer only writes its new keys/values and runs the kernels.

Two paths, because the two shapes want different kernels on CPU:

* **Decode** (sequences with one new token): their context *blocks* are gathered into
  one padded ``[B, n_blocks]`` index, the keys/values read with one ``index_select`` of
  whole blocks (one contiguous copy of ``block_size`` tokens each: measured 1.5x faster
  than gathering token slots) and a single SDPA call with an additive length mask
  serves the whole batch. (At most four
  such groups, split by context length, so one long context does not make every
  sequence pad to it.)
  On a GPU a Triton kernel (:mod:`inferd.llm.cuda`) reads the keys through the block
  table instead, with no copy.
* **Prefill chunks** (more than one new token): one SDPA call per sequence. A first chunk
  (no context) attends over its own fresh keys with ``is_causal``; a later chunk reads its
  context through the block table and uses an explicit mask, because ``is_causal`` aligns
  the triangle top-left and would be wrong when the keys are longer than the queries.

On CPU, half-precision attention runs in float32: without native bf16/fp16 units the
float32 SDPA kernel is faster than the half one (measured 2x at batch 8, AVX2) and more
accurate; the cache itself stays in the model dtype.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from inferd.llm import native
from inferd.llm.batch import ModelInput

BATCHED_FIRST_CHUNKS = frozenset({"cuda"})
"""Devices where first prefill chunks go through one padded SDPA call per group: on a
GPU the per-sequence calls' launches were most of a 500-prompt prefill step; on a CPU
the padding would cost real work (the per-sequence path stays there)."""
Rows = slice | torch.Tensor
"""Which of the step's new tokens a path covers: a contiguous slice or an index tensor."""


@dataclass
class DecodeGroup:
    """Sequences with one new token each, attended in one batched SDPA call."""

    rows: Rows
    blocks: torch.Tensor
    """Flattened ``[B * n_blocks]`` cache blocks (padding reads block 0)."""
    lens: torch.Tensor
    """``[B]`` int64: each sequence's length, the new token included (on the CPU)."""
    max_len: int
    mask: torch.Tensor | None
    """Additive ``[B, 1, 1, n_blocks * block_size]`` mask of the positions past each
    sequence's length; None when every sequence fills its blocks exactly."""
    device_lens: torch.Tensor | None = None
    """``lens`` on the GPU, for the Triton kernel (None on a CPU)."""


@dataclass
class FirstChunks:
    """First prefill chunks (no context) of several sequences, right-padded to the
    longest into ``[B, T]``: with ``is_causal`` a real query never sees a padding key
    (they all come after it), so one SDPA call serves them all."""

    gather: torch.Tensor
    """``[B * T]`` rows of the step's tokens to read (padding repeats a real row)."""
    batch: int
    length: int
    valid: torch.Tensor
    """Positions in the ``[B * T]`` result that are real tokens..."""
    rows: torch.Tensor
    """...and the step's rows they are written back to."""


@dataclass
class PrefillChunk:
    """One sequence with several new tokens."""

    rows: slice
    key_slots: torch.Tensor | None
    """Cache slots of positions 0 .. context+new-1; None for a first chunk (fresh keys)."""
    mask: torch.Tensor | None
    """Additive ``[new, context+new]`` causal mask with the context offset; None with is_causal."""


@dataclass
class AttentionPlan:
    """Per-step indices and masks, shared by all layers."""

    slot_mapping: torch.Tensor
    compute_dtype: torch.dtype
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    first_chunks: list[FirstChunks] = field(default_factory=list)
    """On a GPU: first prefill chunks batched (one SDPA call per group, not per sequence)."""

    @classmethod
    def build(
        cls, inp: ModelInput, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> AttentionPlan:
        """Index tensors for ``inp`` with a cache of ``block_size`` and model ``dtype``."""
        half = dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"
        compute = torch.float32 if half else dtype
        decode: list[tuple[int, int, list[int]]] = []
        prefills: list[PrefillChunk] = []
        firsts: list[tuple[int, int, list[int]]] = []
        gpu = device.type in BATCHED_FIRST_CHUNKS
        start = 0
        for i, (new, ctx, table) in enumerate(
            zip(inp.new_lens, inp.context_lens, inp.block_tables, strict=True)
        ):
            if len(table) * block_size < ctx + new:
                raise ValueError(f"sequence {i}: block table too short for {ctx + new} tokens")
            if new == 1:
                decode.append((start, ctx + 1, table))
            elif new > 1 and ctx == 0 and gpu:
                firsts.append((start, new, table))
            elif new > 1:
                prefills.append(_prefill_chunk(start, new, ctx, table, block_size, device, compute))
            start += new
        decodes = [
            _decode_group(group, block_size, device, compute) for group in _by_length(decode)
        ]
        if len(firsts) == 1:  # alone: no padding, no gather
            prefills.append(_prefill_chunk(firsts[0][0], firsts[0][1], 0, [], 0, device, compute))
            firsts = []
        batched = [_first_chunks(group, device) for group in _by_length(firsts)]
        return cls(inp.slot_mapping.to(device), compute, block_size, decodes, prefills, batched)


def _by_length(
    seqs: list[tuple[int, int, list[int]]], max_groups: int = 4
) -> list[list[tuple[int, int, list[int]]]]:
    """Split decode sequences so that padding to a group's longest context at most
    doubles what a group reads: one long context must not make the whole batch gather
    its length. Few groups, because each costs a kernel call per layer."""
    if not seqs:
        return []
    ordered = sorted(seqs, key=lambda s: -s[1])
    groups = [[ordered[0]]]
    total = ordered[0][1]
    for seq in ordered[1:]:
        group = groups[-1]
        if group[0][1] * (len(group) + 1) > 2 * (total + seq[1]) and len(groups) < max_groups:
            groups.append([seq])
            total = seq[1]
        else:
            group.append(seq)
            total += seq[1]
    return groups


def _decode_group(
    seqs: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    compute: torch.dtype,
) -> DecodeGroup:
    rows = [row for row, _, _ in seqs]
    lens = [length for _, length, _ in seqs]
    n_blocks = -(-max(lens) // block_size)
    padded = n_blocks * block_size
    tables = [table[:n_blocks] + [0] * (n_blocks - len(table[:n_blocks])) for *_, table in seqs]
    blocks = torch.tensor(tables, dtype=torch.int64).view(-1)
    mask = None
    if min(lens) != padded:
        short = torch.arange(padded)[None, :] >= torch.tensor(lens)[:, None]
        mask = torch.zeros(short.shape, dtype=compute).masked_fill(short, -torch.inf)
        mask = mask[:, None, None, :].to(device)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    index: Rows = (
        slice(rows[0], rows[0] + len(rows))
        if contiguous
        else torch.tensor(rows, dtype=torch.int64, device=device)
    )
    cpu_lens = torch.tensor(lens, dtype=torch.int64)
    return DecodeGroup(
        index, blocks.to(device), cpu_lens, max(lens), mask,
        None if device.type == "cpu" else cpu_lens.to(device),
    )  # fmt: skip


def _first_chunks(seqs: list[tuple[int, int, list[int]]], device: torch.device) -> FirstChunks:
    longest = max(new for _, new, _ in seqs)
    gather: list[int] = []
    valid: list[int] = []
    rows: list[int] = []
    for b, (start, new, _) in enumerate(seqs):
        gather += [*range(start, start + new), *[start] * (longest - new)]
        valid += range(b * longest, b * longest + new)
        rows += range(start, start + new)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return FirstChunks(tensor(gather), len(seqs), longest, tensor(valid), tensor(rows))


def _prefill_chunk(
    start: int,
    new: int,
    ctx: int,
    table: list[int],
    block_size: int,
    device: torch.device,
    compute: torch.dtype,
) -> PrefillChunk:
    rows = slice(start, start + new)
    if ctx == 0:
        return PrefillChunk(rows, None, None)
    total = ctx + new
    blocks = torch.tensor(table[: -(-total // block_size)], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).view(-1)[:total]
    future = torch.arange(total)[None, :] > (ctx + torch.arange(new))[:, None]
    mask = torch.zeros(future.shape, dtype=compute).masked_fill(future, -torch.inf)
    return PrefillChunk(rows, slots.to(device), mask.to(device))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Write ``k``/``v`` ([T, H, D]) into ``kv_layer`` ([2, slots, H, D]) at the plan's slots,
    then return causal attention of each new token over its sequence, ``[T, H, D]``."""
    kv_layer[0].index_copy_(0, plan.slot_mapping, k)
    kv_layer[1].index_copy_(0, plan.slot_mapping, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in plan.decodes:
        _decode_attention(q, kv_layer, group, out, plan.compute_dtype, plan.block_size, scale)
    for chunk in plan.prefills:
        out[chunk.rows] = _prefill_attention(q, k, v, kv_layer, chunk, plan.compute_dtype, scale)
    for firsts in plan.first_chunks:
        shape = (firsts.batch, firsts.length, *q.shape[1:])
        qs, ks, vs = (
            t.index_select(0, firsts.gather).view(shape).transpose(1, 2) for t in (q, k, v)
        )
        res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        flat = res.transpose(1, 2).reshape(-1, *q.shape[1:])
        out.index_copy_(0, firsts.rows, flat.index_select(0, firsts.valid))
    return out


def _decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    group: DecodeGroup,
    out: torch.Tensor,
    cd: torch.dtype,
    block_size: int,
    scale: float,
) -> None:
    rows = group.rows
    qd = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
    batch, heads, dim = qd.shape
    if group.device_lens is not None and _triton():
        from inferd.llm import cuda

        tables = group.blocks.view(batch, -1)
        res = cuda.paged_decode(qd, kv_layer, tables, group.device_lens, block_size, scale)
        if isinstance(rows, slice):
            out[rows] = res
        else:
            out.index_copy_(0, rows, res)
        return
    lib = native.kernel() if _native_fits(q, kv_layer, cd) else None
    if lib is not None:
        res = _native_decode(lib, qd, kv_layer, group, block_size, scale)
        if isinstance(rows, slice):
            out[rows] = res
        else:
            out.index_copy_(0, rows, res)
        return
    by_block = kv_layer.view(2, -1, block_size * heads * dim)
    keys = by_block[0].index_select(0, group.blocks).view(batch, -1, heads, dim)
    vals = by_block[1].index_select(0, group.blocks).view(batch, -1, heads, dim)
    res = F.scaled_dot_product_attention(
        qd[:, :, None].to(cd),
        keys.transpose(1, 2).to(cd),
        vals.transpose(1, 2).to(cd),
        attn_mask=group.mask,
        scale=scale,
    ).view(batch, heads, dim)
    if isinstance(rows, slice):
        out[rows] = res
    else:
        out.index_copy_(0, rows, res.to(out.dtype))


@functools.cache
def _triton() -> bool:
    from inferd.llm import cuda

    return cuda.available()


def _native_fits(q: torch.Tensor, kv_layer: torch.Tensor, cd: torch.dtype) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype == kv_layer.dtype == cd == torch.float32
        and kv_layer.is_contiguous()
    )


_POOL: ThreadPoolExecutor | None = None


def _native_decode(
    lib: Any,
    qd: torch.Tensor,
    kv_layer: torch.Tensor,
    group: DecodeGroup,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """The C kernel over the group, the batch split over torch's intra-op thread count."""
    global _POOL
    qd = qd.contiguous()
    batch, heads, dim = qd.shape
    res = torch.empty_like(qd)
    lens = group.lens
    stride = group.blocks.numel() // batch
    threads = max(1, min(torch.get_num_threads(), batch))
    scratch = torch.empty((threads, group.max_len), dtype=torch.float32)
    keys, vals = kv_layer[0], kv_layer[1]
    args = (qd.data_ptr(), keys.data_ptr(), vals.data_ptr(), res.data_ptr(),
            group.blocks.data_ptr(), stride, lens.data_ptr())  # fmt: skip

    def run(part: int) -> None:
        b0, b1 = batch * part // threads, batch * (part + 1) // threads
        lib.paged_decode_f32(*args, b0, b1, heads, dim, block_size, scale,
                             scratch[part].data_ptr())  # fmt: skip

    if threads == 1:
        run(0)
        return res
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="paged-attention")
    others = [_POOL.submit(run, part) for part in range(1, threads)]
    run(0)  # this thread takes the first share
    for future in others:
        future.result()
    return res


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    chunk: PrefillChunk,
    cd: torch.dtype,
    scale: float,
) -> torch.Tensor:
    # 4-D ([1, H, T, D]) inputs: PyTorch's CPU flash kernel takes only those; 3-D ones
    # fall back to the unfused math path (a bmm, softmax and bmm per call).
    qs = q[chunk.rows].transpose(0, 1)[None].to(cd)
    if chunk.key_slots is None:
        keys, vals = k[chunk.rows], v[chunk.rows]
    else:
        keys = kv_layer[0].index_select(0, chunk.key_slots)
        vals = kv_layer[1].index_select(0, chunk.key_slots)
    res = F.scaled_dot_product_attention(
        qs,
        keys.transpose(0, 1)[None].to(cd),
        vals.transpose(0, 1)[None].to(cd),
        attn_mask=chunk.mask,
        is_causal=chunk.key_slots is None,
        scale=scale,
    )
    return res[0].transpose(0, 1)
