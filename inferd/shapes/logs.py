"""Inference-log rows as they cross processes: a gateway's handlers make them, the server
writes them (:mod:`inferd.monitoring.inference_log`) and offers them to the payload
sinks (:mod:`inferd.monitoring.sinks`); the buffer and the shipper that carry them are
:mod:`inferd.telemetry.log_rows`.
"""

from __future__ import annotations

import time

import msgspec


class Payload(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A sampled request's bodies, as they went over the wire (never re-encoded here),
    for the payload sinks (:mod:`inferd.monitoring.sinks`); never a database column.
    A body over ``payload_log.max_payload_bytes`` is None, its size kept."""

    request: bytes | None
    response: bytes | None
    request_bytes: int
    response_bytes: int


class LogRow(msgspec.Struct, array_like=True, frozen=True, kw_only=True, gc=False):
    """One inference request as the log keeps it. Encoded as a msgpack array (gateways
    ship rows to the server in :class:`~inferd.shapes.control.LogRows`); its fields are the
    ``inference_logs`` columns, in their order, except ``user``, stored as its hash, and
    those of :data:`NOT_COLUMNS`."""

    timestamp: float = msgspec.field(default_factory=time.time)
    request_id: str
    model_name: str
    version: str | None
    """The version that answered (``model:version`` when an overflow model did); None
    when none did."""
    api: str
    """v1 | v2 | openai | grpc; explain (an explanation); graph (a node of an
    inference graph, under the graph request's id)"""
    status_code: int
    latency_ms: float
    user: str | None = None
    fallback_from: str | None = None
    cache_hit: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prediction: str | None = None
    gateway_ms: float | None = None
    """Where a predict spent its time (its ``Server-Timing``): in the gateway, the result
    cache, the replica's queue, the frames and batching around the compute, the
    compute. None: not a predict a replica or the cache answered."""
    cache_ms: float | None = None
    queue_ms: float | None = None
    batch_ms: float | None = None
    compute_ms: float | None = None
    cached_tokens: int | None = None
    """A generation's prompt tokens its replica's prefix cache held."""
    routed_by: str | None = None
    """How a generation's replica was chosen among several (``prefix``, ``overloaded``,
    ``new``: :class:`inferd.routing.router.Routed`); None: one replica, or a predict."""
    expected_cached: float | None = None
    """The share of the prompt that choice expected in the replica's prefix cache."""
    payload: Payload | None = None
    """The request's bodies, when payload logging sampled it (sinks only, never stored)."""


NOT_COLUMNS = ("payload",)
""":class:`LogRow` fields that are not ``inference_logs`` columns (the payload sinks'
alone: bodies stay out of the database)."""
