"""Racing: stop a candidate as soon as a front point of no more bits beats it with confidence.

A candidate is scored on a growing share of the units (RUNGS: the first 1/8, 1/4, 1/2, then all
of every part's items and trajectories). After each rung it is compared, paired on the same
units, with every fully scored point of no more key bits; it stops (its trial PRUNED, with the
partial score and standard error kept) once one of them is better by more than z standard errors
of the paired difference (`threshold`). Pairing is what makes early rungs decisive: item difficulty cancels.

The threshold guards the whole race, not one comparison: a candidate meets every eligible front
point at every rung, so with m eligible points and k rungs it faces m * k tests, and each uses
z = the (1 - ALPHA / (m * k)) normal quantile (Bonferroni). A config as good as the best of them
is then stopped with probability at most about ALPHA over its whole race; one that a front point
beats by several standard errors still stops at the first rung.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from pnmix.tuner.scoring import stats

RUNGS = (0.125, 0.25, 0.5, 1.0)
ALPHA = 0.05  # chance, over a whole race, of stopping a config as good as the best it meets
MIN_UNITS = 2  # a part keeps at least this many units at any rung (a standard error needs two)

Units = Mapping[str, Sequence[float]]


def rung_sizes(units: Units | Mapping[str, int], share: float) -> dict[str, int]:
    """Units of each part in a rung of `share` (of per-unit outcomes, or of unit counts): the first
    ceil(share * n), at least MIN_UNITS."""
    counts = {name: u if isinstance(u, int) else len(u) for name, u in units.items()}
    return {name: min(n, max(MIN_UNITS, math.ceil(share * n))) for name, n in counts.items()}


def head(units: Units, sizes: Mapping[str, int]) -> dict[str, list[float]]:
    return {name: list(units[name][: sizes[name]]) for name in sizes if name in units}


@dataclass(frozen=True)
class Verdict:
    stop: bool
    share: float  # the rung it was judged at
    accuracy: float  # the candidate's accuracy on that rung's units
    accuracy_se: float | None
    beaten_by: int | None = None  # index of the front point that beat it
    margin: tuple[float, float | None] | None = None  # (that point - candidate, its SE)
    z: float | None = None  # the threshold it was judged with


def threshold(comparisons: int) -> float:
    """z a paired difference must pass when a race makes `comparisons` tests (Bonferroni)."""
    return NormalDist().inv_cdf(1.0 - ALPHA / max(1, comparisons))


def judge(candidate: Units, bits: float, front: Sequence[tuple[float, Units]], share: float) -> Verdict:
    """The verdict on a candidate's units at one rung (candidate holds at least that rung's units).

    front: (key bits, full per-unit outcomes) of the fully scored front points; only those of no
    more bits than the candidate can stop it.
    """
    sizes = rung_sizes(candidate, share)
    mine = head(candidate, sizes)
    acc = stats.combine({name: stats.part_score(name, u) for name, u in mine.items()})
    se = stats.combined_se(mine)
    eligible = [(i, u) for i, (b, u) in enumerate(front) if b <= bits + 1e-9]
    z = threshold(len(eligible) * (len(RUNGS) - 1))  # the last rung is the full score: no test
    for i, f_units in eligible:
        diff, d_se = stats.paired(head(f_units, sizes), mine)["accuracy"]
        if d_se is not None and diff > z * d_se:
            return Verdict(True, share, acc, se, i, (diff, d_se), z)
    return Verdict(False, share, acc, se, z=z)
