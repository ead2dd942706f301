"""The routing table: what the controller tells every gateway process.

A full snapshot is sent on connect and after every change (it is small: models x
versions x replicas), so a gateway never has to merge deltas. ``generation`` only grows.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ReplicaRoute(msgspec.Struct, frozen=True):
    id: str
    address: str
    state: str
    """starting | loading | ready | draining | failed | stopped"""
    pid: int = 0
    restarts: int = 0
    message: str = ""


class VersionRoute(msgspec.Struct, frozen=True):
    version: str
    framework: str
    signature: dict[str, Any]
    replicas: list[ReplicaRoute]
    desired_replicas: int = 1
    adapters: list[str] = []
    """LoRA adapters registered with this (generative) version; each is also a model name."""


class ModelRoute(msgspec.Struct, frozen=True):
    name: str
    default_version: str | None
    """The version unpinned requests go to; None until one is ready."""
    versions: dict[str, VersionRoute]


class RoutingTable(msgspec.Struct, frozen=True):
    generation: int
    models: dict[str, ModelRoute]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RoutingTable)


def encode_table(table: RoutingTable) -> bytes:
    body = _encoder.encode(table)
    return len(body).to_bytes(4, "little") + body


def decode_table(body: bytes | memoryview) -> RoutingTable:
    return _decoder.decode(body)
