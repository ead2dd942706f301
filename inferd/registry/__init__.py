"""The model registry: models, their immutable versions, and the stored artifacts.

Metadata lives in SQL (SQLite by default, PostgreSQL through the same code), schema
managed by the Alembic migrations in ``migrations/``; artifact files live in an
:class:`ArtifactStore` folder. See :mod:`inferd.registry.registry` for the rules.

The names below load on first use (PEP 562): importing a submodule without the database
layer (``records``, ``store``, ``uploads``, ``api_key``) imports no SQLAlchemy, so a
gateway process pays for it only once a route opens the registry.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferd.registry.records import ModelRecord, VersionRecord
    from inferd.registry.registry import Registry
    from inferd.registry.store import ArtifactStore, StoredArtifact

__all__ = ["ArtifactStore", "ModelRecord", "Registry", "StoredArtifact", "VersionRecord"]

_HOMES = {
    "ArtifactStore": "store",
    "ModelRecord": "records",
    "Registry": "registry",
    "StoredArtifact": "store",
    "VersionRecord": "records",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
