"""Canary analysis: is the new version at least as good as the stable one?

Each step of a canary rollout has an analysis window. At its start the controller
samples every replica's cumulative figures (requests answered and failed, latency and
compute-time sketches) for the canary and for the stable versions (the others taking
traffic); at each pass it samples again, and the difference is what happened inside the
window. Both sides are measured at the same time under the same load, so a slow minute
of a shared machine moves both.

The verdict, in order:

1. a canary replica crashed (restarted) in the window, or none of them can load: fail;
2. once the canary answered ``min_requests``, its error rate above the stable one's by
   more than ``max_error_rate_increase`` fails at once, without waiting for the window;
3. at the end of the window (``step_s``), with ``min_requests`` answered (else it waits
   for them): its median or ``quantile`` (p99) latency above the stable one's by more
   than ``max_latency_increase`` (relative) and by at least ``min_latency_increase_ms``
   fails (the median catches a model that is slower on every request even where a noisy
   machine blurs the tail; the absolute floor keeps fast models from failing on noise:
   a lightly loaded canary replica answered a 0.89 ms XGBoost model in 1.03 ms here);
   so does its end-to-end p99 above ``max_p99_ms`` when set; then the ``webhook``, when
   set, must answer 2xx to a POST of the figures (a custom check: business metrics);
4. otherwise it passes, and the canary moves to its next step.

``latency: "compute"`` (the default) compares the time each request's batch spent in
the model; ``"total"`` compares queue + compute. Compute time is what a slower model
changes; queue time depends mostly on the share of traffic a version gets, so at a 1 %
step the stable version (99 % of the load) queues more and would make a slower canary
look fast. Sketches are accurate to 1 %, so a 20 % slower model stands out clearly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferd.registry.rollout import CanaryRollout
from inferd.serving.client import status_of
from inferd.telemetry.metrics import Sketch

logger = logging.getLogger(__name__)

WEBHOOK_TIMEOUT_S = 10.0


@dataclass(slots=True)
class ReplicaSample:
    """One replica's cumulative figures at one moment (since it started)."""

    answered: int
    failed: int
    latency: Sketch
    compute: Sketch


@dataclass(slots=True)
class Figures:
    """What a set of replicas did in a window."""

    requests: int = 0
    errors: int = 0
    latency: Sketch = field(default_factory=Sketch)
    compute: Sketch = field(default_factory=Sketch)
    crashes: int = 0
    replicas: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_dict(self, quantile: float = 0.99) -> dict[str, Any]:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)

        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 6),
            "p50_ms": ms(self.latency.quantile(0.5)),
            "p99_ms": ms(self.latency.quantile(0.99)),
            "mean_ms": ms(self.latency.mean()),
            "compute_p50_ms": ms(self.compute.quantile(0.5)),
            f"compute_p{quantile * 100:g}_ms": ms(self.compute.quantile(quantile)),
            "compute_mean_ms": ms(self.compute.mean()),
            "crashes": self.crashes,
            "replicas": self.replicas,
        }


Key = tuple[str, int]
"""(replica id, pid): a restarted replica starts its counters again."""


def sample_of(metrics: dict[str, Any]) -> ReplicaSample | None:
    """A replica status's metrics as a sample; None for replicas that do not measure
    these (text generation)."""
    if "latency_sketch" not in metrics:
        return None
    latency = Sketch.of(metrics["latency_sketch"])
    compute = Sketch.of(metrics.get("compute_sketch") or Sketch().snapshot())
    return ReplicaSample(latency.count, int(metrics.get("requests_failed", 0)), latency, compute)


async def sample(replicas: list[tuple[str, int, str]]) -> dict[Key, ReplicaSample]:
    """Samples of ``(replica id, pid, address)``; replicas that do not answer within a
    couple of seconds are left out (the next pass asks again)."""

    async def one(rid: str, address: str) -> ReplicaSample | None:
        status = await status_of(address, rid, timeout_s=2.0)  # None: draining, restarting
        return sample_of(status.metrics) if status is not None else None

    found = await asyncio.gather(*(one(rid, address) for rid, _, address in replicas))
    return {
        (rid, pid): s for (rid, pid, _), s in zip(replicas, found, strict=True) if s is not None
    }


class GraphFigures:
    """What the gateways answered for inference graph versions (which have no replica
    to sample), from the request rows they ship: per ``(model, version)``, its requests
    answered and failed and their latency, as a replica's cumulative sample. A request
    a graph version failed that its fallback (the serving version) answered is logged
    as the fallback's, with ``fallback_from``: a failure of the graph version here, as a
    failed predict is its replica's. Node calls (``api`` ``graph``) are their models'."""

    def __init__(self) -> None:
        self._samples: dict[tuple[str, str], ReplicaSample] = {}

    def observe(self, rows: Any, is_graph: Callable[[str, str], bool]) -> None:
        for row in rows:
            if row.api == "graph":
                continue
            model = row.model_name
            if row.fallback_from is not None and is_graph(model, row.fallback_from):
                self._sample(model, row.fallback_from).failed += 1
            version = row.version
            if version is None or not is_graph(model, version):
                continue
            sample = self._sample(model, version)
            if row.status_code >= 500:
                sample.failed += 1
            elif row.status_code < 400:
                sample.answered += 1
                sample.latency.observe(row.latency_ms / 1000)

    def _sample(self, model: str, version: str) -> ReplicaSample:
        found = self._samples.get((model, version))
        if found is None:
            found = self._samples[(model, version)] = ReplicaSample(0, 0, Sketch(), Sketch())
        return found

    def samples(self, model: str, versions: list[str]) -> dict[Key, ReplicaSample]:
        """Copies of the graph ``versions``' samples now (their latency as their compute
        too: a graph's compute is its nodes' calls), keyed as a replica's would be."""
        out = {}
        for version in versions:
            found = self._samples.get((model, version))
            if found is not None:
                latency = Sketch.of(found.latency.snapshot())
                out[(f"{model}:{version}@gateways", 0)] = ReplicaSample(
                    found.answered, found.failed, latency, latency
                )
        return out


def window(start: dict[Key, ReplicaSample], now: dict[Key, ReplicaSample]) -> Figures:
    """What happened between two samplings; a replica that (re)started since counts
    from its start."""
    out = Figures()
    for key, current in now.items():
        before = start.get(key)
        out.replicas += 1
        if before is None:
            out.requests += current.answered + current.failed
            out.errors += current.failed
            out.latency.add(current.latency)
            out.compute.add(current.compute)
            continue
        out.requests += current.answered - before.answered + current.failed - before.failed
        out.errors += current.failed - before.failed
        out.latency.add(current.latency.minus(before.latency))
        out.compute.add(current.compute.minus(before.compute))
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: str
    """pass | fail | wait"""
    reason: str


def judge(canary: Figures, stable: Figures, rollout: CanaryRollout, final: bool) -> Verdict:
    """The built-in checks (the webhook is the caller's, after a pass)."""
    if canary.crashes:
        return Verdict("fail", f"canary replicas crashed {canary.crashes} time(s) in the window")
    minimum = rollout.min_requests
    if canary.requests >= minimum:
        increase = canary.error_rate - stable.error_rate
        if increase > rollout.max_error_rate_increase:
            return Verdict(
                "fail",
                f"error rate {canary.error_rate:.2%} ({canary.errors}/{canary.requests}) vs "
                f"stable {stable.error_rate:.2%} ({stable.errors}/{stable.requests}); "
                f"limit +{rollout.max_error_rate_increase:.2%}",
            )
    if not final:
        return Verdict("wait", "analysis window still open")
    if canary.requests < minimum:
        return Verdict("wait", f"waiting for traffic: {canary.requests} of {minimum} requests")
    metric, limit = rollout.latency, rollout.max_latency_increase
    slack_ms = rollout.min_latency_increase_ms
    compared = []
    for q in sorted({0.5, rollout.quantile}):
        mine, theirs = (
            (f.compute if metric == "compute" else f.latency).quantile(q) for f in (canary, stable)
        )
        if mine is None or not theirs or stable.requests < minimum:
            continue
        name = f"{metric} p{q * 100:g} {mine * 1000:.2f} ms vs stable {theirs * 1000:.2f} ms"
        if mine > theirs * (1 + limit) and (mine - theirs) * 1000 >= slack_ms:
            return Verdict(
                "fail",
                f"{name} (+{mine / theirs - 1:.0%}; limit +{limit:.0%}) over "
                f"{canary.requests} and {stable.requests} requests",
            )
        compared.append(name)
    p99, ceiling = canary.latency.quantile(0.99), rollout.max_p99_ms
    if ceiling is not None and p99 is not None and p99 * 1000 > ceiling:
        return Verdict("fail", f"p99 {p99 * 1000:.2f} ms over the {ceiling:g} ms limit")
    errors = f"errors {canary.errors}/{canary.requests} vs stable {stable.errors}/{stable.requests}"
    return Verdict("pass", "; ".join([errors, *compared]))


async def call_webhook(url: str, payload: dict[str, Any]) -> Verdict:
    """POST the window's figures; 2xx passes, anything else (or no answer) fails."""
    import httpx  # here, not at the top: gateways import this module for its figures

    try:
        async with httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S) as client:
            reply = await client.post(url, json=payload)
    except httpx.HTTPError as exc:
        return Verdict("fail", f"webhook {url} did not answer: {type(exc).__name__}: {exc}")
    if 200 <= reply.status_code < 300:
        return Verdict("pass", f"webhook answered {reply.status_code}")
    body = reply.text.strip().replace("\n", " ")[:200]
    return Verdict("fail", f"webhook answered {reply.status_code}: {body}")
