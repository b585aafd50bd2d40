"""Held-out scores: a front point that a finished campaign recommends for a budget keeps its score
on the campaign's held-out units (`holdout_accuracy`, its standard error, and a JSON record with
the unit counts and pnmix-paper's held-out score beside it). NULL for every point stored before
this revision and for the points no budget recommends.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.add_column(sa.Column("holdout_accuracy", sa.Double(), nullable=True))
        batch.add_column(sa.Column("holdout_accuracy_se", sa.Double(), nullable=True))
        batch.add_column(sa.Column("holdout", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.drop_column("holdout")
        batch.drop_column("holdout_accuracy_se")
        batch.drop_column("holdout_accuracy")
