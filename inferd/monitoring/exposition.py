"""``/metrics``: the whole server (every gateway process, every replica) in the
Prometheus text format, rendered by the server process.

Where the figures come from, so that none is lost with several gateway processes:

- **Requests** (count by model, version, API and status; latency histogram; cache hits
  and misses; generated tokens): the rows gateway processes already ship to the server
  for the inference log, about once a second — no extra work on the request path, and
  shipped even when the log itself is off (:class:`RequestMetrics`).
- **Gateway counters** that have no row (requests refused by a rate limit before any
  model ran, mirrored requests skipped): deltas shipped with the same rows.
- **Replicas** (state, restarts, queue depth, in-flight, batches and batch sizes,
  expired/rejected/shed requests, the time requests spend in the replica; for
  generation TTFT, inter-token latency, tokens, running/waiting sequences, KV-cache
  blocks): asked for their status at scrape time, all at once, 2 s at most, over one
  kept connection per replica (:class:`ReplicaStatuses`, shared with the console).
- **Processes**: CPU seconds and resident memory of the server, gateway and replica
  processes, from ``/proc``.

A gateway answers ``GET /metrics`` by asking the server over its control socket.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections import defaultdict
from collections.abc import Awaitable, Callable, Container, Iterable
from typing import Any

from inferd.serving.client import ReplicaClient
from inferd.shapes.logs import LogRow

REQUEST_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Seconds from arrival at the gateway to the answer: dense around tens of ms, so a 50 ms
p99 falls between two close bounds."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Ask = Callable[[ReplicaClient, dict[str, str], float], Awaitable[Any]]
"""A question to one replica over its kept connection: (client, labels, timeout)."""


class RequestMetrics:
    """Request figures accumulated from inference log rows."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, str, str, str], int] = defaultdict(int)
        self.latency: dict[tuple[str, str], list[float]] = {}
        """(model, api) -> bucket counts (+Inf last), then the sum."""
        self.cache: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.tokens: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.routed: defaultdict[tuple[str, str], int] = defaultdict(int)
        """(model, decision) -> generations whose replica was chosen among several."""
        self.cached: defaultdict[tuple[str, str], int] = defaultdict(int)
        """(model, "expected" | "found") -> prompt tokens."""
        self.counters: defaultdict[str, int] = defaultdict(int)

    def observe(self, rows: Iterable[LogRow]) -> None:
        bounds = REQUEST_BUCKETS_S
        for row in rows:
            model, api = row.model_name, row.api
            self.requests[(model, row.version or "", api, str(row.status_code))] += 1
            counts = self.latency.get((model, api))
            if counts is None:
                counts = self.latency[(model, api)] = [0.0] * (len(bounds) + 2)
            seconds = row.latency_ms / 1000
            counts[bisect.bisect_left(bounds, seconds)] += 1
            counts[-1] += seconds
            hit = row.cache_hit
            if hit is not None:
                self.cache[(model, "hit" if hit else "miss")] += 1
            if row.prompt_tokens:
                self.tokens[(model, "prompt")] += row.prompt_tokens
            if row.completion_tokens:
                self.tokens[(model, "completion")] += row.completion_tokens
            if row.routed_by is not None:
                self.routed[(model, row.routed_by)] += 1
                if row.prompt_tokens and row.expected_cached:
                    expected = round(row.prompt_tokens * row.expected_cached)
                    self.cached[(model, "expected")] += expected
            if row.cached_tokens:
                self.cached[(model, "found")] += row.cached_tokens

    def add_counters(self, deltas: dict[str, int]) -> None:
        for key, n in deltas.items():
            self.counters[key] += n


class Text:
    """The exposition being written: ``# HELP``/``# TYPE`` once per family. ``keep``:
    also collect the samples of these metric names as ``(name, labels, value)`` (the
    console's alert rules evaluate them without parsing the text back)."""

    def __init__(self, keep: Container[str] | None = None) -> None:
        self.lines: list[str] = []
        self._declared: set[str] = set()
        self.keep = keep
        self.samples: list[tuple[str, dict[str, str], float]] = []

    def family(self, name: str, kind: str, help_: str) -> None:
        if name not in self._declared:
            self._declared.add(name)
            self.lines.append(f"# HELP {name} {help_}")
            self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_number(value)}")
        if self.keep is not None and name in self.keep:
            self.samples.append((name, labels, float(value)))

    def histogram(
        self, name: str, labels: dict[str, str], bounds: Iterable[float], cumulative: list[float],
        total: float,
    ) -> None:  # fmt: skip
        """``cumulative``: counts <= each bound, then the count of all (+Inf)."""
        for bound, n in zip(bounds, cumulative, strict=False):
            self.sample(f"{name}_bucket", {**labels, "le": _number(bound)}, n)
        self.sample(f"{name}_bucket", {**labels, "le": "+Inf"}, cumulative[-1])
        self.sample(f"{name}_sum", labels, total)
        self.sample(f"{name}_count", labels, cumulative[-1])

    def render(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def write_requests(out: Text, metrics: RequestMetrics, log_dropped: int = 0) -> None:
    """Request figures; ``log_dropped``: rows the server's log writer could not keep
    (those gateways dropped come with their counters)."""
    out.family("inferd_requests_total", "counter", "Inference requests answered, by status code.")
    for (model, version, api, code), n in sorted(metrics.requests.items()):
        out.sample(
            "inferd_requests_total",
            {"model": model, "version": version, "api": api, "code": code},
            n,
        )
    name = "inferd_request_duration_seconds"
    out.family(name, "histogram", "Time from arrival at the gateway to the answer.")
    for (model, api), counts in sorted(metrics.latency.items()):
        cumulative: list[float] = []
        running = 0.0
        for in_bucket in counts[:-1]:
            running += in_bucket
            cumulative.append(running)
        out.histogram(name, {"model": model, "api": api}, REQUEST_BUCKETS_S, cumulative, counts[-1])
    out.family("inferd_cache_requests_total", "counter", "Result cache lookups, by result.")
    for (model, result), n in sorted(metrics.cache.items()):
        out.sample("inferd_cache_requests_total", {"model": model, "result": result}, n)
    out.family("inferd_tokens_total", "counter", "Prompt and generated tokens of generations.")
    for (model, kind), n in sorted(metrics.tokens.items()):
        out.sample("inferd_tokens_total", {"model": model, "kind": kind}, n)
    out.family(
        "inferd_generation_routed_total",
        "counter",
        "Generations whose replica was chosen among several: by prefix (where the prompt's "
        "longest known prefix went), balance (a less loaded replica that lacked little more "
        "of it), overloaded (that replica was over its share), new (no replica had been "
        "sent any of it), adapter or adapter-load.",
    )
    for (model, decision), n in sorted(metrics.routed.items()):
        out.sample("inferd_generation_routed_total", {"model": model, "decision": decision}, n)
    out.family(
        "inferd_generation_cached_tokens_total",
        "counter",
        "Prompt tokens of generations in their replica's prefix cache: expected by the "
        "replica choice, and found by the engine.",
    )
    for (model, kind), n in sorted(metrics.cached.items()):
        out.sample("inferd_generation_cached_tokens_total", {"model": model, "kind": kind}, n)
    out.family(
        "inferd_rate_limited_total",
        "counter",
        "Requests refused by a rate limit (429), by limit kind (requests, tokens).",
    )
    for kind in ("requests", "tokens"):
        n = metrics.counters.get(f"rate_limited:{kind}", 0)
        out.sample("inferd_rate_limited_total", {"limit": kind}, n)
    out.family(
        "inferd_inference_log_dropped_rows_total",
        "counter",
        "Inference log rows dropped: a buffer was full or the database refused them.",
    )
    dropped = metrics.counters.get("log_dropped", 0) + log_dropped
    out.sample("inferd_inference_log_dropped_rows_total", {}, dropped)
    out.family(
        "inferd_shadow_skipped_total",
        "counter",
        "Requests not mirrored to a shadow version (too many in flight).",
    )
    out.sample("inferd_shadow_skipped_total", {}, metrics.counters.get("shadow_skipped", 0))
    out.family(
        "inferd_held_requests_total",
        "counter",
        "Requests that found no ready replica and waited for one that was starting.",
    )
    out.sample("inferd_held_requests_total", {}, metrics.counters.get("held", 0))
    out.family(
        "inferd_held_expired_total",
        "counter",
        "Held requests that no replica took before their deadline or the hold limit (503).",
    )
    out.sample("inferd_held_expired_total", {}, metrics.counters.get("held_expired", 0))
    out.family(
        "inferd_connections_refused_total",
        "counter",
        "Client connections a gateway closed to bound them, by port (http, grpc) and "
        "why: flood (frames that cost the server and not the client, or an address that "
        "sent them), limit (connections.max_per_process), timeout (a head, body or frame "
        "too slow), too_large (a head over connections.max_header_bytes), protocol.",
    )
    refused = [(key.split(":"), n) for key, n in metrics.counters.items()
               if key.startswith("connections_refused:")]  # fmt: skip
    for (_, port, why), n in sorted(refused):
        out.sample("inferd_connections_refused_total", {"port": port, "reason": why}, n)
    out.family(
        "inferd_generations_resumed_total",
        "counter",
        "Generations whose replica was lost mid-stream and that went on on another.",
    )
    out.sample("inferd_generations_resumed_total", {}, metrics.counters.get("resumed", 0))


REPLICA_GAUGES = {
    "queued_rows": ("inferd_queue_rows", "Rows waiting in the replica's batch queue."),
    "inflight": ("inferd_inflight_requests", "Requests in the replica (queued or computing)."),
    "explaining": (
        "inferd_explanations_in_progress",
        "Explanations a replica computes or keeps waiting (bounded by explain.max_waiting).",
    ),
    "preparing": (
        "inferd_preparing_requests",
        "Requests waiting for a replica's preparing (decoding) threads or prepared there "
        "now (bounded by images.max_queued).",
    ),
    "running": ("inferd_running_sequences", "Generations decoding in the engine."),
    "waiting": ("inferd_waiting_sequences", "Generations waiting for a slot."),
    "kv_blocks_used": ("inferd_kv_cache_blocks_used", "KV-cache blocks in use."),
    "kv_blocks_total": ("inferd_kv_cache_blocks", "KV-cache blocks of the replica."),
    "kv_cache_usage": (
        "inferd_kv_cache_usage_ratio",
        "vLLM replicas: share of the KV cache in use.",
    ),
    "load_s": ("inferd_replica_load_seconds", "Seconds the replica took to load its model."),
    "warmup_s": (
        "inferd_replica_warmup_seconds",
        "Seconds the replica's warm-up took, after loading, before it reported ready.",
    ),
    "fetch_s": (
        "inferd_replica_fetch_seconds",
        "Seconds the replica took to open its version's files in its host's artifact cache "
        "(a download from the store unless the host had them).",
    ),
    "fetched_bytes": (
        "inferd_replica_fetched_bytes",
        "Bytes the replica downloaded from the artifact store (0: its host's cache had them).",
    ),
}
REPLICA_COUNTERS = {
    "batches": ("inferd_batches_total", "Batches computed."),
    "rows": ("inferd_batch_rows_total", "Rows computed in batches."),
    "expired": ("inferd_requests_expired_total", "Requests dropped: deadline passed in queue."),
    "rejected": ("inferd_requests_rejected_total", "Requests refused: the queue was full."),
    "compute_s": ("inferd_compute_seconds_total", "Seconds spent computing batches."),
    "preemptions": ("inferd_preemptions_total", "Generations preempted (KV cache full)."),
    "prefix_cache_queries": (
        "inferd_prefix_cache_queried_tokens_total",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": (
        "inferd_prefix_cache_hit_tokens_total",
        "Prompt tokens found in the prefix cache (not computed again).",
    ),
    "spec_draft_tokens": (
        "inferd_spec_decode_draft_tokens_total",
        "Speculative decoding: guessed tokens checked.",
    ),
    "spec_accepted_tokens": (
        "inferd_spec_decode_accepted_tokens_total",
        "Speculative decoding: guessed tokens accepted (their share is the acceptance rate).",
    ),
    "adapter_loads": (
        "inferd_lora_adapter_loads_total",
        "LoRA adapters loaded because a request needed one that was not (LRU eviction).",
    ),
    "tokens": ("inferd_batch_tokens_total", "Text models: tokens of the texts computed."),
    "padded_tokens": (
        "inferd_batch_padded_tokens_total",
        "Text models: tokens computed including padding (rows x longest row per batch).",
    ),
}
REPLICA_HISTOGRAMS = {
    "request_s": ("inferd_replica_request_duration_seconds", "Queue + compute in the replica."),
    "batch_rows": ("inferd_batch_size_rows", "Rows per computed batch."),
    "queue_time_s": ("inferd_generation_queue_seconds", "Time a generation waited to start."),
    "ttft_s": ("inferd_time_to_first_token_seconds", "From arrival to the first token."),
    "itl_s": ("inferd_inter_token_seconds", "Between consecutive tokens of a generation."),
    "e2e_s": ("inferd_generation_duration_seconds", "From arrival to the last token."),
    "prompt_tokens": ("inferd_prompt_tokens", "Prompt tokens per generation."),
    "generation_tokens": ("inferd_generation_tokens", "Generated tokens per generation."),
    "adapter_load_s": (
        "inferd_lora_adapter_load_seconds",
        "Loading a LoRA adapter a request needed (the request waited that long).",
    ),
}


class ReplicaStatuses:
    """Status frames of replicas given as (labels, address), over one kept connection
    per replica: ``/metrics`` scrapes and the console's sampling once a slot both ask,
    and neither pays a connection (and, across hosts, a handshake) each time. A
    replica left out of a call, or whose connection broke, has its connection closed."""

    def __init__(self) -> None:
        self._clients: dict[str, tuple[ReplicaClient, asyncio.Task[None]]] = {}

    async def __call__(
        self,
        replicas: list[tuple[dict[str, str], str]],
        timeout_s: float = 2.0,
        ask: Ask | None = None,
    ) -> list[tuple[dict[str, str], Any]]:
        """(labels, status) of ``replicas``; those that do not answer in time are left out.
        ``ask``: another question than the status frame (the drift monitor's counts)."""
        wanted = {f"{labels['replica']}@{address}": labels for labels, address in replicas}
        for key, (client, connecting) in list(self._clients.items()):
            if key not in wanted or (connecting.done() and client.closed):  # gone, or broke
                self._drop(key)
        found = await asyncio.gather(
            *(self._one(key, labels, timeout_s, ask) for key, labels in wanted.items()),
            return_exceptions=True,
        )
        out = []
        for key, result in zip(wanted, found, strict=True):
            if isinstance(result, BaseException):
                self._drop(key)
            else:
                out.append(result)
        return out

    async def _one(
        self, key: str, labels: dict[str, str], timeout_s: float, ask: Ask | None = None
    ) -> tuple[dict[str, str], Any]:
        if key not in self._clients:  # concurrent callers share one connect
            client = ReplicaClient(key.split("@", 1)[1], labels["replica"])
            task = asyncio.get_running_loop().create_task(client.connect(timeout_s))
            self._clients[key] = (client, task)
        client, connecting = self._clients[key]
        await asyncio.shield(connecting)
        if ask is not None:
            return labels, await ask(client, labels, timeout_s)
        return labels, await client.status(timeout_s)

    def _drop(self, key: str) -> None:
        found = self._clients.pop(key, None)
        if found is not None:
            found[1].cancel()
            found[0].close()

    def close(self) -> None:
        for key in list(self._clients):
            self._drop(key)


def write_scaling(
    out: Text,
    desired: list[tuple[str, str, int, bool]],
    decisions: dict[tuple[str, str, str], int],
    cold_starts: dict[tuple[str, str], Any] | None = None,
) -> None:
    """``desired``: (model, version, desired replicas, autoscaled) of every running
    version; ``decisions``: autoscaling decisions by (model, version, reason);
    ``cold_starts``: (model, version) -> :class:`~inferd.control.scaling.ColdStarts`."""
    out.family("inferd_replicas_desired", "gauge", "Replicas a version should have now.")
    for model, version, count, autoscaled in desired:
        labels = {"model": model, "version": version, "autoscaled": str(autoscaled).lower()}
        out.sample("inferd_replicas_desired", labels, count)
    out.family(
        "inferd_autoscaling_decisions_total",
        "counter",
        "Autoscaling decisions by reason (utilisation, queue, latency, calm, idle, demand, "
        "bounds; capacity: a scale-up the machine had no room for).",
    )
    for (model, version, reason), n in sorted(decisions.items()):
        labels = {"model": model, "version": version, "reason": reason}
        out.sample("inferd_autoscaling_decisions_total", labels, n)
    if cold_starts:
        out.family(
            "inferd_cold_start_seconds",
            "histogram",
            "From a request held for a version scaled to zero to its replica being ready.",
        )
        for (model, version), hist in sorted(cold_starts.items()):
            labels = {"model": model, "version": version}
            out.histogram(
                "inferd_cold_start_seconds", labels, hist.bounds, hist.cumulative(), hist.total_s,
            )  # fmt: skip


def write_on_demand(
    out: Text, on_demand: Any, loaded: int, unloaded: int, resident_bytes: int
) -> None:
    """Versions loaded on demand under a memory budget (:class:`~inferd.control.on_demand.
    OnDemand`): how many are loaded now, and the loads and evictions so far."""
    out.family("inferd_on_demand_versions", "gauge", "On-demand versions, loaded or not.")
    out.sample("inferd_on_demand_versions", {"state": "loaded"}, loaded)
    out.sample("inferd_on_demand_versions", {"state": "unloaded"}, unloaded)
    out.family(
        "inferd_on_demand_budget_bytes", "gauge", "The memory budget (models.memory_budget_mb)."
    )
    out.sample("inferd_on_demand_budget_bytes", {}, on_demand.budget_bytes)
    out.family(
        "inferd_on_demand_resident_bytes",
        "gauge",
        "Resident memory of the versions with replicas, as last measured for a load.",
    )
    out.sample("inferd_on_demand_resident_bytes", {}, resident_bytes)
    for key, (name, help_) in ON_DEMAND_COUNTERS.items():
        out.family(name, "counter", help_)
        out.sample(name, {}, getattr(on_demand, key))


ON_DEMAND_COUNTERS = {
    "loads": (
        "inferd_on_demand_loads_total",
        "Versions loaded because a request was waiting for one.",
    ),
    "evictions": (
        "inferd_on_demand_evictions_total",
        "Versions unloaded to make room (least recently used first, never one with "
        "requests in flight or pinned).",
    ),
    "over_budget": (
        "inferd_on_demand_over_budget_total",
        "Loads that went over the budget: nothing resident could be unloaded then (pinned, "
        "busy or just loaded).",
    ),
}


def write_replicas(
    out: Text, states: list[tuple[dict[str, str], str, int]], statuses: list[tuple[dict, Any]]
) -> None:
    """``states``: (labels, state, restarts) of every replica the controller runs."""
    out.family("inferd_replicas", "gauge", "Replicas by state.")
    counts: defaultdict[tuple[str, str, str], int] = defaultdict(int)
    for labels, state, _ in states:
        counts[(labels["model"], labels["version"], state)] += 1
    for (model, version, state), n in sorted(counts.items()):
        out.sample("inferd_replicas", {"model": model, "version": version, "state": state}, n)
    out.family("inferd_replica_restarts_total", "counter", "Restarts of a replica after it died.")
    for labels, _, restarts in states:
        out.sample("inferd_replica_restarts_total", labels, restarts)
    for key, (name, help_) in {**REPLICA_GAUGES, **REPLICA_COUNTERS}.items():
        kind = "gauge" if key in REPLICA_GAUGES else "counter"
        rows = [
            (labels, value)
            for labels, status in statuses
            if (value := getattr(status.stats, key)) is not None
        ]
        if rows:
            out.family(name, kind, help_)
            for labels, value in rows:
                out.sample(name, labels, value)
    _labelled(
        out, statuses, "shed", "priority", "inferd_requests_shed_total",
        "Requests refused or evicted by load shedding, by priority.",
    )  # fmt: skip
    for key, (name, help_) in REPLICA_HISTOGRAMS.items():
        rows = [(labels, s.metrics[key]) for labels, s in statuses if key in s.metrics]
        if rows:
            out.family(name, "histogram", help_)
            for labels, snap in rows:
                out.histogram(name, labels, snap["le"], snap["cumulative"], snap["sum"])
    _labelled(
        out, statuses, "finished", "reason", "inferd_generations_total",
        "Generations finished, by reason.",
    )  # fmt: skip


def _labelled(
    out: Text, statuses: list[tuple[dict, Any]], key: str, label: str, name: str, help_: str
) -> None:
    """A counter family from a ``{label value: count}`` metric of each replica."""
    found = [(labels, s.metrics[key]) for labels, s in statuses if s.metrics.get(key)]
    if not found:
        return
    out.family(name, "counter", help_)
    for labels, by_value in found:
        for value, n in sorted(by_value.items()):
            out.sample(name, {**labels, label: value}, n)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of a process, from /proc; None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as f:
            resident = int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS, resident


def write_processes(out: Text, processes: list[tuple[dict[str, str], int]]) -> None:
    usage = [(labels, u) for labels, pid in processes if (u := process_usage(pid)) is not None]
    out.family("inferd_process_cpu_seconds_total", "counter", "CPU time of an inferd process.")
    for labels, (cpu, _) in usage:
        out.sample("inferd_process_cpu_seconds_total", labels, round(cpu, 2))
    out.family("inferd_process_resident_memory_bytes", "gauge", "Resident memory of a process.")
    for labels, (_, rss) in usage:
        out.sample("inferd_process_resident_memory_bytes", labels, rss)


def write_gpus(out: Text) -> None:
    """GPU utilisation and memory through NVML, when ``nvidia-ml-py`` is installed and a
    GPU is there; nothing at all otherwise (absent, not zero)."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pynvml.nvmlInit()
    except Exception:
        return
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(({"gpu": str(i)}, rates.gpu / 100, memory.used, memory.total))
    except Exception:
        return
    finally:
        pynvml.nvmlShutdown()
    out.family("inferd_gpu_utilization_ratio", "gauge", "Share of time the GPU was busy.")
    for labels, busy, _, _ in gpus:
        out.sample("inferd_gpu_utilization_ratio", labels, busy)
    out.family("inferd_gpu_memory_used_bytes", "gauge", "GPU memory in use.")
    for labels, _, used, _ in gpus:
        out.sample("inferd_gpu_memory_used_bytes", labels, used)
    out.family("inferd_gpu_memory_total_bytes", "gauge", "GPU memory.")
    for labels, _, _, total in gpus:
        out.sample("inferd_gpu_memory_total_bytes", labels, total)


def write_accuracy(
    out: Text, rows: list[dict[str, Any]], thresholds: list[tuple[dict[str, str], float]]
) -> None:
    """Rolling accuracy from feedback (see :mod:`inferd.monitoring.feedback`)."""
    out.family(
        "inferd_model_accuracy", "gauge", "Share of labelled feedback the version got right."
    )
    for row in rows:
        if row["labelled"]:
            labels = {"model": row["model"], "version": row["version"] or ""}
            out.sample("inferd_model_accuracy", labels, round(float(row["accuracy"]), 6))
    out.family(
        "inferd_model_mean_absolute_error", "gauge", "Mean absolute error of numeric feedback."
    )
    for row in rows:
        if row["numeric"]:
            labels = {"model": row["model"], "version": row["version"] or ""}
            out.sample("inferd_model_mean_absolute_error", labels, float(row["mean_abs_error"]))
    out.family("inferd_model_feedback", "gauge", "Feedback received in the accuracy window.")
    for row in rows:
        labels = {"model": row["model"], "version": row["version"] or ""}
        out.sample("inferd_model_feedback", labels, row["labelled"] + row["numeric"])
    out.family(
        "inferd_model_accuracy_threshold",
        "gauge",
        "A version's metadata.accuracy_threshold: the accuracy alert's line.",
    )
    for labels, threshold in thresholds:
        out.sample("inferd_model_accuracy_threshold", labels, threshold)
