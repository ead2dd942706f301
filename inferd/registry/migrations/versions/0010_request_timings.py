"""Where each request spent its time (``inference_logs``: ``gateway_ms``, ``cache_ms``,
``queue_ms``, ``batch_ms``, ``compute_ms``), the fields of its ``Server-Timing`` header.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26

Nullable columns: rows written before (and requests no replica answered) have none. On
PostgreSQL the partitioned table's partitions get the columns with it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("gateway_ms", "cache_ms", "queue_ms", "batch_ms", "compute_ms")


def upgrade() -> None:
    with op.batch_alter_table("inference_logs") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("inference_logs") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
