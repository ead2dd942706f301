"""The registry's catalogue edits: create and edit models, delete versions (a mixin of
:class:`~inferd.registry.Registry`, kept apart so that class stays readable)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inferd.errors import Conflict, InvalidInput, ModelNotFound
from inferd.registry import deployment_rows as rows_
from inferd.registry.checks import check_tags, model_fields
from inferd.registry.store import check_name
from inferd.registry.tables import Model, ModelVersion, utcnow

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from inferd.registry.records import ModelRecord
    from inferd.registry.remote_store import S3Store
    from inferd.registry.store import ArtifactStore

logger = logging.getLogger(__name__)


class CatalogEdits:
    store: ArtifactStore
    remote: S3Store | None

    @property
    def write_engine(self) -> Engine:
        raise NotImplementedError

    def get_model(self, name: str) -> ModelRecord:
        raise NotImplementedError

    def create_model(
        self,
        name: str,
        *,
        framework: str,
        description: str | None = None,
        owner: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> ModelRecord:
        """A model with no version yet (its first pushed version serves at once); 409
        when it exists."""
        check_name("model", name)
        values = model_fields(framework=framework, description=description, owner=owner)
        values["tags"] = check_tags(tags or {})
        try:
            with Session(self.write_engine) as session, session.begin():
                session.add(Model(model_name=name, created_at=utcnow(), **values))
        except IntegrityError:
            raise Conflict(f"model {name!r} already exists", model=name) from None
        return self.get_model(name)

    def update_model(self, name: str, **changes: Any) -> ModelRecord:
        """Set the given fields of ``name`` (description, owner, framework, tags; None
        clears description and owner)."""
        unknown = set(changes) - {"description", "owner", "framework", "tags"}
        if unknown:
            raise InvalidInput(
                f"unknown model fields {sorted(unknown)}; known: description, owner, "
                "framework, tags"
            )
        values = model_fields(**{k: v for k, v in changes.items() if k != "tags"})
        if "tags" in changes:
            values["tags"] = check_tags(changes["tags"] or {})
        with Session(self.write_engine) as session, session.begin():
            row = rows_.lock_model(session, name)
            for key, value in values.items():
                setattr(row, key, value)
        return self.get_model(name)

    def delete_version(self, name: str, version: str) -> None:
        """Remove a version and its files; 409 while it is deployed, or while it is the
        version automatic mode serves."""
        with Session(self.write_engine) as session, session.begin():
            model = rows_.lock_model(session, name)
            row = version_row(session, name, version)
            _refuse_deleting_served(session, model, version)
            session.delete(row)
        self.store.delete(name, version)
        if self.remote is not None:
            self.remote.delete(name, version)
        logger.info("deleted %s version %s", name, version)


def _refuse_deleting_served(session: Session, model: Model, version: str) -> None:
    """409 when ``version`` of ``model`` is deployed, or is what automatic mode serves."""
    name = model.model_name
    deployed = rows_.of_model(session, name)
    mine = next((d for d in deployed if d.version == version), None)
    if mine is not None:
        raise Conflict(
            f"{name}:{version} is deployed ({mine.status}, {mine.traffic_pct} % of the "
            f"traffic): undeploy it first (DELETE /api/v1/deployments/{name}/{version})",
            model=name,
            version=version,
        )
    if not deployed and model.loaded and model.versions[-1].version == version:
        raise Conflict(
            f"{name}:{version} serves the model (automatic mode: its newest version): "
            "deploy another version, or unload the model, first",
            model=name,
            version=version,
        )


def version_row(session: Session, name: str, version: str) -> ModelVersion:
    """The version's row; 404 (ModelNotFound) when it is not registered."""
    row = session.scalar(
        select(ModelVersion).where(ModelVersion.model_name == name, ModelVersion.version == version)
    )
    if row is None:
        raise ModelNotFound(
            f"version {version!r} of model {name!r} not found", model=name, version=version
        )
    return row
