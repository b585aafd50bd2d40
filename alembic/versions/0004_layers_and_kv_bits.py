"""Layer-wise configs and the KV-bits figure: front points keep a layer-wise config's ranges
(`layers`, NULL for a single config) and both bit figures (`kv_bits` beside `key_bits`); a
campaign says which one its budgets constrain (`budget_on`, copied onto its points).

Points stored before this revision had key budgets and single configs; their KV bits are
computed here with the formula of pnmix.bits.kv_bits (T_q = 32768).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

OLD_CHECK = "key_bits > 0 AND key_bits <= budget + 1e-9"
NEW_CHECK = ("key_bits > 0 AND kv_bits > 0 AND (budget_on = 'key' AND key_bits <= budget + 1e-9 OR "
             "budget_on = 'kv' AND kv_bits <= budget + 1e-9)")
# value bits per element with the fp16 sinks, as pnmix.bits.value_bits_total counts them
VALUE_BITS = ("CASE WHEN value_bits = 16 THEN 16.0 ELSE (32768 * (value_bits + 32.0 / value_group_size) + "
              "n_sink * 16.0) / (32768 + n_sink) END")


def upgrade() -> None:
    with op.batch_alter_table("pnmix_campaigns") as batch:
        batch.add_column(sa.Column("budget_on", sa.String(8), nullable=False, server_default="key"))
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.add_column(sa.Column("budget_on", sa.String(8), nullable=False, server_default="key"))
        batch.add_column(sa.Column("layers", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("kv_bits", sa.Double(), nullable=True))
    op.execute(f"UPDATE pnmix_front_points SET kv_bits = (key_bits + {VALUE_BITS}) / 2")
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.alter_column("kv_bits", existing_type=sa.Double(), nullable=False)
        batch.drop_constraint(op.f("ck_pnmix_front_points_within_budget"), type_="check")
        batch.create_check_constraint(op.f("ck_pnmix_front_points_within_budget"), NEW_CHECK)
    op.create_index("ix_pnmix_front_points_model_kv_bits", "pnmix_front_points", ["model_id", "kv_bits"])


def downgrade() -> None:
    op.drop_index("ix_pnmix_front_points_model_kv_bits", table_name="pnmix_front_points")
    op.execute("DELETE FROM pnmix_front_points WHERE budget_on <> 'key' OR layers IS NOT NULL")
    with op.batch_alter_table("pnmix_front_points") as batch:
        batch.drop_constraint(op.f("ck_pnmix_front_points_within_budget"), type_="check")
        batch.create_check_constraint(op.f("ck_pnmix_front_points_within_budget"), OLD_CHECK)
        batch.drop_column("kv_bits")
        batch.drop_column("layers")
        batch.drop_column("budget_on")
    with op.batch_alter_table("pnmix_campaigns") as batch:
        batch.drop_column("budget_on")
