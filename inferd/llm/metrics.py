"""What the engine measures about the requests it serves (no HTTP, no exporter here).

Times are seconds from the request's arrival: at the gateway when the caller passes it
(``add_request(arrived=...)``), else when the engine got it. Snapshots are plain dicts
(see :mod:`inferd.telemetry.metrics`) that the replica reports in its status.
"""

from __future__ import annotations

from typing import Any

from inferd.telemetry.metrics import (
    LATENCY_BUCKETS_S,
    TOKEN_BUCKETS,
    Histogram,
    LabeledCounter,
    Sketch,
)


class GenerationMetrics:
    def __init__(self) -> None:
        self.queue_time_s = Histogram(LATENCY_BUCKETS_S)
        """Arrival -> first scheduled (its prefill starts)."""
        self.ttft_s = Histogram(LATENCY_BUCKETS_S)
        """Arrival -> first token."""
        self.ttft_sketch = Sketch()
        """The same, finely (the autoscaler's latency signal against the version's SLA)."""
        self.itl_s = Histogram(LATENCY_BUCKETS_S)
        """Gap between consecutive tokens of a request."""
        self.e2e_s = Histogram(LATENCY_BUCKETS_S)
        """Arrival -> last token, for requests that finished (not aborted)."""
        self.prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.generation_tokens = Histogram(TOKEN_BUCKETS)
        self.finished = LabeledCounter()
        """Requests that ended, by finish reason: stop, length, abort, queue_timeout, error."""
        self.requests_by_adapter = LabeledCounter()
        """Requests accepted, by adapter name ("" for the base model)."""
        self.step_s = Histogram(LATENCY_BUCKETS_S)
        """Duration of each engine step (schedule, forward pass, sampling, outputs)."""
        self.step_tokens = Histogram(TOKEN_BUCKETS)
        """Tokens (prefill chunks + decodes) computed per step."""
        self.adapter_load_s = Histogram(LATENCY_BUCKETS_S)
        """Loading a LoRA adapter a request needed (into a free or evicted slot)."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "queue_time_s": self.queue_time_s.snapshot(),
            "ttft_s": self.ttft_s.snapshot(),
            "ttft_sketch": self.ttft_sketch.snapshot(),
            "itl_s": self.itl_s.snapshot(),
            "e2e_s": self.e2e_s.snapshot(),
            "prompt_tokens": self.prompt_tokens.snapshot(),
            "generation_tokens": self.generation_tokens.snapshot(),
            "finished": self.finished.snapshot(),
            "requests_by_adapter": self.requests_by_adapter.snapshot(),
            "step_s": self.step_s.snapshot(),
            "step_tokens": self.step_tokens.snapshot(),
            "adapter_load_s": self.adapter_load_s.snapshot(),
            "prompt_tokens_total": self.prompt_tokens.sum,
            "generation_tokens_total": self.generation_tokens.sum,
        }
