"""Pareto plot of a campaign: accuracy vs the budget's bits (key or KV) per budget, front marked
with each point's standard error (layer-wise points as diamonds), presets marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pnmix.config import PNMixConfig, preset
from pnmix.layerwise import LayerwiseConfig


def pareto_plot(studies: dict[float, Any], path: Path, title: str, budget_on: str = "key") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna

    from pnmix.tuner import record
    from pnmix.tuner.fronts import front_trials

    marks = {"pnmix-paper": preset("pnmix-paper"), "kivi2": preset("kivi2"), "kivi1": preset("kivi1")}
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (budget, study) in enumerate(sorted(studies.items())):
        color = f"C{i}"
        done = [r for r in map(record.read, study.get_trials(deepcopy=False,
                                                              states=(optuna.trial.TrialState.COMPLETE,)))
                if r.has_score]
        ax.scatter([r.bits or 0.0 for r in done], [r.accuracy or 0.0 for r in done], s=14, alpha=0.4, color=color)
        front = sorted(map(record.read, front_trials(study)), key=lambda r: r.bits or 0.0)
        # Each front point with its standard error; layer-wise configs as diamonds, uniform as circles.
        xs, ys = [r.bits or 0.0 for r in front], [r.accuracy or 0.0 for r in front]
        ax.plot(xs, ys, "-", color=color, label=f"front, budget {budget:g} bits (+- 1 SE)")
        ax.errorbar(xs, ys, yerr=[r.accuracy_se or 0.0 for r in front], fmt="none", ecolor=color, capsize=3,
                    linewidth=1)
        layered = [isinstance(r.config, LayerwiseConfig) for r in front]
        for marker, which in (("D", True), ("o", False)):
            ax.scatter([x for x, lw in zip(xs, layered, strict=True) if lw is which],
                       [y for y, lw in zip(ys, layered, strict=True) if lw is which], marker=marker, color=color,
                       s=30, zorder=3)
        ax.axvline(budget, color=color, linestyle=":", linewidth=1)
        for r in done:
            cfg = r.config
            for name, ref in marks.items():
                if isinstance(cfg, PNMixConfig) and _same_method(cfg, ref):
                    ax.annotate(name, (r.bits or 0.0, r.accuracy or 0.0), fontsize=8, xytext=(4, -10),
                                textcoords="offset points")
    ax.set_xlabel("KV bits per cached element (keys and values, formula)" if budget_on == "kv"
                  else "key bits per element (formula, metadata included; layers' mean)")
    ax.set_ylabel("accuracy (combined)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.scatter([], [], marker="D", color="gray", label="layer-wise config")
    ax.scatter([], [], marker="o", color="gray", label="uniform config")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _same_method(a: PNMixConfig, b: PNMixConfig) -> bool:
    keys = ("b_high", "b_low", "group_size", "salient_ratio", "n_sink")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def layers_plot(sensitivity: list[float], chosen: list[PNMixConfig], chosen_kl: list[float], head_dim: int,
                path: Path, title: str) -> Path:
    """Per layer: the base config's proxy KL (the sensitivity profile), the allocated config's KL,
    and the allocated config's key bits (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pnmix.bits import key_bits

    layers = list(range(len(sensitivity)))
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
