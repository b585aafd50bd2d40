"""Request and response bodies (pydantic v2), in families: `...Public` out, `...Create` in."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from pnmix.inputs import BUDGET, TRIALS
from pnmix.names import BACKENDS, METHODS
from storage.orm import CAMPAIGN_STATUSES, Campaign, FrontPoint
from storage.read import OPTIMIZE, ModelSummary
from storage.write import OBJECTIVES, REQUIRED_OBJECTIVES, check_budgets, check_objectives
from tuner.profiles import PROFILES

# The ranges are pnmix.inputs', the command line's too: `pnmix recommend --bits` takes what `target_bits` takes.
Budget = Annotated[float, Field(**BUDGET.constraints(), description="key bits per element")]


def _whole(v: Any) -> Any:
    """A JSON number with no fractional part (`30.0`) is an integer to JSON Schema, so to us;
    `true` and `"30"` stay what they are and the strict check refuses them."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


WholeNumber = Annotated[int, BeforeValidator(_whole)]
Status = Literal[CAMPAIGN_STATUSES]  # type: ignore[valid-type]
Optimize = Literal[OPTIMIZE]  # type: ignore[valid-type]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    version: str
    database: str  # the URL, password masked
    backend: str
    schema_revision: str | None
    schema_head: str
    ready: bool
    detail: str | None = None


class ModelPublic(BaseModel):
    name: str
    family: str
    source: str
    location: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    front_points: int = Field(description="stored Pareto points over all campaigns")
    budgets: list[float] = Field(description="budgets that have points, largest first")

    @classmethod
    def of(cls, s: ModelSummary) -> ModelPublic:
        m = s.model
        return cls(
            name=m.name, family=m.family, source=m.source, location=m.location, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            front_points=s.front_points, budgets=s.budgets,
        )


class ConfigPublic(BaseModel):
    """Every `PNMixConfig` field; `PNMixConfig.from_dict(...)` accepts it as is."""

    b_high: int
    b_low: int
    group_size: int
    salient_ratio: float
    n_sink: int
    residual_len: int
    value_bits: int
    value_group_size: int
    criterion: str
    seed: int


class PointPublic(BaseModel):
    id: int
    campaign_id: int
    budget: float
    trial_number: int
    config: ConfigPublic
    accuracy: float
    accuracy_se: float | None = Field(default=None, description="standard error of accuracy; null where the point "
                                      "was stored without one")
    accuracy_parts: dict[str, float]
    key_bits: float = Field(description="pnmix.bits.key_bits(config, head_dim).total at T_q = 32768")
    kv_bytes: int = Field(description="measured KV-cache bytes on the campaign's workload")
    throughput: float = Field(description="measured decode tokens/s on the campaign's workload")
    backend: str
    device: str
    versions: dict[str, str]
    created_at: datetime

    @classmethod
    def of(cls, p: FrontPoint) -> PointPublic:
        return cls(
            id=p.id, campaign_id=p.campaign_id, budget=p.budget, trial_number=p.trial_number,
            config=ConfigPublic(**p.config.to_dict()), accuracy=p.accuracy,
            accuracy_se=p.accuracy_se if p.accuracy_se is not None and _finite(p.accuracy_se) else None,
            accuracy_parts={k: float(v) for k, v in p.accuracy_parts.items() if _finite(v)},
            key_bits=p.key_bits, kv_bytes=p.kv_bytes, throughput=p.throughput, backend=p.backend, device=p.device,
            versions={str(k): str(v) for k, v in p.versions.items()}, created_at=p.created_at,
        )


class Recommendation(BaseModel):
    model: str
    target_bits: float
    optimize: Optimize
    min_accuracy: float
    point: PointPublic
    pnmix_config: str = Field(description="the PNMixConfig as JSON (PNMixConfig.from_json reads it)")
    ties: list[PointPublic] = Field(
        default_factory=list,
        description="optimize=accuracy: the points statistically tied with the most accurate one (accuracy "
                    "within 2 standard errors of the difference), one per config, by fewest key bits, then "
                    "highest throughput; `point` is the first. Empty for the other objectives")


class Page(BaseModel):
    total: int
    limit: int
    offset: int


class ModelPage(Page):
    items: list[ModelPublic]


class PointPage(Page):
    model: str
    items: list[PointPublic]


class CampaignPublic(BaseModel):
    id: int
    model: str
    method: str
    budgets: list[float]
    n_trials: int
    profile: str
    objectives: list[str]
    backend: str
    search_space: dict[str, Any] | None
    status: Status
    trials_done: int
    trials_total: int
    progress: float = Field(description="trials_done / trials_total, 0 when there is no total yet")
    study_names: dict[str, str]
    message: str | None
    worker_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None

    @classmethod
    def of(cls, c: Campaign) -> CampaignPublic:
        return cls(
            id=c.id, model=c.model.name, method=c.method, budgets=[float(b) for b in c.budgets], n_trials=c.n_trials,
            profile=c.profile, objectives=list(c.objectives), backend=c.backend, search_space=c.search_space,
            status=c.status,  # type: ignore[arg-type]
            trials_done=c.trials_done, trials_total=c.trials_total,
            progress=c.trials_done / c.trials_total if c.trials_total else 0.0,
            study_names={str(k): str(v) for k, v in c.study_names.items()}, message=c.message,
            worker_id=c.worker_id, created_at=c.created_at, started_at=c.started_at, finished_at=c.finished_at,
            heartbeat_at=c.heartbeat_at,
        )


class CampaignPage(Page):
    items: list[CampaignPublic]


class CampaignCreate(BaseModel):
    """A campaign to enqueue; a `pnmix worker` picks it up.

    Strict types: `true` is no budget and `"30"` no trial count (a worker would run what lax
    conversion made of them); a key given twice is refused by the route (api/deps.py).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=255, description="a stored model or a registry name (not a "
                       "random-weight shape model: a campaign scores accuracy)")
    budgets: list[Budget] = Field(min_length=1, max_length=16, json_schema_extra={"uniqueItems": True})
    n_trials: WholeNumber = Field(default=30, ge=TRIALS.low, le=TRIALS.high,
                          description="trials per budget (the default is `pnmix tune`'s)")
    method: Literal[METHODS] = "pnmix"  # type: ignore[valid-type]
    profile: Literal[tuple(PROFILES)] = "quick"  # type: ignore[valid-type]
    objectives: list[Literal[tuple(OBJECTIVES)]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(REQUIRED_OBJECTIVES), min_length=2, max_length=len(OBJECTIVES),
        description=f"distinct names; must include {' and '.join(REQUIRED_OBJECTIVES)}",
        json_schema_extra={
            "uniqueItems": True,
            "allOf": [{"contains": {"const": name}} for name in REQUIRED_OBJECTIVES],
        },
    )
    backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]

    # The schema above documents the rules; the checks themselves are the storage's (an
    # InvalidValueError is a ValueError, so pydantic answers it as a 422).
    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[float]) -> list[float]:
        check_budgets(v)
        return v

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, v: list[str]) -> list[str]:
        return check_objectives(v)


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
