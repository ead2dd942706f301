"""Autoscaling: a deployment's policy (``deployments.autoscaling``, a JSON object; NULL:
a fixed replica count) and the scaling decisions taken (``scaling_events``).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24

Existing deployments keep their fixed replica counts, so upgrading changes nothing that runs.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("autoscaling", sa.JSON(), nullable=True))
    op.create_table(
        "scaling_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("model_name", sa.String(128), sa.ForeignKey("models.model_name"), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("from_replicas", sa.Integer(), nullable=False),
        sa.Column("to_replicas", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("figures", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_scaling_events_model_name", "scaling_events", ["model_name"])


def downgrade() -> None:
    op.drop_index("ix_scaling_events_model_name", "scaling_events")
    op.drop_table("scaling_events")
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("autoscaling")
