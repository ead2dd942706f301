"""The engine: one step = ``schedule()`` -> ``execute()`` -> ``update()``.

The replica calls :meth:`LLMEngine.step` in a loop while there is work; each step runs
one forward pass over every scheduled sequence (decodes and prefill chunks together),
samples one token for each sequence that reached the end of its known tokens, and
returns the text deltas to stream. Requests join and leave between any two steps.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from inferd.llm.batch import KVCache, ModelInput
from inferd.llm.guides import GuideCompiler
from inferd.llm.metrics import GenerationMetrics
from inferd.llm.sampling import sample
from inferd.llm.scheduler import Scheduled, Scheduler, SchedulerConfig
from inferd.llm.sequence import Sequence
from inferd.llm.speculation import Speculation
from inferd.llm.stops import StopChecker
from inferd.llm.tokenizer import Detokenizer, TextTokenizer
from inferd.shapes.llm import SamplingParams, TokenOutput

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 128
    max_batched_tokens: int = 512
    max_waiting: int = 1024
    dtype: torch.dtype = torch.float32
    queue_timeout_s: float | None = None
    """A request that waited this long without being scheduled leaves the queue with
    ``finish_reason="queue_timeout"`` (None: it waits as long as it takes)."""
    max_prompt_tokens: int | None = None
    """Longer prompts are refused (:class:`PromptOverLimit`); None: the context's size."""
    speculation: Speculation | None = None
    """Prompt-lookup speculative decoding for greedy sequences (None: off)."""
    prefix_caching: bool = True
    """Reuse the keys and values of prompts' prefixes computed before
    (:mod:`inferd.llm.blocks`)."""


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer
    stops: StopChecker
    started: float = field(default_factory=time.monotonic)
    """Arrival (monotonic clock): at the gateway when known."""
    scheduled: bool = False
    last_token: float | None = None
    matcher: Any = None
    """The request's output constraint (:mod:`inferd.llm.guides`), or None."""
    replay: str = ""
    """A resumed request's text so far, sent with its first new token."""


class PromptTooLong(ValueError):
    """The prompt does not fit the model's context."""


class PromptOverLimit(ValueError):
    """The prompt has more tokens than the server accepts (``max_prompt_tokens``)."""


class EngineFull(RuntimeError):
    """The waiting queue is at its bound: the caller should answer 503."""


class LLMEngine:
    def __init__(
        self,
        model: Model,
        tokenizer: TextTokenizer,
        config: EngineConfig,
        lora: Any = None,
        guides: GuideCompiler | None = None,
    ) -> None:
        self.model = model
        self.guides = guides
        self.tokenizer = tokenizer
        self.config = config
        self.lora = lora
        shape = model.config
        self.max_positions = shape.n_positions
        self.vocab_size: int | None = getattr(shape, "vocab_size", None)
        self.device = torch.device(getattr(model, "device", "cpu"))
        # On a GPU one block more than the scheduler hands out: the padding rows of a
        # CUDA-graph decode step write there (inferd.llm.cuda).
        gpu = self.device.type != "cpu"
        self.cache = KVCache(
            shape.n_layer, shape.n_head, shape.head_dim, config.num_blocks + gpu,
            config.block_size, config.dtype, self.device,
        )  # fmt: skip
        self.graphs: Any = None
        """:class:`inferd.llm.cuda.DecodeGraphs` once :meth:`capture_graphs` ran."""
        self.last_step: tuple[int, int, bool] = (0, 0, False)
        """The last step's sequences, tokens, and whether a CUDA graph ran it."""
        self.draft_tokens = 0
        """Draft tokens checked (speculative decoding), and of them accepted."""
        self.accepted_tokens = 0
        self.scheduler = Scheduler(
            SchedulerConfig(config.num_blocks, config.block_size, config.max_num_seqs,
                            config.max_batched_tokens, shape.n_positions, config.max_waiting,
                            prefix_caching=config.prefix_caching, whole_prompts=gpu),
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        self.requests: dict[str, _Request] = {}
        self.steps = 0
        self.busy_s = 0.0
        """Step time weighted by how full the engine was (see :meth:`occupancy`): the
        autoscaler's utilisation is its growth over wall time."""
        self._adapters: OrderedDict[str, int] = OrderedDict()
        """Loaded adapters: name -> bank slot, least recently used first."""
        self._known: dict[str, Path] = {}
        """Adapters it may load: name -> folder."""
        self.loaded_adapters: tuple[str, ...] = ()
        """The loaded adapters' names, replaced whole (read from other threads)."""
        self.adapter_loads = 0
        """Adapters loaded because a request needed them."""
        self.adapter_room = lora.max_adapters if lora is not None else 0
        """Slots a request for another adapter could load it into now: free, or held by
        an adapter no sequence uses (counted after each step; read from other threads)."""
        self._slot_loads: dict[int, int] = {}
        """Adapters loaded into each slot so far: with the slot, the prefix-cache salt
        of what it computes (a reloaded adapter reuses nothing of the old one's)."""
        self.metrics = GenerationMetrics()

    # -- requests -----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter_slot: int = -1,
        arrived: float | None = None,
        adapter_name: str | None = None,
        resume: list[int] | None = None,
    ) -> Sequence:
        """``arrived``: when the request arrived (``time.monotonic()``; default now), the
        origin of its queue time, TTFT and latency metrics. ``adapter_name`` labels it
        in :attr:`metrics`. ``resume``: the tokens another replica generated for it
        before it was lost; it goes on after them (its first output's text is theirs
        as this engine would have streamed it, then the new token's)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        limit = self.max_positions
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(
                f"token id {bad} in the prompt is outside the vocabulary (0..{vocab - 1})"
            )
        cap = self.config.max_prompt_tokens
        if cap is not None and len(ids) > cap:
            raise PromptOverLimit(
                f"the prompt has {len(ids)} tokens; this server accepts at most {cap} "
                "(llm.max_prompt_tokens)"
            )
        if len(ids) >= limit:
            raise PromptTooLong(
                f"the prompt has {len(ids)} tokens; the model's context is {limit} tokens"
            )
        resume = list(resume or ())
        if resume and (
            len(resume) >= params.max_tokens
            or len(ids) + len(resume) >= limit
            or (vocab is not None and not all(0 <= t < vocab for t in resume))
        ):
            raise ValueError("the tokens to resume from end the generation or are not tokens")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineFull(f"{len(self.scheduler.waiting)} requests are already waiting")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        matcher = None
        if params.guide is not None:
            if self.guides is None:
                raise ValueError("this engine was started without structured outputs")
            matcher = self.guides.matcher(params.guide)
        salt = b""
        if adapter_slot >= 0:
            salt = b"%d:%d" % (adapter_slot, self._slot_loads[adapter_slot])
        seq = Sequence(request_id, ids, params, adapter_slot, cache_salt=salt)
        now = time.monotonic()
        request = _Request(
            seq,
            Detokenizer(self.tokenizer, ids, params.skip_special_tokens),
            StopChecker(params.stop, params.include_stop_str_in_output),
            now if arrived is None else min(arrived, now),
            matcher=matcher,
        )
        if resume:
            self._replay(request, resume)
        self.requests[request_id] = request
        self.metrics.requests_by_adapter.inc(adapter_name or "")
        self.metrics.prompt_tokens.observe(len(ids))
        self.scheduler.add(seq)
        return seq

    def _replay(self, request: _Request, resume: list[int]) -> None:
        """A resumed request's state after ``resume``, as if it had generated them: its
        output, the text its stream released (sent with its next token), its stop
        checker's and its guide's state. Its seeded draws depend on the position only
        (:mod:`inferd.llm.sampling`), so they go on as they would have."""
        seq = request.seq
        seq.output_ids = list(resume)
        text = []
        params, eos = seq.params, self.tokenizer.eos_token_id
        for token in resume:
            ended = token in params.stop_token_ids or (token == eos and not params.ignore_eos)
            if not ended or params.include_stop_str_in_output:  # as _output does
                text.append(request.detok.add(token))
            if request.matcher is not None:
                request.matcher.consume_token(token)
        request.replay, _ = request.stops.feed("".join(text))
        request.last_token = request.started  # its next token is not a first token

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Cancel a request; its blocks are free before the next step."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request.seq, reason)
        self.metrics.finished.inc(reason)
        return True

    # -- LoRA adapters ----------------------------------------------------------------
    # An adapter is *known* (its folder: registered with the version, or loaded at run
    # time) and, while it holds one of the bank's slots, *loaded*. A request for a known
    # adapter that is not loaded loads it (ensure_adapter), into a free slot or the
    # slot of the least recently used adapter that no running sequence uses; with every
    # slot in use by running sequences it waits for one (the caller holds it).

    def adapter_slot(self, name: str | None) -> int:
        """The bank slot of a loaded adapter (-1 for the base model); KeyError if unknown."""
        return -1 if name is None else self._adapters[name]

    def load_adapter(self, name: str, folder: Path) -> dict[str, int]:
        """Load (or reload) an adapter under ``name`` now, evicting the least recently
        used idle one if every slot is taken; with every slot in use by running
        sequences, the next request for it loads it (ValueError: not an adapter this
        engine can load).

        A reload takes a fresh slot: sequences already running with the old weights
        finish on the old slot, and nothing computed with the old weights is reused
        for new requests. A slot is recycled only once no name and no live sequence
        uses it.
        """
        from inferd.llm.lora import LoRAAdapter

        if self.lora is None:
            raise ValueError("this model was started without LoRA support")
        adapter = LoRAAdapter.load(folder)
        self._known[name] = folder
        slot = self._free_slot()
        if slot is None:
            if name in self._adapters:
                self._drop(name)  # running ones finish on the old weights
            return dict(self._adapters)
        self._place(name, slot, adapter)
        return dict(self._adapters)

    def know_adapter(self, name: str, folder: Path) -> None:
        """``name`` may be loaded from ``folder`` when a request needs it."""
        if self.lora is None:
            raise ValueError("this model was started without LoRA support")
        if not (folder / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter_config.json in {folder}")
        self._known[name] = folder

    def ensure_adapter(self, name: str | None) -> int | None:
        """The slot of adapter ``name`` (-1: the base model), loading it first if it is
        known but not loaded; None when every slot is in use by running sequences (try
        again after a step). KeyError: an adapter this engine does not know."""
        if name is None:
            return -1
        slot = self._adapters.get(name)
        if slot is not None:
            self._adapters.move_to_end(name)
            return slot
        folder = self._known[name]
        from inferd.llm.lora import LoRAAdapter

        slot = self._free_slot()
        if slot is None:
            return None
        began = time.perf_counter()
        self._place(name, slot, LoRAAdapter.load(folder))
        self.metrics.adapter_load_s.observe(time.perf_counter() - began)
        self.adapter_loads += 1
        return slot

    def _free_slot(self) -> int | None:
        """A slot no adapter name and no live sequence holds, after evicting the least
        recently used adapter no live sequence uses, if need be."""
        assert self.lora is not None
        live = {r.seq.adapter_slot for r in self.requests.values()}
        busy = set(self._adapters.values()) | live
        for slot in range(self.lora.max_adapters):
            if slot not in busy:
                return slot
        for name, slot in self._adapters.items():  # least recently used first
            if slot not in live:
                self._drop(name)
                return slot
        return None

    def _place(self, name: str, slot: int, adapter: Any) -> None:
        assert self.lora is not None
        self.lora.load(slot, adapter)
        if name in self._adapters:
            self._drop(name)
        self._adapters[name] = slot
        self._slot_loads[slot] = self._slot_loads.get(slot, 0) + 1
        self.loaded_adapters = tuple(self._adapters)

    def _drop(self, name: str) -> None:
        del self._adapters[name]
        self.loaded_adapters = tuple(self._adapters)

    def unload_adapter(self, name: str) -> None:
        """New requests can no longer use it; running ones finish on its slot."""
        if name not in self._known:
            raise KeyError(name)
        del self._known[name]
        if name in self._adapters:
            self._drop(name)

    @property
    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    @property
    def known_adapters(self) -> list[str]:
        return sorted(self._known)

    def _count_room(self) -> None:
        """:attr:`adapter_room`, after a step (on the engine's thread; nothing to count
        for a base model without adapters)."""
        if self.lora is not None and self._known:
            live = {r.seq.adapter_slot for r in self.requests.values()}
            self.adapter_room = self.lora.max_adapters - len(live - {-1})

    def capture_graphs(self) -> int:
        """On a GPU, capture the decode step in CUDA graphs for batches up to
        ``max_num_seqs``; pure-decode steps replay them. Returns how many were captured."""
        from inferd.llm.cuda import DecodeGraphs

        decode = getattr(self.model, "decode", None)
        if self.device.type != "cuda" or decode is None:
            return 0
        cfg = self.config
        max_blocks = -(-self.max_positions // cfg.block_size)

        def forward(*args: Any) -> torch.Tensor:
            return decode(*args, cache=self.cache, lora=self.lora)

        graphs = DecodeGraphs(
            forward, self.cache, cfg.max_num_seqs, max_blocks, self.lora, cfg.num_blocks
        )
        graphs.capture()
        self.graphs = graphs
        return len(graphs.graphs)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -----------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        started = time.perf_counter()
        expired = self._expire_waiting()
        if self.config.speculation is not None:
            self._propose(self.config.speculation)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return expired
        self._note_scheduled()
        sampled, checked = self.execute(scheduled)
        accepted = {seq: len(tokens) - 1 for seq, tokens in checked.items()}
        self.scheduler.update(scheduled, {seq: tok for seq, (tok, _) in sampled.items()}, accepted)
        self._advance_guides(sampled)
        self.steps += 1
        out = [self._output(seq, tok, lp) for seq, (tok, lp) in sampled.items()]
        for seq, tokens in checked.items():
            for token in tokens:  # one by one, as plain decoding would have given them
                self.scheduler.append(seq, token)
                out.append(self._output(seq, token, None))
                if seq.finished:
                    break
        self._count_room()
        elapsed = time.perf_counter() - started
        self.busy_s += elapsed * self.occupancy()
        self.metrics.step_s.observe(elapsed)
        self.metrics.step_tokens.observe(sum(item.num_tokens for item in scheduled))
        return expired + out

    def _note_scheduled(self) -> None:
        now = time.monotonic()
        for seq in self.scheduler.admitted:  # a first prefill chunk (or a recompute)
            request = self.requests[seq.request_id]
            if not request.scheduled:
                request.scheduled = True
                self.metrics.queue_time_s.observe(now - request.started)

    def _expire_waiting(self) -> list[TokenOutput]:
        """Requests that waited longer than ``queue_timeout_s`` and never started (a
        preempted one that already streamed tokens stays, to be finished)."""
        limit = self.config.queue_timeout_s
        if limit is None or not self.scheduler.waiting:
            return []
        now = time.monotonic()
        out = []
        for seq in list(self.scheduler.waiting):
            request = self.requests[seq.request_id]
            if seq.output_ids or now - request.started < limit:
                continue
            self.scheduler.finish(seq, "queue_timeout")
            self.metrics.finished.inc("queue_timeout")
            del self.requests[seq.request_id]
            out.append(
                TokenOutput(seq.request_id, "", None, True, "queue_timeout", len(seq.prompt_ids), 0)
            )
        return out

    def _propose(self, speculation: Speculation) -> None:
        """Drafts for the decoding sequences that can check one exactly: greedy, with
        nothing that changes their logits (penalties, a guide) and no logprobs asked. A
        guess costs a token of compute for each guessed token: a sequence guesses one
        more token than it kept last time, and after a guess of which nothing was kept
        it waits 1, 2, 4 ... up to 16 steps before the next (in a row of misses), so a
        text that does not repeat its context pays little."""
        running = self.scheduler.running
        if speculation.max_batch is not None and len(running) > speculation.max_batch:
            return
        for seq in running:
            params = seq.params
            if (
                seq.remaining != 1
                or not params.greedy
                or params.adjusts_logits
                or params.logprobs
                or self.requests[seq.request_id].matcher is not None
            ):
                continue
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            room = min(params.max_tokens - len(seq.output_ids), self.max_positions - len(seq))
            wanted = min(speculation.tokens, seq.draft_limit or speculation.tokens)
            seq.draft = speculation.propose(seq.tokens, min(wanted, room - 1))

    def execute(
        self, scheduled: list[Scheduled]
    ) -> tuple[dict[Sequence, tuple[int, float | None]], dict[Sequence, list[int]]]:
        """The step's sampled token (and logprob) of each sequence that samples, and
        for each that checked a draft, its tokens: the draft's accepted prefix, then
        the model's own next token."""
        with torch.inference_mode():
            logits, sampling, checking = self._forward(scheduled)
            guided = [
                (row, request.matcher)
                for row, seq in enumerate(sampling)
                if (request := self.requests[seq.request_id]).matcher is not None
            ]
            if guided and self.guides is not None:
                self.guides.mask(logits, [r for r, _ in guided], [m for _, m in guided])
        checked = self._check_drafts(logits[len(sampling) :], checking)
        tokens, logprobs = sample(logits[: len(sampling)], sampling, self.tokenizer.eos_token_id)
        sampled = {seq: (t, lp) for seq, t, lp in zip(sampling, tokens, logprobs, strict=True)}
        return sampled, checked

    def _check_drafts(
        self, logits: torch.Tensor, checking: list[Scheduled]
    ) -> dict[Sequence, list[int]]:
        """Greedy choices at each draft position (``logits``: each checking sequence's
        ``draft + 1`` rows, in order): the draft tokens up to the first the model would
        not have chosen, then the model's choice there."""
        if not checking:
            return {}
        chosen = logits.argmax(dim=-1).tolist()
        out: dict[Sequence, list[int]] = {}
        row = 0
        for item in checking:
            draft, picks = item.seq.draft, chosen[row : row + item.draft + 1]
            kept = 0
            while kept < item.draft and picks[kept] == draft[kept]:
                kept += 1
            seq = item.seq
            out[seq] = [*draft[:kept], picks[kept]]
            seq.draft_limit = kept + 1
            seq.draft_misses = 0 if kept else seq.draft_misses + 1
            seq.draft_pause = min(2 ** (seq.draft_misses - 1), 16) if seq.draft_misses else 0
            self.draft_tokens += item.draft
            self.accepted_tokens += kept
            row += item.draft + 1
        return out

    def _forward(
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

    def _advance_guides(self, sampled: dict[Sequence, tuple[int, float | None]]) -> None:
        """Each guided sequence's matcher takes its token; one whose output is complete
        (the grammar admits nothing more) finishes with ``stop``."""
        for seq, (token, _) in sampled.items():
            matcher = self.requests[seq.request_id].matcher
            if matcher is None:
                continue
            matcher.consume_token(token)
            if not (matcher.is_stopped() or matcher.is_error()):
                continue
            if not seq.finished:
                self.scheduler.finish(seq, "stop")
            elif seq.finish_reason == "length":  # complete on its last allowed token
                seq.finish_reason = "stop"

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

    def _output(self, seq: Sequence, token: int, logprob: float | None) -> TokenOutput:
        request = self.requests[seq.request_id]
        if logprob is not None:
            seq.logprobs.append(logprob)
        params = seq.params
        ended = token in params.stop_token_ids or (
            token == self.tokenizer.eos_token_id and not params.ignore_eos
        )
        # The token that ended it is not part of the text (as vLLM) unless asked for.
        keep = not ended or params.include_stop_str_in_output
        text = request.detok.add(token) if keep else ""
        if seq.finished:
            text += request.detok.flush()
        text, stopped = request.stops.feed(text, final=seq.finished)
        replayed = len(request.replay)
        if replayed:
            text, request.replay = request.replay + text, ""
        if stopped and not seq.finished:
            self.scheduler.finish(seq, "stop")
        now, metrics = time.monotonic(), self.metrics
        if request.last_token is None:
            metrics.ttft_s.observe(now - request.started)
            metrics.ttft_sketch.observe(now - request.started)
        else:
            metrics.itl_s.observe(now - request.last_token)
        request.last_token = now
        if seq.finished:
            del self.requests[seq.request_id]
            metrics.e2e_s.observe(now - request.started)
            metrics.generation_tokens.observe(len(seq.output_ids))
            metrics.finished.inc(seq.finish_reason or "")
        return TokenOutput(
            seq.request_id, text, token, seq.finished, seq.finish_reason,
            len(seq.prompt_ids), len(seq.output_ids),
            logprob, min(seq.cached_tokens, len(seq.prompt_ids)), replayed,
        )  # fmt: skip

    def occupancy(self) -> float:
        """How full the engine is, 0..1: the larger of its sequence slots in use and its
        KV cache in use (a step of one short sequence is not a busy engine; one that
        cannot admit another sequence is)."""
        s = self.scheduler
        slots = len(s.running) / max(1, s.config.max_num_seqs)
        blocks = s.allocator.used_count / max(1, s.allocator.num_blocks)
        return min(1.0, max(slots, blocks))

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "busy_s": round(self.busy_s, 6),
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_blocks_used": s.allocator.used_count,
            "kv_blocks_total": s.allocator.num_blocks,
            "preemptions": s.preemptions,
            "prefix_cache_queries": s.prefix_queries,
            "prefix_cache_hits": s.prefix_hits,
            "steps": self.steps,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "adapter_loads": self.adapter_loads,
        }
