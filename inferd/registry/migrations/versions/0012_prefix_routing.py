"""How a generation's replica was chosen and what its prefix cache held
(``inference_logs``: ``cached_tokens``, ``routed_by``, ``expected_cached``).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27

Nullable columns: rows written before, predicts, and generations of versions with one
replica have none. On PostgreSQL the partitioned table's partitions get the columns
with it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("inference_logs") as batch:
        batch.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("routed_by", sa.String(16), nullable=True))
        batch.add_column(sa.Column("expected_cached", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("inference_logs") as batch:
        for name in ("expected_cached", "routed_by", "cached_tokens"):
            batch.drop_column(name)
