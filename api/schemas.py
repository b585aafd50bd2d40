"""Request and response bodies (pydantic v2), in families: `...Public` out, `...Create` in."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    field_validator,
    model_validator,
)

from pnmix.inputs import BUDGET
from pnmix.models import SHAPE_MODELS
from pnmix.names import BACKENDS
from pnmix.recipes import ENGINES
from pnmix.storage.orm import CAMPAIGN_STATUSES, Campaign, FrontPoint
from pnmix.storage.read import OPTIMIZE, ModelSummary
from pnmix.storage.vocabulary import BUDGET_ON, DEFAULT_METHOD, LAYER_GROUPS, METHODS, TRIALS
from pnmix.storage.write import OBJECTIVES, REQUIRED_OBJECTIVES, check_budgets, check_objectives
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.holdout import DEFAULT_SHARE, HOLDOUT
from pnmix.tuner.scoring.parts import ENTRY_PATTERN, check_entries
from pnmix.tuner.scoring.profiles import PROFILES
from pnmix.tuner.search.space import DEFAULT_LAYER_GROUPS, SearchSpace

# The ranges are pnmix.inputs' and storage.vocabulary's, the command line's too: `pnmix recommend --bits`
# takes what `target_bits` takes.
Budget = Annotated[float, Field(**BUDGET.constraints(), description="bits per element")]
BitsOf = Literal[BUDGET_ON]  # type: ignore[valid-type]


def _whole(v: Any) -> Any:
    """A JSON number with no fractional part (`30.0`) is an integer to JSON Schema, so to us;
    `true` and `"30"` stay what they are and the strict check refuses them."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


WholeNumber = Annotated[int, BeforeValidator(_whole)]
# What a request may name: the bit objective is always called key_bits there (under budget_on=kv it
# stands for the KV bits, which the stored campaign then names kv_bits).
REQUESTED_OBJECTIVES = tuple(o for o in OBJECTIVES if o != "kv_bits")
Status = Literal[CAMPAIGN_STATUSES]  # type: ignore[valid-type]
Optimize = Literal[OPTIMIZE]  # type: ignore[valid-type]
Engine = Literal[ENGINES]  # type: ignore[valid-type]


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
    layer_kinds: list[str] | None = Field(
        default=None, description="each layer's kind (full_attention, sliding_attention); null: every layer full "
        "attention. A model with sliding-window layers has budgets weighted by the elements each layer holds")
    sliding_window: int | None = Field(default=None, description="the sliding layers' window; null: none")
    front_points: int = Field(description="stored Pareto points over all campaigns")
    budgets: list[float] = Field(description="budgets that have points, largest first")

    @classmethod
    def of(cls, s: ModelSummary) -> ModelPublic:
        m = s.model
        return cls(
            name=m.name, family=m.family, source=m.source, location=m.location, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            layer_kinds=m.layer_kinds, sliding_window=m.sliding_window,
            front_points=s.front_points, budgets=s.budgets,
        )


class ConfigPublic(BaseModel):
    """Every `PNMixConfig` field; `PNMixConfig.from_dict(...)` accepts it as is. Of a layer-wise
    config, the default (the point's `layers` holds its ranges)."""

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


class PaperHoldout(BaseModel):
    accuracy: float
    accuracy_se: float | None
    diff: float = Field(description="the point minus pnmix-paper on the held-out units, paired unit by unit")
    diff_se: float | None


class HoldoutPublic(BaseModel):
    """A point's score on its campaign's held-out units: items and documents no trial saw."""

    accuracy: float
    accuracy_se: float | None
    units: dict[str, int] = Field(description="held-out units per part")
    minus_in_search: float = Field(description="held-out minus in-search accuracy (disjoint units)")
    minus_in_search_se: float | None = Field(description="its standard error, sqrt(se_held^2 + se_search^2)")
    holds: bool | None = Field(description="false when the held-out score falls more than 2 SE below the in-search "
                               "one; null when the gap has no SE (a part with one held-out unit)")
    pnmix_paper: PaperHoldout | None = Field(description="pnmix-paper on the same held-out units, where it fits "
                                             "the budget")


class PointPublic(BaseModel):
    id: int
    campaign_id: int
    budget: float
    trial_number: int
    config: ConfigPublic | None = Field(description="the PN-Mix config (of a layer-wise one, the default); null "
                                        "for an engine recipe")
    layers: dict[str, dict[str, int | float | str]] | None = Field(
        default=None, description='a layer-wise config\'s ranges over `config`, {"A-B": {field: value}} '
        '(LayerwiseConfig JSON "layers"); null: every layer has `config`')
    windows: list[int] | None = Field(
        default=None, description="the sliding-window layers whose windows the config quantizes, each under its "
        "layer's config (LayerwiseConfig JSON \"windows\"); null: every window in the model's dtype")
    recipe: list[list[str]] | None = Field(
        default=None, description="the engine method's answer: each layer's [key format, value format] among bf16, "
        "fp8, nvfp4, q8_0, q4_0 (pnmix.recipes.EngineRecipe); null for a PN-Mix config")
    accuracy: float
    accuracy_se: float | None = Field(default=None, description="standard error of accuracy; null where the point "
                                      "was stored without one")
    accuracy_parts: dict[str, float]
    key_bits: float = Field(description="key bits per element, the layers' mean (pnmix.bits.mean_key_bits, "
                            "T_q = 32768); on a model with sliding-window layers weighted by the elements each "
                            "layer holds, a window at 16 bits unless `windows` quantizes it "
                            "(pnmix.bits.weighted_key_bits)")
    kv_bits: float = Field(description="key and value bits per cached element (pnmix.bits.kv_bits; weighted "
                           "likewise, pnmix.bits.weighted_kv_bits)")
    budget_on: BitsOf = Field(description="the figure the campaign's budget constrained: key or kv bits")
    kv_bytes: int = Field(description="measured KV-cache bytes on the campaign's workload")
    throughput: float = Field(description="measured decode tokens/s on the campaign's workload")
    backend: str
    device: str
    versions: dict[str, str]
    holdout: HoldoutPublic | None = Field(default=None, description="the score on the campaign's held-out units, "
                                          "for the point a finished campaign recommends at one of its budgets; "
                                          "null: not scored there")
    created_at: datetime

    @classmethod
    def of(cls, p: FrontPoint) -> PointPublic:
        return cls(
            id=p.id, campaign_id=p.campaign_id, budget=p.budget, trial_number=p.trial_number,
            config=None if p.recipe is not None else ConfigPublic(**_default(p.config).to_dict()),
            layers=p.layers or None, windows=p.windows or None,
            recipe=p.recipe["layers"] if p.recipe is not None else None, accuracy=p.accuracy,
            accuracy_se=p.accuracy_se if p.accuracy_se is not None and _finite(p.accuracy_se) else None,
            accuracy_parts={k: float(v) for k, v in p.accuracy_parts.items() if _finite(v)},
            key_bits=p.key_bits, kv_bits=p.kv_bits, budget_on=p.budget_on,  # type: ignore[arg-type]
            kv_bytes=p.kv_bytes, throughput=p.throughput, backend=p.backend, device=p.device,
            versions={str(k): str(v) for k, v in p.versions.items()}, created_at=p.created_at,
            holdout=HoldoutPublic.model_validate(p.holdout_summary()) if p.holdout_accuracy is not None else None,
        )


class Recommendation(BaseModel):
    model: str
    target_bits: float
    bits_of: BitsOf = Field(description="the figure target_bits bounds: key bits or KV bits")
    optimize: Optimize
    min_accuracy: float
    point: PointPublic
    pnmix_config: str = Field(description="the config as JSON, a PNMixConfig or a layer-wise one "
                              "(pnmix.layerwise.load_config reads either), or an engine recipe")
    format: Engine | None = Field(default=None, description="the engine asked for: only recipes it loads as they are")
    engine_config: str | None = Field(default=None, description="with `format`: the recommendation as that engine "
                                      "loads it (vLLM's flags, Model-Optimizer's JSON, TensorRT-LLM's dtype string, "
                                      "SGLang's flags, ik_llama.cpp's flags)")
    ties: list[PointPublic] = Field(
        default_factory=list,
        description="optimize=accuracy: the points statistically tied with the most accurate one (accuracy "
                    "within 2 standard errors of the difference), one per config, by fewest bits, then "
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
    budget_on: BitsOf
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
            profile=c.profile, objectives=list(c.objectives), backend=c.backend,
            budget_on=c.budget_on,  # type: ignore[arg-type]
            search_space=c.search_space,
            status=c.status,  # type: ignore[arg-type]
            trials_done=c.trials_done, trials_total=c.trials_total,
            progress=c.trials_done / c.trials_total if c.trials_total else 0.0,
            study_names={str(k): str(v) for k, v in c.study_names.items()}, message=c.message,
            worker_id=c.worker_id, created_at=c.created_at, started_at=c.started_at, finished_at=c.finished_at,
            heartbeat_at=c.heartbeat_at,
        )


class CampaignPage(Page):
    items: list[CampaignPublic]


SHAPE_NAMES: list[JsonValue] = [*sorted(SHAPE_MODELS)]  # random-weight models: no campaign (CampaignCreate.model)


class CampaignCreate(BaseModel):
    """A campaign to enqueue; a `pnmix worker` picks it up.

    Strict types: `true` is no budget and `"30"` no trial count (a worker would run what lax
    conversion made of them); a key given twice is refused by the route (api/deps.py).
    """

    # search_values needs budget_on=kv: said in the schema too, so that a client generating requests
    # from it never sends a schema-valid body the service refuses.
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"allOf": [
        {"if": {"properties": {"search_values": {"const": True}}, "required": ["search_values"]},
         "then": {"properties": {"budget_on": {"const": "kv"}}, "required": ["budget_on"]}},
        # the engine method's budgets are effective KV bits, and it sets every layer's values itself
        {"if": {"properties": {"method": {"const": "engine"}}, "required": ["method"]},
         "then": {"properties": {"budget_on": {"const": "kv"}, "search_values": {"const": False}},
                  "required": ["budget_on"]}}]})

    # The shape models are excluded in the schema too, so that a client generating requests from it
    # never sends a schema-valid body the service refuses (422).
    model: str = Field(min_length=1, max_length=255, description="a stored model or a registry name (not a "
                       "random-weight shape model: a campaign scores accuracy)",
                       json_schema_extra={"not": {"enum": SHAPE_NAMES}})
    budgets: list[Budget] = Field(min_length=1, max_length=16, json_schema_extra={"uniqueItems": True},
                                  description="bit budgets, on the figure `budget_on` names")
    n_trials: WholeNumber = Field(default=30, ge=TRIALS.low, le=TRIALS.high,
                          description="trials per budget (the default is `pnmix tune`'s)")
    method: Literal[METHODS] = Field(  # type: ignore[valid-type]
        default=DEFAULT_METHOD, description="pnmix-alloc (default): each layer's bits from the allocator, local "
        "moves scored by real accuracy; pnmix, kivi, kitty: uniform configs of each method's knobs; "
        "pnmix-layers: sampled layer groups; engine: serving engines' per-layer KV formats (budget_on=kv)")
    profile: Literal[tuple(PROFILES)] = "quick"  # type: ignore[valid-type]
    objectives: list[Literal[REQUESTED_OBJECTIVES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(REQUIRED_OBJECTIVES), min_length=2, max_length=len(REQUESTED_OBJECTIVES),
        description=f"distinct names; must include {' and '.join(REQUIRED_OBJECTIVES)} (under budget_on=kv, "
                    "key_bits stands for the KV bits)",
        json_schema_extra={
            "uniqueItems": True,
            "allOf": [{"contains": {"const": name}} for name in REQUIRED_OBJECTIVES],
        },
    )
    backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]
    budget_on: BitsOf = Field(default="key", description="what the budgets constrain: key bits, or key and "
                              "value bits together per cached element (kv)")
    layer_groups: WholeNumber = Field(default=DEFAULT_LAYER_GROUPS, ge=LAYER_GROUPS.low, le=LAYER_GROUPS.high,
                                      description="method pnmix-layers: groups of layers, each with its own "
                                                  "b_high, b_low and r, formed by layer sensitivity")
    search_values: bool = Field(default=False, description="search value bits and value group size too (needs "
                                "budget_on=kv: under a key budget values cost nothing); method pnmix-alloc: "
                                "each layer's own")
    tasks: list[Annotated[str, StringConstraints(pattern=ENTRY_PATTERN, max_length=4096)]] | None = Field(
        default=None, min_length=1, max_length=8, description=(
        "the campaign's tasks (default: passkey, kv_lookup, fidelity): those names, lm_eval:TASK[@LIMIT], "
        "items:PATH (a JSONL items file) or texts:PATH[@PREFIX+TOKENS] (a texts file). A file is a path on the "
        "service's machine, checked now (404 when it is not there, 422 when it is not a file of its kind); the "
        "worker reads it again and must see it at the same path"))
    holdout: float = Field(default=DEFAULT_SHARE, ge=HOLDOUT.low, le=HOLDOUT.high, description=(
        "share of every task's items and documents held back from the search; each budget's pick is scored on "
        "them when the campaign finishes (0: none)"))

    # The schema above documents the rules; the checks themselves are the storage's (an
    # InvalidValueError is a ValueError, so pydantic answers it as a 422).
    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[float]) -> list[float]:
        check_budgets(v)
        return v

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            try:
                check_entries(v, files=False)  # the files: by the route (a missing one is a 404)
            except EvalError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, v: list[str]) -> list[str]:
        return check_objectives(v)  # under budget_on=kv the storage puts kv_bits in key_bits' place

    @model_validator(mode="after")
    def _space(self) -> CampaignCreate:
        try:
            self.space()
        except EvalError as exc:  # e.g. search_values under a key budget
            raise ValueError(str(exc)) from None
        check_objectives(self.objectives, self.budget_on)
        return self

    def space(self) -> SearchSpace:
        """The search space this request asks for (its checks are the tuner's: EvalError, one line)."""
        return SearchSpace(method=self.method, budget_on=self.budget_on, search_values=self.search_values,
                           layer_groups=self.layer_groups)


def _default(config: Any) -> Any:
    """A layer-wise config's default, a single config itself."""
    return getattr(config, "default", config)


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
