"""Accuracy feedback: the logged prediction of single-row requests, and the ground truth
clients send for them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # On PostgreSQL the column reaches every partition through the partitioned parent.
    op.add_column("inference_logs", sa.Column("prediction", sa.String(256), nullable=True))
    op.create_table(
        "feedback",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(128), nullable=True),
        sa.Column("prediction", sa.String(256), nullable=False),
        sa.Column("label", sa.String(256), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("correct", sa.Boolean(), nullable=True),
        sa.Column("abs_error", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_feedback"),
    )
    op.create_index("ix_feedback_model_created", "feedback", ["model_name", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_feedback_model_created", table_name="feedback")
    op.drop_table("feedback")
    op.drop_column("inference_logs", "prediction")
