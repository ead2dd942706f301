"""What a replica process is told to serve (passed from the controller as JSON)."""

from __future__ import annotations

from typing import Any

import msgspec


class ReplicaSpec(msgspec.Struct, frozen=True):
    replica_id: str
    model: str
    version: str
    framework: str
    artifact_dir: str
    address: str
    """``unix:/path.sock`` or ``tcp:host:port`` the replica listens on."""
    batching: dict[str, Any]
    signature: dict[str, Any] | None = None
    metadata: dict[str, Any] = {}
    threads: int = 1
    log_level: str = "INFO"
    log_json: bool = False
    llm: dict[str, Any] = {}
    """Engine settings of generative models (kv_cache_mb, max_num_seqs, dtype, adapters)."""
    gpus: list[int] | None = None
    """The GPU devices it may use (its deployment's ``resources.gpu``); None: not set."""

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> ReplicaSpec:
        return msgspec.json.decode(text, type=cls)
