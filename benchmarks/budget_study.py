"""Beyond one uniform key config: KV-budget campaigns (values searched) and layer-group campaigns
against the exhaustive uniform ground truth, on the same items.

    python benchmarks/budget_study.py --campaign sqlite:///out/budgets.db --out DIR

For every campaign in the database that searches past the uniform key space (`--budget-on kv`,
or `--method pnmix-layers`), per budget: the campaign's most accurate front point against the
best config of the ground truth (every uniform config of the pnmix space, values fixed at the
paper's 2 bits in groups of 32: what a key-budget search can reach) within the same budget on the
same figure (KV bits for a KV campaign, key bits for a layer-group one), paired item by item
(the sweep and the campaign share model, profile and task seed). For a KV campaign it also gives
the cheapest front point that is no worse than pnmix-paper (paired difference >= -1 SE) and the KV
bytes each would hold on `qwen3-8b-shape` at 8K (formula), and writes the most accurate point of
each KV budget to DIR/kv-<budget>.json (`static_study.py --part maxbatch` measures the largest
feasible batch of each).
Writes budget_study.json and budget_study.png to --out and prints the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pnmix.bits import ModelShape, kv_bits, kv_cache_bytes
from pnmix.config import PNMixConfig, preset
from pnmix.layerwise import config_from_dict
from pnmix.tuner.scoring.stats import paired
from pnmix.tuner.search.sweep import config_key, read_sweep

TRUTH = Path(__file__).parent / "ground_truth" / "smollm2-135m-pnmix-full-seed0.jsonl.gz"
QWEN3_8B = ModelShape(num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128)


def no_worse_than(point: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether `point`'s accuracy is at least `reference`'s minus one standard error, paired."""
    diff, se = paired(point["units"], reference["units"])["accuracy"]
    return diff >= -(se or 0.0)


def best_within(records: list[dict[str, Any]], figure: str, budget: float) -> dict[str, Any] | None:
    inside = [r for r in records if r[figure] <= budget + 1e-9]
    return max(inside, key=lambda r: (r["accuracy"], -r[figure])) if inside else None


def campaign_rows(url: str, model: str) -> list[dict[str, Any]]:
    """Each budget of each campaign beyond the uniform key space: its front trials (with units)."""
    import optuna

    from pnmix.storage.read import list_campaigns
    from pnmix.tuner.search import record
    from pnmix.tuner.search.fronts import front_trials
    from pnmix.tuner.search.session import open_db
    from pnmix.tuner.search.studies import study_name

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = open_db(url)
    with db.session(readonly=True) as s:
        campaigns = [(c.id, c.method, c.budget_on, list(c.budgets)) for c in list_campaigns(s, model=model).items
                     if c.budget_on == "kv" or c.method == "pnmix-layers"]
    out = []
    for cid, method, budget_on, budgets in sorted(campaigns):
        for b in sorted(budgets):
            study = optuna.load_study(study_name=study_name(cid, b), storage=db.url)
            front = [{"config": r.config_dict, "bits": r.bits, "key_bits": r.key_bits, "kv_bits": r.kv_bits,
                      "accuracy": r.accuracy, "accuracy_se": r.accuracy_se, "units": r.units}
                     for r in map(record.read, front_trials(study))]
            out.append({"campaign": cid, "method": method, "budget_on": budget_on, "budget": b, "front": front})
    db.engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--campaign", required=True, help="database URL holding the campaigns")
    ap.add_argument("--truth", default=str(TRUTH), help="the uniform ground-truth sweep (same model and profile)")
    ap.add_argument("--out", default="out/budget_study")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    truth = read_sweep(args.truth)
    model = truth.header["model"]
    from pnmix.models import model_shape

    shape = model_shape(model)
    records = truth.records
    for r in records:
        r["kv_bits"] = kv_bits(PNMixConfig.from_dict(r["config"]), shape.num_layers, shape.head_dim)
    by_key = {config_key(r["config"]): r for r in records}
    paper = by_key.get(config_key(preset("pnmix-paper")))
    if paper is None:
        raise SystemExit(f"error: {args.truth} holds no score of pnmix-paper, the study's reference")
    rows = campaign_rows(args.campaign, model)
    if not rows:
        raise SystemExit(f"error: {args.campaign} holds no KV-budget or pnmix-layers campaign of {model}")
    summary: dict[str, Any] = {"truth": truth.header, "pnmix_paper": {k: paper[k] for k in (
        "config", "key_bits", "kv_bits", "accuracy", "accuracy_se")}, "budgets": []}
    print(f"{model}; ground truth: {len(records)} uniform configs, profile {truth.header['profile']}, seed "
          f"{truth.header['seed']}; pnmix-paper {paper['key_bits']:.3f} key / {paper['kv_bits']:.3f} KV bits, "
          f"accuracy {paper['accuracy']:.3f} +- {paper['accuracy_se']:.3f}\n")
    print("| campaign | budget | its best | key / KV bits | accuracy +- SE | best uniform (values 2-bit G32) | "
          "key / KV bits | accuracy +- SE | difference (paired) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    picks: list[dict[str, Any]] = []
    for row in rows:
        figure = "kv_bits" if row["budget_on"] == "kv" else "key_bits"
        mine = max(row["front"], key=lambda p: (p["accuracy"], -p["bits"]), default=None)
        uniform = best_within(records, figure, row["budget"])
        if mine is None or uniform is None:
            continue
        diff, se = paired(mine["units"], uniform["units"])["accuracy"]
        kind = f"{row['campaign']} ({row['method']}, {row['budget_on']} budget)"
        print(f"| {kind} | {row['budget']:g} | {config_from_dict(mine['config']).label} | {mine['key_bits']:.3f} / "
              f"{mine['kv_bits']:.3f} | {mine['accuracy']:.3f} +- {mine['accuracy_se']:.3f} | "
              f"{PNMixConfig.from_dict(uniform['config']).label} | {uniform['key_bits']:.3f} / "
              f"{uniform['kv_bits']:.3f} | {uniform['accuracy']:.3f} +- {uniform['accuracy_se']:.3f} | "
              f"{diff:+.3f} +- {se or 0:.3f} |")
        entry = {**{k: row[k] for k in ("campaign", "method", "budget_on", "budget")},
                 "best": {k: mine[k] for k in ("config", "key_bits", "kv_bits", "accuracy", "accuracy_se")},
                 "best_uniform": {k: uniform[k] for k in ("config", "key_bits", "kv_bits", "accuracy", "accuracy_se")},
                 "difference": diff, "difference_se": se}
        if row["budget_on"] == "kv":
            no_worse = [p for p in row["front"] if no_worse_than(p, paper)]
            cheapest = min(no_worse, key=lambda p: p["kv_bits"], default=None)
            entry["cheapest_no_worse_than_paper"] = cheapest and {k: cheapest[k] for k in (
                "config", "key_bits", "kv_bits", "accuracy", "accuracy_se")}
            picks.append({"budget": row["budget"], **mine})
        summary["budgets"].append(entry)
    summary["kv_picks"] = []
    for pick in picks:  # each KV budget's best, for static_study.py --part maxbatch
        cfg = config_from_dict(pick["config"])
        path = out / f"kv-{pick['budget']:g}.json"
        path.write_text(cfg.to_json() + "\n")
        mine_b = kv_cache_bytes(cfg, QWEN3_8B, 1, 141 + 8192)
        paper_b = kv_cache_bytes(preset("pnmix-paper"), QWEN3_8B, 1, 141 + 8192)
        diff, se = paired(pick["units"], paper["units"])["accuracy"]
        summary["kv_picks"].append({"budget": pick["budget"], "config": pick["config"], "kv_bits": pick["kv_bits"],
                                    "accuracy": pick["accuracy"], "accuracy_se": pick["accuracy_se"],
                                    "minus_pnmix_paper": [diff, se], "qwen3_8b_bytes_8k": mine_b.total,
                                    "pnmix_paper_bytes_8k": paper_b.total, "fp16_bytes_8k": mine_b.fp16_total})
        print(f"KV budget {pick['budget']:g}: {cfg.label}, {pick['kv_bits']:.3f} KV bits, accuracy "
              f"{pick['accuracy']:.3f} +- {pick['accuracy_se']:.3f} ({diff:+.3f} +- {se or 0:.3f} vs pnmix-paper, "
              f"paired); qwen3-8b-shape at 8K: {mine_b.total / 2**20:.1f} MiB a sequence, fp16 "
              f"{mine_b.fp16_total / mine_b.total:.2f}x it (pnmix-paper {paper_b.fp16_total / paper_b.total:.2f}x); "
              f"wrote {path}")
    (out / "budget_study.json").write_text(json.dumps(summary, indent=1))
    plot(records, rows, paper, out / "budget_study.png", model)
    print(f"wrote {out / 'budget_study.json'} and {out / 'budget_study.png'}")


def plot(records: list[dict[str, Any]], rows: list[dict[str, Any]], paper: dict[str, Any], path: Path,
         model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pnmix.tuner.search.sweep import front

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, figure, title in ((axes[0], "key_bits", "layer groups (key budgets)"),
                              (axes[1], "kv_bits", "values searched (KV budgets)")):
        ax.scatter([r[figure] for r in records], [r["accuracy"] for r in records], s=6, alpha=0.3, color="gray",
                   label=f"every uniform config ({len(records)})")
        ranked = sorted(records, key=lambda r: (r[figure], -r["accuracy"]))
        whole = front([{**r, "key_bits": r[figure]} for r in ranked])
        ax.plot([r["key_bits"] for r in whole], [r["accuracy"] for r in whole], "o-", ms=3, color="C0", lw=1,
                label="uniform front (ground truth)")
        shown = [row for row in rows if (row["budget_on"] == "kv") == (figure == "kv_bits")]
        # Highest budget first: a lower budget's front is a subset of a higher one's and is drawn on top.
        for i, row in sorted(enumerate(shown), key=lambda item: -item[1]["budget"]):
            pts = sorted(row["front"], key=lambda p: p[figure])
            ax.errorbar([p[figure] for p in pts], [p["accuracy"] for p in pts],
                        yerr=[2 * p["accuracy_se"] for p in pts], fmt="s", ms=4, color=f"C{i + 1}", capsize=2,
                        label=f"campaign {row['campaign']}, budget {row['budget']:g} (+- 2 SE)")
            ax.axvline(row["budget"], color=f"C{i + 1}", ls=":", lw=1)
        ax.plot(paper[figure], paper["accuracy"], "kx", ms=9, label="pnmix-paper")
        ax.set(xlabel=("KV bits per cached element" if figure == "kv_bits" else "key bits per element (mean)"),
               ylabel="accuracy (combined)", title=f"{model}: {title}")
        lo = min([row["budget"] for row in shown] or [2.0]) - 0.6
        ax.set_xlim(lo, max([row["budget"] for row in shown] or [3.0]) + 0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
