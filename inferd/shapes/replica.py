"""The gateway <-> replica wire protocol.

Frames are ``<u32 little-endian length><msgpack body>`` over a Unix socket (or TCP).
Bodies are tagged msgspec Structs, so one decoder reads every kind. Tensors travel as
raw numpy buffers (``Tensor.data``), never as Python lists; BYTES tensors travel as a
msgpack array of str/bytes. One connection carries many requests at once: replies are
matched by ``id``, which the sender chooses (unique per connection).

Why not ZeroMQ: measured by ``bench/ipc.py`` on this 2-core machine (medians of 3
interleaved runs, one row of 30 float32), this transport does a round trip in 60 us
p50 and 32k calls/s with 64 in flight; pyzmq's asyncio DEALER/ROUTER over ``ipc://``
with the same msgspec bodies took 292 us and 6.9k calls/s, and even raw pyzmq sockets
on the event loop's reader took 158 us and 20.8k calls/s. It also needs no extra
dependency nor background I/O thread.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import time
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np

from inferd.shapes.drift import Profile
from inferd.shapes.llm import SamplingParams
from inferd.shapes.tensors import DATATYPES, datatype_of

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
Columns = dict[str, np.ndarray]
"""A request's (or an answer's) tensors by name, each with the rows as its first axis."""


class Reached(Protocol):
    """What a policy reads of a target it admits (a ``routing.targets.Target``)."""

    @property
    def model(self) -> str: ...

    @property
    def framework(self) -> str: ...


TargetT = TypeVar("TargetT", bound=Reached)
TargetT_contra = TypeVar("TargetT_contra", bound=Reached, contravariant=True)


class Reaches(Protocol[TargetT_contra]):
    """The models an inference graph target can call (a ``graphs.runner.Graphs``)."""

    def reach(self, target: TargetT_contra) -> frozenset[str]: ...


class ModelPolicy(Protocol):
    """The caller's per-model policy, for the models a request reaches beyond the one
    its route checked (an inference graph's nodes): implemented where the caller is
    known (:class:`inferd.access.policy.RequestPolicy`, made by HTTP's
    :func:`inferd.api.policy.policy_of` and by the gRPC service)."""

    def authorize(self, model: str) -> None:
        """Raise the error refusing the caller ``model`` (a 403)."""
        ...

    async def charge(self, model: str) -> None:
        """Take the request from ``model``'s rate limit (once a request; raises 429)."""
        ...

    async def admit(self, target: TargetT, graphs: Reaches[TargetT]) -> None:
        """The caller may reach ``target`` (a graph: and every model it can reach), and
        ``target``'s rate limit is taken; raises the 403 or 429."""
        ...


class InferRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a predict request carries besides its tensors, from the route that built it
    through the data plane, the router and the replica client into the :class:`Infer`
    frame: built once per request (gateway side only; never encoded itself)."""

    request_id: str = ""
    started: float
    """``time.perf_counter()`` when the request arrived: the origin of its deadline."""
    timeout_s: float
    """The request's deadline, from ``started``."""
    priority: int = 0
    """Its level in the replica's queue (0: the default; see :mod:`inferd.priority`)."""
    pinned: bool = False
    """The request named its version: no fallback, overflow model or shadow copy."""
    policy: ModelPolicy | None = None
    """Who may reach what, for the models its graph nodes call (None: nobody checks)."""

    def left_s(self) -> float:
        """Seconds until the deadline (<= 0: it passed)."""
        return self.timeout_s - (time.perf_counter() - self.started)


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A generation as the gateway sends it, from ``start_generation`` through the
    router and the replica client into the :class:`Generate` frame."""

    prompt: str | list[int] | dict[str, Any]
    """Text, token ids, or a chat (``messages``, ``tools``) the replica renders with
    the model's chat template."""
    params: SamplingParams
    adapter: str | None = None
    request_id: str = ""
    arrived_at: float = 0.0
    """Wall-clock time (``time.time()``) the request reached the gateway; 0 = unknown."""
    idle_timeout_s: float
    """After the first chunk, each next one must come within this."""
    first_timeout_s: float | None = None
    """The first chunk may take this long (it may wait in the replica's queue); None:
    ``idle_timeout_s``."""
    resume: list[int] | None = None
    """The tokens generated before the replica that made them was lost: the next one
    goes on after them (see :meth:`inferd.routing.router.Router.generate`)."""


class Tensor(msgspec.Struct, array_like=True):
    datatype: str
    shape: tuple[int, ...]
    data: bytes | list[Any]


class Infer(msgspec.Struct, tag="infer", array_like=True):
    id: int
    inputs: dict[str, Tensor]
    rows: int
    timeout_ms: float
    request_id: str = ""
    priority: int = 0
    reference: dict[str, Tensor] | None = None
    """A mirrored (shadow) request: the live version's answer. The replica compares its
    own with it (within ``tolerance``), counts the outcome, and answers no outputs."""
    tolerance: float = 0.0
    trace: dict[str, str] | None = None
    """The caller's span context (``traceparent``, ...) when tracing is on."""


class InferResult(msgspec.Struct, tag="result", array_like=True):
    id: int
    outputs: dict[str, Tensor]
    queue_ms: float = 0.0
    """How long the request waited in the replica's queue for its batch to start."""
    compute_ms: float = 0.0
    """How long its batch computed."""
    batch_rows: int = 0
    """Rows in its batch (0: not known)."""


@dataclass(slots=True)
class Answer:
    """A replica's answer to one predict as the gateway's client hands it up: the
    outputs, and where the request spent its time there (for ``Server-Timing``)."""

    outputs: Columns
    replica_ms: float = 0.0
    """The round trip from the gateway: queue, compute, and the transport and batching
    around them."""
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    batch_rows: int = 0


class Explain(msgspec.Struct, tag="explain", array_like=True):
    """Each feature's share of each row's prediction (answered by :class:`Explained`):
    computed off the batcher, at most ``explain.max_rows`` rows."""

    id: int
    inputs: dict[str, Tensor]
    rows: int
    timeout_ms: float
    request_id: str = ""


class Explained(msgspec.Struct, tag="explained", array_like=True):
    """An :class:`~inferd.runtimes.explain.Explanation` on the wire."""

    id: int
    attributions: Tensor
    """(rows, features, outputs)"""
    values: Tensor
    """(rows, outputs)"""
    expected: Tensor
    """(outputs,)"""
    features: list[str]
    outputs: list[str]
    method: str
    space: str
    compute_ms: float = 0.0


class Error(msgspec.Struct, tag="error", array_like=True):
    id: int
    code: str
    message: str
    status: int = 500
    retry_after_s: int = 0
    """For a 503: when to try again (the Retry-After the client gets); 0: unknown."""


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    id: int


class StatusQuery(msgspec.Struct, tag="status?", array_like=True):
    id: int


class ReplicaState(enum.StrEnum):
    """Where a replica is in its life. A replica reports ``loading``, ``ready``,
    ``draining`` or ``failed`` itself (:class:`Status`, and a joined one's
    :class:`~inferd.shapes.control.Beat`); the controller's routes
    (:class:`~inferd.shapes.control.ReplicaRoute`) also say ``starting`` (its process is
    not answering yet) and ``stopped``."""

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"
    STOPPED = "stopped"


class ReplicaStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A replica's figures in its :class:`Status` (and ``/api/v1`` status replies, as they
    are: each figure a number, the ones a replica does not have left out). None: this
    replica has no such figure (a predict replica has no engine, a generation replica no
    batcher). The Prometheus families they feed are
    :data:`inferd.monitoring.exposition.REPLICA_GAUGES` and ``REPLICA_COUNTERS``."""

    uptime_s: float | None = None
    inflight: float | None = None
    """Requests in the replica (queued or computing; generations it streams)."""
    rss_bytes: float | None = None
    # predict replicas (serving/replica.py: ReplicaCore.stats)
    explaining: float | None = None
    """Explanations computing or waiting (bounded by ``explain.max_waiting``)."""
    preparing: float | None = None
    """Requests waiting for, or on, the preparing (decoding) threads."""
    queued_rows: float | None = None
    """Rows waiting in the batch queue."""
    batches: float | None = None
    rows: float | None = None
    requests: float | None = None
    expired: float | None = None
    rejected: float | None = None
    shed: float | None = None
    compute_s: float | None = None
    tokens: float | None = None
    """Text models: tokens of the rows computed (when any were padded)."""
    padded_tokens: float | None = None
    load_s: float | None = None
    warmup_s: float | None = None
    warmup_requests: float | None = None
    model_bytes: float | None = None
    """In a shared process: what its load added to that process's memory."""
    # generation replicas (inferd's engine: LLMEngine.stats; vLLM's: VLLMCore.stats)
    busy_s: float | None = None
    """Seconds the engine computed, weighted by how full it was."""
    running: float | None = None
    waiting: float | None = None
    kv_blocks_used: float | None = None
    kv_blocks_total: float | None = None
    kv_cache_usage: float | None = None
    """vLLM: the share of its KV cache in use."""
    preemptions: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    steps: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None
    adapter_loads: float | None = None
    adapters: float | None = None
    """LoRA adapters loaded: in the status that answers an :class:`Adapter` frame."""
    # how the version's files came (replica_server.py)
    fetch_s: float | None = None
    fetched_bytes: float | None = None

    @property
    def queued(self) -> float:
        """What waits in the replica: rows in a predict replica's batch queue, sequences
        waiting for a generation engine's slot."""
        return self.queued_rows if self.queued_rows is not None else self.waiting or 0.0

    @property
    def computed_s(self) -> float:
        """Seconds computed: a predict replica's batches', a generation engine's
        (weighted by how full it was)."""
        return self.compute_s if self.compute_s is not None else self.busy_s or 0.0


class Status(msgspec.Struct, tag="status", array_like=True):
    id: int
    state: ReplicaState
    """loading | ready | draining | failed"""
    pid: int
    model: str
    version: str
    stats: ReplicaStats = msgspec.field(default_factory=ReplicaStats)
    message: str = ""
    metrics: dict[str, Any] = {}
    """Histograms and counters of the replica (generation models: see inferd.llm.metrics)."""


class Drain(msgspec.Struct, tag="drain", array_like=True):
    id: int


class Generate(msgspec.Struct, tag="generate", array_like=True):
    """Start a generation; the replica answers with TokenChunk frames, the last one
    ``finished``."""

    id: int
    prompt: str | list[int] | dict[str, Any]
    params: SamplingParams
    adapter: str | None = None
    request_id: str = ""
    arrived_at: float = 0.0
    """Wall-clock time (``time.time()``) the request reached the gateway; 0 = unknown.
    The origin of the replica's queue-time, TTFT and latency metrics."""
    trace: dict[str, str] | None = None
    """The caller's span context (``traceparent``, ...) when tracing is on."""
    prefix: list[int] | None = None
    """The prompt's keys when the gateway chose among replicas by prefix: the replica
    reports them to every gateway (:class:`Load`)."""
    resume: list[int] | None = None
    """Output tokens another replica generated before it was lost: go on after them,
    the first chunk's text being theirs (as this replica would have streamed it) and
    the new token's."""


class TokenChunk(msgspec.Struct, tag="tokens", array_like=True):
    id: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those the engine's prefix cache held (not computed)."""
    replayed: int = 0
    """A resumed generation's first chunk: its text starts with this many characters
    of the text of the tokens it resumed after (the gateway cuts what its caller has)."""


class Load(msgspec.Struct, tag="load", array_like=True):
    """A generation replica's engine state, pushed to every connected gateway when it
    changes (and once a second): replica choice weighs what the engine holds from every
    gateway, not one gateway's own requests. ``id`` is 0: it answers nothing."""

    id: int
    running: int
    """Sequences the engine is computing."""
    waiting: int
    """Accepted, not computing yet (queued, or preempted)."""
    kv_used: float
    """Share of the KV cache's blocks in use (0 to 1)."""
    prefix: list[int] = []
    """Prompt keys gateways sent it since the last report (:mod:`inferd.routing.prefix`)."""
    adapters: list[str] = []
    """The LoRA adapters its engine has loaded."""
    adapter_room: int = 0
    """Adapter slots a request for another adapter could load it into now (free, or
    held by an adapter no running sequence uses)."""


class Adapter(msgspec.Struct, tag="adapter", array_like=True):
    """Load (``path`` given) or unload (``path`` None) a LoRA adapter by name."""

    id: int
    name: str
    path: str | None = None


class DriftQuery(msgspec.Struct, tag="drift?", array_like=True):
    """Server -> predict replica: its counts of its version's inputs on their reference
    profile (:mod:`inferd.shapes.drift`; counted by :mod:`inferd.telemetry.drift`),
    answered by :class:`DriftCounts`. The first query starts the counting (a server with
    drift off never asks)."""

    id: int
    reference: Profile | None = None
    """The version's profile, when the replica does not count on it yet."""
    reference_rows: int = 1000
    """With no profile: the replica builds one from this many of its first rows."""
    max_categories: int = 50
    max_rows_per_s: int = 5000
    """Past this many rows a second, the replica counts one row in K."""


class DriftCounts(msgspec.Struct, tag="drift", array_like=True):
    """Rows counted on the profile named ``digest`` since the replica began counting on
    it (cumulative: the server differences them into windows)."""

    id: int
    digest: str
    """The profile's; empty while the replica has none (it is collecting rows)."""
    since: float
    """When this counter began (wall clock): another value is another counter (the
    replica restarted, or was handed another profile)."""
    age_s: float
    """Seconds it has counted (monotonic: no clock skew between hosts)."""
    rows: int
    """Rows counted (all, or one in K past ``max_rows_per_s``)."""
    counts: list[int]
    """Per bin, each feature's bins in profile order."""
    sums: list[float]
    squares: list[float]
    """Per feature: the sum and the sum of squares of its finite values."""
    collected: int = 0
    """Rows kept towards a profile of its own, while it has none."""
    seen: int = 0
    """Rows it was given since it began counting (counted or not)."""
    profile: Profile | None = None
    """The profile it built from its first rows, until the server hands it one."""


Message = (
    Infer
    | InferResult
    | Error
    | Cancel
    | StatusQuery
    | Status
    | DriftQuery
    | DriftCounts
    | Drain
    | Generate
    | TokenChunk
    | Adapter
    | Load
    | Explain
    | Explained
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode(body: bytes | memoryview) -> Message:
    return _decoder.decode(body)


class TurnWriter:
    """Frames to one transport: the first of a turn of the event loop is written at once,
    the ones that follow it in the same turn go together in one write at the end of the
    turn. One system call for what a turn produces (a batch's results; the requests of
    the many connections a gateway read in one turn; one token for each of a decode
    step's streams) instead of one each, and a lone frame is not delayed."""

    __slots__ = ("_burst", "transport")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self._burst: list[bytes] | None = None

    def write(self, frame: bytes) -> None:
        if self._burst is not None:
            self._burst.append(frame)
            return
        self.transport.write(frame)
        self._burst = []
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        burst, self._burst = self._burst, None
        if burst and not self.transport.is_closing():
            self.transport.write(b"".join(burst))


class FrameBuffer:
    """Accumulates stream bytes and yields complete frame bodies."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        buf = self._buf
        buf += data
        messages: list[Message] = []
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {size} bytes exceeds the limit")
            if end - pos - 4 < size:
                break
            messages.append(_decoder.decode(memoryview(buf)[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return messages


def to_tensor(array: np.ndarray) -> Tensor:
    datatype = datatype_of(array)
    if datatype == "BYTES":
        return Tensor(datatype, array.shape, array.ravel().tolist())
    return Tensor(datatype, array.shape, np.ascontiguousarray(array).tobytes())


def from_tensor(tensor: Tensor) -> np.ndarray:
    if tensor.datatype == "BYTES":
        out = np.empty(len(tensor.data), dtype=object)
        out[:] = tensor.data
        return out.reshape(tensor.shape)
    dtype = DATATYPES[tensor.datatype]
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape)  # type: ignore[arg-type]
