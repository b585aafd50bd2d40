"""Campaign claiming by workers: who holds a campaign, its last heartbeat, and the queue index.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pnmix_campaigns") as batch:
        batch.add_column(sa.Column("worker_id", sa.String(255), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    # Campaigns already running before workers existed: their last sign of life is their start.
    op.execute("UPDATE pnmix_campaigns SET heartbeat_at = started_at WHERE status = 'running'")
    op.create_index("ix_pnmix_campaigns_status_id", "pnmix_campaigns", ["status", "id"])


def downgrade() -> None:
    op.drop_index("ix_pnmix_campaigns_status_id", table_name="pnmix_campaigns")
    with op.batch_alter_table("pnmix_campaigns") as batch:
        batch.drop_column("heartbeat_at")
        batch.drop_column("worker_id")
