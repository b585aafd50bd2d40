"""Models, campaigns and Pareto front points.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _now() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    _models()
    _campaigns()
    _front_points()


def _models() -> None:
    op.create_table(
        "pnmix_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("location", sa.String(1024), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_heads", sa.Integer(), nullable=False),
        sa.Column("num_kv_heads", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("created_at", _now(), nullable=False),
        sa.Column("updated_at", _now(), nullable=False),
        sa.CheckConstraint(
            "num_layers > 0 AND num_heads > 0 AND num_kv_heads > 0", name=op.f("ck_pnmix_models_positive_shape")
        ),
        sa.CheckConstraint("head_dim > 0 AND head_dim % 2 = 0", name=op.f("ck_pnmix_models_even_head_dim")),
        sa.CheckConstraint("num_heads % num_kv_heads = 0", name=op.f("ck_pnmix_models_kv_heads_divide_heads")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pnmix_models")),
        sa.UniqueConstraint("name", name=op.f("uq_pnmix_models_name")),
    )


def _campaigns() -> None:
    op.create_table(
        "pnmix_campaigns",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("budgets", sa.JSON(), nullable=False),
        sa.Column("n_trials", sa.Integer(), nullable=False),
        sa.Column("profile", sa.String(16), nullable=False),
        sa.Column("objectives", sa.JSON(), nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("search_space", sa.JSON(), nullable=True),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("trials_done", sa.Integer(), nullable=False),
        sa.Column("trials_total", sa.Integer(), nullable=False),
        sa.Column("study_names", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", _now(), nullable=False),
        sa.Column("started_at", _now(), nullable=True),
        sa.Column("finished_at", _now(), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_pnmix_campaigns_status")
        ),
        sa.CheckConstraint("n_trials > 0", name=op.f("ck_pnmix_campaigns_positive_trials")),
        sa.CheckConstraint("trials_done >= 0 AND trials_total >= 0", name=op.f("ck_pnmix_campaigns_progress")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["pnmix_models.id"], name=op.f("fk_pnmix_campaigns_model_id_pnmix_models"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pnmix_campaigns")),
    )
    op.create_index(op.f("ix_pnmix_campaigns_model_id"), "pnmix_campaigns", ["model_id"])


def _front_points() -> None:
    op.create_table(
        "pnmix_front_points",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("campaign_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("budget", sa.Double(), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("b_high", sa.Integer(), nullable=False),
        sa.Column("b_low", sa.Integer(), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("salient_ratio", sa.Double(), nullable=False),
        sa.Column("n_sink", sa.Integer(), nullable=False),
        sa.Column("residual_len", sa.Integer(), nullable=False),
        sa.Column("value_bits", sa.Integer(), nullable=False),
        sa.Column("value_group_size", sa.Integer(), nullable=False),
        sa.Column("criterion", sa.String(32), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("accuracy", sa.Double(), nullable=False),
        sa.Column("accuracy_parts", sa.JSON(), nullable=False),
        sa.Column("key_bits", sa.Double(), nullable=False),
        sa.Column("kv_bytes", sa.BigInteger(), nullable=False),
        sa.Column("throughput", sa.Double(), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("device", sa.String(255), nullable=False),
        sa.Column("versions", sa.JSON(), nullable=False),
        sa.Column("created_at", _now(), nullable=False),
        sa.CheckConstraint(
            "key_bits > 0 AND key_bits <= budget + 1e-9", name=op.f("ck_pnmix_front_points_within_budget")
        ),
        sa.CheckConstraint("accuracy >= 0 AND accuracy <= 1", name=op.f("ck_pnmix_front_points_accuracy_range")),
        sa.CheckConstraint("b_low <= b_high", name=op.f("ck_pnmix_front_points_bits_order")),
        sa.CheckConstraint("kv_bytes >= 0 AND throughput >= 0", name=op.f("ck_pnmix_front_points_measurements")),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["pnmix_campaigns.id"], name=op.f("fk_pnmix_front_points_campaign_id_pnmix_campaigns"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["pnmix_models.id"], name=op.f("fk_pnmix_front_points_model_id_pnmix_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pnmix_front_points")),
        sa.UniqueConstraint(
            "campaign_id", "budget", "trial_number", name=op.f("uq_pnmix_front_points_campaign_id_budget_trial_number")
        ),
    )
    op.create_index("ix_pnmix_front_points_model_bits", "pnmix_front_points", ["model_id", "key_bits"])
    op.create_index("ix_pnmix_front_points_campaign_budget", "pnmix_front_points", ["campaign_id", "budget"])


def downgrade() -> None:
    op.drop_table("pnmix_front_points")
    op.drop_table("pnmix_campaigns")
    op.drop_table("pnmix_models")
