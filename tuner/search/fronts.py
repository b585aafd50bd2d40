"""Pareto fronts of a study: which trials are on it, their stored form, and the area they dominate.

A budget's front is the study's feasible, fully evaluated, non-dominated trials (Optuna's
`best_trials` honour constraints). Engine recipes (the engine method) are compared only with the
recipes the same engines load as they are (`families`): the front is the union of each family's
front, so that the best recipe of every engine is stored, and `recommend --format vllm` finds
vLLM's best two-level recipe even where a recipe vLLM cannot load is more accurate.
`front_points` maps them to the storage's `FrontPointIn`, which `tuner.search.campaign` writes
after every finished trial. `tuner.search.sweep` and the benchmarks use the same
maths on the ground truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna

from pnmix.layerwise import config_key
from pnmix.tuner.search import record


def pareto_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """`study.best_trials` in trial order, read without copying every trial (the scores carry
    per-unit outcomes, so a deep copy per front write would dominate a long campaign): COMPLETE
    trials, only the feasible ones when the study has constraints, none dominated by another."""
    import numpy as np

    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if any(t.constraints for t in trials):
        trials = [t for t in trials if all(c <= 0.0 for c in t.constraints.values())]
    if not trials:
        return []
    sign = np.array([-1.0 if d == optuna.study.StudyDirection.MAXIMIZE else 1.0 for d in study.directions])
    out = []
    for group in families(trials).values():
        loss = np.array([t.values for t in group], dtype=float) * sign  # lower is better in every column
        no_worse = (loss[:, None, :] <= loss[None, :, :]).all(axis=2)  # [j, i]: j is nowhere worse than i
        better = (loss[:, None, :] < loss[None, :, :]).any(axis=2)
        dominated = (no_worse & better).any(axis=0)
        out += [t for t, d in zip(group, dominated, strict=True) if not d]
    return sorted(out, key=lambda t: t.number)


def families(trials: Sequence[optuna.trial.FrozenTrial]) -> dict[Any, list[optuna.trial.FrozenTrial]]:
    """The trials by the engines that load their config as it is (`pnmix.recipes.expresses`): every
    PN-Mix config in one family, engine recipes in one per set of engines."""
    from pnmix.configs import is_recipe_dict
    from pnmix.recipes import ENGINES, EngineRecipe, expresses

    out: dict[Any, list[optuna.trial.FrozenTrial]] = {}
    for t in trials:
        data = record.read(t).config_dict
        key = None
        if is_recipe_dict(data):
            recipe = EngineRecipe.from_dict(data)
            key = tuple(expresses(recipe, engine) for engine in ENGINES)
        out.setdefault(key, []).append(t)
    return out


def front_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible, fully evaluated Pareto-optimal trials.

    A trial that reused the score of an identical earlier config is left out: the earlier one stands.
    Two workers may also have scored one config side by side: its first trial stands.
    """
    front, seen = [], set()
    for t in pareto_trials(study):
        r = record.read(t)
        key = config_key(r.config_dict) if r.config_dict is not None else "null"
        if r.stands_for_its_config and key not in seen:
            seen.add(key)
            front.append(t)
    return front


def front_points(study: optuna.Study) -> list[Any]:
    """The study's front as the storage's `FrontPointIn` rows."""
    from pnmix.storage import FrontPointIn
    from pnmix.tuner.scoring.stats import unit_influence

    points = []
    for r in map(record.read, front_trials(study)):
        # Front trials are scored: every field of a full evaluation is there.
        assert r.config is not None and r.accuracy is not None and r.kv_bytes is not None
        assert r.throughput is not None and r.parts is not None and r.versions is not None
        points.append(FrontPointIn(
            config=r.config, accuracy=float(r.accuracy), kv_bytes=int(r.kv_bytes), throughput=float(r.throughput),
            trial_number=r.number, backend=str(r.backend), device=str(r.device), accuracy_parts=dict(r.parts),
            versions=dict(r.versions), accuracy_se=r.accuracy_se,
            unit_influence=unit_influence(r.units) if r.units else None))
    return points


def hypervolume_2d(points: Sequence[tuple[float, float]], budget: float) -> float:
    """Area dominated by (accuracy up, key bits down) points, reference (accuracy 0, bits = budget)."""
    pts = sorted((b, a) for a, b in points if b <= budget and a > 0)
    area, best = 0.0, 0.0
    # Sweep from the budget down: each point adds (accuracy gain) x (bits it undercuts the budget by).
    for bits, acc in pts:
        if acc > best:
            area += (acc - best) * (budget - bits)
            best = acc
    return area
