"""Versions' reference profiles for input drift, in the registry's database
(``registry.drift_references``; the profile itself: :mod:`inferd.telemetry.drift`).

A profile from a registered sample is written in the push's own transaction
(:meth:`DriftReferences.add_in`); one from a version's first requests is written once
by the server (:meth:`DriftReferences.keep`): the first written stays, so two
controllers, or two replicas' profiles, cannot leave a version with two references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inferd.registry.catalog import version_row
from inferd.registry.tables import DriftReference, utcnow

if TYPE_CHECKING:
    from inferd.registry.registry import Registry


class DriftReferences:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def get(self, model: str, version: str) -> dict[str, Any] | None:
        """The version's profile (a dict), or None while it has none; 404 (ModelNotFound)
        when the version is not registered."""
        with Session(self._registry.engine) as session:
            row = version_row(session, model, version)
            found = session.get(DriftReference, row.id)
            return None if found is None else dict(found.profile)

    def keep(self, model: str, version: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Write ``profile`` as the version's reference unless it has one; the one it has
        after (``profile``, or the one written first)."""
        try:
            with Session(self._registry.write_engine) as session, session.begin():
                row = version_row(session, model, version)
                if session.get(DriftReference, row.id) is None:
                    self.add_in(session, row.id, profile)
        except IntegrityError:  # written meanwhile by another process
            pass
        found = self.get(model, version)
        assert found is not None
        return found

    @staticmethod
    def add_in(session: Session, version_id: int, profile: dict[str, Any]) -> None:
        """Add the version's reference in ``session`` (a push's transaction)."""
        session.add(
            DriftReference(
                version_id=version_id, source=profile["source"], rows=profile["rows"],
                profile=profile, created_at=utcnow(),
            )
        )  # fmt: skip
