"""Desired load state per model: ``models.loaded`` (the model repository extension).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

Existing rows become loaded (``server_default``), so upgrading changes nothing that
runs. Written out by hand, like 0001, so it never changes with ``tables.py``.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(
            sa.Column("loaded", sa.Boolean(), server_default=sa.true(), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("loaded")
