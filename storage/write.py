"""The write API: what the tuner, `pnmix worker` and the service call to change the database.

Every function takes an open `Session` and runs inside the caller's transaction, which
`Database.session()` commits at the end of its block (or rolls back if anything raised):

    with db.session() as s:
        model = upsert_model(s, ModelIn("smollm2-135m", "llama", "embedded", 30, 9, 3, 64))
        campaign = create_campaign(s, "smollm2-135m", [3.0, 2.25], n_trials=30, status="running")
    ...
    with db.session() as s:                          # after each completed trial
        replace_front(s, campaign.id, 2.25, [FrontPointIn(config, accuracy=0.9, kv_bytes=..., ...)])
        update_campaign_progress(s, campaign.id, trials_done=17)

Values are checked before anything is written; a refused write raises `InvalidValueError`
(a `StorageError`, so a `PNMixError`) and leaves the database as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig
from pnmix.configs import Answer, key_bits, kv_bits
from pnmix.inputs import BUDGET
from pnmix.layerwise import LayerwiseConfig, simplest
from pnmix.names import BACKENDS
from pnmix.recipes import EngineRecipe
from pnmix.storage.errors import InvalidValueError, NotFoundError
from pnmix.storage.orm import CAMPAIGN_STATUSES, CONFIG_FIELDS, TERMINAL_STATUSES, Campaign, FrontPoint, Model, utcnow
from pnmix.storage.vocabulary import BUDGET_ON, METHODS, TRIALS, BudgetOn

# What a campaign may optimize: measured columns of its front points, each with the direction that
# improves it (the tuner's Optuna study directions). Every campaign optimizes accuracy and key bits.
# Every campaign optimizes accuracy and the bit figure its budgets constrain: key bits, or KV bits
# for a `budget_on="kv"` campaign (`CampaignSpec` puts kv_bits in key_bits' place).
OBJECTIVES: dict[str, Literal["maximize", "minimize"]] = {
    "accuracy": "maximize", "key_bits": "minimize", "kv_bits": "minimize", "kv_bytes": "minimize",
    "throughput": "maximize"}
REQUIRED_OBJECTIVES = ("accuracy", "key_bits")
MODEL_SOURCES = ("embedded", "shape", "local", "hub")
MAX_BITS = BUDGET.high
# A budget and the formula's key bits are compared with this slack, so that a config whose bits
# equal the budget up to float rounding counts as within it. Budgets themselves are compared
# exactly: a float survives JSON, SQLite REAL and PostgreSQL float8 unchanged.
BITS_EPS = 1e-9


@dataclass(frozen=True)
class ModelIn:
    """A model as `upsert_model` stores it. `family` is the transformers `model_type`."""

    name: str
    family: str
    source: str  # embedded | shape | local | hub
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    location: str = ""  # GGUF path, checkpoint directory or hub id
    # each layer's kind (pnmix.names FULL, SLIDING) and the sliding window; empty: all full attention
    layer_kinds: tuple[str, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 255:
            raise InvalidValueError(f"invalid model name {self.name!r}: 1 to 255 characters")
        if self.source not in MODEL_SOURCES:
            raise InvalidValueError(f"invalid model source {self.source!r}: allowed {', '.join(MODEL_SOURCES)}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidValueError(f"invalid {name}={value!r} for model {self.name!r}: a positive integer")
        if self.head_dim % 2:
            raise InvalidValueError(f"invalid head_dim={self.head_dim} for model {self.name!r}: RoPE needs it even")
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            raise InvalidValueError(f"invalid layer_kinds for model {self.name!r}: {len(self.layer_kinds)} kinds, "
                                    f"allowed one per layer ({self.num_layers})")
        if self.num_heads % self.num_kv_heads:
            raise InvalidValueError(
                f"invalid num_kv_heads={self.num_kv_heads} for model {self.name!r}: "
                f"must divide num_heads={self.num_heads}"
            )


@dataclass(frozen=True)
class FrontPointIn:
    """One Pareto point as the tuner measured it. Bits are not given: `replace_front` computes the
    key bits (`pnmix.bits.weighted_key_bits`) and KV bits (`weighted_kv_bits`) from `config` and the
    model's shape and layer kinds.

    config:         a `PNMixConfig`, a `LayerwiseConfig` or an `EngineRecipe` (the engine method's)
    accuracy:       aggregate score in [0, 1] (what the front maximizes)
    accuracy_se:    its standard error (tuner/scoring/stats.py), None where not measured
    accuracy_parts: the score's parts by name, e.g. {"passkey": 0.8, "top1_agreement": 0.93, "kl": 0.04}
    kv_bytes:       measured `cache.nbytes()["total"]` on the profile's workload
    throughput:     measured decode tokens/s on that workload
    trial_number:   the Optuna trial number (unique within one front)
    backend:        "torch" (CPU/GPU reference) or "triton"
    device:         what it ran on, e.g. "cpu" or "NVIDIA H200"
    versions:       package -> version, e.g. {"torch": "2.13.0", "transformers": "5.24.0"}
    unit_influence: per part, its weight in the accuracy and the per-unit values whose mean is the
                    part's score ({"passkey": {"weight": 0.25, "values": [1.0, 0.0, ...]}}; tuner/scoring/stats.py):
                    two points of one campaign, scored on the same units, then compare paired
    """

    config: Answer
    accuracy: float
    kv_bytes: int
    throughput: float
    trial_number: int
    backend: str
    device: str
    accuracy_parts: Mapping[str, float] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    accuracy_se: float | None = None
    unit_influence: Mapping[str, Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, PNMixConfig | LayerwiseConfig | EngineRecipe):
            raise InvalidValueError(f"config must be a PNMixConfig, LayerwiseConfig or EngineRecipe, "
                                    f"got {type(self.config).__name__}")
        _check_number("accuracy", self.accuracy, low=0.0, high=1.0)
        _check_number("throughput", self.throughput, low=0.0)
        if self.accuracy_se is not None:
            _check_number("accuracy_se", self.accuracy_se, low=0.0, high=1.0)
        if isinstance(self.kv_bytes, bool) or not isinstance(self.kv_bytes, int) or self.kv_bytes < 0:
            raise InvalidValueError(f"invalid kv_bytes={self.kv_bytes!r}: an integer >= 0")
        if isinstance(self.trial_number, bool) or not isinstance(self.trial_number, int) or self.trial_number < 0:
            raise InvalidValueError(f"invalid trial_number={self.trial_number!r}: an integer >= 0")
        for name in ("backend", "device"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidValueError(f"invalid {name}={value!r}: a non-empty string")
        for part, value in self.accuracy_parts.items():
            _check_number(f"accuracy_parts[{part!r}]", value)
        for part, entry in (self.unit_influence or {}).items():
            values = entry.get("values") if isinstance(entry, Mapping) else None
            if not isinstance(values, list) or not values:
                raise InvalidValueError(f"invalid unit_influence[{part!r}]: a weight and a non-empty list of values")
            _check_number(f"unit_influence[{part!r}].weight", entry.get("weight"), low=0.0)
            for value in values:
                _check_number(f"unit_influence[{part!r}] value", value)


@dataclass(frozen=True)
class HoldoutIn:
    """A front point's score on its campaign's held-out units (tuner/scoring/holdout.py).

    accuracy, accuracy_se: the combined score there and its standard error
    units:                 held-out units per part, e.g. {"passkey": 34, "fidelity": 3}
    paper:                 pnmix-paper on the same units, where it fits the budget: {"accuracy", "accuracy_se",
                           "diff", "diff_se"} with diff = this point minus pnmix-paper, paired unit by unit
    """

    accuracy: float
    accuracy_se: float | None
    units: Mapping[str, int]
    paper: Mapping[str, float | None] | None = None

    def __post_init__(self) -> None:
        _check_number("holdout accuracy", self.accuracy, low=0.0, high=1.0)
        if self.accuracy_se is not None:
            _check_number("holdout accuracy_se", self.accuracy_se, low=0.0, high=1.0)
        for part, n in self.units.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InvalidValueError(f"invalid held-out units of {part!r}: {n!r}, an integer >= 1")
        for name, value in (self.paper or {}).items():
            if name not in ("accuracy", "accuracy_se", "diff", "diff_se"):
                raise InvalidValueError(f"invalid holdout paper field {name!r}")
            if value is not None:
                _check_number(f"holdout paper {name}", value, low=-1.0, high=1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"units": {str(k): int(v) for k, v in self.units.items()},
                "paper": None if self.paper is None else {k: None if v is None else float(v)
                                                          for k, v in self.paper.items()}}


def set_holdout(session: Session, campaign_id: int, budget: float, trial_number: int,
                holdout: HoldoutIn) -> FrontPoint:
    """Stores the held-out score of the front point of (campaign, budget, trial); rewriting its front
    later keeps it (`replace_front`). NotFoundError when that front no longer holds the trial
    (another worker replaced it meanwhile).

    The campaign row is locked first, as `replace_front` locks it: a front replaced by another
    worker at the same moment either carries this score over or is replaced before it is set."""
    if not isinstance(holdout, HoldoutIn):
        raise InvalidValueError(f"a held-out score must be a HoldoutIn, got {type(holdout).__name__}")
    if session.get(Campaign, campaign_id, with_for_update=True, populate_existing=True) is None:
        raise NotFoundError(f"no campaign with id {campaign_id}")
    where = (FrontPoint.campaign_id == campaign_id, FrontPoint.budget == budget,
             FrontPoint.trial_number == trial_number)
    result = session.execute(update(FrontPoint).where(*where).values(
        holdout_accuracy=float(holdout.accuracy),
        holdout_accuracy_se=None if holdout.accuracy_se is None else float(holdout.accuracy_se),
        holdout=holdout.to_dict()).execution_options(synchronize_session=False))
    if not result.rowcount:  # type: ignore[attr-defined]
        raise NotFoundError(f"no front point of campaign {campaign_id}, budget {budget:g}, trial {trial_number}")
    return session.scalars(select(FrontPoint).where(*where).execution_options(populate_existing=True)).one()


def upsert_model(session: Session, model: ModelIn) -> Model:
    """Inserts the model, or updates family/source/location/shape of the one with the same name."""
    row = session.scalars(select(Model).where(Model.name == model.name)).one_or_none()
    if row is None:
        row = Model(name=model.name)
        session.add(row)
    row.family = model.family
    row.source = model.source
    row.location = model.location
    row.num_layers = model.num_layers
    row.num_heads = model.num_heads
    row.num_kv_heads = model.num_kv_heads
    row.head_dim = model.head_dim
    hybrid = LayerPlan(model.layer_kinds, model.sliding_window).hybrid
    row.layer_kinds = list(model.layer_kinds) if hybrid else None
    row.sliding_window = model.sliding_window if hybrid else None
    session.flush()
    return row


def registry_model(name: str) -> ModelIn | None:
    """The `ModelIn` of a model that `pnmix.models` knows without loading anything (embedded and
    shape models), or None for other names (local directories and hub ids: the tuner registers
    those itself after reading their config)."""
    from pnmix import models

    if name in models.EMBEDDED:
        spec = models.EMBEDDED[name]
        shape, family, source = spec.shape, spec.family, "embedded"
    elif name in models.SHAPE_MODELS:
        shape_spec = models.SHAPE_MODELS[name]
        shape, family, source = shape_spec.shape, str(shape_spec.config["model_type"]), "shape"
    else:
        return None
    plan = models.layer_plan(name)
    return ModelIn(name, family, source, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                   layer_kinds=plan.kinds, sliding_window=plan.window)


def create_campaign(
    session: Session,
    model: str,
    budgets: Sequence[float],
    n_trials: int,
    *,
    method: str = "pnmix",
    profile: str = "quick",
    objectives: Sequence[str] = ("accuracy", "key_bits"),
    backend: str = "auto",
    budget_on: str = "key",
    search_space: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    status: str = "queued",
    worker_id: str | None = None,
) -> Campaign:
    """Creates a campaign of `model` (already stored, or a registry model, which is stored first).

    `status="queued"` (the default) leaves it for `claim_next_queued_campaign`; a tuner that runs
    the campaign itself passes `status="running"` (and its `worker_id`). `budget_on`: which bit
    figure the budgets constrain, "key" (key bits) or "kv" (keys and values). `trials_total` starts at
    `n_trials * len(budgets)`; `study_names` starts empty (set it with `update_campaign_progress`).
    """
    budgets, objectives = _check_campaign_fields(budgets, n_trials, method, profile, objectives, backend,
                                                 budget_on, status)
    model_row = _campaign_model(session, model)
    now = utcnow()
    campaign = Campaign(
        model_id=model_row.id,
        method=method,
        budgets=budgets,
        n_trials=n_trials,
        profile=profile,
        objectives=objectives,
        backend=backend,
        budget_on=budget_on,
        search_space=dict(search_space) if search_space is not None else None,
        options=dict(options or {}),
        status=status,
        trials_done=0,
        trials_total=n_trials * len(budgets),
        study_names={},
        worker_id=worker_id,
        created_at=now,
        started_at=now if status == "running" else None,
        heartbeat_at=now if status == "running" else None,
    )
    session.add(campaign)
    session.flush()
    return campaign


def _check_campaign_fields(budgets: Sequence[float], n_trials: int, method: str, profile: str,
                           objectives: Sequence[str], backend: str, budget_on: str,
                           status: str) -> tuple[list[float], list[str]]:
    """`create_campaign`'s arguments checked in turn (the first bad one is refused), before the
    database is touched: the budgets and the objectives as they are stored."""
    budgets = check_budgets(budgets)
    if not TRIALS.contains(n_trials):
        raise InvalidValueError(f"invalid n_trials={n_trials!r}: {TRIALS.allowed}")
    _check_choice("method", method, METHODS)
    # Profiles are the tuner's (tuner.scoring.profiles), which sits above this layer: the tuner and the
    # service check the name; here it only has to fit its column.
    if not isinstance(profile, str) or not 0 < len(profile) <= 16:
        raise InvalidValueError(f"invalid profile={profile!r}: a profile name of 1 to 16 characters")
    _check_choice("backend", backend, BACKENDS)
    _check_choice("budget_on", budget_on, BUDGET_ON)
    _check_choice("status", status, ("queued", "running"))
    return budgets, check_objectives(objectives, budget_on)


def _campaign_model(session: Session, model: str) -> Model:
    """The stored row of a campaign's model (a registry model is stored first); a shape model, which
    has random weights, is refused."""
    model_row = _model_or_registry(session, model)
    if model_row.source == "shape":  # a worker would load it for accuracy and refuse: refuse it here
        raise InvalidValueError(f"model {model!r} has random weights (performance work only); a campaign scores "
                                "accuracy: use a real model such as smollm2-135m")
    return model_row


def claim_next_queued_campaign(
    session: Session, worker_id: str, stale_after_s: float | None = None, backends: Sequence[str] | None = None
) -> Campaign | None:
    """Marks the oldest queued campaign as running for `worker_id` and returns it (None if none).

    `backends`: only campaigns of these backends (a worker without a GPU leaves `triton` campaigns
    queued for one that has one, and takes the next it can run).

    With `stale_after_s`, a `running` campaign whose heartbeat (`heartbeat_at`, refreshed by its
    worker every few seconds) is older than that is claimed too: its worker died (kill -9, a lost
    host) and nothing else would ever finish it. The new worker resumes it through Optuna, whose
    own heartbeats retry the dead worker's trial.

    Safe with many workers: on PostgreSQL the row is taken with `SELECT ... FOR UPDATE SKIP LOCKED`,
    so concurrent workers get different campaigns without waiting on each other; on every backend
    the status change is a compare-and-set (`UPDATE ... WHERE status = 'queued'`, or the stale
    heartbeat), so one campaign is never claimed twice. Commit promptly (end the session block)
    to publish the claim.
    """
    if not worker_id:
        raise InvalidValueError("worker_id must be a non-empty string")
    claimable = Campaign.status == "queued"
    if stale_after_s is not None:
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        claimable = or_(claimable, and_(Campaign.status == "running", Campaign.heartbeat_at < cutoff))
    if backends is not None:
        claimable = and_(claimable, Campaign.backend.in_(list(backends)))
    for _ in range(100):  # another worker may win a candidate between our SELECT and UPDATE (SQLite)
        candidate = session.scalars(
            select(Campaign.id)
            .where(claimable)
            .order_by(Campaign.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if candidate is None:
            return None
        now = utcnow()
        claimed = session.execute(
            update(Campaign)
            .where(Campaign.id == candidate, claimable)
            .values(status="running", worker_id=worker_id, started_at=func.coalesce(Campaign.started_at, now),
                    heartbeat_at=now)
            .execution_options(synchronize_session=False)
        )
        if claimed.rowcount == 1:  # type: ignore[attr-defined]
            campaign = session.get(Campaign, candidate, populate_existing=True)
            assert campaign is not None
            return campaign
    return None


def touch_campaign(session: Session, campaign_id: int, worker_id: str | None = None) -> bool:
    """Refreshes a running campaign's heartbeat (and owner); False when it is not running any more."""
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if worker_id:
        values["worker_id"] = worker_id
    result = session.execute(
        update(Campaign)
        .where(Campaign.id == campaign_id, Campaign.status == "running")
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def update_campaign_progress(
    session: Session,
    campaign_id: int,
    *,
    trials_done: int | None = None,
    trials_total: int | None = None,
    status: str | None = None,
    study_names: Mapping[str, str] | None = None,
    search_space: Mapping[str, Any] | None = None,
    message: str | None = None,
) -> Campaign:
    """Records progress of a campaign; arguments left None are not changed. Every call is a heartbeat.

    status: "running" (from queued), "done" or "failed" (from queued or running; sets finished_at).
    A finished campaign accepts no further change. study_names: budget (as str) -> Optuna study
    name, merged into what is stored. message: a failure reason or a progress note.
    """
    campaign = session.get(Campaign, campaign_id, with_for_update=True, populate_existing=True)
    if campaign is None:
        raise NotFoundError(f"no campaign with id {campaign_id}")
    if campaign.status in TERMINAL_STATUSES:
        raise InvalidValueError(f"campaign {campaign_id} is {campaign.status}; a finished campaign cannot change")
    now = utcnow()
    if status is not None:
        _check_choice("status", status, CAMPAIGN_STATUSES)
        if status == "queued":
            raise InvalidValueError(f"campaign {campaign_id} cannot go back to queued")
        if status == "running" and campaign.started_at is None:
            campaign.started_at = now
        if status in TERMINAL_STATUSES:
            campaign.finished_at = now
        campaign.status = status
    total = campaign.trials_total if trials_total is None else trials_total
    done = campaign.trials_done if trials_done is None else trials_done
    for name, value in (("trials_done", done), ("trials_total", total)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidValueError(f"invalid {name}={value!r}: an integer >= 0")
    if done > total:
        raise InvalidValueError(f"invalid trials_done={done}: more than trials_total={total}")
    campaign.trials_done, campaign.trials_total = done, total
    if study_names is not None:
        campaign.study_names = {**campaign.study_names, **{str(k): str(v) for k, v in study_names.items()}}
    if search_space is not None:
        campaign.search_space = dict(search_space)
    if message is not None:
        campaign.message = message
    campaign.heartbeat_at = now
    session.flush()
    return campaign


def replace_front(
    session: Session, campaign_id: int, budget: float, points: Sequence[FrontPointIn]
) -> list[FrontPoint]:
    """Replaces the stored front of (campaign, budget) with `points`, atomically.

    `budget` must be one of the campaign's budgets. Each point's key bits and KV bits are computed
    here from its config, the model's shape and what its layers hold (`pnmix.bits.weighted_key_bits`,
    `weighted_kv_bits`, T_q = 32768: a full-attention model's layer mean, `mean_key_bits` and `kv_bits`);
    the figure the campaign's `budget_on` names must not exceed the budget; trial numbers must be
    distinct. A layer-wise config is checked against the model's layers and stored compactly (its
    default in the config columns, its ranges in `layers`; all layers alike: no ranges). All points are checked
    before anything changes, and the old front is deleted and the new one inserted in the caller's
    transaction, so readers see either the old front or the new one, never a mix. The campaign row
    is locked first (`FOR UPDATE` on PostgreSQL, the write lock on SQLite), so two workers
    replacing the same front one after the other cannot interleave. An empty `points` clears it.
    """
    campaign = session.get(Campaign, campaign_id, with_for_update=True, populate_existing=True)
    if campaign is None:
        raise NotFoundError(f"no campaign with id {campaign_id}")
    budget = check_budgets([budget])[0]
    if budget not in campaign.budgets:
        raise InvalidValueError(f"budget {budget:g} is not one of campaign {campaign_id}'s budgets {campaign.budgets}")
    head_dim, plan = campaign.model.head_dim, campaign.model.plan
    rows: list[FrontPoint] = []
    seen: set[int] = set()
    for point in points:
        if not isinstance(point, FrontPointIn):
            raise InvalidValueError(f"front points must be FrontPointIn, got {type(point).__name__}")
        if point.trial_number in seen:
            raise InvalidValueError(f"trial {point.trial_number} appears twice in the front of budget {budget:g}")
        seen.add(point.trial_number)
        rows.append(_front_row(campaign, budget, point, head_dim, plan))
    _keep_holdouts(session, campaign.id, budget, rows)
    session.execute(
        delete(FrontPoint)
        .where(FrontPoint.campaign_id == campaign.id, FrontPoint.budget == budget)
        .execution_options(synchronize_session=False)
    )
    session.add_all(rows)
    campaign.heartbeat_at = utcnow()
    session.flush()
    return rows


def _point_bits(campaign: Campaign, budget: float, trial_number: int, config: Answer,
                head_dim: int, plan: LayerPlan) -> tuple[float, float]:
    """A front point's (key bits, KV bits) on the campaign's model (`pnmix.configs`); the figure the
    campaign's `budget_on` names must be within `budget`."""
    try:
        key = key_bits(config, plan, head_dim)
        kv = kv_bits(config, plan, head_dim)
    except ValueError as exc:  # ConfigError: config does not fit the model (value_group_size, layers)
        raise InvalidValueError(f"trial {trial_number}: {exc}") from None
    bits = kv if campaign.budget_on == BudgetOn.KV else key
    if bits > budget + BITS_EPS:
        raise InvalidValueError(
            f"trial {trial_number} needs {bits:.5f} {campaign.budget_on} bits, over the budget {budget:g}"
        )
    return key, kv


def _front_row(campaign: Campaign, budget: float, point: FrontPointIn, head_dim: int,
               plan: LayerPlan) -> FrontPoint:
    """The row that stores `point` in the front of (campaign, budget): its config compact, its bits
    computed and checked against the budget (`_point_bits`)."""
    config = point.config if isinstance(point.config, EngineRecipe) else simplest(point.config)
    key, kv = _point_bits(campaign, budget, point.trial_number, config, head_dim, plan)
    default = config.default if isinstance(config, LayerwiseConfig) else config
    return FrontPoint(
        campaign_id=campaign.id,
        model_id=campaign.model_id,
        budget=budget,
        budget_on=campaign.budget_on,
        trial_number=point.trial_number,
        **{name: getattr(default, name, None) for name in CONFIG_FIELDS},
        layers=config.to_dict()["layers"] if isinstance(config, LayerwiseConfig) else None,
        windows=list(config.windows) if isinstance(config, LayerwiseConfig) and config.windows else None,
        recipe=config.to_dict() if isinstance(config, EngineRecipe) else None,
        accuracy=float(point.accuracy),
        accuracy_se=None if point.accuracy_se is None else float(point.accuracy_se),
        accuracy_parts={str(k): float(v) for k, v in point.accuracy_parts.items()},
        key_bits=key,
        kv_bits=kv,
        kv_bytes=point.kv_bytes,
        throughput=float(point.throughput),
        backend=point.backend,
        device=point.device,
        versions={str(k): str(v) for k, v in point.versions.items()},
        unit_influence=None if point.unit_influence is None else {
            str(k): {"weight": float(v["weight"]), "values": [float(x) for x in v["values"]]}
            for k, v in point.unit_influence.items()},
    )


def _keep_holdouts(session: Session, campaign_id: int, budget: float, rows: Sequence[FrontPoint]) -> None:
    """Carries the held-out scores of the stored front of (campaign, budget) over to the `rows` that
    replace it: a point's held-out score (set once the campaign finished) stays with its trial's config."""
    kept = {(p.trial_number, p.config.to_json()): (p.holdout_accuracy, p.holdout_accuracy_se, p.holdout)
            for p in session.scalars(select(FrontPoint).where(FrontPoint.campaign_id == campaign_id,
                                                              FrontPoint.budget == budget,
                                                              FrontPoint.holdout_accuracy.is_not(None)))}
    for row in rows:
        held = kept.get((row.trial_number, row.config.to_json()))
        if held is not None:
            row.holdout_accuracy, row.holdout_accuracy_se, row.holdout = held


def check_objectives(objectives: Sequence[str], budget_on: str = "key") -> list[str]:
    """Objectives as a list: distinct names of `OBJECTIVES` that include accuracy and key_bits.

    Under a KV budget (`budget_on="kv"`) the bit objective is the KV bits: a key_bits given there
    stands for it and is replaced (so the same `--objectives` serves either budget)."""
    if isinstance(objectives, str | bytes) or not isinstance(objectives, Sequence):
        raise InvalidValueError(f"invalid objectives={objectives!r}: a list of names")
    out = list(objectives)
    for name in out:
        _check_choice("objective", name, tuple(OBJECTIVES))
    if len(set(out)) != len(out) or (budget_on == BudgetOn.KEY and not set(REQUIRED_OBJECTIVES) <= set(out)):
        raise InvalidValueError(
            f"invalid objectives={out}: distinct names that include {' and '.join(REQUIRED_OBJECTIVES)}"
        )
    if budget_on == BudgetOn.KEY:
        if "kv_bits" in out:
            raise InvalidValueError(f"invalid objectives={out}: kv_bits is the bit objective of a KV budget "
                                    "(budget_on kv); under a key budget the bits are key_bits")
        return out
    out = ["kv_bits" if name == "key_bits" else name for name in out]
    if len(set(out)) != len(out) or not {"accuracy", "kv_bits"} <= set(out):
        raise InvalidValueError(f"invalid objectives={list(objectives)}: under a KV budget, distinct names "
                                "that include accuracy and key_bits or kv_bits (the budget's bits)")
    return out


def check_budgets(budgets: Sequence[float]) -> list[float]:
    """Budgets as floats: at least one, each finite in (0, 16], no duplicates. The one budget check:
    the tuner's `CampaignSpec` and the service's request bodies call it too."""
    if isinstance(budgets, str | bytes) or not isinstance(budgets, Sequence) or len(budgets) == 0:
        raise InvalidValueError(f"invalid budgets={budgets!r}: a non-empty list of key-bit budgets")
    out: list[float] = []
    for b in budgets:
        if not BUDGET.contains(b):
            raise InvalidValueError(f"invalid budget={b!r}: {BUDGET.allowed}")
        if float(b) in out:
            raise InvalidValueError(f"budget {b} is given twice")
        out.append(float(b))
    return out


def _model_or_registry(session: Session, name: str) -> Model:
    row = session.scalars(select(Model).where(Model.name == name)).one_or_none()
    if row is not None:
        return row
    known = registry_model(name)
    if known is None:
        raise NotFoundError(
            f"unknown model {name!r}: not in the database; register it first (the tuner does when it runs "
            "on a local checkpoint or hub id), or use a registry model such as smollm2-135m"
        )
    return upsert_model(session, known)


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise InvalidValueError(f"invalid {name}={value!r}: allowed {', '.join(allowed)}")


def _check_number(
    name: str, value: object, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low  # type: ignore[operator]
    if ok and high is not None:
        ok = value <= high  # type: ignore[operator]
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}]"
        allowed = f"a finite number in {lo}, {hi}" if low is not None and high is not None else "a finite number"
        if low is not None and high is None:
            allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
        raise InvalidValueError(f"invalid {name}={value!r}: {allowed}")
