"""The engine study: per-layer KV formats the serving engines load, chosen by measured accuracy,
against the uniform formats, vLLM's two-level recipes, Model-Optimizer's KL rule and PN-Mix, on one
model, paired on the same items, with held-out scores.

    python benchmarks/engine_study.py --model smollm2-135m --profile full --device cuda --out DIR
    python benchmarks/engine_study.py --report DIR/engine_study-smollm2-135m.json   # table and plot

Budgets are effective KV bits per element (Model-Optimizer's `kv_effective_bits`: bf16 16, FP8 8,
NVFP4 4.5, q8_0 8.5, q4_0 4.5; weighted by the tokens each layer holds on a hybrid model). One
evaluator scores everything (the profile's items and trajectories, seed 0, a quarter of every
part's units held out), so every difference is paired. Per budget:
  tuned    the `engine` campaign's most accurate recipe within the budget, with its held-out score
  vllm     the campaign's most accurate recipe vLLM loads as it is (`--format vllm`: one quantized
           dtype and bf16 skip layers), its flag line and held-out score, and what `pnmix export
           --format vllm` prints (the fewest bits among the recipes tied with it)
  uniform  every uniform format that fits (all FP8, FP8 keys + NVFP4 values, all NVFP4, q8_0, q4_0):
           the most accurate of them
  kl-rule  Model-Optimizer's rule: each layer's forward KL on calibration text with that layer alone
           in a format (the others bf16), the knapsack under the budget over FP8, FP8/NVFP4 and NVFP4
           (calibration text: the first two fidelity trajectories, prompt and fp16 continuation;
           `Evaluator.format_kl`). The engine campaign scores this recipe among its warm starts.
  pnmix    the `pnmix-alloc` campaign's pick under the same KV budget (value formats searched,
           `--pnmix-trials` a budget), and pnmix-paper at its own bits
  fp16
Resumable: the campaigns live in DIR/engine-MODEL.db, the other scores in DIR/scores-MODEL-PROFILE.json.
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

BUDGETS = "4.5,5.4,6.25,8,9"  # 9: FP8 with a few bf16 layers, the question vLLM's skip list asks


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def campaign(method: str, ev: Any, budgets: tuple[float, ...], trials: int, db: Any) -> dict[str, Any]:
    """The campaign's studies by budget (resumed where the database has it), under KV budgets."""
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.session import find_or_create_campaign
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    space = SearchSpace(method=method, budget_on="kv", search_values=method != "engine")
    spec = CampaignSpec(model=ev.model_name, budgets=budgets, n_trials=trials, method=method, profile=ev.profile.name,
                        seed=ev.seed, holdout=ev.holdout, space=space, objectives=("accuracy", "kv_bits"),
                        tasks=ev.tasks)
    campaign_id = find_or_create_campaign(db, spec)
    started = time.perf_counter()
    studies = CampaignRunner(db, db.url, campaign_id, spec, ev, progress=log).run()
    seconds = time.perf_counter() - started
    log(f"{method} campaign: {seconds:.0f} s")
    return {"campaign_id": campaign_id, "studies": studies, "seconds": seconds}


SCORES: dict[str, Any] = {}  # what this study scored, by config and split: kept on disk, so a resumed run reuses it


def scored(ev: Any, config: Any, label: str, held: bool = False) -> dict[str, Any]:
    """`config` scored on the search units (and, `held`, on the held-out ones)."""
    key = json.dumps({"config": config.to_dict(), "held": held}, sort_keys=True)
    if key not in SCORES:
        SCORES[key] = _score(ev, config, held)
        if CACHE is not None:
            CACHE.write_text(json.dumps(SCORES))
    return {**SCORES[key], "label": label}


CACHE: Path | None = None


def _score(ev: Any, config: Any, held: bool) -> dict[str, Any]:
    from pnmix.configs import key_bits, kv_bits
    from pnmix.tuner.scoring.score import Split

    s = ev.evaluate(config, measure=False)
    out = {"config": config.to_dict(), "kv_bits": kv_bits(config, ev.plan, ev.head_dim),
           "key_bits": key_bits(config, ev.plan, ev.head_dim), "accuracy": s.accuracy, "accuracy_se": s.accuracy_se,
           "units": s.units}
    if held:
        h = ev.evaluate(config, measure=False, which=Split.HOLDOUT)
        out["holdout"] = {"accuracy": h.accuracy, "accuracy_se": h.accuracy_se}
    return out


def kl_rule(ev: Any, budget: float) -> Any:
    """Model-Optimizer's rule (`modelopt_rule`) over each layer's forward KL per format pair
    (`Evaluator.format_kl`, tuner/scoring/layer_kl.py), weighted as the engine campaign weighs layers."""
    from pnmix.tuner.search.methods import POOLS
    from pnmix.tuner.search.recipe_alloc import WEIGHT_TOKENS, modelopt_rule

    weights = [float(w) for w in ev.plan.held(WEIGHT_TOKENS)]
    return modelopt_rule(ev.format_kl(list(POOLS["modelopt"].pairs)), budget, weights)


def study(model: str, device: str, profile_name: str, trials: int, pnmix_trials: int, budgets: tuple[float, ...],
          out: Path, tasks: tuple[str, ...] | None = None) -> Path:
    global CACHE
    import optuna
    import torch

    from pnmix.config import preset
    from pnmix.recipes import EngineRecipe, export
    from pnmix.storage import Database, recommend, recommend_with_ties, upgrade
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.scoring.stats import paired
    from pnmix.tuner.search.methods import POOLS, UNIFORM

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(model).name  # a checkpoint directory's own name
    CACHE = out / f"scores-{name}-{profile_name}.json"
    if CACHE.is_file():
        SCORES.update(json.loads(CACHE.read_text()))
    res: dict[str, Any] = {"model": model, "profile": profile_name, "trials": trials, "pnmix_trials": pnmix_trials,
                           "device": device, "budgets": list(budgets)}
    t0 = time.perf_counter()
    ev = Evaluator(model, profile(profile_name), device=device, holdout=0.25, progress=log, tasks=tasks)
    ev.prepare()
    res["preparation_s"] = time.perf_counter() - t0
    res["plan"] = {"kinds": list(ev.plan.kinds), "window": ev.plan.window}
    db = Database(f"sqlite:///{out / f'engine-{name}.db'}")
    upgrade(db)
    runs = {m: campaign(m, ev, budgets, n, db) for m, n in (("engine", trials), ("pnmix-alloc", pnmix_trials))}
    res["campaign_s"] = {m: r["seconds"] for m, r in runs.items()}
    t0 = time.perf_counter()
    for pair, row in ev.format_kl(list(POOLS["modelopt"].pairs)).items():  # computed, or read from the cache
        log(f"KL rule: {pair.key}/{pair.value} per layer {[round(x, 5) for x in row]}")
    res["kl_rule_s"] = time.perf_counter() - t0
    n = ev.num_layers
    refs: dict[str, Any] = {"fp16": scored(ev, preset("fp16"), "fp16"),
                            "pnmix-paper": scored(ev, preset("pnmix-paper"), "pnmix-paper")}
    uniform = {f"{k}/{v}": scored(ev, EngineRecipe.uniform(n, k, v), f"all {k}" if k == v else f"{k}/{v}")
               for k, v in UNIFORM}
    res["uniform"], res["references"] = uniform, refs
    rows = []
    for budget in budgets:
        row: dict[str, Any] = {"budget": budget}
        with db.session(readonly=True) as s:
            # the campaign's most accurate recipe within the budget (`recommend` would take the fewest
            # bits among those tied with it: the comparison with the uniform formats wants the best)
            best = recommend_with_ties(s, model, budget, bits_of="kv", campaign_id=runs["engine"]["campaign_id"]).best
            row["tuned"] = {**scored(ev, best.config, best.config.label, held=True), "trial": best.trial_number}
            try:  # vLLM's most accurate two-level recipe, and what `pnmix export --format vllm` prints
                rec = recommend_with_ties(s, model, budget, bits_of="kv", campaign_id=runs["engine"]["campaign_id"],
                                          engine="vllm")
                row["vllm"] = {**scored(ev, rec.best.config, rec.best.config.label, held=True),
                               "flags": export(rec.best.config, "vllm"), "exported": export(rec.point.config, "vllm")}
            except LookupError:
                pass
            best_pnmix = recommend(s, model, budget, bits_of="kv", campaign_id=runs["pnmix-alloc"]["campaign_id"])
            row["pnmix"] = scored(ev, best_pnmix.config, best_pnmix.config.label)
        fits = {k: u for k, u in uniform.items() if u["kv_bits"] <= budget + 1e-9}
        if fits:
            row["uniform"] = max(fits.values(), key=lambda u: u["accuracy"])
        rule = kl_rule(ev, budget)
        row["kl-rule"] = scored(ev, rule, rule.label)
        row["fp16"] = refs["fp16"]
        if refs["pnmix-paper"]["kv_bits"] <= budget:
            row["pnmix-paper"] = refs["pnmix-paper"]
        row["minus"] = {k: list(paired(row["tuned"]["units"], row[k]["units"])["accuracy"])
                        for k in ("uniform", "vllm", "kl-rule", "pnmix", "pnmix-paper", "fp16") if k in row}
        row["uniform_minus_fp16"] = (list(paired(row["uniform"]["units"], refs["fp16"]["units"])["accuracy"])
                                     if "uniform" in row else None)
        rows.append(row)
        log(f"{budget:g}: tuned {row['tuned']['accuracy']:.3f} ({row['tuned']['label'][:60]}); "
            + "; ".join(f"- {k} {d:+.3f} +- {se:.3f}" for k, (d, se) in row["minus"].items()))
    res["rows"] = rows
    res["env"] = {"torch": torch.__version__, "python": platform.python_version(),
                  "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
                  "date": datetime.date.today().isoformat()}
    path = out / f"engine_study-{name}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    return path


def report(path: Path) -> None:
    """The RESULTS table and the plot from a study JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(path.read_text())

    def cell(m: dict[str, Any], k: str) -> str:
        if m.get(k) is None:
            return "-"
        d, s = m[k]
        return f"**{d:+.3f} +- {s:.3f}**" if s and abs(d) > 2 * s else f"{d:+.3f} +- {s:.3f}"

    def held(x: dict[str, Any]) -> str:
        h = x.get("holdout")
        if not h:
            return "-"
        se = math.hypot(h["accuracy_se"] or 0.0, x["accuracy_se"] or 0.0)  # disjoint units
        return f"{h['accuracy'] - x['accuracy']:+.3f} +- {se:.3f}"

    lines = [f"{res['model']}, profile {res['profile']}, {res['trials']} trials a budget a campaign; "
             f"{res['env']['gpu']}, torch {res['env']['torch']}, {res['env']['date']}", "",
             "| budget (KV bits) | tuned recipe | bits | accuracy +- SE | held-out minus in-search | minus best "
             "uniform (which) | minus vLLM two-level | minus KL rule | minus PN-Mix there | minus fp16 | best uniform "
             "minus fp16 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    vllm_lines = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in res["rows"]:
        t, m = row["tuned"], row["minus"]
        u = row.get("uniform")
        um = row.get("uniform_minus_fp16")
        lines.append(f"| {row['budget']:g} | {t['label']} | {t['kv_bits']:.2f} | {t['accuracy']:.3f} +- "
                     f"{t['accuracy_se']:.3f} | {held(t)} | {cell(m, 'uniform')}"
                     f"{' (' + u['label'] + ')' if u else ''} | {cell(m, 'vllm')} | {cell(m, 'kl-rule')} | "
                     f"{cell(m, 'pnmix')} | {cell(m, 'fp16')} | "
                     f"{'-' if um is None else cell({'x': um}, 'x')} |")
        if "vllm" in row:
            v = row["vllm"]
            vllm_lines.append(f"- {row['budget']:g} bits: `{v['flags']}` ({v['kv_bits']:.2f} bits, "
                              f"{v['accuracy']:.3f} +- {v['accuracy_se']:.3f}, held-out minus in-search {held(v)}); "
                              f"`pnmix export --format vllm` prints `{v['exported']}` (the fewest bits among the "
                              "recipes tied with it)")
    series = (("tuned", "tuned recipe", "D"), ("uniform", "best uniform format", "o"), ("vllm", "vLLM two-level", "s"),
              ("kl-rule", "Model-Optimizer's KL rule", "^"), ("pnmix", "PN-Mix (pnmix-alloc)", "v"))
    for key, label, marker in series:
        pts = [(r[key]["kv_bits"], r[key]["accuracy"], r[key]["accuracy_se"] or 0) for r in res["rows"] if key in r]
        if pts:
            xs, ys, es = zip(*pts, strict=True)
            ax.errorbar(xs, ys, yerr=es, fmt=marker, capsize=3, label=label, alpha=0.85)
    p = res["references"]["pnmix-paper"]
    ax.errorbar([p["kv_bits"]], [p["accuracy"]], yerr=[p["accuracy_se"] or 0], fmt="*", capsize=3, label="pnmix-paper")
    ax.axhline(res["references"]["fp16"]["accuracy"], color="grey", ls="--", lw=1, label="fp16")
    ax.set(xlabel="effective KV bits per element (32K tokens)", ylabel="accuracy (+- SE)",
           title=f"{res['model']}: engine recipes, {res['profile']} profile")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    table = "\n".join(lines + ["", "vLLM's flags for its most accurate two-level recipe:", *vllm_lines])
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"preparation {res['preparation_s']:.0f} s, campaigns "
          + ", ".join(f"{m} {s:.0f} s" for m, s in res["campaign_s"].items()) + f", KL rule {res['kl_rule_s']:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--trials", type=int, default=5, help="the engine campaign's trials a budget")
    ap.add_argument("--pnmix-trials", type=int, default=3, help="the pnmix-alloc campaign's trials a budget")
    ap.add_argument("--budgets", default=BUDGETS, help="effective KV bits, comma-separated")
    ap.add_argument("--tasks", help="comma-separated parts (default: the profile's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/engine_study"))
    ap.add_argument("--report", metavar="JSON")
    args = ap.parse_args()
    if args.report:
        report(Path(args.report))
        return
    budgets = tuple(float(b) for b in args.budgets.split(","))
    tasks = tuple(args.tasks.split(",")) if args.tasks else None
    report(study(args.model, args.device, args.profile, args.trials, args.pnmix_trials, budgets, Path(args.out), tasks))


if __name__ == "__main__":
    main()
