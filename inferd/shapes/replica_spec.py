"""What a replica is told to serve (built by the controller, passed to a replica process
as JSON on its command line).

Its batching and engine settings are the settings' own types
(:class:`~inferd.config.BatchingConfig`, :class:`~inferd.config.LLMConfig`), so their
field names, bounds and defaults are written once; they cross the process boundary as
JSON and are validated again on the way in.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel

from inferd.replica_config import BatchingConfig, ExplainConfig, ImagesConfig, LLMConfig
from inferd.shapes.tensors import Signature


class ReplicaSpec(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    model: str
    version: str
    framework: str
    artifact_dir: str
    """Where the replica reads the version's files (the local store, or its cache)."""
    address: str
    """``unix:/path.sock``, ``tcp:host:port`` or ``inproc:name``; empty: the backend
    picks one when it starts the replica."""
    batching: BatchingConfig = msgspec.field(default_factory=BatchingConfig)
    signature: Signature | None = None
    """The version's signature as registered (None: the runtime's own)."""
    metadata: dict[str, Any] = {}
    threads: int = 1
    log_level: str = "INFO"
    log_json: bool = False
    llm: LLMConfig = msgspec.field(default_factory=LLMConfig)
    images: ImagesConfig = msgspec.field(default_factory=ImagesConfig)
    """Engine settings of generative models."""
    explain: ExplainConfig = msgspec.field(default_factory=ExplainConfig)
    adapters: dict[str, str] = {}
    """LoRA adapters loaded with a generative base model: name -> folder inside the
    version's artifact folder."""
    gpus: list[int] | None = None
    """The GPU devices it may use (its deployment's ``resources.gpu``); None: not set."""
    artifact_uri: str = ""
    """Where the version's files live when not in ``artifact_dir`` already
    (``s3://…``): the replica fetches and checks them there first."""
    sha256: str = ""
    """The registered digest of the version's files."""
    artifact_cache_dir: str = ""
    """This host's artifact cache, where files from ``artifact_uri`` are fetched to
    (:mod:`inferd.registry.artifact_cache`)."""
    artifact_cache_max_bytes: int = 50 * 1024**3
    shared_process: bool = False
    """It runs in a shared replica process (:mod:`inferd.serving.host`): its stats report
    ``model_bytes``, what its load added to that process's memory, as its own."""
    busy_file: str = ""
    """In a shared process: where its compute thread marks when its current call began
    (:class:`~inferd.serving.compute.BusyMark`), for the server to read should that
    process stop answering; empty: no mark."""

    def to_json(self) -> str:
        return msgspec.json.encode(self, enc_hook=_encode).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> ReplicaSpec:
        return msgspec.json.decode(text, type=cls, dec_hook=_decode)


def _encode(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _decode(kind: type, obj: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate(obj)
    raise NotImplementedError(f"cannot decode {kind}")
