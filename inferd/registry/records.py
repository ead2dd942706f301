"""What the registry hands out: frozen plain records of models and versions, detached
from any database session."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from inferd.shapes.tensors import Signature

if TYPE_CHECKING:  # the rows are read here, never built: no SQLAlchemy for the records
    from inferd.registry.tables import Model, ModelVersion


@dataclass(frozen=True, slots=True)
class VersionRecord:
    model_name: str
    version: str
    framework: str
    artifact_uri: str
    artifact_path: Path
    signature: Signature
    metadata: dict[str, Any]
    batching: dict[str, Any] | None
    sha256: str
    size_bytes: int
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "version": self.version,
            "framework": self.framework,
            "artifact_uri": self.artifact_uri,
            "artifact_path": str(self.artifact_path),
            "signature": self.signature.to_dict(),
            "metadata": self.metadata,
            "batching": self.batching,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class ModelRecord:
    name: str
    description: str | None
    framework: str
    owner: str | None
    created_at: datetime
    versions: tuple[VersionRecord, ...]
    """Oldest first."""
    loaded: bool = True
    """Desired state: serve the newest version (True) or run no replicas (False)."""
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "framework": self.framework,
            "owner": self.owner,
            "tags": self.tags,
            "created_at": self.created_at.isoformat(),
            "loaded": self.loaded,
            "versions": [v.to_dict() for v in self.versions],
        }


def version_record(row: ModelVersion, cache: Path) -> VersionRecord:
    """``cache``: the local artifact root, where a version kept in an object store was
    staged when this host registered it (elsewhere, its files come through the host's
    artifact cache: ``registry.local_files``)."""
    uri = urlparse(row.artifact_uri)
    local = (
        Path(url2pathname(uri.path))
        if uri.scheme == "file"
        else cache / row.model_name / row.version
    )
    return VersionRecord(
        model_name=row.model_name,
        version=row.version,
        framework=row.framework,
        artifact_uri=row.artifact_uri,
        artifact_path=local,
        signature=Signature.from_dict(row.signature),
        metadata=dict(row.meta),
        batching=dict(row.batching) if row.batching is not None else None,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
    )


def model_record(row: Model, cache: Path) -> ModelRecord:
    return ModelRecord(
        name=row.model_name,
        description=row.description,
        framework=row.framework,
        owner=row.owner,
        created_at=row.created_at,
        versions=tuple(version_record(v, cache) for v in row.versions),
        loaded=row.loaded,
        tags=dict(row.tags or {}),
    )
