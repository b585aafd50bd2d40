"""The ground truth of a sweep: its true front per budget, a Pareto plot, and how repeatable it is.

    python benchmarks/ground_truth_report.py benchmarks/ground_truth/smollm2-135m-pnmix-full-seed0.jsonl.gz \\
        --repeat benchmarks/ground_truth/smollm2-135m-pnmix-full-seed1-half.jsonl.gz --out benchmarks/ground_truth

A sweep (`pnmix sweep`) scores every config of a search space with one profile and task seed;
--repeat is a sweep with another task seed (other items, other trajectories) over the whole
space or part of it: on the configs both hold it gives how far a score, and a front, move when
only the items change. --campaign is a database holding a campaign of the same model, method,
profile and task seed (`pnmix tune --storage URL`): its stored fronts are compared with the true
ones (hypervolume fraction with the campaign's own scores and with the sweep's scores of the same
configs; its best point per budget against the true best and against pnmix-paper). Writes
fronts.json and pareto.png to --out; prints the tables.

    python benchmarks/ground_truth_report.py benchmarks/ground_truth/smollm2-135m-pnmix-full-seed0.jsonl.gz \\
        --campaign sqlite:///out/campaign.db --out out/campaign-vs-truth
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from pnmix.config import PNMixConfig, preset
from pnmix.tuner.search.sweep import config_key, front, hypervolume, read_sweep

BUDGETS = (3.0, 2.5, 2.25, 2.0, 1.5)
PRESETS = ("pnmix-paper", "kivi2", "kitty", "kivi1")


def label(cfg: dict[str, Any]) -> str:
    return PNMixConfig.from_dict(cfg).label


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def plot(records: list[dict[str, Any]], fronts: dict[float, list[dict[str, Any]]], marks: dict[str, Any],
         path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([r["key_bits"] for r in records], [r["accuracy"] for r in records], s=8, alpha=0.35, color="gray",
               label=f"every config ({len(records)})")
    whole = front(records)
    ax.errorbar([r["key_bits"] for r in whole], [r["accuracy"] for r in whole],
                yerr=[2 * r["accuracy_se"] for r in whole], fmt="o-", ms=3, color="C0", lw=1, capsize=2,
                label="true front (+- 2 SE)")
    for i, budget in enumerate(BUDGETS):
        ax.axvline(budget, color=f"C{i + 1}", linestyle=":", linewidth=1)
        best = fronts[budget][-1] if fronts[budget] else None
        if best:
            ax.plot(best["key_bits"], best["accuracy"], "*", ms=11, color=f"C{i + 1}",
                    label=f"best within {budget:g} bits: {label(best['config'])}")
    for name, r in marks.items():
        ax.annotate(name, (r["key_bits"], r["accuracy"]), fontsize=8, xytext=(4, -10), textcoords="offset points")
        ax.plot(r["key_bits"], r["accuracy"], "kx")
    ax.set_xlim(1.3, 5.2)
    ax.set_xlabel("key bits per element (formula, metadata included)")
    ax.set_ylabel("accuracy (combined)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def against_campaign(url: str, campaign_id: int | None, header: dict[str, Any], by_key: dict[str, dict[str, Any]],
                     fronts: dict[float, list[dict[str, Any]]], paper: dict[str, Any] | None) -> dict[str, Any]:
    """A stored campaign's fronts against the sweep's true fronts, per budget (printed and returned)."""
    from pnmix.storage.read import list_campaigns, list_front_points
    from pnmix.tuner.scoring.stats import paired
    from pnmix.tuner.search.session import open_db

    db = open_db(url)
    with db.session(readonly=True) as s:
        if campaign_id is None:
            same_method = [c for c in list_campaigns(s, model=header["model"]).items
                           if c.options.get("method", "pnmix") == header["method"]]
            if not same_method:
                raise SystemExit(f"error: {url} holds no {header['method']} campaign of {header['model']}")
            campaign_id = max(c.id for c in same_method)
        points = list_front_points(s, header["model"], campaign_id=campaign_id).items
        rows = [(p.budget, p.config.to_dict(), p.key_bits, p.accuracy, p.accuracy_se or 0.0) for p in points]
    print(f"\ncampaign {campaign_id} of {url} against the true fronts")
    print("| budget | hypervolume fraction, own scores / sweep's scores | campaign's best | key bits | accuracy +- SE "
          "(sweep's) | true best, accuracy +- SE | best - true best | best - pnmix-paper (paired, sweep) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    out: dict[str, Any] = {"campaign_id": campaign_id, "budgets": {}}
    for b in BUDGETS:
        mine = [r for r in rows if abs(r[0] - b) < 1e-9]
        if not mine or not fronts[b]:
            continue
        truth = hypervolume([(r["key_bits"], r["accuracy"]) for r in fronts[b]], b)
        own = hypervolume([(bits, acc) for _, _, bits, acc, _ in mine], b) / truth
        swept = [by_key[config_key(cfg)] for _, cfg, *_ in mine if config_key(cfg) in by_key]
        theirs = hypervolume([(r["key_bits"], r["accuracy"]) for r in swept], b) / truth
        _, cfg, bits, acc, se = max(mine, key=lambda r: (r[3], -r[2]))
        true_best = fronts[b][-1]
        gap = acc - true_best["accuracy"]
        gap_se = math.hypot(se, true_best["accuracy_se"])
        rec = by_key.get(config_key(cfg))
        vs_paper = paired(rec["units"], paper["units"])["accuracy"] if rec and paper else (float("nan"), None)
        print(f"| {b:g} | {own:.3f} / {theirs:.3f} | {label(cfg)} | {bits:.3f} | {acc:.3f} +- {se:.3f} "
              f"({rec['accuracy'] if rec else float('nan'):.3f}) | {true_best['accuracy']:.3f} +- "
              f"{true_best['accuracy_se']:.3f} | {gap:+.3f} +- {gap_se:.3f} | {vs_paper[0]:+.3f} +- "
              f"{vs_paper[1] or 0:.3f} |")
        out["budgets"][f"{b:g}"] = {
            "fraction_own": own, "fraction_sweep": theirs, "best": cfg, "best_key_bits": bits, "best_accuracy": acc,
            "best_accuracy_se": se, "true_best_accuracy": true_best["accuracy"],
            "within_one_se_of_true_best": gap >= -gap_se, "best_minus_pnmix_paper": list(vs_paper)}
    db.engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--repeat", default=None, help="a sweep of the same space with another task seed")
    ap.add_argument("--campaign", default=None, help="database URL of a campaign to compare with the truth")
    ap.add_argument("--campaign-id", type=int, default=None, help="which campaign there (default: the newest)")
    ap.add_argument("--out", default="out/ground_truth")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sw = read_sweep(args.sweep)
    records = sw.records
    by_key = {config_key(r["config"]): r for r in records}
    marks = {name: by_key[config_key(preset(name))] for name in PRESETS if config_key(preset(name)) in by_key}
    fronts = {b: front(records, b) for b in BUDGETS}
    h = sw.header
    seconds = sum(r["seconds"] for r in records)
    print(f"{h['model']}, method {h['method']}, profile {h['profile']}, seed {h['seed']}: {len(records)} configs, "
          f"{seconds:.0f} evaluation seconds")
    print("\n| budget | front points | best config | key bits | accuracy +- SE | vs pnmix-paper (paired) |")
    print("| --- | --- | --- | --- | --- | --- |")
    from pnmix.tuner.scoring.stats import paired

    paper = marks.get("pnmix-paper")
    summary: dict[str, Any] = {"header": h, "configs": len(records), "evaluation_seconds": seconds, "budgets": {}}
    for b in BUDGETS:
        best = fronts[b][-1]
        d, se = paired(best["units"], paper["units"])["accuracy"] if paper else (float("nan"), None)
        print(f"| {b:g} | {len(fronts[b])} | {label(best['config'])} | {best['key_bits']:.3f} | "
              f"{best['accuracy']:.3f} +- {best['accuracy_se']:.3f} | {d:+.3f} +- {se or 0:.3f} |")
        summary["budgets"][f"{b:g}"] = {
            "front": [{"config": r["config"], "key_bits": r["key_bits"], "accuracy": r["accuracy"],
                       "accuracy_se": r["accuracy_se"]} for r in fronts[b]],
            "best_minus_pnmix_paper": {"diff": d, "se": se}}
    for name, r in marks.items():
        print(f"{name}: {r['key_bits']:.3f} bits, accuracy {r['accuracy']:.3f} +- {r['accuracy_se']:.3f}")
    if args.repeat:
        rep = read_sweep(args.repeat)
        other = {config_key(r["config"]): r for r in rep.records}
        common = [k for k in by_key if k in other]
        a = [by_key[k]["accuracy"] for k in common]
        b_ = [other[k]["accuracy"] for k in common]
        diffs = [x - y for x, y in zip(a, b_, strict=True)]
        within = sum(abs(by_key[k]["accuracy"] - other[k]["accuracy"]) <= 2 * math.hypot(
            by_key[k]["accuracy_se"], other[k]["accuracy_se"]) for k in common) / len(common)
        rep_stats: dict[str, Any] = {
            "seed": rep.header["seed"], "common_configs": len(common), "pearson": statistics.correlation(a, b_),
            "spearman": statistics.correlation(ranks(a), ranks(b_)),
            "mean_abs_diff": statistics.fmean(abs(x) for x in diffs),
            "mean_diff": statistics.fmean(diffs), "within_2se_share": within, "budgets": {}}
        print(f"\nrepeat with seed {rep.header['seed']} on {len(common)} common configs: Pearson "
              f"{rep_stats['pearson']:.4f}, Spearman {rep_stats['spearman']:.4f}, mean |diff| "
              f"{rep_stats['mean_abs_diff']:.4f}, mean diff {rep_stats['mean_diff']:+.4f}, within 2 SE: "
              f"{within:.1%}")
        print("\n| budget | best of the common configs, seed "
              f"{h['seed']} | its accuracy, seed {h['seed']} / seed {rep.header['seed']} | best, seed "
              f"{rep.header['seed']} | same config |")
        print("| --- | --- | --- | --- | --- |")
        sub0 = [by_key[k] for k in common]
        sub1 = [other[k] for k in common]
        for b in BUDGETS:
            f0, f1 = front(sub0, b), front(sub1, b)
            if not f0 or not f1:
                continue
            b0, b1 = f0[-1], f1[-1]
            k0 = config_key(b0["config"])
            same = k0 == config_key(b1["config"])
            print(f"| {b:g} | {label(b0['config'])} | {b0['accuracy']:.3f} / {other[k0]['accuracy']:.3f} | "
                  f"{label(b1['config'])} ({b1['accuracy']:.3f}) | {'yes' if same else 'no'} |")
            rep_stats["budgets"][f"{b:g}"] = {"best_seed0": b0["config"], "best_repeat": b1["config"], "same": same}
        summary["repeat"] = rep_stats
    if args.campaign:
        summary["campaign"] = against_campaign(args.campaign, args.campaign_id, h, by_key, fronts, paper)
    (out / "fronts.json").write_text(json.dumps(summary, indent=1))
    plot(records, fronts, marks, out / "pareto.png",
         f"{h['model']}: every {h['method']} config, profile {h['profile']}, seed {h['seed']}")
    print(f"\nwrote {out / 'fronts.json'} and {out / 'pareto.png'}")


if __name__ == "__main__":
    main()
