"""Quantized windows on the fronts: a front point of a model with sliding-window layers keeps the
windows its config quantizes (`windows`, `pnmix.layerwise.LayerwiseConfig.windows`, a list of layer
indices); NULL where none is (every window in the model's dtype).

Every point stored before this revision quantizes no window.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.add_column(sa.Column("windows", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.execute("DELETE FROM pnmix_front_points WHERE windows IS NOT NULL")
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.drop_column("windows")
