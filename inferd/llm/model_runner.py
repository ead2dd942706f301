"""The model side of an engine step: the step's scheduled sequences in, logits out.

:class:`ModelRunner` is :class:`inferd.llm.engine.LLMEngine`'s (``engine.runner``; the
engine schedules, samples and updates around it). It owns the paged KV cache the model
computes into (:mod:`inferd.llm.batch`), builds each step's :class:`ModelInput` from the
scheduler's choice, and runs the model: eagerly, or on a GPU by replaying a CUDA graph
for a pure-decode step (:mod:`inferd.llm.cuda`), a step of decodes and prefill chunks in
two passes (its decodes from a graph, its chunks eagerly).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from inferd.llm.batch import KVCache, ModelInput
from inferd.llm.scheduler import Scheduled
from inferd.llm.sequence import Sequence


class ModelShape(Protocol):
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_positions(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class Model(Protocol):
    @property
    def config(self) -> ModelShape: ...

    def forward(self, inp: ModelInput, cache: KVCache, lora: Any = None) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        model: Model,
        lora: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        max_num_seqs: int,
    ) -> None:
        """``num_blocks`` of ``block_size`` tokens for the scheduler to hand out;
        ``max_num_seqs``: the largest decode batch a CUDA graph is captured for."""
        self.model = model
        self.lora = lora
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        shape = model.config
        self.max_positions = shape.n_positions
        self.device = torch.device(getattr(model, "device", "cpu"))
        # On a GPU one block more than the scheduler hands out: the padding rows of a
        # CUDA-graph decode step write there (inferd.llm.cuda).
        gpu = self.device.type != "cpu"
        self.cache = KVCache(
            shape.n_layer, shape.n_head, shape.head_dim, num_blocks + gpu, block_size, dtype,
            self.device,
        )  # fmt: skip
        self.graphs: Any = None
        """:class:`inferd.llm.cuda.DecodeGraphs` once :meth:`capture_graphs` ran."""
        self.last_step: tuple[int, int, bool] = (0, 0, False)
        """The last step's sequences, tokens, and whether a CUDA graph ran it."""

    def capture_graphs(self) -> int:
        """On a GPU, capture the decode step in CUDA graphs for batches up to
        ``max_num_seqs``; pure-decode steps replay them. Returns how many were captured."""
        from inferd.llm.cuda import DecodeGraphs

        decode = getattr(self.model, "decode", None)
        if self.device.type != "cuda" or decode is None:
            return 0
        max_blocks = -(-self.max_positions // self.cache.block_size)

        def forward(*args: Any) -> torch.Tensor:
            return decode(*args, cache=self.cache, lora=self.lora)

        graphs = DecodeGraphs(
            forward, self.cache, self.max_num_seqs, max_blocks, self.lora, self.num_blocks
        )
        graphs.capture()
        self.graphs = graphs
        return len(graphs.graphs)

    def forward(
        self, scheduled: list[Scheduled]
    ) -> tuple[torch.Tensor, list[Sequence], list[Scheduled]]:
        """Logits of the step's sampled rows and their sequences, in the same order,
        then the rows of the sequences checking a draft (:meth:`_model_input`)."""
        tokens = sum(item.num_tokens for item in scheduled)
        split = self._split_forward(scheduled) if self.graphs is not None else None
        if split is not None:
            self.last_step = (len(scheduled), tokens, True)
            return split
        inp, sampling, checking = self._model_input(scheduled)
        graph = self.graphs is not None and self.graphs.fits(inp)
        logits = self.graphs.run(inp) if graph else self.model.forward(inp, self.cache, self.lora)
        self.last_step = (len(scheduled), tokens, graph)
        return logits, sampling, checking

    def _split_forward(
        self, scheduled: list[Scheduled]
    ) -> tuple[torch.Tensor, list[Sequence], list[Scheduled]] | None:
        """A step of decodes and prefill chunks in two passes: the decodes from a CUDA
        graph, the chunks eagerly (None: not such a step, or no graph holds its decodes).
        In one eager pass, such steps took 54-103 ms while a burst of 500 prompts was
        prefilled, against 10 ms for a pure decode step from a graph and 13 ms for a
        step of prefill chunks alone (H200, GPT-2 small, 8,192 tokens a step)."""
        assert self.graphs is not None
        decodes: list[Scheduled] = []
        chunks: list[Scheduled] = []
        for item in scheduled:
            (decodes if item.num_tokens == 1 and item.samples else chunks).append(item)
        if not decodes or not chunks:
            return None
        inp, sampling, _ = self._model_input(decodes)
        if not self.graphs.fits(inp):
            return None
        # The graph's logits live in a buffer its next replay overwrites; the
        # concatenation copies them before that (the chunks' draft rows stay last).
        decoded = self.graphs.run(inp)
        rest, rest_sampling, checking = self._model_input(chunks)
        logits = self.model.forward(rest, self.cache, self.lora)
        return torch.cat([decoded, logits]), sampling + rest_sampling, checking

    def _model_input(
        self, scheduled: list[Scheduled]
    ) -> tuple[ModelInput, list[Sequence], list[Scheduled]]:
        """The step's model input; the sequences whose next token is sampled, whose
        logits rows come first, in order; then the items checking a draft, whose
        ``draft + 1`` rows each come after those."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_at: list[int] = []
        sampling: list[Sequence] = []
        checking: list[Scheduled] = []
        checked_at: list[int] = []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            if item.draft:
                ids += seq.span(start, len(seq))
                ids += seq.draft
                checking.append(item)
                checked_at += range(len(ids) - item.draft - 1, len(ids))
            else:
                ids += seq.span(start, start + n)
            positions += range(start, start + n)
            slots += self.cache.slots(seq.block_table, start, start + n)
            if item.samples and not item.draft:
                logits_at.append(len(ids) - 1)
                sampling.append(seq)
        logits_at += checked_at
        inp = ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            new_lens=[i.num_tokens for i in scheduled],
            context_lens=[i.seq.num_computed for i in scheduled],
            block_tables=[list(i.seq.block_table) for i in scheduled],
            logits_indices=torch.tensor(logits_at, dtype=torch.long),
            adapter_slots=[i.seq.adapter_slot for i in scheduled],
        )
        return inp, sampling, checking
