"""Read helpers: what the service (and `pnmix recommend`) ask of the database."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, joinedload

from pnmix.recipes import ENGINES, expresses
from pnmix.storage.errors import InvalidValueError, NoFeasiblePointError, NotFoundError
from pnmix.storage.orm import CAMPAIGN_STATUSES, Campaign, FrontPoint, Model
from pnmix.storage.vocabulary import BUDGET_ON, TIE_Z, BudgetOn  # TIE_Z: also importable from here
from pnmix.storage.write import BITS_EPS

T = TypeVar("T")
OPTIMIZE = ("accuracy", "throughput", "memory")
# Without an explicit floor, throughput and memory rank only points at least this share of the best
# accuracy within the budget: the fastest or smallest cache overall is the 1-bit one that has lost
# the answers. The accuracy ranking needs no floor.
RELATIVE_FLOOR = 0.9

# What "best" means for each objective; later keys break ties. Memory is the measured KV bytes
# (keys and values, on the campaign's workload), then the formula's key bits. The id comes last,
# so that the answer is the same on every call.
_ORDER: dict[str, tuple[ColumnElement[Any], ...]] = {
    "accuracy": (FrontPoint.accuracy.desc(), FrontPoint.throughput.desc(), FrontPoint.kv_bytes.asc()),
    "throughput": (FrontPoint.throughput.desc(), FrontPoint.kv_bytes.asc(), FrontPoint.accuracy.desc()),
    "memory": (FrontPoint.kv_bytes.asc(), FrontPoint.key_bits.asc(), FrontPoint.throughput.desc(),
               FrontPoint.accuracy.desc()),
}


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


@dataclass(frozen=True)
class ModelSummary:
    model: Model
    front_points: int
    budgets: list[float]


def get_model(session: Session, name: str) -> Model:
    row = session.scalars(select(Model).where(Model.name == name)).one_or_none()
    if row is None:
        raise NotFoundError(f"unknown model {name!r}")
    return row


def list_models(session: Session, limit: int = 50, offset: int = 0) -> Page[ModelSummary]:
    """Models by name, each with its number of front points and the budgets they were tuned at."""
    total = session.scalar(select(func.count()).select_from(Model)) or 0
    models = list(session.scalars(select(Model).order_by(Model.name).limit(limit).offset(offset)))
    return Page([summarize(session, m) for m in models], total, limit, offset)


def summarize(session: Session, model: Model) -> ModelSummary:
    rows = session.execute(
        select(FrontPoint.budget, func.count())
        .where(FrontPoint.model_id == model.id)
        .group_by(FrontPoint.budget)
        .order_by(FrontPoint.budget.desc())
    ).all()
    return ModelSummary(model, sum(int(n) for _, n in rows), [float(b) for b, _ in rows])


def list_front_points(
    session: Session,
    model: str,
    budget: float | None = None,
    campaign_id: int | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> Page[FrontPoint]:
    """A model's front points (optionally of one budget and/or campaign), ordered by campaign,
    budget (descending), then key bits. Raises NotFoundError for an unknown model."""
    model_row = get_model(session, model)
    query = select(FrontPoint).where(FrontPoint.model_id == model_row.id)
    if budget is not None:
        query = query.where(FrontPoint.budget == budget)
    if campaign_id is not None:
        query = query.where(FrontPoint.campaign_id == campaign_id)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    query = query.order_by(
        FrontPoint.campaign_id, FrontPoint.budget.desc(), FrontPoint.key_bits, FrontPoint.trial_number
    ).offset(offset)
    if limit is not None:
        query = query.limit(limit)
    return Page(list(session.scalars(query)), total, limit if limit is not None else total, offset)


def tied_with(best: FrontPoint, point: FrontPoint) -> bool:
    """Whether `point`'s accuracy is statistically indistinguishable from `best`'s: equal, or lower by
    at most TIE_Z standard errors of the difference. Two points of one campaign that keep their
    per-unit outcomes were scored on the same items: the difference is paired (`paired_se`). Else it
    is unpaired, sqrt(se_best^2 + se_point^2), which errs towards calling points tied."""
    if point.accuracy >= best.accuracy:
        return True
    se = paired_se(best, point)
    if se is None:
        if best.accuracy_se is None or point.accuracy_se is None:
            return False
        se = math.hypot(best.accuracy_se, point.accuracy_se)
    return best.accuracy - point.accuracy <= TIE_Z * se


def paired_se(a: FrontPoint, b: FrontPoint) -> float | None:
    """The standard error of a's accuracy minus b's, paired unit by unit, for two points of one
    campaign that both keep their per-unit outcomes (`unit_influence`) on the same parts; else None.
    Per part the SE of the mean per-unit difference, combined with the parts' weights (tuner/scoring/stats.py)."""
    ua, ub = a.unit_influence, b.unit_influence
    if a.campaign_id != b.campaign_id or not ua or not ub or set(ua) != set(ub):
        return None
    total = sum(float(ua[p]["weight"]) for p in ua)
    if total <= 0:
        return None
    var = 0.0
    for part, entry in ua.items():
        xs, ys = entry["values"], ub[part]["values"]
        if len(xs) != len(ys) or len(xs) < 2:
            return None
        diffs = [x - y for x, y in zip(xs, ys, strict=True)]
        mean = sum(diffs) / len(diffs)
        sem2 = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)
        var += (float(entry["weight"]) / total) ** 2 * sem2
    return math.sqrt(var)


def bits_column(bits_of: str) -> Any:
    """The column of the bit figure a recommendation's budget is on: key bits or KV bits."""
    if bits_of not in BUDGET_ON:
        raise InvalidValueError(f"invalid bits_of={bits_of!r}: allowed {', '.join(BUDGET_ON)}")
    return FrontPoint.kv_bits if bits_of == BudgetOn.KV else FrontPoint.key_bits


def applied_floor(session: Session, model: str, target_bits: float, optimize: str = "accuracy",
                  min_accuracy: float | None = None, campaign_id: int | None = None, bits_of: str = "key") -> float:
    """The accuracy floor a recommendation uses: `min_accuracy` when given; else 0 for accuracy and,
    for throughput and memory, RELATIVE_FLOOR times the best accuracy of the points within the budget."""
    bits = bits_column(bits_of)
    if min_accuracy is not None:
        return min_accuracy
    if optimize == "accuracy":
        return 0.0
    conditions = [Model.name == model, bits <= target_bits + BITS_EPS]
    if campaign_id is not None:
        conditions.append(FrontPoint.campaign_id == campaign_id)
    best = session.scalar(select(func.max(FrontPoint.accuracy)).join(Model, FrontPoint.model_id == Model.id)
                          .where(*conditions))
    return 0.0 if best is None else RELATIVE_FLOOR * float(best)


@dataclass(frozen=True)
class Recommendation:
    """What `recommend_with_ties` answers: the point, the points tied with the most accurate one, and
    the rules that chose them, so that the REST route and the command line only render it."""

    point: FrontPoint  # the recommended point
    ties: list[FrontPoint]  # optimize=accuracy: every point tied with `best`, the recommendation first; else []
    best: FrontPoint  # the most accurate point within the budget and floor (ties are judged against it)
    floor: float  # the accuracy floor applied (`applied_floor`)
    tie_se: dict[int, float | None]  # by tied point id: the SE of best's accuracy minus its own (None: equal)
    paired: dict[int, bool]  # by tied point id: whether that SE is paired on the same units (`paired_se`)
    optimize: str
    bits_of: str

    @property
    def others(self) -> list[FrontPoint]:
        """The tied points besides the recommendation."""
        return [p for p in self.ties if p is not self.point]


def recommend(
    session: Session,
    model: str,
    target_bits: float,
    optimize: str = "accuracy",
    min_accuracy: float | None = None,
    campaign_id: int | None = None,
    bits_of: str = "key",
    engine: str | None = None,
) -> FrontPoint:
    """The recommended point: `recommend_with_ties(...).point`."""
    return recommend_with_ties(session, model, target_bits, optimize, min_accuracy, campaign_id, bits_of,
                               engine).point


def recommend_with_ties(
    session: Session,
    model: str,
    target_bits: float,
    optimize: str = "accuracy",
    min_accuracy: float | None = None,
    campaign_id: int | None = None,
    bits_of: str = "key",
    engine: str | None = None,
) -> Recommendation:
    """The recommended stored point of `model` with key bits (`bits_of="key"`) or KV bits (`"kv"`)
    <= `target_bits` and accuracy >= `min_accuracy`, and the points tied with the most accurate one
    (the recommendation among them). Every point carries both figures, so either question is
    answered from every campaign's points, whichever figure their budgets constrained.

    Looks at every front of the model (all campaigns and budgets, or one campaign). `optimize`:
    - "accuracy": the most accurate point and every point statistically tied with it (`tied_with`,
      one per config); among them the one with the fewest bits (of `bits_of`), then the highest measured
      throughput, then the fewest KV bytes. Ties are ordered the same way, the recommendation first.
    - "throughput" (highest decode tokens/s) or "memory" (fewest measured KV bytes): that point,
      no ties. Without `min_accuracy`, only points with at least RELATIVE_FLOOR of the best accuracy
      within the budget count (`applied_floor`).
    `engine` (one of `pnmix.recipes.ENGINES`): only the engine recipes that engine loads as they
    are (`pnmix.recipes.expresses`), e.g. vLLM's one quantized dtype with bf16 skip layers.
    Raises NotFoundError for an unknown model, NoFeasiblePointError (with the smallest bits that
    would fit) when nothing satisfies the constraints.
    """
    if optimize not in OPTIMIZE:
        raise InvalidValueError(f"invalid optimize={optimize!r}: allowed {', '.join(OPTIMIZE)}")
    bits = bits_column(bits_of)
    floor = applied_floor(session, model, target_bits, optimize, min_accuracy, campaign_id, bits_of)
    # On the hot path: one query for the best point (the model joined by name) and, for accuracy,
    # one for the points that may tie with it; the slower queries that explain an empty answer
    # (unknown model, or the smallest bits that would fit) run only when it is empty.
    conditions = [FrontPoint.accuracy >= floor]
    if campaign_id is not None:
        conditions.append(FrontPoint.campaign_id == campaign_id)
    feasible_of_model = (select(FrontPoint).join(Model, FrontPoint.model_id == Model.id)
                         .where(Model.name == model, bits <= target_bits + BITS_EPS, *conditions))
    loaded: list[FrontPoint] | None = None
    if engine is None:
        best = session.scalars(feasible_of_model.order_by(*_ORDER[optimize], FrontPoint.id).limit(1)).first()
    else:
        if engine not in ENGINES:
            raise InvalidValueError(f"invalid engine {engine!r}: allowed {', '.join(ENGINES)}")
        conditions.append(FrontPoint.recipe.is_not(None))
        loaded = [p for p in session.scalars(feasible_of_model.where(FrontPoint.recipe.is_not(None))
                                             .order_by(*_ORDER[optimize], FrontPoint.id))
                  if expresses(p.config, engine)]  # type: ignore[arg-type]
        best = loaded[0] if loaded else None
    if best is not None:
        if optimize != "accuracy":
            return Recommendation(best, [], best, floor, {}, {}, optimize, bits_of)
        if loaded is None:
            if best.accuracy_se is None:  # only equal accuracy ties with it
                feasible_of_model = feasible_of_model.where(FrontPoint.accuracy == best.accuracy)
            loaded = list(session.scalars(feasible_of_model))
        ties = _tie_order(best, loaded, bits_of)
        tie_se = {p.id: _diff_se(best, p) for p in ties}
        paired = {p.id: paired_se(best, p) is not None for p in ties}
        return Recommendation(ties[0], ties, best, floor, tie_se, paired, optimize, bits_of)
    model_row = get_model(session, model)
    feasible = select(bits.label("bits")).where(FrontPoint.model_id == model_row.id, *conditions).subquery()
    smallest = session.scalar(select(func.min(feasible.c.bits)))
    raise NoFeasiblePointError(model, target_bits, floor, None if smallest is None else float(smallest), bits_of)


def _diff_se(best: FrontPoint, point: FrontPoint) -> float | None:
    """The SE `tied_with` judges best minus point by: paired where it can be, else unpaired."""
    if point is best:
        return None
    se = paired_se(best, point)
    if se is None and best.accuracy_se is not None and point.accuracy_se is not None:
        se = math.hypot(best.accuracy_se, point.accuracy_se)
    return se


def _tie_order(best: FrontPoint, points: list[FrontPoint], bits_of: str) -> list[FrontPoint]:
    """The points tied with `best`, one per config, fewest bits first (the recommendation first)."""
    by_config: dict[str, FrontPoint] = {}
    for p in sorted(points, key=lambda p: (-p.accuracy, p.id)):
        if tied_with(best, p):
            by_config.setdefault(p.config.to_json(), p)
    return sorted(by_config.values(), key=lambda p: (p.bits(bits_of), -p.throughput, p.kv_bytes, p.id))


def get_campaign(session: Session, campaign_id: int) -> Campaign:
    row = session.scalars(
        select(Campaign).options(joinedload(Campaign.model, innerjoin=True)).where(Campaign.id == campaign_id)
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"no campaign with id {campaign_id}")
    return row


def list_campaigns(
    session: Session, model: str | None = None, status: str | None = None, limit: int = 50, offset: int = 0
) -> Page[Campaign]:
    """Campaigns, newest first, optionally of one model and/or status."""
    query = select(Campaign)
    if model is not None:
        query = query.join(Campaign.model).where(Model.name == model)
    if status is not None:
        if status not in CAMPAIGN_STATUSES:
            raise InvalidValueError(f"invalid status={status!r}: allowed {', '.join(CAMPAIGN_STATUSES)}")
        query = query.where(Campaign.status == status)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    query = query.options(joinedload(Campaign.model, innerjoin=True)).order_by(Campaign.id.desc())
    return Page(list(session.scalars(query.limit(limit).offset(offset))), total, limit, offset)
