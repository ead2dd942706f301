"""Input drift: each version's reference profile (``drift_references``), from the
sample registered with it or from its first requests.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27

A table of its own rather than the version's metadata: a version's row stays as it was
pushed, and a profile built from the first requests is written later, once.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "drift_references",
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("profile", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["model_versions.id"],
            name="fk_drift_references_version_id_model_versions",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("version_id", name="pk_drift_references"),
    )


def downgrade() -> None:
    op.drop_table("drift_references")
