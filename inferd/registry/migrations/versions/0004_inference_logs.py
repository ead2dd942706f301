"""The inference log: one row per inference request.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22

On PostgreSQL the table is declared ``PARTITION BY RANGE ("timestamp")``, as the design
documents ask: the server creates a partition per day ahead of time and drops whole
partitions past the retention period (:mod:`inferd.monitoring.inference_log`). The
primary key of a partitioned table must include the partition key, hence
``(id, "timestamp")``. SQLite gets a plain table with the same columns.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = """
    "timestamp" TIMESTAMPTZ NOT NULL,
    request_id VARCHAR(128) NOT NULL,
    model_name VARCHAR(128) NOT NULL,
    version VARCHAR(128),
    api VARCHAR(16) NOT NULL,
    status_code INTEGER NOT NULL,
    latency_ms DOUBLE PRECISION NOT NULL,
    user_hash VARCHAR(32),
    fallback_from VARCHAR(128),
    cache_hit BOOLEAN,
    prompt_tokens INTEGER,
    completion_tokens INTEGER
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"""CREATE TABLE inference_logs (
                id BIGSERIAL NOT NULL,{_COLUMNS},
                CONSTRAINT pk_inference_logs PRIMARY KEY (id, "timestamp")
            ) PARTITION BY RANGE ("timestamp")"""
        )
    else:
        op.create_table(
            "inference_logs",
            sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("timestamp", sa.DateTime(timezone=True), nullable=False),
            sa.Column("request_id", sa.String(128), nullable=False),
            sa.Column("model_name", sa.String(128), nullable=False),
            sa.Column("version", sa.String(128), nullable=True),
            sa.Column("api", sa.String(16), nullable=False),
            sa.Column("status_code", sa.Integer(), nullable=False),
            sa.Column("latency_ms", sa.Float(), nullable=False),
            sa.Column("user_hash", sa.String(32), nullable=True),
            sa.Column("fallback_from", sa.String(128), nullable=True),
            sa.Column("cache_hit", sa.Boolean(), nullable=True),
            sa.Column("prompt_tokens", sa.Integer(), nullable=True),
            sa.Column("completion_tokens", sa.Integer(), nullable=True),
            sa.PrimaryKeyConstraint("id", name="pk_inference_logs"),
        )
    op.create_index("ix_inference_logs_timestamp", "inference_logs", ["timestamp"])
    op.create_index("ix_inference_logs_model_name", "inference_logs", ["model_name", "timestamp"])
    op.create_index("ix_inference_logs_request_id", "inference_logs", ["request_id"])


def downgrade() -> None:
    op.drop_table("inference_logs")  # on PostgreSQL its partitions go with it
