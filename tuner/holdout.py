"""The held-out share of a campaign's units: items and documents that no trial sees.

A search picks the best of many noisy scores, so the pick's in-search score is biased upwards
(the winner's curse). A campaign therefore holds back a seeded share of every part's units
(`DEFAULT_SHARE`; 0 turns it off). Its trials are scored on the rest; when it finishes, each
budget's recommended point and pnmix-paper are scored once on the held-out units, and that score
is stored beside the front point (`score_holdout`, which the campaign runs when it is done).

For the built-in tasks, the profile's counts are what the search sees: the preparation builds
`total_for(count)` units, so that the search keeps the profile's statistics and the held-out
units come on top, at least `MIN_HELD` of every part: a part with one held-out unit has no
standard error, and then neither has the held-out score nor its verdict. For the user's files
(items, texts, lm-eval documents), the units they hold are split (two held out from four units
on). The split depends only on (seed, part, unit count): every worker of a campaign draws the
same one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from pnmix.config import preset
from pnmix.inputs import Range
from pnmix.layerwise import AnyConfig

DEFAULT_SHARE = 0.25
MAX_SHARE = 0.5  # beyond half, the search would see fewer units than it leaves out
HOLDOUT = Range(0.0, MAX_SHARE)  # the shares a campaign may hold back
MIN_HELD = 2  # held-out units of a part, where it has enough: two give a standard error


def held_count(n: int, share: float) -> int:
    """Units held back of n: round(share * n), at least MIN_HELD once a part has twice as many
    units, and at least one on each side once there are two."""
    if share <= 0 or n < 2:
        return 0
    least = MIN_HELD if n >= 2 * MIN_HELD else 1
    return min(n - 1, max(least, math.floor(share * n + 0.5)))


def total_for(search: int, share: float) -> int:
    """Units to prepare so that `search` remain for the search after the held-out share: the fewest
    that hold out at least MIN_HELD, or else as many as can be (a part of one search unit)."""
    # total - held_count(total) grows by at most one a step from `search - 1`: it lands on `search`.
    exact = [t for t in range(search, 2 * search + 2 * MIN_HELD + 1) if t - held_count(t, share) == search]
    return max(exact, key=lambda t: (min(held_count(t, share), MIN_HELD), -t))


def split(n: int, share: float, seed: int, part: str) -> tuple[list[int], list[int]]:
    """(search indices, held-out indices) of a part's n units, both ascending."""
    held = set(random.Random(f"holdout-{seed}-{part}-{n}").sample(range(n), held_count(n, share)))
    return [i for i in range(n) if i not in held], sorted(held)


def score_holdout(db: Any, campaign_id: int, spec: Any, space: Any, evaluator: Any,
                  progress: Callable[[str], None]) -> None:
    """Scores each budget's recommended point (storage.recommend within this campaign, as `pnmix
    recommend --bits BUDGET` answers) and pnmix-paper, where it fits the budget, on the held-out
    units, and stores the result with the point. Runs once, when the campaign is done: points that
    already hold a held-out score are skipped, so a resumed campaign pays nothing. `space` is the
    campaign's space (with its layer groups)."""
    from pnmix.tuner.record import config_key
    from pnmix.tuner.score import Split

    # Evaluators that replay recorded scores (benchmarks, tests) hold nothing out.
    if not getattr(evaluator, "holdout", 0.0) or not evaluator.unit_counts(Split.HOLDOUT):
        return
    paper = space.recast(preset("pnmix-paper"))
    scored: dict[str, Any] = {}  # config key -> held-out Score, shared by budgets that pick the same config

    def held_out(config: AnyConfig) -> Any:
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
                  held_out: Callable[[Any], Any], paper: AnyConfig) -> bool:
    """One budget's held-out score; False when the front changed under it (the caller retries)."""
    from pnmix.storage import HoldoutIn, recommend, set_holdout
    from pnmix.storage.errors import NoFeasiblePointError, NotFoundError
    from pnmix.tuner.stats import paired

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
