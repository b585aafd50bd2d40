"""Layer-wise PN-Mix against the best uniform config at the paper's budgets, on the same items.

    python benchmarks/layerwise_study.py --device cuda --out DIR

For each budget (3.0, 2.5, 2.25, 2.0, 1.5) the uniform config is the ground truth's best within
it (benchmarks/ground_truth/, full profile, seed 0). The layer-wise configs keep that config's
shared fields (G, sinks, residual, values) and let each layer take any bit pair and salient
ratio of the space, chosen by `tuner.search.layers.allocate` from the proxy's per-layer attention KL
(`--variants`):
  - uniform-bits: mean key bits <= the uniform config's own (equal or fewer bits);
  - budget: mean key bits <= the budget.
All are scored with the full profile on the same items and trajectories; the table gives each
layer-wise config's accuracy minus the uniform's, paired item by item, with its standard error.
Writes layerwise_study.json and layerwise_study.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pnmix.bits import mean_key_bits
from pnmix.config import PNMixConfig
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile
from pnmix.tuner.scoring.stats import paired
from pnmix.tuner.search.layers import candidates_like, layerwise_for_budget
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.sweep import front, read_sweep

TRUTH = Path(__file__).parent / "ground_truth" / "smollm2-135m-pnmix-full-seed0.jsonl.gz"
BUDGETS = (3.0, 2.5, 2.25, 2.0, 1.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS))
    ap.add_argument("--variants", default="uniform-bits,budget",
                    help="uniform-bits: mean key bits <= the uniform config's; budget: <= the budget")
    ap.add_argument("--out", default="out/layerwise_study")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    truth = read_sweep(TRUTH)
    ev = Evaluator(truth.header["model"], profile(args.profile), int(truth.header["seed"]), device=args.device)
    ev.prepare()
    space, d = SearchSpace(), ev.head_dim
    n_layers = ev.loaded.shape.num_layers
    kl_of: dict[PNMixConfig, list[float]] = {}
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        base = PNMixConfig.from_dict(front(truth.records, budget)[-1]["config"])
        t0 = time.perf_counter()
        for c in candidates_like(base, space):
            if c not in kl_of:
                kl_of[c] = ev.proxy_by_layer(c)
        proxy_s = time.perf_counter() - t0
        uniform = ev.evaluate(base, measure=False)
        row: dict[str, Any] = {"budget": budget, "uniform": base.label, "uniform_bits": uniform.key_bits,
                               "uniform_accuracy": uniform.accuracy, "uniform_se": uniform.accuracy_se,
                               "uniform_proxy": sum(kl_of[base]), "proxy_seconds": proxy_s, "device": uniform.device,
                               "layerwise": {}}
        limits = {"uniform-bits": ("at uniform's bits", uniform.key_bits), "budget": ("at budget", budget)}
        for name, limit in (limits[v] for v in args.variants.split(",")):
            lw = layerwise_for_budget(base, limit, d, space, kl_of)
            score = ev.evaluate(lw, measure=False)
            diff, se = paired(score.units, uniform.units)["accuracy"]
            row["layerwise"][name] = {
                "config": lw.to_dict(), "label": lw.label, "key_bits": mean_key_bits(lw, n_layers, d),
                "accuracy": score.accuracy, "accuracy_se": score.accuracy_se, "minus_uniform": diff,
                "minus_uniform_se": se, "proxy": sum(kl_of[c][i] for i, c in enumerate(lw.per_layer(n_layers)))}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(rows, out, args.profile)


def write(rows: list[dict[str, Any]], out: Path, profile_name: str) -> None:
    """The table so far (each budget is written as it finishes, so a cut run keeps what it did)."""
    lines = ["| budget | uniform (ground truth's best) | bits | accuracy +- SE | layer-wise | bits | accuracy +- SE "
             "| minus uniform (paired) | summed proxy KL, uniform / layer-wise |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for name, lw in r["layerwise"].items():
            lines.append(
                f"| {r['budget']:g} ({name}) | {r['uniform']} | {r['uniform_bits']:.3f} | "
                f"{r['uniform_accuracy']:.3f} +- {r['uniform_se']:.3f} | {lw['label']} | {lw['key_bits']:.3f} | "
                f"{lw['accuracy']:.3f} +- {lw['accuracy_se']:.3f} | {lw['minus_uniform']:+.3f} +- "
                f"{lw['minus_uniform_se']:.3f} | {r['uniform_proxy']:.3f} / {lw['proxy']:.3f} |")
    table = "\n".join(lines)
    print("\n" + table)
    (out / "layerwise_study.md").write_text(table + "\n")
    device = rows[0]["device"] if rows else ""
    (out / "layerwise_study.json").write_text(json.dumps({"device": device, "profile": profile_name, "rows": rows},
                                                         indent=1))


if __name__ == "__main__":
    main()
