"""The SQL schema: three tables, typed SQLAlchemy 2.0 ORM classes.

Table names carry a `pnmix_` prefix because the same database also holds Optuna's tables
(`studies`, `trials`, ..., and `alembic_version`). Any change here needs an Alembic revision in
`alembic/versions/`; `tests/test_storage_migrations.py` checks that the two agree.

- `pnmix_models`: a model a campaign can tune, with the shape the bit formula needs.
- `pnmix_campaigns`: one tuning campaign over several bit budgets; workers claim queued ones.
- `pnmix_front_points`: the feasible Pareto front of one (campaign, budget); every `PNMixConfig`
  field as its own column, so queries can filter on them. A layer-wise config stores its default
  in those columns and its per-layer ranges in `layers` (NULL: every layer the same). An engine
  recipe (the engine method's answer) stores its per-layer formats in `recipe`, its config
  columns NULL. Each point
  carries both bit figures, key bits and KV bits, so a recommendation answers for either.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig
from pnmix.layerwise import LayerwiseConfig
from pnmix.recipes import EngineRecipe
from pnmix.storage.vocabulary import TIE_Z, BudgetOn

CAMPAIGN_STATUSES = ("queued", "running", "done", "failed")
TERMINAL_STATUSES = ("done", "failed")
CONFIG_FIELDS = (
    "b_high",
    "b_low",
    "group_size",
    "salient_ratio",
    "n_sink",
    "residual_len",
    "value_bits",
    "value_group_size",
    "criterion",
    "seed",
)

# Stable constraint names, so that migrations (and SQLite batch mode) can refer to them.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Model(Base):
    __tablename__ = "pnmix_models"
    __table_args__ = (
        CheckConstraint("num_layers > 0 AND num_heads > 0 AND num_kv_heads > 0", name="positive_shape"),
        CheckConstraint("head_dim > 0 AND head_dim % 2 = 0", name="even_head_dim"),
        CheckConstraint("num_heads % num_kv_heads = 0", name="kv_heads_divide_heads"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    family: Mapped[str] = mapped_column(String(64))  # transformers model_type: llama, qwen3, ...
    source: Mapped[str] = mapped_column(String(16))  # embedded | shape | local | hub
    location: Mapped[str] = mapped_column(String(1024), default="")  # GGUF path, directory or hub id
    num_layers: Mapped[int] = mapped_column(Integer)
    num_heads: Mapped[int] = mapped_column(Integer)
    num_kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    # each layer's kind, ["full_attention", "sliding_attention", ...] (pnmix.names FULL, SLIDING); NULL:
    # every layer full attention
    layer_kinds: Mapped[list[Any] | None] = mapped_column(default=None)
    sliding_window: Mapped[int | None] = mapped_column(Integer, nullable=True, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    campaigns: Mapped[list[Campaign]] = relationship(back_populates="model", passive_deletes=True)

    @property
    def plan(self) -> LayerPlan:
        """What each layer holds: the bit figures of a hybrid model weigh its layers by it."""
        if not self.layer_kinds:
            return LayerPlan.full(self.num_layers)
        return LayerPlan(tuple(self.layer_kinds), self.sliding_window)


class Campaign(Base):
    __tablename__ = "pnmix_campaigns"
    __table_args__ = (
        CheckConstraint("status IN ('queued', 'running', 'done', 'failed')", name="status"),
        CheckConstraint("n_trials > 0", name="positive_trials"),
        CheckConstraint("trials_done >= 0 AND trials_total >= 0", name="progress"),
        Index("ix_pnmix_campaigns_status_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pnmix_models.id", ondelete="RESTRICT"), index=True)
    method: Mapped[str] = mapped_column(String(16))  # pnmix | kivi | kitty: which knobs are searched
    budgets: Mapped[list[Any]] = mapped_column()  # key-bit budgets, floats, one Optuna study each
    n_trials: Mapped[int] = mapped_column(Integer)  # trials per budget
    profile: Mapped[str] = mapped_column(String(16))  # quick | full
    objectives: Mapped[list[Any]] = mapped_column()  # e.g. ["accuracy", "key_bits"]
    backend: Mapped[str] = mapped_column(String(16), default="auto")  # auto | torch | triton
    budget_on: Mapped[str] = mapped_column(String(8), default="key", server_default="key")  # vocabulary.BUDGET_ON
    search_space: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    options: Mapped[dict[str, Any]] = mapped_column(default=dict)  # tuner knobs not worth a column
    status: Mapped[str] = mapped_column(String(16), default="queued")
    trials_done: Mapped[int] = mapped_column(Integer, default=0)
    trials_total: Mapped[int] = mapped_column(Integer, default=0)
    study_names: Mapped[dict[str, Any]] = mapped_column(default=dict)  # budget (str) -> Optuna study name
    message: Mapped[str | None] = mapped_column(Text, default=None)  # why it failed, or a progress note
    worker_id: Mapped[str | None] = mapped_column(String(255), default=None)  # who claimed it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)  # last progress report

    model: Mapped[Model] = relationship(back_populates="campaigns")
    points: Mapped[list[FrontPoint]] = relationship(back_populates="campaign", passive_deletes=True)


class FrontPoint(Base):
    """One config on the feasible Pareto front of (campaign, budget), with its measurements."""

    __tablename__ = "pnmix_front_points"
    __table_args__ = (
        UniqueConstraint("campaign_id", "budget", "trial_number"),
        CheckConstraint("key_bits > 0 AND kv_bits > 0 AND (budget_on = 'key' AND key_bits <= budget + 1e-9 OR "
                        "budget_on = 'kv' AND kv_bits <= budget + 1e-9)", name="within_budget"),
        CheckConstraint("accuracy >= 0 AND accuracy <= 1", name="accuracy_range"),
        CheckConstraint("b_low <= b_high", name="bits_order"),
        CheckConstraint("(recipe IS NULL) = (b_high IS NOT NULL)", name="config_or_recipe"),
        CheckConstraint("kv_bytes >= 0 AND throughput >= 0", name="measurements"),
        # recommend(): a model's points under a bit budget
        Index("ix_pnmix_front_points_model_bits", "model_id", "key_bits"),
        Index("ix_pnmix_front_points_model_kv_bits", "model_id", "kv_bits"),
        # fronts: a campaign's points per budget
        Index("ix_pnmix_front_points_campaign_budget", "campaign_id", "budget"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(ForeignKey("pnmix_campaigns.id", ondelete="CASCADE"))
    # Copied from the campaign so that the recommendation query needs no join.
    model_id: Mapped[int] = mapped_column(ForeignKey("pnmix_models.id", ondelete="CASCADE"))
    budget: Mapped[float] = mapped_column(Double)
    budget_on: Mapped[str] = mapped_column(String(8), default="key", server_default="key")  # the campaign's
    trial_number: Mapped[int] = mapped_column(Integer)
    # every PNMixConfig field; NULL for an engine recipe's point (`recipe` set)
    b_high: Mapped[int | None] = mapped_column(Integer)
    b_low: Mapped[int | None] = mapped_column(Integer)
    group_size: Mapped[int | None] = mapped_column(Integer)
    salient_ratio: Mapped[float | None] = mapped_column(Double)
    n_sink: Mapped[int | None] = mapped_column(Integer)
    residual_len: Mapped[int | None] = mapped_column(Integer)
    value_bits: Mapped[int | None] = mapped_column(Integer)
    value_group_size: Mapped[int | None] = mapped_column(Integer)
    criterion: Mapped[str | None] = mapped_column(String(32))
    seed: Mapped[int | None] = mapped_column(Integer)
    # a layer-wise config's ranges, {"A-B": {field: value}} (LayerwiseConfig.to_dict()["layers"]); NULL: none
    layers: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # the sliding-window layers whose windows the config quantizes (LayerwiseConfig.windows); NULL: none
    windows: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True), default=None)
    # an engine recipe, {"layers": [[key format, value format], ...]} (EngineRecipe.to_dict()); NULL: a PN-Mix config
    # (SQL NULL, not JSON null: the config_or_recipe check reads it)
    recipe: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    # metrics
    accuracy: Mapped[float] = mapped_column(Double)  # aggregate score in [0, 1]
    accuracy_se: Mapped[float | None] = mapped_column(Double, nullable=True)  # its standard error; None: unknown
    accuracy_parts: Mapped[dict[str, Any]] = mapped_column(default=dict)  # e.g. passkey, top1_agreement, kl
    key_bits: Mapped[float] = mapped_column(Double)  # pnmix.bits.weighted_key_bits(config, model.plan, head_dim)
    kv_bits: Mapped[float] = mapped_column(Double)  # pnmix.bits.weighted_kv_bits(config, model.plan, head_dim)
    kv_bytes: Mapped[int] = mapped_column(BigInteger)  # measured cache.nbytes() total on the workload
    throughput: Mapped[float] = mapped_column(Double)  # decode tokens/s on the workload
    backend: Mapped[str] = mapped_column(String(32))  # torch | triton
    device: Mapped[str] = mapped_column(String(255))  # e.g. "cpu (2 cores)", "NVIDIA H200"
    versions: Mapped[dict[str, Any]] = mapped_column(default=dict)  # package -> version
    # per part {"weight": w, "values": [per-unit influence]} (storage.write.FrontPointIn); NULL: unknown
    unit_influence: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # The point's score on its campaign's held-out units (tuner/scoring/holdout.py), set when the campaign
    # finishes for the point each budget recommends; NULL: not scored there (no hold-out, or not a pick).
    holdout_accuracy: Mapped[float | None] = mapped_column(Double, nullable=True, default=None)
    holdout_accuracy_se: Mapped[float | None] = mapped_column(Double, nullable=True, default=None)
    # the rest of that measurement (storage.write.HoldoutIn.to_dict): unit counts, pnmix-paper beside it
    holdout: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    campaign: Mapped[Campaign] = relationship(back_populates="points")

    @property
    def config(self) -> PNMixConfig | LayerwiseConfig | EngineRecipe:
        if self.recipe is not None:
            return EngineRecipe.from_dict(self.recipe)
        default = PNMixConfig(**{name: getattr(self, name) for name in CONFIG_FIELDS})
        if not self.layers and not self.windows:
            return default
        return LayerwiseConfig.from_dict({"default": default.to_dict(), "layers": self.layers or {},
                                          "windows": self.windows or []})

    def holdout_gap(self) -> tuple[float, float | None] | None:
        """(held-out minus in-search accuracy, its standard error), None without a held-out score.
        The two scores come from disjoint units, so the error combines both: sqrt(se_h^2 + se_s^2)."""
        if self.holdout_accuracy is None:
            return None
        ses = (self.holdout_accuracy_se, self.accuracy_se)
        se = None if None in ses else math.hypot(*ses)  # type: ignore[arg-type]
        return self.holdout_accuracy - self.accuracy, se

    def holdout_summary(self) -> dict[str, Any] | None:
        """The held-out score as `recommend --json` and the API give it; None without one. `holds`:
        the held-out score is not more than TIE_Z (2) standard errors (of the gap) below the in-search one;
        None when the gap has no standard error (a part with a single held-out unit)."""
        gap = self.holdout_gap()
        if gap is None:
            return None
        detail = self.holdout or {}
        diff, se = gap
        return {"accuracy": self.holdout_accuracy, "accuracy_se": self.holdout_accuracy_se,
                "units": detail.get("units", {}), "minus_in_search": diff, "minus_in_search_se": se,
                "holds": None if se is None else diff >= -TIE_Z * se, "pnmix_paper": detail.get("paper")}

    def bits(self, of: str) -> float:
        """The point's key bits (`of="key"`) or KV bits (`"kv"`)."""
        return self.kv_bits if of == BudgetOn.KV else self.key_bits
