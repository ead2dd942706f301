"""The settings groups a replica reads: dynamic batching and the generation engines.

Part of :class:`inferd.config.Settings` (``batching``, ``images``, ``llm``; also importable
from :mod:`inferd.config`), kept in a module of their own so that a replica process,
which receives them in its :class:`~inferd.shapes.replica_spec.ReplicaSpec`, imports
pydantic's models without pydantic-settings and the server's other settings.
:class:`Group` is the base of every settings group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Group(BaseModel):
    """A group of settings (``INFERD_<GROUP>__<KEY>``, ``group: {key: ...}`` in YAML)."""

    model_config = ConfigDict(extra="forbid")


class BatchingConfig(Group):
    """Dynamic batching of one model version inside its replica."""

    max_batch_size: int = Field(32, ge=1, le=65536)
    """Most rows (not requests) in one predict_batch call."""
    max_wait_ms: float = Field(5.0, ge=0, le=10_000)
    """Longest a batch waits for more rows after its first arrived (when it waits at all:
    see ``adaptive``)."""
    adaptive: bool = True
    """Adaptive batching: at low load a free replica computes what is queued at once (a
    request that finds its replica idle is not held for companions; while a batch
    computes, the next one gathers). Once computing the arriving requests one by one
    would keep the replica busy all its time, batches wait up to
    ``max_wait_ms`` for ``max_batch_size`` rows: fewer, fuller batches where a queue
    forms anyway. False: window batching, every batch waits that way, idle or not."""
    max_queue_rows: int = Field(8192, ge=1)
    """Rows queued in the replica beyond which new requests get 503 (Retry-After); a
    request of a better level takes the place of queued ones of worse levels instead
    (they get the 503: shed, newest first)."""
    queue_timeout_ms: float | None = Field(None, gt=0)
    """A cap on how long a request may wait in the replica's queue, below its deadline
    (then 504 without running). None: the request's deadline is the only bound (its
    ``X-Request-Timeout`` / ``timeout``, else ``request_timeout_s``)."""
    priority_levels: int = Field(4, ge=1, le=100)
    """Request priorities: 1 is served first, ``priority_levels`` last (strictly: a level
    waits while a better one has requests). Requests name theirs with ``priority``: a
    level number (the Open Inference Protocol's parameter) or a name: ``high`` is 1,
    ``normal`` the default level, ``low`` the one after it, ``batch`` (batch jobs) the
    last. By default: 1 high, 2 normal, 3 low, 4 batch."""
    default_priority: int = Field(2, ge=1, le=100)
    """The level of requests that name no priority (or 0)."""
    low_queue_share: float = Field(0.5, gt=0, le=1)
    """Load shedding: levels after the default one (``low``) are refused at once (503,
    Retry-After) while the queue holds this share of ``max_queue_rows`` or more."""
    batch_queue_share: float = Field(0.25, gt=0, le=1)
    """The same for the last level (``batch``), when it comes after the default one."""
    warmup_requests: int = Field(4, ge=0, le=1000)
    """Before it reports ready, a replica sends this many one-row requests, one at a
    time, and then one full batch (``max_batch_size`` rows, at most 1,024) through its
    own batcher, so the first requests routed to it are not the ones that pay the
    model's first calls (lazy initialisation, a framework's first run of a shape). The
    rows are the version's ``warmup_samples`` (metadata: a list of rows, as a predict
    request's) or generated from its signature. The time goes in the replica's
    ``warmup_s`` (``inferd_replica_warmup_seconds``); the requests are not counted as
    traffic. 0: the replica is ready once loaded, without running the model."""
    length_buckets: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [16, 32, 64, 128, 256, 512]
    )
    """Text models: upper bounds (tokens) of the length buckets. A batch holds requests of
    one bucket (the oldest request's), so short texts are not padded to long ones; an
    empty list batches texts of any length together."""

    @model_validator(mode="after")
    def _default_priority_is_a_level(self) -> BatchingConfig:
        if self.default_priority > self.priority_levels:
            raise ValueError(
                f"default_priority {self.default_priority} is above priority_levels "
                f"{self.priority_levels}"
            )
        return self


class ImagesConfig(Group):
    """Image inputs: versions whose metadata declares ``image`` preprocessing take encoded
    images (:mod:`inferd.runtimes.images`)."""

    allowed_buckets: list[str] = Field(default_factory=list)
    """``bucket`` or ``bucket/prefix`` entries whose ``s3://`` URIs an image input may
    name (fetched with the ``AWS_*`` endpoint and credentials, as the artifact store),
    matched by whole path segments: ``images`` takes ``s3://images/…`` but not
    ``s3://images-private/…``; ``images/x`` takes ``s3://images/x/…`` but not
    ``s3://images/x-private/…``. A key with an empty, ``.`` or ``..`` segment is
    refused. None: a URI is refused (422). No other URL is ever fetched. Requests
    naming an ``s3://`` URI are never answered from the result cache (the object may
    change under its name, and this list may change)."""
    max_pixels: int = Field(40_000_000, ge=1)
    """Largest image (width x height) decoded; a larger one is refused (422) from its
    header, before decoding: a decompression bomb costs nothing. Each version's own
    (Pillow's process-wide ``MAX_IMAGE_PIXELS`` is left as it is, for the neighbours
    of a shared replica process; its WebP and TIFF readers still check it too)."""
    max_object_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Largest object an ``s3://`` URI may name (422 beyond)."""
    max_request_pixels: int = Field(200_000_000, ge=1)
    """The pixels of one request's images together (each as its header says): a 413
    for the image that passes it, before it is decoded. A body of small compressed
    images can hold thousands of them."""
    max_queued: int = Field(64, ge=1, le=100_000)
    """Requests a replica keeps waiting for its decoding threads; one more is refused
    (503 with Retry-After). A request whose deadline passed while it waited is not
    decoded."""
    decode_threads: int = Field(2, ge=1, le=64)
    """Threads of a replica that fetch and decode images, a request at a time each (the
    decoders release the GIL): requests decode in parallel and apart, so a corrupt
    image fails its own request only, then their tensors batch together."""

    @field_validator("allowed_buckets")
    @classmethod
    def _bucket_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            parts = entry.strip("/").split("/")
            if entry.startswith("s3:") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(
                    f"images.allowed_buckets entry {entry!r}: give `bucket` or "
                    "`bucket/prefix` (no s3://, no empty, . or .. segments)"
                )
        return entries


class ExplainConfig(Group):
    """Explanations (:mod:`inferd.runtimes.explain`): what one request may cost a
    replica, and how many a replica takes at once."""

    max_rows: int = Field(100, ge=1, le=100_000)
    """Rows one explanation request may hold (413 beyond)."""
    coalitions: int = Field(2048, ge=2, le=1_000_000)
    """Coalitions KernelSHAP evaluates per row: every one when there are fewer (exact
    Shapley values of the background), else this many drawn by kernel weight."""
    background_rows: int = Field(64, ge=1, le=100_000)
    """Background rows KernelSHAP averages over (more registered: an evenly spaced
    subset of them)."""
    max_model_rows: int = Field(4_000_000, ge=1)
    """Model rows one KernelSHAP explanation may cost (rows x coalitions x background
    rows, and the rows and background themselves), estimated before it starts: a 413
    naming this beyond. TreeSHAP costs its rows only."""
    max_waiting: int = Field(4, ge=0, le=10_000)
    """Explanations a replica keeps waiting behind the one it computes; one more is
    refused (503 with Retry-After), as is any while its batch queue holds
    ``low_queue_share`` of ``max_queue_rows`` (predictions go first)."""


class LLMConfig(Group):
    """The generation engines: inferd's own (GPT-2 family) and vLLM (any decoder it
    runs); the version's metadata ``engine`` picks one for a model."""

    engine: str = Field("auto", pattern="^(auto|inferd|vllm)$")
    """The engine of generative versions whose metadata does not name one. ``auto``:
    inferd's own engine for the GPT-2 family, vLLM for other architectures."""
    vllm_python: Path | None = None
    """The Python interpreter of an environment with vLLM (``make vllm`` makes
    ``.venv-vllm``): vLLM replicas run under it. None: this interpreter when it imports
    vllm, else ``.venv-vllm/bin/python`` in the working folder when that exists."""
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    """Extra vLLM engine arguments for every vLLM replica (e.g.
    ``{"gpu_memory_utilization": 0.85}``); a version's metadata ``vllm_args`` adds to them."""

    kv_cache_mb: int = Field(256, ge=1)
    """Memory of each replica's paged KV cache. On a GPU, when the version states its
    ``gpu_memory_gb`` (the budget placement plans with), the cache takes what that
    budget leaves after the weights and a workspace reserve instead."""
    block_size: int = Field(16, ge=1, le=256)
    """Tokens per KV-cache block."""
    prefix_caching: bool = True
    """Keep the keys and values of computed prompt blocks and reuse them for a later
    prompt that starts with the same tokens (a shared system prompt, the earlier turns
    of a chat): only the rest is computed. Both engines (vLLM's
    ``enable_prefix_caching``)."""
    prefix_routing: bool = True
    """With several replicas of a generative version, send a generation to the replica
    its prompt's longest prefix went to before (where the engine has it cached), within
    ``prefix_routing_margin``; false: the least loaded one always."""
    prefix_routing_margin: float = Field(0.5, ge=0)
    """A replica loses the preference when the generation would take its engine above
    its fair share of the version's sequences (this one included) by more than this
    fraction of that share, or more than one sequence, whichever is more."""
    prefix_routing_move_tokens: int = Field(256, ge=0)
    """A generation goes to a replica running fewer sequences than the one its prefix
    prefers (when that one runs two or more) if it lacks at most this many more of the
    prompt's tokens (about 4 bytes of prompt each): a chat's first turns even the load
    out, cheaply, where a long history stays on the replica that holds it. 0: only the
    margin moves a generation."""
    max_num_seqs: int = Field(128, ge=1)
    """Sequences decoding together in one step. On a 2-core CPU, GPT-2 small's output
    tokens/s was flat from 64 to 128 and fell at 256 (233, 237, 148 tok/s for 500
    requests, measured with PyTorch attention, before the C decode kernel); a GPU wants more."""
    max_batched_tokens: int = Field(512, ge=16)
    """Tokens (prefill chunks + decodes) per step; bounds how long a step takes."""
    max_waiting: int = Field(1024, ge=1)
    """Requests queued in a replica beyond which new ones get 503."""
    queue_timeout_s: float = Field(600.0, gt=0)
    """How long a request may wait in a replica's queue for a free sequence slot before
    it gets 503 (Retry-After). Waiting is not idleness: the gateway's
    ``request_timeout_s`` counts only between tokens once a request runs."""
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$")
    """Where inferd's own engine runs. ``auto``: on the GPU when the replica sees one
    (a deployment with ``resources.gpu`` gives each replica its own), else on the CPU."""
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$")
    """Weights and KV-cache dtype. ``auto``: float32 on a CPU, bfloat16 on a GPU."""
    quantize: str = Field("none", pattern="^(none|fp8)$")
    """``fp8``: the transformer blocks' weights in float8 (e4m3, one scale per output
    channel; activations scaled per token), on GPUs with fp8 matrix units (compute
    capability 8.9+: L4, H100, H200). Ignored, with a warning, elsewhere."""
    cuda_graphs: bool = True
    """On a GPU, replay decode steps from CUDA graphs (captured at start for batch
    sizes up to ``max_num_seqs``); false: every step runs eagerly."""
    max_adapters: int = Field(4, ge=0, le=64)
    """LoRA adapter slots per replica."""
    max_lora_rank: int = Field(16, ge=1, le=256)
    """Largest LoRA rank a slot holds."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longer prompts are refused with 413 (None: up to the model's context)."""
    max_tokens_limit: int = Field(4096, ge=1, le=65536)
    """The largest ``max_tokens`` a request may ask for (422 beyond)."""
    native: bool = True
    """Paged decode attention through a small C kernel compiled on first use (where a C
    compiler is found); false: PyTorch ops only."""
    speculative: dict[str, Any] | None = None
    """Speculative decoding for every generative version (a version's metadata
    ``speculative`` replaces it for that version), in the shape of vLLM's
    ``speculative_config``. inferd's engine: ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    "disable_by_batch_size": N}`` (prompt lookup, for greedy requests, with exactly
    plain decoding's tokens; :mod:`inferd.llm.speculation`); the vLLM engine takes any
    of vLLM's methods. None: off."""

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("method", "ngram") == "ngram":
            SpeculationConfig.parse(value, "llm.speculative")
        return value


SPECULATION_KEYS = {
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "disable_by_batch_size",
}  # fmt: skip


@dataclass(frozen=True)
class SpeculationConfig:
    """inferd's engine's speculative decoding, as the ``llm.speculative`` setting or a
    version's ``speculative`` metadata configures it (vLLM's ``speculative_config``
    shape); the proposer is :class:`inferd.llm.speculation.Speculation`."""

    tokens: int = 4
    """Draft tokens proposed per step at most (``num_speculative_tokens``; how many a
    sequence guesses each time: :meth:`inferd.llm.engine.LLMEngine._propose`)."""
    lookup_max: int = 4
    """Longest suffix looked up (``prompt_lookup_max``); shorter ones are tried next."""
    lookup_min: int = 2
    """Shortest suffix looked up (``prompt_lookup_min``)."""
    max_batch: int | None = None
    """No speculation while more sequences than this run (``disable_by_batch_size``): a
    full batch is bound by compute, where checking guesses costs what it saves."""

    @classmethod
    def parse(cls, config: dict[str, Any] | None, where: str) -> Self | None:
        """From vLLM's ``speculative_config`` shape; None when ``config`` is empty.
        ValueError naming ``where`` and the field for anything inferd's engine cannot do."""
        if not config:
            return None
        if not isinstance(config, dict):
            raise ValueError(f"{where} must be an object like vLLM's speculative_config")
        unknown = sorted(set(config) - SPECULATION_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown} for inferd's engine; it takes "
                f"{sorted(SPECULATION_KEYS)} (other vLLM methods: use the vLLM engine)"
            )
        method = config.get("method", "ngram")
        if method != "ngram":
            raise ValueError(
                f"{where}.method {method!r}: inferd's engine speculates with 'ngram' "
                "(prompt lookup); other methods need the vLLM engine"
            )
        values: dict[str, int] = {}
        for key, name in (("num_speculative_tokens", "tokens"),
                          ("prompt_lookup_max", "lookup_max"),
                          ("prompt_lookup_min", "lookup_min")):  # fmt: skip
            value = config.get(key, getattr(cls, name))
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{where}.{key} must be an integer from 1 to 64, got {value!r}")
            values[name] = value
        cap = config.get("disable_by_batch_size")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"{where}.disable_by_batch_size must be a positive integer")
        if values["lookup_min"] > values["lookup_max"]:
            raise ValueError(f"{where}: prompt_lookup_min is larger than prompt_lookup_max")
        return cls(**values, max_batch=cap)

    @classmethod
    def for_version(cls, metadata: dict[str, Any], setting: dict[str, Any] | None) -> Self | None:
        """A version's: its ``speculative`` metadata, else the ``llm.speculative``
        setting; errors name the one they came from."""
        if metadata.get("speculative") is not None:
            return cls.parse(metadata["speculative"], "metadata.speculative")
        return cls.parse(setting, "llm.speculative")
