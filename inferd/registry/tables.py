"""The registry's two tables, as SQLAlchemy 2 declarative classes.

The schema itself is created by the Alembic migrations next to this module, never by
``metadata.create_all``; these classes must describe exactly what the latest migration
builds (a test compares them). Only portable types are used so that the same code runs
on SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Explicit constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL keeps the instant (``timestamptz``) but returns it in the session time
    zone; SQLite has no time zone at all and would silently drop it. So values are
    normalised to UTC on the way in (naive ones are refused: their zone is unknown)
    and always come back as aware UTC datetimes.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; the registry stores timezone-aware UTC only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Model(Base):
    __tablename__ = "models"

    model_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    description: Mapped[str | None] = mapped_column(Text)
    framework: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Desired state: an unloaded model keeps its versions but runs no replicas.
    loaded: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    tags: Mapped[dict[str, str] | None] = mapped_column(JSON)

    versions: Mapped[list[ModelVersion]] = relationship(
        back_populates="model",
        order_by=lambda: [ModelVersion.created_at, ModelVersion.id],
    )


class ModelVersion(Base):
    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_name: Mapped[str] = mapped_column(String(128), ForeignKey("models.model_name"))
    version: Mapped[str] = mapped_column(String(128))
    artifact_uri: Mapped[str] = mapped_column(String(4096))
    framework: Mapped[str] = mapped_column(String(64))
    signature: Mapped[dict[str, Any]] = mapped_column(JSON)
    # ``metadata`` is reserved on declarative classes (it is the MetaData), hence ``meta``.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    batching: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    model: Mapped[Model] = relationship(back_populates="versions")


class Deployment(Base):
    """A version that runs: its replicas and its share of the model's traffic."""

    __tablename__ = "deployments"
    __table_args__ = (UniqueConstraint("model_name", "version"),)

    deployment_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    model_name: Mapped[str] = mapped_column(String(128), ForeignKey("models.model_name"))
    version: Mapped[str] = mapped_column(String(128))
    # deploying, active, failed (the controller's view), draining (being removed)
    status: Mapped[str] = mapped_column(String(16))
    replicas: Mapped[int | None] = mapped_column(Integer)  # None: the server's default
    gpu_type: Mapped[str | None] = mapped_column(String(64))
    traffic_pct: Mapped[int] = mapped_column(Integer)
    strategy: Mapped[str] = mapped_column(String(16))
    batching: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # A request this version fails (not ready, overloaded, the model raised) is retried
    # on the model's serving version, unless the request pinned this version.
    fallback: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # The strategy's settings and progress, e.g. blue-green: keep_old_s, switched_at, done.
    rollout: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The autoscaling policy (registry/autoscaling.py); None: a fixed replica count.
    autoscaling: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class TrafficChange(Base):
    """One change of a model's traffic split: the split after it, who made it and why."""

    __tablename__ = "traffic_history"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_name: Mapped[str] = mapped_column(
        String(128), ForeignKey("models.model_name"), index=True
    )
    split: Mapped[dict[str, int]] = mapped_column(JSON)
    # deploy, manual, rollback, undeploy, canary_step, auto_rollback, promote
    reason: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(128))
    detail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ScalingEvent(Base):
    """One autoscaling decision: a version's replica count from, to, why, with the
    figures that triggered it (capacity refusals keep from = to)."""

    __tablename__ = "scaling_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_name: Mapped[str] = mapped_column(
        String(128), ForeignKey("models.model_name"), index=True
    )
    version: Mapped[str] = mapped_column(String(128))
    from_replicas: Mapped[int] = mapped_column(Integer)
    to_replicas: Mapped[int] = mapped_column(Integer)
    # utilisation, queue, latency, calm, idle, demand, bounds, capacity
    reason: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text)
    figures: Mapped[dict[str, float]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class DriftReference(Base):
    """A version's reference profile for input drift (:mod:`inferd.telemetry.drift`):
    from the sample registered with it (written at push), or from its first requests
    (written once by the server, the first profile a replica reports winning). Apart
    from the version's row, which stays as pushed; removed with it."""

    __tablename__ = "drift_references"

    version_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("model_versions.id", ondelete="CASCADE"), primary_key=True
    )
    source: Mapped[str] = mapped_column(String(16))  # sample | requests
    rows: Mapped[int] = mapped_column(Integer)
    profile: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    """An API key: only the SHA-256 of its secret is kept (the key is shown once, when
    it is created). ``scopes``: admin (control plane: registry, deployments, keys, logs;
    includes infer) and infer (data plane); ``models``: an allow-list, or None for all."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    models: Mapped[list[str] | None] = mapped_column(JSON)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


LOGS_METADATA = MetaData()
"""The inference log lives in the same database but apart from the registry's classes:
on PostgreSQL it is partitioned by time (one table per day, created ahead by the server
and dropped by retention), which declarative classes cannot describe."""

inference_logs = Table(
    "inference_logs",
    LOGS_METADATA,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), nullable=False),
    Column("timestamp", UTCDateTime(), nullable=False),
    Column("request_id", String(128), nullable=False),
    Column("model_name", String(128), nullable=False),
    Column("version", String(128), nullable=True),
    Column("api", String(16), nullable=False),
    Column("status_code", Integer(), nullable=False),
    Column("latency_ms", Float(), nullable=False),
    Column("user_hash", String(32), nullable=True),
    Column("fallback_from", String(128), nullable=True),
    Column("cache_hit", Boolean(), nullable=True),
    Column("prompt_tokens", Integer(), nullable=True),
    Column("completion_tokens", Integer(), nullable=True),
    Column("prediction", String(256), nullable=True),
    Column("gateway_ms", Float(), nullable=True),
    Column("cache_ms", Float(), nullable=True),
    Column("queue_ms", Float(), nullable=True),
    Column("batch_ms", Float(), nullable=True),
    Column("compute_ms", Float(), nullable=True),
    Column("cached_tokens", Integer(), nullable=True),
    Column("routed_by", String(16), nullable=True),
    Column("expected_cached", Float(), nullable=True),
)
"""One row per inference request: who answered it (the version the traffic split chose:
the experiment assignment), how it went, and how long it took."""

feedback = Table(
    "feedback",
    LOGS_METADATA,
    Column("request_id", String(128), primary_key=True),
    Column("model_name", String(128), nullable=False),
    Column("version", String(128), nullable=True),
    Column("prediction", String(256), nullable=False),
    Column("label", String(256), nullable=True),
    Column("value", Float(), nullable=True),
    Column("correct", Boolean(), nullable=True),
    Column("abs_error", Float(), nullable=True),
    Column("created_at", UTCDateTime(), nullable=False),
)
"""Ground truth for logged predictions (``POST /api/v1/feedback``): a class label is
``correct`` or not; a number has an ``abs_error``."""


JOBS_METADATA = MetaData(naming_convention=NAMING_CONVENTION)
"""Jobs (:mod:`inferd.jobs`): what was accepted and what came of each item. The queue
holds the work itself (its own backend); these tables are the record clients read."""

jobs = Table(
    "jobs",
    JOBS_METADATA,
    Column("id", String(40), primary_key=True),
    Column("kind", String(16), nullable=False),  # batch, or request (one async request)
    Column("model_name", String(128), nullable=False),
    Column("version", String(128), nullable=True),
    Column("status", String(16), nullable=False),  # queued running succeeded failed cancelled
    Column("priority", String(16), nullable=False),
    Column("total", Integer(), nullable=False),
    Column("succeeded", Integer(), nullable=False),
    Column("failed", Integer(), nullable=False),
    Column("request", JSON(), nullable=False),  # the batch's parameters, or the request
    Column("callback_url", Text(), nullable=True),
    Column("callback", JSON(), nullable=True),  # its delivery: state and every attempt
    Column("error", Text(), nullable=True),
    Column("owner", String(128), nullable=True),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("started_at", UTCDateTime(), nullable=True),
    Column("finished_at", UTCDateTime(), nullable=True),
    Column("expires_at", UTCDateTime(), nullable=False),
)

job_results = Table(
    "job_results",
    JOBS_METADATA,
    Column("job_id", String(40), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("item", Integer(), primary_key=True, autoincrement=False),
    Column("status_code", Integer(), nullable=False),
    Column("output", Text(), nullable=True),  # the answer (or error) as JSON text
)
"""One row per (job, item): the key makes writing a result idempotent, so an item a
crash made the queue deliver again never gets two."""

files = Table(
    "files",
    JOBS_METADATA,
    Column("id", String(40), primary_key=True),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(256), nullable=False),
    Column("bytes", BigInteger(), nullable=False),
    Column("owner", String(128), nullable=True, index=True),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("content", LargeBinary(), nullable=True),  # the bytes, as servers before 0014 kept them
    Column("sha256", String(64), nullable=True),
    Column("location", String(1024), nullable=True),  # where the bytes are; null: in content
    Column("expires_at", UTCDateTime(), nullable=True, index=True),  # null: never
    Column("status", String(16), nullable=False, server_default="processed"),  # or uploading
)
"""Files uploaded through OpenAI's ``/v1/files`` (a batch's input, JSON Lines), kept
until they expire or are deleted; their bytes in the file store (``location``:
``<data_dir>/files`` or the S3 artifact store's ``_files``, see :mod:`inferd.jobs.files`)."""
