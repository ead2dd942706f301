"""Uploaded files' bytes in the file store, not the database; files expire
(``files``: ``content`` nullable; ``sha256``, ``location``, ``expires_at``, ``status``).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28

Rows written before keep their bytes in ``content`` (``location`` null) and never
expire (``expires_at`` null), as they were uploaded to; every row so far is
``processed``. The indexes serve the per-owner quota and the upkeep's purge.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.alter_column("content", existing_type=sa.LargeBinary(), nullable=True)
        batch.add_column(sa.Column("sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("location", sa.String(1024), nullable=True))
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(
            sa.Column("status", sa.String(16), nullable=False, server_default="processed")
        )
    op.create_index("ix_files_owner", "files", ["owner"])
    op.create_index("ix_files_expires_at", "files", ["expires_at"])


def downgrade() -> None:
    """Rows whose bytes are in the file store cannot be described by 0013: they are
    dropped (their bytes stay where they are)."""
    op.drop_index("ix_files_expires_at", "files")
    op.drop_index("ix_files_owner", "files")
    op.execute("DELETE FROM files WHERE content IS NULL")
    with op.batch_alter_table("files") as batch:
        for name in ("status", "expires_at", "location", "sha256"):
            batch.drop_column(name)
        batch.alter_column("content", existing_type=sa.LargeBinary(), nullable=False)
