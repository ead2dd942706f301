"""Tags on models (``models.tags``, a JSON object of strings), set by ``POST`` and
``PATCH /api/v1/models``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24

Existing rows get no tags (NULL reads as ``{}``), so upgrading changes nothing that runs.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("tags", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("tags")
