"""The engine: one step = ``schedule()`` -> ``execute()`` -> ``update()``.

The replica calls :meth:`LLMEngine.step` in a loop while there is work; each step runs
one forward pass over every scheduled sequence (decodes and prefill chunks together),
samples one token for each sequence that reached the end of its known tokens, and
returns the text deltas to stream. Requests join and leave between any two steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from inferd.llm.adapter_bank import AdapterBank
from inferd.llm.guides import GuideCompiler
from inferd.llm.metrics import GenerationMetrics
from inferd.llm.model_runner import Model, ModelRunner
from inferd.llm.output import OutputProcessor
from inferd.llm.sampling import sample
from inferd.llm.scheduler import Scheduled, Scheduler, SchedulerConfig
from inferd.llm.sequence import Sequence
from inferd.llm.speculation import Speculation
from inferd.llm.tokenizer import TextTokenizer
from inferd.shapes.llm import SamplingParams, TokenOutput

logger = logging.getLogger(__name__)


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
        self.runner = ModelRunner(
            model, lora, config.num_blocks, config.block_size, config.dtype, config.max_num_seqs
        )
        self.device = self.runner.device
        gpu = self.device.type != "cpu"
        self.draft_tokens = 0
        """Draft tokens checked (speculative decoding), and of them accepted."""
        self.accepted_tokens = 0
        self.scheduler = Scheduler(
            SchedulerConfig(config.num_blocks, config.block_size, config.max_num_seqs,
                            config.max_batched_tokens, shape.n_positions, config.max_waiting,
                            prefix_caching=config.prefix_caching, whole_prompts=gpu),
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        metrics = GenerationMetrics()
        self.output = OutputProcessor(tokenizer, self.scheduler, metrics)
        self.requests = self.output.requests
        """The live requests by id (the output processor's)."""
        requests = self.requests
        self.adapters = AdapterBank(
            lora, lambda: {r.seq.adapter_slot for r in requests.values()}, metrics
        )
        self.steps = 0
        self.busy_s = 0.0
        """Step time weighted by how full the engine was (see :meth:`occupancy`): the
        autoscaler's utilisation is its growth over wall time."""

    @property
    def metrics(self) -> GenerationMetrics:
        """What the engine measures (its output's and its adapters' figures too)."""
        return self.output.metrics

    @metrics.setter
    def metrics(self, metrics: GenerationMetrics) -> None:
        self.output.metrics = self.adapters.metrics = metrics

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
        seq = Sequence(
            request_id, ids, params, adapter_slot, cache_salt=self.adapters.salt(adapter_slot)
        )
        self.output.add(seq, arrived, matcher, resume, adapter_name)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Cancel a request; its blocks are free before the next step."""
        return self.output.end(request_id, reason) is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -----------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """One forward pass over the scheduled work; the outputs to stream (those of
        requests that left the queue on a timeout first)."""
        started = time.perf_counter()
        expired, scheduled = self.schedule()
        if not scheduled:
            return expired
        outputs = self.update(scheduled, *self.execute(scheduled))
        elapsed = time.perf_counter() - started
        self.busy_s += elapsed * self.occupancy()
        self.metrics.step_s.observe(elapsed)
        self.metrics.step_tokens.observe(sum(item.num_tokens for item in scheduled))
        return expired + outputs

    def schedule(self) -> tuple[list[TokenOutput], list[Scheduled]]:
        """The outputs of requests that waited too long, then the step's work: drafts
        proposed, the scheduler's choice (and the queue time of what it admitted)."""
        expired = self._expire_waiting()
        if self.config.speculation is not None:
            self._propose(self.config.speculation)
        scheduled = self.scheduler.schedule()
        if scheduled:
            self.output.scheduled(self.scheduler.admitted)
        return expired, scheduled

    def update(
        self,
        scheduled: list[Scheduled],
        sampled: dict[Sequence, tuple[int, float | None]],
        checked: dict[Sequence, list[int]],
    ) -> list[TokenOutput]:
        """The step's tokens appended (a checked draft's one by one, as plain decoding
        would have given them), guides advanced, and each token's output."""
        accepted = {seq: len(tokens) - 1 for seq, tokens in checked.items()}
        self.scheduler.update(scheduled, {seq: tok for seq, (tok, _) in sampled.items()}, accepted)
        self._advance_guides(sampled)
        self.steps += 1
        emit = self.output.emit
        out = [emit(seq, tok, lp) for seq, (tok, lp) in sampled.items()]
        for seq, tokens in checked.items():
            for token in tokens:
                self.scheduler.append(seq, token)
                out.append(emit(seq, token, None))
                if seq.finished:
                    break
        self.adapters.count_room()
        return out

    def _expire_waiting(self) -> list[TokenOutput]:
        """Requests that waited longer than ``queue_timeout_s`` and never started (a
        preempted one that already streamed tokens stays, to be finished)."""
        limit = self.config.queue_timeout_s
        if limit is None or not self.scheduler.waiting:
            return []
        now = time.monotonic()
        out = []
        for seq in list(self.scheduler.waiting):
            if seq.output_ids or now - self.requests[seq.request_id].started < limit:
                continue
            self.output.end(seq.request_id, "queue_timeout")
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
            logits, sampling, checking = self.runner.forward(scheduled)
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
            "adapter_loads": self.adapters.loads,
        }
