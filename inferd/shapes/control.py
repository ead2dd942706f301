"""The control channel: routing tables down to the gateways, requests back up.

A full snapshot is sent on connect and after every change (it is small: models x
versions x replicas), so a gateway never has to merge deltas. ``generation`` only grows.
The other way, a gateway may send a :class:`ReconcileRequest` (after changing a model's
desired state in the registry) so the controller acts now instead of on its next
periodic pass, and sends its inference log rows (:class:`LogRows`) about once a
second. Both directions use the same frame: a 4-byte little-endian length, then
msgpack; new fields get defaults so either side may be older.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from inferd.shapes.logs import LogRow
from inferd.shapes.replica import ReplicaState
from inferd.shapes.tensors import Signature


class ReplicaRoute(msgspec.Struct, frozen=True):
    id: str
    address: str
    state: ReplicaState
    pid: int = 0
    restarts: int = 0
    message: str = ""
    ever_ready: bool = False
    """It was ready once: when it is starting again (a crash restart), requests wait for it."""
    gpus: list[int] | None = None
    """The GPUs it sees (``CUDA_VISIBLE_DEVICES``); None: no GPU asked for."""
    placement: str = "local"
    """Where it runs: ``local`` (started by the controller on its host), ``host NAME``
    (joined from another host), ``pod`` (a Kubernetes pod, named by its id)."""


class VersionRoute(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    framework: str
    signature: Signature
    replicas: list[ReplicaRoute]
    desired_replicas: int = 1
    adapters: list[str] = []
    """LoRA adapters registered with this (generative) version; each is also a model name."""
    fallback: bool = True
    """A request this version fails, unless pinned to it, is retried on the serving one."""
    mirror_pct: int = 0
    """A shadow deployment: the percent of the model's requests mirrored to it (their
    answers are compared with the live ones, then dropped); it takes no live traffic."""
    tolerance: float = 0.0
    """A shadow's answer agrees with the live one when every number is within this
    (absolute and relative) of it, and everything else is equal."""
    cache_ttl_s: float | None = None
    """The version's result cache TTL (its ``metadata.cache_ttl_s``; 0: never cached;
    None: the server's default)."""
    digest: str = ""
    """The sha256 of the version's artifact: result cache keys include it, so a version
    deleted and pushed again under the same label never gets the old one's answers."""
    overflow_model: str | None = None
    """A lightweight model taking the same inputs that answers this version's requests
    while it is saturated (its ``metadata.overflow_model``); None: they get 503."""
    allow_non_finite: bool = False
    """Float inputs may be NaN or ±Infinity (its ``metadata.allow_non_finite``; see
    :mod:`inferd.protocols.numbers`)."""
    scale_from_zero: bool = False
    """Autoscaled with ``min_replicas`` 0: at zero replicas, a request is held and the
    gateway asks the controller for one (:class:`Demand`)."""
    graph: dict[str, Any] | None = None
    """An inference graph's spec (framework ``graph``, :mod:`inferd.shapes.graph`): it has
    no replica, the gateway runs it."""


class ModelRoute(msgspec.Struct, frozen=True):
    name: str
    default_version: str | None
    """The version unpinned requests go to without a split; None until one is ready."""
    versions: dict[str, VersionRoute]
    loaded: bool = True
    """The controller's desired state; an unloaded model has no serving version and its
    replicas drain away (an unloaded model is not waited for by readiness probes)."""
    traffic: dict[str, int] = {}
    """Deployed versions -> percent of unpinned requests, newest version first (empty:
    all to ``default_version``). Gateways split among the versions that have ready
    replicas; ``default_version`` is the ready version with the largest share."""


class RoutingTable(msgspec.Struct, frozen=True, tag="table"):
    generation: int
    models: dict[str, ModelRoute]
    epoch: str = ""
    """The controller that made it (one id per controller start): a gateway takes a
    table of a new epoch whatever its generation (a restarted or failed-over
    controller counts from 1 again)."""


class Heartbeat(msgspec.Struct, frozen=True, tag="beat"):
    """Controller -> gateway, every second: still here (a gateway that stops hearing
    it keeps serving its last table and says so in ``/health/ready``)."""

    generation: int


class ReconcileRequest(msgspec.Struct, frozen=True, tag="reconcile"):
    """Gateway -> controller: reconcile now, the registry changed for ``model``."""

    model: str = ""


class Demand(msgspec.Struct, frozen=True, tag="demand"):
    """Gateway -> controller: a request waits for ``model:version``, scaled to zero."""

    model: str
    version: str


class LogRows(msgspec.Struct, frozen=True, tag="log"):
    """Gateway -> server: inference log rows (see :mod:`inferd.telemetry.log_rows`)
    that the server process writes, so gateways never hold a database driver's GIL."""

    rows: list[LogRow]
    counters: dict[str, int] = {}
    """Gateway counters (rate-limited, ...) since the last frame, for ``/metrics``."""


class MetricsQuery(msgspec.Struct, frozen=True, tag="metrics?"):
    """Gateway -> server: render ``/metrics``; answered with :class:`MetricsText`."""

    id: int


class MetricsText(msgspec.Struct, frozen=True, tag="metrics"):
    """Server -> gateway: the ``/metrics`` exposition asked for by query ``id``."""

    id: int
    text: str


class ConsoleView(enum.StrEnum):
    """What a :class:`ConsoleQuery` asks for."""

    OVERVIEW = "overview"
    """Per model summaries, alerts, control health."""
    SERIES = "series"
    """Time series."""
    DRIFT = "drift"
    """A version's input drift (:mod:`inferd.control.drift`)."""


class ConsoleQuery(msgspec.Struct, frozen=True, tag="console?"):
    """Gateway -> server: the web console's figures (see
    :mod:`inferd.monitoring.recent`); answered with :class:`ConsoleAnswer`."""

    id: int
    what: ConsoleView
    models: list[str] | None = None
    """Only these models (a key limited to some models); None: all."""
    since: float | None = None
    """series: the slots after this one (the ``until`` of a previous answer)."""
    window_s: float = 300.0
    version: str | None = None
    """drift: the version (None: the model's serving version)."""


class ConsoleAnswer(msgspec.Struct, frozen=True, tag="console"):
    """Server -> gateway: the JSON body asked for by query ``id``."""

    id: int
    body: bytes


class Join(msgspec.Struct, frozen=True, tag="join"):
    """Replica (``inferd replica`` on any host) -> controller, first on its connection:
    serve ``model:version`` at ``address`` (where gateways reach it, ``tcp:host:port``).
    ``replica_id`` empty: a first join; else a rejoin after losing the controller."""

    model: str
    version: str
    address: str
    host: str = ""
    replica_id: str = ""


class Joined(msgspec.Struct, frozen=True, tag="joined"):
    """Controller -> replica: what to serve (a ``ReplicaSpec`` as JSON) under which id."""

    replica_id: str
    spec: str


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """Controller -> replica: why it may not join (the connection then closes)."""

    reason: str


class Beat(msgspec.Struct, frozen=True, tag="rbeat"):
    """Replica -> controller, every second: its state (loading | ready | failed |
    draining) and why it is not ready; missing beats take it out of routing."""

    state: ReplicaState
    message: str = ""


class DrainReplica(msgspec.Struct, frozen=True, tag="drain"):
    """Controller -> replica: finish what you accepted, then leave."""


_encoder = msgspec.msgpack.Encoder()
Down = RoutingTable | MetricsText | ConsoleAnswer | Heartbeat | Joined | Refused | DrainReplica
_decoder = msgspec.msgpack.Decoder(Down)
_request_decoder = msgspec.msgpack.Decoder(
    ReconcileRequest | Demand | LogRows | MetricsQuery | ConsoleQuery | Join | Beat
)


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


def encode_table(table: RoutingTable) -> bytes:
    return _frame(_encoder.encode(table))


def decode_table(body: bytes | memoryview) -> Down:
    """What the controller sends: to a gateway a table, a ``/metrics`` answer, a
    heartbeat; to a joined replica its spec, a refusal, a drain."""
    return _decoder.decode(body)


def encode_down(
    message: MetricsText | ConsoleAnswer | Heartbeat | Joined | Refused | DrainReplica,
) -> bytes:
    return _frame(_encoder.encode(message))


Request = ReconcileRequest | Demand | LogRows | MetricsQuery | ConsoleQuery | Join | Beat


def encode_request(request: Request) -> bytes:
    return _frame(_encoder.encode(request))


def decode_request(body: bytes | memoryview) -> Request:
    return _request_decoder.decode(body)
