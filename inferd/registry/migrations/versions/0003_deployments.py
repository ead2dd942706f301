"""Deployments (which versions run, with how many replicas and what share of traffic)
and the history of every traffic change.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22

A model without deployment rows keeps the old behaviour (its newest version serves all
traffic), so upgrading changes nothing that runs. Written out by hand, like 0001.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployments",
        sa.Column("deployment_id", sa.String(32), nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=True),
        sa.Column("gpu_type", sa.String(64), nullable=True),
        sa.Column("traffic_pct", sa.Integer(), nullable=False),
        sa.Column("strategy", sa.String(16), nullable=False),
        sa.Column("batching", sa.JSON(), nullable=True),
        sa.Column("fallback", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.Column("rollout", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("deployment_id", name="pk_deployments"),
        sa.ForeignKeyConstraint(
            ["model_name"], ["models.model_name"], name="fk_deployments_model_name_models"
        ),
        sa.UniqueConstraint("model_name", "version", name="uq_deployments_model_name"),
    )
    op.create_table(
        "traffic_history",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("split", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_traffic_history"),
        sa.ForeignKeyConstraint(
            ["model_name"], ["models.model_name"], name="fk_traffic_history_model_name_models"
        ),
    )
    op.create_index("ix_traffic_history_model_name", "traffic_history", ["model_name"])


def downgrade() -> None:
    op.drop_index("ix_traffic_history_model_name", "traffic_history")
    op.drop_table("traffic_history")
    op.drop_table("deployments")
