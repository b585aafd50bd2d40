"""How the tuner's commands print scores: numbers with their standard errors, paired differences,
stored fronts, held-out scores, ties and the comparison with pnmix-paper."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from pnmix.bits import LayerPlan
from pnmix.cli import (
    console,
)
from pnmix.storage.vocabulary import TIE_Z, BudgetOn


def num(value: float, fmt: str) -> str:
    """A number, or n/a where it does not apply (NaN: a peer's key bits or proxy KL)."""
    return "n/a" if value != value else format(value, fmt)


def pm(value: float, se: float | None) -> str:
    return f"{value:.3f} +- {se:.3f}" if se is not None else f"{value:.3f}"


def budget_words(budget: float, budget_on: str = BudgetOn.KEY, plan: LayerPlan | None = None) -> str:
    """A budget as its figure and unit; on a hybrid model, with the mean bits it leaves the
    full-attention layers (the weighted figure counts the windows' tokens at 16 bits)."""
    words = f"{budget:g} {budget_on} bits"
    if plan is None or not plan.hybrid:
        return words
    return f"{words} ({plan.full_layer_budget(budget, n_sink=32):.2f} on the full-attention layers)"


def budget_list(budgets: Sequence[float], budget_on: str = BudgetOn.KEY, plan: LayerPlan | None = None) -> str:
    return "; ".join(budget_words(b, budget_on, plan) for b in budgets)


def signed(value: float, se: float | None) -> str:
    if se is None:
        return f"{value:+.3f}"
    mark = "*" if abs(value) > TIE_Z * se else ""
    return f"{value:+.3f} +- {se:.3f}{mark}"


def print_fronts(db: Any, model: str, campaign_id: int | None = None) -> None:
    from pnmix.storage import list_front_points

    with db.session(readonly=True) as s:
        points = list_front_points(s, model, campaign_id=campaign_id, limit=500).items
        table = Table(title=f"Pareto fronts of {model}" + (f", campaign {campaign_id}" if campaign_id else ""))
        for col in ("campaign", "budget", "trial", "config", "key bits", "KV bits", "accuracy", "parts",
                    "KV KiB", "tok/s", "backend"):
            table.add_column(col, justify="right")
        for p in sorted(points, key=lambda p: (p.campaign_id, p.budget, p.bits(p.budget_on))):
            parts = " ".join(f"{k}={v:.2f}" for k, v in (p.accuracy_parts or {}).items())
            budget = f"{p.budget:g}" + (" (kv)" if p.budget_on == BudgetOn.KV else "")
            table.add_row(str(p.campaign_id), budget, str(p.trial_number), p.config.label, f"{p.key_bits:.3f}",
                          f"{p.kv_bits:.3f}", f"{p.accuracy:.3f}", parts, f"{p.kv_bytes / 1024:.0f}",
                          f"{p.throughput:.1f}", p.backend)
    console.print(table if points else f"no front points stored for {model}")


def print_holdout(db: Any, model: str, campaign_id: int, budgets: Sequence[float], bits_of: str) -> None:
    """Each budget's recommendation in the campaign and its held-out score (`holdout_line`)."""
    from pnmix.storage import recommend
    from pnmix.storage.errors import NoFeasiblePointError

    with db.session(readonly=True) as s:
        for budget in sorted(budgets):
            try:
                p = recommend(s, model, budget, campaign_id=campaign_id, bits_of=bits_of)
            except NoFeasiblePointError:
                continue
            console.print(f"at <= {budget:g} {bits_of} bits: {p.config.label} ({p.bits(bits_of):.3f} bits, in-search "
                          f"accuracy {pm(p.accuracy, p.accuracy_se)}); {holdout_line(p)}")


def holdout_line(p: Any) -> str:
    """One sentence on a point's held-out score, its gap to the in-search score and pnmix-paper's."""
    held = p.holdout_summary()
    if held is None:
        return ("held-out: not scored (the campaign held nothing back, had not finished, or did not recommend "
                "this point for one of its budgets)")
    units = ", ".join(f"{n} {part}" for part, n in held["units"].items())
    text = (f"held-out ({units}): accuracy {pm(held['accuracy'], held['accuracy_se'])}, minus the in-search "
            f"score {signed(held['minus_in_search'], held['minus_in_search_se'])}")
    text += {True: ": holds (not more than 2 SE below)",
             False: ": FALLS more than 2 SE below the in-search score; the pick may not hold on unseen data",
             None: ": no standard error (a part has one held-out unit: a share too small for it), no verdict",
             }[held["holds"]]
    paper = held["pnmix_paper"]
    if paper:
        text += f"; minus pnmix-paper on the held-out units, paired: {signed(paper['diff'], paper['diff_se'])}"
    return text


def print_ties(rec: Any) -> None:
    """The points tied with a recommendation (a `storage.Recommendation`), each with the SE its tie
    with the most accurate point was judged by."""
    others = rec.others
    if not others:
        return
    console.print(f"tied with it (accuracy within 2 SE of the most accurate; chosen: fewest bits, then "
                  f"throughput): {len(others)} more")
    for q in others:
        se = rec.tie_se.get(q.id)
        how = "paired" if rec.paired.get(q.id) else "unpaired"
        judged = "" if se is None else f"; SE of the difference {se:.3f}, {how}"
        console.print(f"  {q.config.label}: {q.bits(rec.bits_of):.3f} bits, accuracy {pm(q.accuracy, q.accuracy_se)}"
                      f"{judged}")


def against_paper(study: Any, trial_number: int, space: Any, elsewhere: Sequence[Any] = ()) -> str:
    """A point's accuracy (trial `trial_number` of `study`) minus pnmix-paper's, paired on the same
    items, as the end of a sentence about the point. pnmix-paper's score comes from `study` or else
    from one of `elsewhere`, the campaign's other budgets (one campaign scores every budget on the
    same items)."""
    from pnmix.config import preset
    from pnmix.tuner.scoring.stats import paired
    from pnmix.tuner.search import record

    paper = space.recast(preset("pnmix-paper")).to_dict()
    mine = next((record.read(t) for t in study.get_trials(deepcopy=False) if t.number == trial_number), None)
    theirs = None
    for other in (study, *elsewhere):
        theirs = next((r for r in map(record.read, other.get_trials(deepcopy=False))
                       if r.config_dict == paper and r.units), None)
        if theirs is not None:
            break
    if mine is None or theirs is None or not mine.units or not theirs.units:
        return "against pnmix-paper: not scored in this campaign, no paired comparison"
    if mine.config_dict == theirs.config_dict:
        return "is pnmix-paper itself"
    diff, se = paired(mine.units, theirs.units)["accuracy"]
    verdict = ("beyond two standard errors" if se and abs(diff) > TIE_Z * se
               else "within two standard errors: not a measured difference")
    return f"minus pnmix-paper, paired on the same items: {signed(diff, se)} ({verdict})"
