"""Text output: the token frames an engine step emits, and the request figures they make.

:class:`OutputProcessor` is :class:`inferd.llm.engine.LLMEngine`'s (``engine.output``).
It keeps what a live request needs beside its :class:`~inferd.llm.sequence.Sequence`
(:class:`RequestState`: its incremental detokenizer, its stop strings, its guide's
matcher, a resumed request's text so far, the times its latencies count from); for each
token a step appends it makes the :class:`~inferd.shapes.llm.TokenOutput` to stream
(finishing the sequence when a stop string is reached) and observes the request's
latencies (TTFT, inter-token, end to end) and totals in :class:`GenerationMetrics`.

It runs on the engine's thread, once per token: no more work per token than the text
delta, the stop check and the frame.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inferd.llm.metrics import GenerationMetrics
from inferd.llm.scheduler import Scheduler
from inferd.llm.sequence import Sequence
from inferd.llm.stops import StopChecker
from inferd.llm.tokenizer import Detokenizer, TextTokenizer
from inferd.shapes.llm import TokenOutput


@dataclass
class RequestState:
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


class OutputProcessor:
    def __init__(
        self, tokenizer: TextTokenizer, scheduler: Scheduler, metrics: GenerationMetrics
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        """The live requests by id: a request leaves with its last output."""

    def add(
        self,
        seq: Sequence,
        arrived: float | None,
        matcher: Any,
        resume: list[int],
        adapter_name: str | None,
    ) -> None:
        """Start ``seq``'s output (``arrived``: as :meth:`LLMEngine.add_request`'s; a
        ``resume``'s tokens as if it had generated them, :meth:`_replay`)."""
        params = seq.params
        now = time.monotonic()
        request = RequestState(
            seq,
            Detokenizer(self.tokenizer, seq.prompt_ids, params.skip_special_tokens),
            StopChecker(params.stop, params.include_stop_str_in_output),
            now if arrived is None else min(arrived, now),
            matcher=matcher,
        )
        if resume:
            self._replay(request, resume)
        self.requests[seq.request_id] = request
        self.metrics.requests_by_adapter.inc(adapter_name or "")
        self.metrics.prompt_tokens.observe(len(seq.prompt_ids))

    def _replay(self, request: RequestState, resume: list[int]) -> None:
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
            if not ended or params.include_stop_str_in_output:  # as emit does
                text.append(request.detok.add(token))
            if request.matcher is not None:
                request.matcher.consume_token(token)
        request.replay, _ = request.stops.feed("".join(text))
        request.last_token = request.started  # its next token is not a first token

    def end(self, request_id: str, reason: str) -> Sequence | None:
        """Finish a request that makes no more tokens (aborted, or never scheduled in
        time); its sequence, or None if it is not live."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request.seq, reason)
        self.metrics.finished.inc(reason)
        return request.seq

    def scheduled(self, admitted: list[Sequence]) -> None:
        """The queue time of each request whose first prefill chunk the step admitted
        (not again for a recompute after preemption)."""
        now = time.monotonic()
        for seq in admitted:
            request = self.requests[seq.request_id]
            if not request.scheduled:
                request.scheduled = True
                self.metrics.queue_time_s.observe(now - request.started)

    def emit(self, seq: Sequence, token: int, logprob: float | None) -> TokenOutput:
        """The frame for ``token``, just appended to ``seq``: its text delta (what the
        stop strings release, and at the end what the detokenizer held back)."""
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
