"""A model study: the allocator campaign, the best uniform config, pnmix-paper, KIVI-2 and fp16 on one
model, paired on the same items, with held-out scores, and where the allocator puts the bits.

    python benchmarks/model_study.py --model gemma3-270m --profile quick --out DIR   # campaigns + rescoring
    python benchmarks/model_study.py --report DIR/model_study-gemma3-270m.json     # table and plot
    STEP=study benchmarks/gpu_model_study.sh    # on a GPU machine without network (its header says how)

Budgets are given as the mean key bits of the model's full-attention layers (`--full-bits`; "paper"
is pnmix-paper's own figure). On a full-attention model that is the budget itself; on a hybrid model
the campaign's budget is the weighted figure at 32K tokens in which the sliding windows count at 16
bits (`pnmix.bits.LayerPlan.budget_for`), so both models are compared at the
same bits in the layers PN-Mix quantizes. Or as the weighted figures themselves (`--budgets 2.5,3.0`):
what a hybrid model's allocator, which may quantize its windows, is asked for directly (the table's
full-layer column then says what the budget would leave the full layers beside exact windows).
One evaluator scores everything (the profile's items and
trajectories, seed 0, a quarter of every part's units held out), so every difference is paired:
  alloc    a `pnmix-alloc` campaign (the default method), `--trials` scored configs a budget;
  uniform  a `pnmix` campaign (one config for every full layer), as many trials: the best uniform
           config it finds;
  then per budget: each campaign's best (the most accurate point of its front), pnmix-paper and KIVI-2
  where they fit, and fp16, each with its SE; alloc minus each, paired; the alloc campaign's
  recommendation (`pnmix recommend`: the fewest bits among the points tied with the best) with its
  held-out score minus its in-search score; the alloc pick's key bits per full layer.
Resumable: the campaigns live in DIR/study-MODEL.db.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from pnmix.bits import key_bits, weighted_key_bits
from pnmix.config import preset
from pnmix.layerwise import as_layerwise, config_from_dict

BASELINES = ("pnmix-paper", "kivi2", "fp16")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_campaign(method: str, ev: Any, budgets: tuple[float, ...], trials: int, db: Any) -> dict[float, Any]:
    """The campaign's studies by budget (resumed where the database has it)."""
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.session import find_or_create_campaign
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    spec = CampaignSpec(model=ev.model_name, budgets=budgets, n_trials=trials, method=method,
                        profile=ev.profile.name, seed=ev.seed, holdout=ev.holdout, space=SearchSpace(method=method))
    campaign_id = find_or_create_campaign(db, spec)
    started = time.perf_counter()
    studies = CampaignRunner(db, db.url, campaign_id, spec, ev, progress=log).run()
    log(f"{method} campaign: {time.perf_counter() - started:.0f} s")
    return {"campaign_id": campaign_id, "studies": studies, "seconds": time.perf_counter() - started}


def best_of(study: Any) -> dict[str, Any]:
    from pnmix.tuner.search import record
    from pnmix.tuner.search.fronts import front_trials

    r = max(map(record.read, front_trials(study)), key=lambda r: r.accuracy or 0.0)
    return {"trial": r.number, "config": r.config_dict, "label": r.config.label, "bits": r.bits,
            "key_bits": r.key_bits, "kv_bits": r.kv_bits, "accuracy": r.accuracy, "accuracy_se": r.accuracy_se,
            "units": r.units, "origin": r.origin}


def study(model: str, device: str, profile_name: str, trials: int, full_bits: list[str], out: Path,
          weighted: list[float] | None = None) -> Path:
    import optuna
    import torch

    from pnmix.storage import Database, recommend, upgrade
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.scoring.stats import paired

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"model": model, "profile": profile_name, "trials": trials, "device": device}
    t0 = time.perf_counter()
    ev = Evaluator(model, profile(profile_name), device=device, holdout=0.25, progress=log)
    res["model_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev.prepare()
    res["preparation_s"] = time.perf_counter() - t0
    plan, d = ev.plan, ev.head_dim
    paper = preset("pnmix-paper")
    if weighted:
        budgets = tuple(weighted)
        targets = [plan.full_layer_budget(b, paper.n_sink) for b in budgets]
    else:
        targets = [key_bits(paper, d).total if b == "paper" else float(b) for b in full_bits]
        # pnmix-paper's own figure rounded up, so that it fits the budget named after it
        budgets = tuple(math.ceil(weighted_key_bits(paper, plan, d) * 1e4) / 1e4 if b == "paper"
                        else plan.budget_for(float(b)) for b in full_bits)
    res.update(plan={"kinds": list(plan.kinds), "window": plan.window}, full_bits=targets, budgets=list(budgets))
    log(f"{model}: budgets {budgets} (full layers' mean key bits {[round(b, 3) for b in targets]})")
    db = Database(f"sqlite:///{out / f'study-{model}.db'}")
    upgrade(db)
    runs = {m: run_campaign(m, ev, budgets, trials, db) for m in ("pnmix-alloc", "pnmix")}
    res["campaign_s"] = {m: r["seconds"] for m, r in runs.items()}
    scores: dict[str, Any] = {}
    for name in BASELINES:
        s = ev.evaluate(preset(name), measure=False)
        scores[name] = {"label": name, "config": preset(name).to_dict(), "bits": s.key_bits, "key_bits": s.key_bits,
                        "accuracy": s.accuracy, "accuracy_se": s.accuracy_se, "units": s.units}
    res["baselines"] = scores
    rows = []
    for budget, target in zip(budgets, targets, strict=True):
        row: dict[str, Any] = {"budget": budget, "full_bits": target,
                               "alloc": best_of(runs["pnmix-alloc"]["studies"][budget]),
                               "uniform": best_of(runs["pnmix"]["studies"][budget])}
        for name in BASELINES:
            if scores[name]["key_bits"] <= budget + 1e-9 or name == "fp16":
                row[name] = scores[name]
        row["minus"] = {k: list(paired(row["alloc"]["units"], row[k]["units"])["accuracy"])
                        for k in ("uniform", *BASELINES) if k in row}
        picked = as_layerwise(config_from_dict(row["alloc"]["config"]))
        layers = picked.per_layer(len(plan.kinds))
        row["full_layer_bits"] = {i: key_bits(layers[i], d).total for i in plan.full_layers}
        row["windows_quantized"] = list(picked.windows)
        with db.session(readonly=True) as s:  # what `pnmix recommend --bits BUDGET` answers, held out
            rec = recommend(s, model, budget, campaign_id=runs["pnmix-alloc"]["campaign_id"])
            row["recommended"] = {"label": rec.config.label, "key_bits": rec.key_bits, "accuracy": rec.accuracy,
                                  "accuracy_se": rec.accuracy_se}
            row["holdout"] = rec.holdout_summary()
        rows.append(row)
        log(f"{budget:g}: alloc {row['alloc']['accuracy']:.3f} ({row['alloc']['label'][:70]}); "
            + "; ".join(f"- {k} {d_:+.3f} +- {se:.3f}" for k, (d_, se) in row["minus"].items()))
    res["rows"] = rows
    res["env"] = {"torch": torch.__version__, "python": platform.python_version(),
                  "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
                  "date": datetime.date.today().isoformat()}
    path = out / f"model_study-{model}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    return path


def report(path: Path) -> None:
    """The RESULTS table and the plot from a study JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(path.read_text())

    def cell(m: dict[str, Any], k: str) -> str:
        if k not in m:
            return "-"
        d, s = m[k]
        return f"**{d:+.3f} +- {s:.3f}**" if abs(d) > 2 * s else f"{d:+.3f} +- {s:.3f}"

    lines = [f"{res['model']}, profile {res['profile']}, {res['trials']} trials a budget a campaign; "
             f"{res['env']['gpu']}, torch {res['env']['torch']}, {res['env']['date']}", "",
             "| budget (full layers' bits) | allocator's best | bits | accuracy +- SE | minus best uniform "
             "| minus pnmix-paper | minus KIVI-2 | minus fp16 | full layers' key bits | recommended: held-out minus "
             "in-search |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in res["rows"]:
        a, m, h = row["alloc"], row["minus"], row["holdout"]
        r = row["recommended"]
        gap = f"{r['label']} ({r['key_bits']:.3f} bits): " + (
            "-" if not h else f"{h['minus_in_search']:+.3f} +- {h['minus_in_search_se']:.3f}")
        bits = list(row["full_layer_bits"].values())
        layer_bits = (", ".join(f"{i}: {b:.2f}" for i, b in row["full_layer_bits"].items()) if len(bits) <= 6
                      else f"{min(bits):.2f} to {max(bits):.2f} over {len(bits)} layers")
        if row.get("windows_quantized"):
            layer_bits += f"; {len(row['windows_quantized'])} windows quantized"
        lines.append(f"| {row['budget']:g} ({row['full_bits']:.3f}) | {a['label']} | {a['bits']:.3f} | "
                     f"{a['accuracy']:.3f} +- {a['accuracy_se']:.3f} | {cell(m, 'uniform')} | {cell(m, 'pnmix-paper')} "
                     f"| {cell(m, 'kivi2')} | {cell(m, 'fp16')} | {layer_bits} | {gap} |")
    for key, label, marker in (("alloc", "allocator's best", "D"), ("uniform", "best uniform", "o")):
        pts = [(r[key]["bits"], r[key]["accuracy"], r[key]["accuracy_se"] or 0) for r in res["rows"]]
        xs, ys, es = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=es, fmt=marker, capsize=3, label=label)
    for name, marker in (("pnmix-paper", "^"), ("kivi2", "v")):
        b = res["baselines"][name]
        ax.errorbar([b["key_bits"]], [b["accuracy"]], yerr=[b["accuracy_se"] or 0], fmt=marker, capsize=3, label=name)
    ax.axhline(res["baselines"]["fp16"]["accuracy"], color="grey", ls="--", lw=1, label="fp16")
    ax.set(xlabel="key bits per element the model holds (32K tokens)", ylabel="accuracy (+- SE)",
           title=f"{res['model']}: {res['profile']} profile")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    table = "\n".join(lines)
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"model load {res['model_load_s']:.0f} s, preparation {res['preparation_s']:.0f} s, campaigns "
          + ", ".join(f"{m} {s:.0f} s" for m, s in res["campaign_s"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--full-bits", default="2.0,paper,2.5",
                    help="the full-attention layers' mean key bits of each budget ('paper': pnmix-paper's)")
    ap.add_argument("--budgets", help="weighted key-bit budgets, comma-separated (instead of --full-bits)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/model_study"))
    ap.add_argument("--report", metavar="JSON")
    args = ap.parse_args()
    if args.report:
        report(Path(args.report))
        return
    weighted = [float(b) for b in args.budgets.split(",")] if args.budgets else None
    path = study(args.model, args.device, args.profile, args.trials, args.full_bits.split(","), Path(args.out),
                 weighted)
    report(path)


if __name__ == "__main__":
    main()
