"""The held-out verdict of a finished campaign: each budget's pick scored on the units no trial saw.

The split itself (which units are held out) is the scoring wing's (tuner/scoring/holdout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pnmix.config import preset
from pnmix.configs import Answer
from pnmix.layerwise import config_key
from pnmix.storage import HoldoutIn, recommend, set_holdout
from pnmix.storage.errors import NoFeasiblePointError, NotFoundError
from pnmix.tuner.scoring.score import Split
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.scoring.stats import paired


def score_holdout(db: Any, campaign_id: int, spec: Any, space: Any, evaluator: Scorer,
                  progress: Callable[[str], None]) -> None:
    """Scores each budget's recommended point (storage.recommend within this campaign, as `pnmix
    recommend --bits BUDGET` answers) and pnmix-paper, where it fits the budget, on the held-out
    units, and stores the result with the point. Runs once, when the campaign is done: points that
    already hold a held-out score are skipped, so a resumed campaign pays nothing. `space` is the
    campaign's space (with its layer groups)."""
    # Evaluators that replay recorded scores (benchmarks, tests) hold nothing out.
    if not getattr(evaluator, "holdout", 0.0) or not evaluator.unit_counts(Split.HOLDOUT):
        return
    paper = space.recast(preset("pnmix-paper"))
    scored: dict[str, Any] = {}  # config key -> held-out Score, shared by budgets that pick the same config

    def held_out(config: Answer) -> Any:
        key = config_key(config)
        if key not in scored:
            progress(f"held-out units: scoring {config.label}")
            scored[key] = evaluator.evaluate(config, measure=False, which=Split.HOLDOUT)
        return scored[key]

    for budget in sorted(spec.budgets):
        fits = space.cost(paper, evaluator.head_dim) <= budget + 1e-9
        for _ in range(3):  # another worker may replace the front between the read and the write
            if _score_budget(db, campaign_id, spec.model, space.budget_on, budget, fits, held_out, paper):
                break


def _score_budget(db: Any, campaign_id: int, model: str, bits_of: str, budget: float, fits: bool,
                  held_out: Callable[[Any], Any], paper: Answer) -> bool:
    """One budget's held-out score; False when the front changed under it (the caller retries)."""
    with db.session(readonly=True) as s:
        try:
            point = recommend(s, model, budget, campaign_id=campaign_id, bits_of=bits_of)
        except NoFeasiblePointError:
            return True
        where = (point.budget, point.trial_number)
        # Scored already under a lower budget: again only to add pnmix-paper, which fits this one.
        config, done = point.config, point.holdout_accuracy is not None and (
            not fits or bool((point.holdout or {}).get("paper")))
    if done:
        return True
    mine = held_out(config)
    against = None
    if fits:
        theirs = held_out(paper)
        diff, diff_se = paired(mine.units, theirs.units)["accuracy"]
        against = {"accuracy": theirs.accuracy, "accuracy_se": theirs.accuracy_se, "diff": diff, "diff_se": diff_se}
    try:
        with db.session() as s:
            set_holdout(s, campaign_id, *where, HoldoutIn(mine.accuracy, mine.accuracy_se, dict(mine.items), against))
        return True
    except NotFoundError:
        return False
