"""Layer kinds: a model keeps each layer's kind (`layer_kinds`, a JSON list of "full" and
"sliding"; NULL: every layer full attention) and its sliding window (`sliding_window`), so that
stored fronts weigh a hybrid model's layers by the elements each holds (pnmix.bits.weighted_key_bits).
Every model stored before this revision was a full-attention model: NULL is its plan.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pnmix_models") as batch:
        batch.add_column(sa.Column("layer_kinds", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("sliding_window", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pnmix_models") as batch:
        batch.drop_column("sliding_window")
        batch.drop_column("layer_kinds")
