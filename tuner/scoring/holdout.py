"""The held-out share of a campaign's units: items and documents that no trial sees.

A search picks the best of many noisy scores, so the pick's in-search score is biased upwards
(the winner's curse). A campaign therefore holds back a seeded share of every part's units
(`DEFAULT_SHARE`; 0 turns it off). Its trials are scored on the rest; when it finishes, each
budget's recommended point and pnmix-paper are scored once on the held-out units
(tuner/search/holdout_score.py).

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

from pnmix.inputs import Range

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
