"""The model registry: models, their immutable versions, and the stored artifacts.

Metadata lives in SQL (SQLite by default, PostgreSQL through the same code), schema
managed by the Alembic migrations in ``migrations/``; artifact files live in an
:class:`ArtifactStore` folder. See :mod:`inferd.registry.registry` for the rules.
"""

from inferd.registry.registry import ModelRecord, Registry, VersionRecord
from inferd.registry.store import ArtifactStore, StoredArtifact

__all__ = ["ArtifactStore", "ModelRecord", "Registry", "StoredArtifact", "VersionRecord"]
