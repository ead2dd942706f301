"""The model registry: which models and versions exist, and where their artifacts are.

Rules this module keeps:
- A registered version is immutable. Pushing a name+version that exists raises
  VersionExists and never touches the stored files.
- Nothing half-done survives a crash or a lost race. ``push`` copies the artifact into
  a staging folder first (slow, outside any transaction), then, in one transaction,
  inserts the row and renames the folder into place before committing. The version's
  UNIQUE constraint is the lock: a concurrent push of the same version blocks on it
  (PostgreSQL) or on the write lock (SQLite), then fails, and only the holder ever
  renames into the final folder. A folder found there by the holder is an orphan of a
  crash between rename and commit, and is replaced.
- The service is synchronous; callers on an event loop run it in a thread. Records
  handed out are frozen plain data, detached from any session.
- One code path for SQLite and PostgreSQL. SQLite is shared by several processes (the
  gateway workers and the CLI), hence WAL, a busy timeout, and write transactions that
  take the write lock up front (``BEGIN IMMEDIATE``) instead of failing when a read
  lock cannot be upgraded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from inferd.config import Settings
from inferd.errors import InvalidInput, ModelNotFound, VersionExists
from inferd.registry import deployment_rows as rows_
from inferd.registry import schema
from inferd.registry.artifact_cache import ArtifactCache
from inferd.registry.catalog import CatalogEdits, version_row
from inferd.registry.checks import check_batching
from inferd.registry.deployments import Deployments
from inferd.registry.drift_references import DriftReferences
from inferd.registry.engine import WRITE, create_registry_engine
from inferd.registry.keys import ApiKeys
from inferd.registry.records import ModelRecord, VersionRecord
from inferd.registry.records import model_record as _model_record
from inferd.registry.records import version_record as _version_record
from inferd.registry.remote_store import S3Store
from inferd.registry.rollout_progress import RolloutProgress
from inferd.registry.store import ArtifactStore, StagedArtifact, check_name
from inferd.registry.tables import Model, ModelVersion, utcnow
from inferd.runtimes import MANIFEST, OUTPUT_METADATA, read_manifest
from inferd.shapes.graph import GRAPH_FRAMEWORK, SPEC_FILE
from inferd.shapes.graph import parse as parse_graph
from inferd.shapes.graph import signature_of as graph_signature
from inferd.shapes.tensors import Signature
from inferd.telemetry.drift import build_profile, read_reference_sample

logger = logging.getLogger(__name__)


def _insert_model_if_missing(session: Session, values: dict[str, Any]) -> None:
    # ON CONFLICT DO NOTHING: a concurrent first push of another version may create the
    # model row at the same time; that must not fail either push.
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    session.execute(dialect.insert(Model).values(**values).on_conflict_do_nothing())


class Registry(CatalogEdits):
    def __init__(
        self,
        database_url: str,
        artifact_root: Path,
        migrate: bool = True,
        artifact_store: str | None = None,
        artifact_cache: ArtifactCache | None = None,
    ) -> None:
        self.engine = create_registry_engine(database_url)
        self._write_engine = self.engine.execution_options(**{WRITE: True})
        self.store = ArtifactStore(artifact_root)
        """The local artifact folder (with ``artifact_store``: where pushes stage)."""
        self.remote = S3Store(artifact_store) if artifact_store else None
        """Where versions live when not only on this machine (``s3://bucket/prefix``)."""
        self.cache = artifact_cache or ArtifactCache(
            Path(artifact_root).parent / "artifact-cache", 50 * 1024**3
        )
        """This host's cache of versions from ``artifact_store``, by sha256: a push
        seeds it, downloads read from it, replicas open it."""
        self.deployments = Deployments(self)
        self.rollouts = RolloutProgress(self)
        self.keys = ApiKeys(self)
        self.drift_references = DriftReferences(self)
        """Versions' reference profiles for input drift."""
        self.drift_categories = 50
        """A registered sample's text input with at most this many distinct values is
        categorical (``drift.max_categories``)."""
        """Which versions run and the traffic split between them."""
        self.gpus_here = True
        """Replicas run on this machine: ``resources.gpu`` names a GPU it has. False: an
        orchestrator (Kubernetes) places them on its nodes."""
        if migrate:
            self.migrate()

    @classmethod
    def from_settings(cls, settings: Settings, migrate: bool = True) -> Registry:
        registry = cls(
            settings.resolved_database_url,
            settings.artifact_dir,
            migrate=migrate,
            artifact_store=settings.artifact_store,
            artifact_cache=ArtifactCache(
                settings.artifact_cache_dir, settings.artifact_cache_max_bytes
            ),
        )
        registry.gpus_here = settings.replica_backend == "local"
        registry.drift_categories = settings.drift.max_categories
        return registry

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.engine.dispose()

    @property
    def write_engine(self) -> Engine:
        """The engine whose transactions write (SQLite: they take the write lock first)."""
        return self._write_engine

    def migrate(self) -> None:
        """Upgrade the schema to the newest migration; a no-op when already there (see
        :func:`inferd.registry.schema.upgrade`: concurrent processes upgrade once)."""
        schema.upgrade(self.engine)

    # -- writes ---------------------------------------------------------------------

    def push(
        self,
        name: str,
        source: Path,
        version: str,
        *,
        framework: str,
        signature: Signature,
        metadata: dict[str, Any] | None = None,
        description: str | None = None,
        owner: str | None = None,
        batching: dict[str, Any] | None = None,
        deploy: bool = False,
        actor: str = "cli",
    ) -> VersionRecord:
        """Register ``source`` (a file or a folder) as version ``version`` of ``name``.

        The stored folder gets an ``inferd.json`` with the version's framework,
        signature and the metadata that changes its answers (labels, dtype, pooling, …;
        ``OUTPUT_METADATA``): pushing that folder, or a pull of it, again gives a version
        that answers the same. Such metadata shipped in ``source``'s own ``inferd.json``
        applies unless ``metadata`` overrides it.

        Registering is not deploying: when ``name`` already has a version serving, the
        new one takes no traffic (a model in automatic mode gets its serving version
        pinned as a deployment at 100 %, in the same transaction) until a deployment
        gives it some. The first version of a new model serves at once. ``deploy``: the
        new version takes all the traffic, as a rolling deployment at 100 % (a model in
        automatic mode simply switches to it, its newest version)."""
        check_name("model", name)
        check_name("version", version)
        if not framework:
            raise InvalidInput("framework is required")
        source = Path(source)
        metadata = {**_shipped_metadata(source), **(metadata or {})}
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"metadata is not JSON-serialisable: {exc}") from None
        if not isinstance(metadata.get("allow_non_finite", False), bool):
            raise InvalidInput("metadata allow_non_finite must be true or false")
        batching = check_batching(batching)
        if framework == GRAPH_FRAMEWORK:
            signature, metadata = self._graph(source, metadata)
        reference = self._drift_reference(source, signature, metadata)
        self.refuse_existing(name, version)
        manifest = {
            "framework": framework,
            "signature": signature.to_dict(),
            "metadata": {k: metadata[k] for k in sorted(OUTPUT_METADATA) if k in metadata},
        }
        staged = self.store.stage(
            name, version, source, extra={MANIFEST: json.dumps(manifest, indent=2).encode()}
        )
        uploaded = False
        try:
            uri = self.store.path(name, version).as_uri()
            if self.remote is not None:
                uri, uploaded = self.remote.upload(staged), True
            row = ModelVersion(
                model_name=name,
                version=version,
                artifact_uri=uri,
                framework=framework,
                signature=signature.to_dict(),
                meta=metadata,
                batching=batching,
                sha256=staged.sha256,
                size_bytes=staged.size_bytes,
                created_at=utcnow(),
            )
            record = self._insert(
                row, staged, description=description, owner=owner, deploy=deploy, actor=actor,
                reference=reference,
            )  # fmt: skip
            if uploaded:  # this host's replicas need not download what it just sent
                self.cache.seed(staged.sha256, self.store.path(name, version))
        except BaseException:
            if uploaded and self.remote is not None:
                self.remote.delete(name, version)
            raise
        finally:
            self.store.discard(staged)  # no-op when published
        logger.info(
            "registered %s version %s (%d bytes, sha256 %s)",
            name,
            version,
            record.size_bytes,
            record.sha256,
        )
        return record

    def _insert(
        self,
        row: ModelVersion,
        staged: StagedArtifact,
        *,
        description: str | None,
        owner: str | None,
        deploy: bool,
        actor: str,
        reference: dict[str, Any] | None = None,
    ) -> VersionRecord:
        name, version = row.model_name, row.version
        model_values = {
            "model_name": name,
            "framework": row.framework,
            "description": description,
            "owner": owner,
            "created_at": row.created_at,
        }
        changes = {
            k: v for k, v in (("description", description), ("owner", owner)) if v is not None
        }
        published = False
        try:
            with Session(self._write_engine) as session, session.begin():
                _insert_model_if_missing(session, model_values)
                if changes:
                    session.execute(update(Model).where(Model.model_name == name).values(**changes))
                rows_.lock_model(session, name)
                deployed = rows_.of_model(session, name)
                if not deploy and not deployed:
                    rows_.adopt_newest(session, name, version, f"{version} registered", actor)
                session.add(row)
                session.flush()  # a concurrent winner of this version surfaces here
                if reference is not None:
                    DriftReferences.add_in(session, row.id, reference)
                self.store.publish(staged, replace=True)
                published = True
                record = _version_record(row, self.store.root)
                if deploy and deployed:
                    self.deployments.deploy_in(session, name, version, actor=actor)
        except BaseException as exc:
            # Files are removed only if this call put them there: after losing the race
            # (IntegrityError before publishing) they belong to the winner.
            if published:
                self.store.delete(name, version)
            if isinstance(exc, IntegrityError):
                logger.info("lost a concurrent push of %s version %s", name, version)
                raise _version_exists_error(name, version) from None
            raise
        return record

    def _drift_reference(
        self, source: Path, signature: Signature, metadata: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The reference profile of the sample ``source`` ships (``drift_reference.npz``),
        or None; 422 saying what does not fit."""
        if not source.is_dir():
            return None
        try:
            sample = read_reference_sample(source, signature, metadata)
            if sample is None:
                return None
            profile = build_profile(signature, sample, "sample", metadata, self.drift_categories)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return profile.to_dict()

    def _graph(self, source: Path, metadata: dict[str, Any]) -> tuple[Signature, dict[str, Any]]:
        """An inference graph's signature, from the versions of the models it calls,
        and its metadata with the spec (``graph``: the routing table carries it to the
        gateways that run it); 422 naming what is wrong, or the models not registered."""
        try:
            spec = json.loads((Path(source) / SPEC_FILE).read_text())
            graph = parse_graph(spec)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"not a valid graph: {exc}") from None
        signatures, missing = {}, []
        for node in graph.nodes.values():
            if node.kind != "model":
                continue
            try:
                record = (
                    self.get_version(node.model, node.version)
                    if node.version is not None
                    else self.latest_version(node.model)
                )
            except ModelNotFound:
                missing.append(node.model + (f":{node.version}" if node.version else ""))
                continue
            signatures[node.name] = record.signature
        if missing:
            raise InvalidInput(f"the graph calls models that are not registered: {missing}")
        try:
            signature = graph_signature(graph, signatures)
        except ValueError as exc:
            raise InvalidInput(f"not a valid graph: {exc}") from None
        return signature, {**metadata, "graph": spec}

    def set_loaded(self, name: str, loaded: bool) -> None:
        """Set whether ``name`` should be served; the controller acts on its next pass.

        Raises ModelNotFound for an unknown model. Idempotent.
        """
        with Session(self._write_engine) as session, session.begin():
            row = session.get(Model, name)
            if row is None:
                raise ModelNotFound(f"model {name!r} not found", model=name)
            row.loaded = loaded
        logger.info("model %s marked %s", name, "loaded" if loaded else "unloaded")

    # -- reads ----------------------------------------------------------------------

    def refuse_existing(self, name: str, version: str) -> None:
        """409 (VersionExists) when ``name`` already has ``version``: versions are
        immutable. Checked again, under the row's UNIQUE constraint, when one is pushed."""
        with Session(self.engine) as session:
            found = session.scalar(
                select(ModelVersion.id).where(
                    ModelVersion.model_name == name, ModelVersion.version == version
                )
            )
        if found is not None:
            raise _version_exists_error(name, version)

    def list_models(self) -> list[ModelRecord]:
        with Session(self.engine) as session:
            rows = session.scalars(
                select(Model)
                .options(selectinload(Model.versions))
                .order_by(Model.created_at, Model.model_name)
            )
            return [_model_record(row, self.store.root) for row in rows]

    def get_model(self, name: str) -> ModelRecord:
        with Session(self.engine) as session:
            row = session.get(Model, name, options=[selectinload(Model.versions)])
            if row is None:
                raise ModelNotFound(f"model {name!r} not found", model=name)
            return _model_record(row, self.store.root)

    def get_version(self, name: str, version: str) -> VersionRecord:
        with Session(self.engine) as session:
            return _version_record(version_row(session, name, version), self.store.root)

    def latest_version(self, name: str) -> VersionRecord:
        """The most recently registered version of ``name``."""
        with Session(self.engine) as session:
            row = session.scalar(
                select(ModelVersion)
                .where(ModelVersion.model_name == name)
                .order_by(ModelVersion.created_at.desc(), ModelVersion.id.desc())
                .limit(1)
            )
            if row is None:
                raise ModelNotFound(f"model {name!r} not found", model=name)
            return _version_record(row, self.store.root)


def _version_exists_error(name: str, version: str) -> VersionExists:
    return VersionExists(
        f"model {name!r} version {version!r} already exists; registered versions are immutable",
        model=name,
        version=version,
    )


def _shipped_metadata(source: Path) -> dict[str, Any]:
    """The metadata of ``source``'s ``inferd.json`` (a folder's), or {}."""
    if not source.is_dir():
        return {}
    try:
        return dict(read_manifest(source).get("metadata") or {})
    except ValueError as exc:  # json.JSONDecodeError included
        raise InvalidInput(f"unreadable {MANIFEST} in {source}: {exc}") from None


def local_files(registry: Registry, record: VersionRecord) -> Path:
    """The version's files on this machine: from the host's artifact cache (fetched and
    checked unless already there) when they live in the object store."""
    if registry.remote is None or record.artifact_uri.startswith("file:"):
        return record.artifact_path
    from inferd.registry.remote_store import download

    remote, uri, sha256 = registry.remote, record.artifact_uri, record.sha256
    return registry.cache.open(
        sha256, lambda folder: download(remote, uri, sha256, folder), hold=False
    ).path
