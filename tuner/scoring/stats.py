"""Scores as measurements: each part's standard error, the combined one, and paired differences.

Every part of a score is a mean over units that every config sees alike, so each part is kept as
its per-unit outcomes and everything below is computed from them:
- item tasks (passkey, kv_lookup, items, lm_eval): a unit is an item, its outcome 1 (answered) or
  0. The part is the share answered; its standard error is the binomial one, sd / sqrt(n), with the
  sample standard deviation of the 0/1 outcomes.
- texts: a unit is a document, its outcome the document's top-1 agreement with the unquantized
  model; the part is the mean over documents, its standard error sd / sqrt(n) over documents.
- fidelity: a unit is a trajectory (the tokens of one trajectory are strongly correlated, so
  tokens or blocks of one trajectory would understate the error), its outcome the trajectory's
  mean KL(p_fp16 || p_quant). The part is exp(-mean KL); its standard error follows by the delta
  method, exp(-mean KL) * sd(KL) / sqrt(n). Trajectories are equally long, so the mean of their
  means is the mean over all tokens.
- the combined accuracy, sum_i w_i p_i / W over the parts that ran: the parts use disjoint units,
  so SE = sqrt(sum_i (w_i / W)^2 SE_i^2).
- a paired difference of two configs scored on the same units: the standard error of the mean
  per-unit difference (fidelity linearised as above), combined over parts with the same weights.
  Pairing removes the spread of item difficulty, so it resolves differences that two unpaired
  standard errors would not.
A standard error needs two units; with one it is None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pnmix.tuner.scoring.parts import WEIGHTS


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _sem(xs: Sequence[float]) -> float | None:
    """Standard error of the mean of xs (sample standard deviation), None below two values."""
    n = len(xs)
    if n < 2:
        return None
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def part_score(name: str, units: Sequence[float]) -> float:
    """A part's score from its per-unit outcomes (share correct; fidelity exp(-mean KL))."""
    if not units:
        raise ValueError(f"part {name} has no units")
    return math.exp(-_mean(units)) if name == "fidelity" else _mean(units)


def influence(name: str, units: Sequence[float]) -> list[float]:
    """Per-unit values whose mean is the part's score, to first order (what SEs are computed from).

    Item parts: the outcomes themselves. Fidelity: s * (1 - (KL_j - mean KL)), s = exp(-mean KL).
    """
    if name != "fidelity":
        return [float(u) for u in units]
    s, m = part_score(name, units), _mean(units)
    return [s * (1.0 - (u - m)) for u in units]


def unit_influence(units: Mapping[str, Sequence[float]]) -> dict[str, dict[str, object]]:
    """What a stored point keeps to be compared paired (storage.read.paired_se): each part's weight
    and its per-unit influence values; `paired` on two configs' units gives the same SE."""
    return {name: {"weight": WEIGHTS[name], "values": influence(name, u)} for name, u in units.items() if u}


def combine(parts: Mapping[str, float]) -> float:
    """The combined accuracy: weighted mean of the parts that ran (weights in tuner/scoring/parts.py)."""
    total = sum(WEIGHTS[name] for name in parts)
    return sum(WEIGHTS[name] * value for name, value in parts.items()) / total


def part_se(name: str, units: Sequence[float]) -> float | None:
    return _sem(influence(name, units))


def _combine_se(ses: Mapping[str, float | None]) -> float | None:
    if not ses or any(se is None for se in ses.values()):
        return None
    total = sum(WEIGHTS[name] for name in ses)
    return math.sqrt(sum((WEIGHTS[name] / total * se) ** 2 for name, se in ses.items() if se is not None))


def combined_se(units: Mapping[str, Sequence[float]]) -> float | None:
    """Standard error of the combined accuracy from every part's units."""
    return _combine_se({name: part_se(name, u) for name, u in units.items()})


def paired(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float | None]]:
    """{part or "accuracy": (score_a - score_b, its standard error)} over the parts both ran.

    a and b are per-unit outcomes of two configs on the same units (same items, same trajectories).
    """
    out: dict[str, tuple[float, float | None]] = {}
    ses: dict[str, float | None] = {}
    for name in a:
        if name not in b:
            continue
        if len(a[name]) != len(b[name]):
            raise ValueError(f"part {name}: {len(a[name])} vs {len(b[name])} units, not the same items")
        diff = part_score(name, a[name]) - part_score(name, b[name])
        se = _sem([x - y for x, y in zip(influence(name, a[name]), influence(name, b[name]), strict=True)])
        out[name] = (diff, se)
        ses[name] = se
    if out:
        total = sum(WEIGHTS[name] for name in out)
        acc = sum(WEIGHTS[name] * diff for name, (diff, _) in out.items()) / total
        out["accuracy"] = (acc, _combine_se(ses))
    return out
