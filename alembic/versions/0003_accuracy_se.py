"""Front points carry the standard error of their accuracy (NULL for points stored before it existed).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.add_column(sa.Column("accuracy_se", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.drop_column("accuracy_se")
