"""Paired comparisons of stored points: each front point may keep its per-unit outcomes, as each
part's weight and the per-unit influence values whose mean is the part's score (tuner/scoring/stats.py),
so that two points of one campaign (scored on the same items) are compared paired item by item
(`storage.read.tied_with`). NULL for points stored before this revision: those compare unpaired.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.add_column(sa.Column("unit_influence", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.drop_column("unit_influence")
