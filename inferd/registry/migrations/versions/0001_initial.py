"""Initial schema: models and their immutable versions.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Written out by hand rather than importing ``inferd.registry.tables``: a migration is a
frozen record of one schema step and must not change when the classes do later.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("framework", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_name", name="pk_models"),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("artifact_uri", sa.String(4096), nullable=False),
        sa.Column("framework", sa.String(64), nullable=False),
        sa.Column("signature", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("batching", sa.JSON(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_versions"),
        sa.ForeignKeyConstraint(
            ["model_name"],
            ["models.model_name"],
            name="fk_model_versions_model_name_models",
        ),
        sa.UniqueConstraint("model_name", "version", name="uq_model_versions_model_name"),
    )


def downgrade() -> None:
    op.drop_table("model_versions")
    op.drop_table("models")
