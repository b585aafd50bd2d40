"""Pareto plot of a campaign: accuracy vs the budget's bits (key or KV), one panel per budget.

Read at a glance: each budget has its own panel (on a shared accuracy axis), so budgets whose
fronts share points stay apart; the front is drawn as steps (the best accuracy found at or under
each number of bits), never as a line across bits where nothing was scored; points that would
overlap (within `NEAR_BITS` and `NEAR_ACCURACY`) are drawn once, with their count beside them; each
preset's name is written once a panel; the recommendation is a star."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig, preset
from pnmix.layerwise import LayerwiseConfig
from pnmix.storage.vocabulary import BudgetOn
from pnmix.tuner.commands.render import budget_words

NEAR_BITS = 0.02  # points closer than this in bits and NEAR_ACCURACY in accuracy are drawn as one
NEAR_ACCURACY = 0.01
MARKS = ("pnmix-paper", "kivi2", "kivi1")  # presets named where a panel has them


@dataclass
class Spot:
    """One drawn marker: the points it stands for (their first is the one drawn)."""

    bits: float
    accuracy: float
    accuracy_se: float
    layered: bool
    on_front: bool
    names: list[str] = field(default_factory=list)  # presets among its points
    trials: list[int] = field(default_factory=list)  # the trial numbers it stands for

    @property
    def count(self) -> int:
        return len(self.trials)


def spots(records: Sequence[Any], front: set[int]) -> list[Spot]:
    """Scored trial records (`tuner.search.record.TrialRecord`: number, bits, accuracy, accuracy_se,
    config) merged into markers: front points first, each point joining the first marker near it
    of the same kind (front or not)."""
    out: list[Spot] = []
    ordered = sorted(records, key=lambda r: (r.number not in front, r.bits or 0.0, -(r.accuracy or 0.0)))
    for r in ordered:
        bits, acc, on_front = r.bits or 0.0, r.accuracy or 0.0, r.number in front
        names = [n for n in MARKS if isinstance(r.config, PNMixConfig) and _same_method(r.config, preset(n))]
        near = next((s for s in out if s.on_front == on_front and abs(s.bits - bits) < NEAR_BITS
                     and abs(s.accuracy - acc) < NEAR_ACCURACY), None)
        if near is None:
            out.append(Spot(bits, acc, r.accuracy_se or 0.0, isinstance(r.config, LayerwiseConfig), on_front,
                            names=names, trials=[r.number]))
        else:
            near.trials.append(r.number)
            near.names += [n for n in names if n not in near.names]
    return out


def front_steps(front: Sequence[Spot]) -> tuple[list[float], list[float]]:
    """The front as steps: from each point's bits, its accuracy, up to the next point's bits."""
    pts = sorted(front, key=lambda s: s.bits)
    xs, ys = [], []
    for a, b in zip(pts, pts[1:] + [None], strict=True):
        xs.append(a.bits)
        ys.append(a.accuracy)
        if b is not None:
            xs.append(b.bits)
            ys.append(a.accuracy)
    return xs, ys


def bits_axis(budget_on: str, plan: LayerPlan | None) -> str:
    """What the x axis measures: the mean over layers, or on a hybrid model the mean weighted by the
    tokens each layer holds (the windows' at 16 bits)."""
    figure = "KV bits per element" if budget_on == BudgetOn.KV else "key bits per element"
    if plan is not None and plan.hybrid:
        return f"{figure} (weighted by tokens held; windows at 16 bits)"
    return f"{figure} (layers' mean)"


def pareto_plot(studies: dict[float, Any], path: Path, title: str, budget_on: str = "key",
                recommended: tuple[float, int] | None = None, plan: LayerPlan | None = None) -> Path:
    """Writes the plot to `path`; `recommended` = (budget, trial number) of the point to star. On a
    hybrid model (`plan`), the bits are the weighted figure, and each budget says what it leaves
    the full-attention layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna

    from pnmix.tuner.search import record
    from pnmix.tuner.search.fronts import front_trials

    budgets = sorted(studies)
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets) + 1.5, 4.8), sharey=True, squeeze=False)
    for i, (budget, ax) in enumerate(zip(budgets, axes[0], strict=True)):
        study, color = studies[budget], f"C{i}"
        done = [r for r in map(record.read, study.get_trials(deepcopy=False,
                                                              states=(optuna.trial.TrialState.COMPLETE,)))
                if r.has_score]
        front = {t.number for t in front_trials(study)}
        marks = spots(done, front)
        on = [s for s in marks if s.on_front]
        ax.plot(*front_steps(on), "-", color=color, linewidth=1.2, label="front (steps)")
        for s in marks:
            marker = "D" if s.layered else "o"
            if s.on_front:
                ax.errorbar([s.bits], [s.accuracy], yerr=[s.accuracy_se], fmt=marker, color=color, capsize=3,
                            markersize=6, zorder=3)
            else:
                ax.scatter([s.bits], [s.accuracy], marker=marker, s=16, color="gray", alpha=0.5, zorder=2)
            text = ", ".join(s.names) + (f" (x{s.count})" if s.count > 1 else "")
            if text:
                ax.annotate(text, (s.bits, s.accuracy), fontsize=7, xytext=(5, -11), textcoords="offset points")
            if recommended is not None and recommended[0] == budget and recommended[1] in s.trials:
                ax.scatter([s.bits], [s.accuracy], marker="*", s=260, color="gold", edgecolors="black", zorder=4,
                           label="recommended")
        ax.axvline(budget, color=color, linestyle=":", linewidth=1, label=f"budget {budget:g} bits")
        ax.set_title(f"budget {budget_words(budget, budget_on, plan)}: {len(done)} scored, {len(on)} on the front",
                     fontsize=9)
        ax.set_xlabel(bits_axis(budget_on, plan), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("accuracy (combined, +- 1 SE on the front)")
    for ax in axes[0][1:]:
        ax.tick_params(labelleft=True)
    fig.legend(handles=[plt.Line2D([], [], marker="D", color="gray", linestyle="", label="layer-wise config"),
                        plt.Line2D([], [], marker="o", color="gray", linestyle="", label="uniform config"),
                        plt.Line2D([], [], marker="o", color="gray", alpha=0.5, linestyle="",
                                   label="scored, not on the front")],
               loc="upper right", fontsize=7, ncol=3)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _same_method(a: PNMixConfig, b: PNMixConfig) -> bool:
    keys = ("b_high", "b_low", "group_size", "salient_ratio", "n_sink")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def layers_plot(sensitivity: list[float], chosen: list[PNMixConfig], chosen_kl: list[float], head_dim: int,
                path: Path, title: str, layers: list[int]) -> Path:
    """Per allocated layer (`layers`: their indices; a hybrid model's full-attention layers): the
    base config's proxy KL (the sensitivity profile), the allocated config's KL, and the allocated
    config's key bits (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pnmix.bits import key_bits

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar([i - 0.2 for i in layers], sensitivity, width=0.4, color="C0", label="base config: attention KL")
    ax.bar([i + 0.2 for i in layers], chosen_kl, width=0.4, color="C1", label="layer-wise: attention KL")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention KL (proxy)")
    right = ax.twinx()
    right.plot(layers, [key_bits(c, head_dim).total for c in chosen], "k.-", label="layer-wise: key bits")
    right.set_ylabel("key bits of the layer's config")
    ax.set_title(title, fontsize=10)
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
