"""Engine recipes on the fronts: a front point of the engine method keeps its recipe (`recipe`,
each layer's [key format, value format], `pnmix.recipes.EngineRecipe.to_dict`) and no PN-Mix
config, so the config columns take NULL where `recipe` is set, and only there.

Every point stored before this revision holds a PN-Mix config and no recipe.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

INTEGERS = ("b_high", "b_low", "group_size", "n_sink", "residual_len", "value_bits", "value_group_size", "seed")
CHECK = "(recipe IS NULL) = (b_high IS NOT NULL)"


def _config_columns(batch: object, nullable: bool) -> None:
    for name in INTEGERS:
        batch.alter_column(name, existing_type=sa.Integer(), nullable=nullable)  # type: ignore[attr-defined]
    batch.alter_column("salient_ratio", existing_type=sa.Double(), nullable=nullable)  # type: ignore[attr-defined]
    batch.alter_column("criterion", existing_type=sa.String(32), nullable=nullable)  # type: ignore[attr-defined]


def upgrade() -> None:
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.add_column(sa.Column("recipe", sa.JSON(), nullable=True))
        _config_columns(batch, nullable=True)
        batch.create_check_constraint(op.f("ck_pnmix_front_points_config_or_recipe"), CHECK)


def downgrade() -> None:
    op.execute("DELETE FROM pnmix_front_points WHERE recipe IS NOT NULL")
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.drop_constraint(op.f("ck_pnmix_front_points_config_or_recipe"), type_="check")
        _config_columns(batch, nullable=False)
        batch.drop_column("recipe")
