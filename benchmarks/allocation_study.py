"""The allocator campaign against the best uniform config, the pure proxy allocation and pnmix-paper.

    python benchmarks/allocation_study.py --device cuda --out DIR [--trials 10]   # GPU: campaigns + rescoring
    python benchmarks/allocation_study.py --report DIR/allocation_study.json     # anywhere: table and plot

On the embedded model, full profile, seed 0 (the ground truth's items and trajectories), one
evaluator for everything, so every score below is on the same items and every difference is paired:
  key   a `pnmix-alloc` campaign over the key budgets 1.5, 2.0, 2.25, 2.263 (pnmix-paper's bits),
        2.5 and 3.0, `--trials` scored configs a budget;
  kv    a `pnmix-alloc` campaign over the KV budgets 2.25, 2.5 and 2.64 with value formats searched;
  then, per budget: the campaign's best (the most accurate point of its front), the pure proxy
  allocation (the budget's first trial: the allocator's config at the shared fields the proxy
  rates best, before any real score), the best uniform config of the ground-truth sweep within the budget
  (benchmarks/ground_truth/, 870 configs, re-scored here; under a KV budget by its KV bits) and
  pnmix-paper where it fits, each with its SE; the campaign minus each, paired.
The model's load (with the GGUF's conversion on a fresh machine) and the preparation (items
filtered by fp16, trajectories) are timed apart, then the wall time of each campaign
(sensitivity tables and every trial) is recorded, as
are the kernel specialisations the campaign's trials compiled and the compiler's seconds
(`kernels.compiles`: Triton's compilation listener). Each budget's pick is written as a config
for `qwen3-8b-shape` (its 30 layers stretched onto 36 by relative depth: layer j takes layer
floor(j * 30 / 36)'s config) to DIR/picks/, for `static_study.py --part maxbatch --config
NAME=FILE`. Resumable: a cut run keeps its campaigns
(DIR/study.db) and the JSON of every part it finished.

`--seeds 0,1,2` runs the key campaign once per campaign seed (the sampler's and the moves' order;
the items stay seed 0's), as parts `key`, `key-seed1`, ...: per budget, each run's best, the best of
all runs, each run's best minus it (paired) and the spread, so that what a recommendation owes to
the search's luck is measured. The seeds can also run as separate processes sharing one GPU (one
`--seeds N --parts key --out DIR_N` each), then `--merge DIR_0/allocation_study.json ... --out DIR`
joins their parts and reports the spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from pnmix.bits import kv_bits, mean_key_bits
from pnmix.config import PNMixConfig, preset
from pnmix.layerwise import AnyConfig, LayerwiseConfig, config_from_dict, simplest

TRUTH = Path(__file__).parent / "ground_truth" / "smollm2-135m-pnmix-full-seed0.jsonl.gz"
KEY_BUDGETS = (1.5, 2.0, 2.25, 2.263, 2.5, 3.0)
KV_BUDGETS = (2.25, 2.5, 2.64)
MODEL, LAYERS, HEAD_DIM, TARGET_LAYERS = "smollm2-135m", 30, 64, 36


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stretch(config: AnyConfig, layers: int = LAYERS, target: int = TARGET_LAYERS) -> AnyConfig:
    """`config` on a model of `target` layers: layer j takes layer floor(j * layers / target)'s config."""
    if isinstance(config, PNMixConfig):
        return config
    per = config.per_layer(layers)
    return simplest(LayerwiseConfig.from_layers([per[j * layers // target] for j in range(target)]))


def run_part(name: str, ev: Any, budgets: tuple[float, ...], trials: int, out: Path, res: dict[str, Any],
             seed: int = 0) -> None:
    import optuna

    from pnmix.storage import Database, upgrade
    from pnmix.tuner.errors import EvalError
    from pnmix.tuner.search import record as trial_record
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.fronts import front_trials
    from pnmix.tuner.search.record import Kind
    from pnmix.tuner.search.session import find_or_create_campaign
    from pnmix.tuner.search.space import ALLOCATED, SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    kv = name.startswith("kv")
    space = SearchSpace(method=ALLOCATED, budget_on="kv" if kv else "key", search_values=kv)
    spec = CampaignSpec(model=MODEL, budgets=budgets, n_trials=trials, method=ALLOCATED, profile=ev.profile.name,
                        objectives=("accuracy", "key_bits"), seed=seed, space=space)
    db = Database(f"sqlite:///{out / 'study.db'}")
    upgrade(db)
    try:
        campaign_id = find_or_create_campaign(db, spec)
    except EvalError:  # resumed with another trial count: the same campaign, run to the new count
        from dataclasses import replace

        campaign_id = find_or_create_campaign(db, replace(spec, n_trials=10))
    started = time.perf_counter()
    runner = CampaignRunner(db, db.url, campaign_id, spec, ev, progress=log)
    studies = runner.run()
    wall = time.perf_counter() - started
    tables = len(runner.allocator.tables) if runner.allocator else 0
    part: dict[str, Any] = {"budgets": list(budgets), "trials": trials, "seed": seed, "campaign_s": wall,
                            "sensitivity_s": runner.sensitivity_seconds, "sensitivity_tables": tables,
                            "kernels_compiled": runner.kernels_compiled, "compile_s": runner.compile_seconds,
                            "rows": []}
    for budget in budgets:
        study = studies[budget]
        records = [trial_record.read(t) for t in study.trials]
        own = sorted((r for r in records if r.kind in (Kind.SCORED, Kind.REUSED)), key=lambda r: r.number)
        best = max(map(trial_record.read, front_trials(study)), key=lambda r: r.accuracy or 0.0)
        proxy = next(r for r in own if r.origin == "allocation")
        part["rows"].append({
            "budget": budget, "best": summary(best), "proxy": summary(proxy),
            "origins": {o: sum(1 for r in own if r.origin == o) for o in ("allocation", "proposal", "move")},
            "trial_seconds": [r.seconds for r in own],
            "trial_compile_s": [r.timings.get("kernel_compile") for r in own],
            "scored": sum(1 for r in records if r.has_score)})
    res[name] = part
    log(f"part {name}: {wall:.0f} s, sensitivity {runner.sensitivity_seconds:.1f} s in {tables} tables")


def part_name(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}-seed{seed}"


def robustness(res: dict[str, Any], seeds: list[int]) -> None:
    """Per key budget across the campaign seeds: each run's best, the best of all runs, each run's best
    minus it (paired on the same items) and the spread (most minus least accurate best)."""
    from pnmix.tuner.scoring.stats import paired

    parts = [res[part_name("key", s)] for s in seeds if part_name("key", s) in res]
    rows = []
    for i, budget in enumerate(parts[0]["budgets"]):
        bests = [p["rows"][i]["best"] for p in parts]
        top = max(bests, key=lambda b: b["accuracy"])
        minus = [list(paired(b["units"], top["units"])["accuracy"]) for b in bests]
        accs = [b["accuracy"] for b in bests]
        rows.append({"budget": budget, "bests": [{k: b[k] for k in ("label", "bits", "accuracy", "accuracy_se",
                                                                  "origin", "trial")} for b in bests],
                     "minus_top": minus, "spread": max(accs) - min(accs),
                     "within_1se": all(d >= -se - 1e-12 for d, se in minus)})
        log(f"seeds {budget:g}: " + ", ".join(f"{b['accuracy']:.3f} ({d:+.3f} +- {se:.3f})"
                                              for b, (d, se) in zip(bests, minus, strict=True)))
    res["robustness"] = {"seeds": seeds[:len(parts)], "campaign_s": [p["campaign_s"] for p in parts], "rows": rows}


def summary(r: Any) -> dict[str, Any]:
    """What the study keeps of a trial's record (tuner/search/record.py)."""
    return {"trial": r.number, "config": r.config_dict, "label": r.config.label, "bits": r.bits,
            "key_bits": r.key_bits, "kv_bits": r.kv_bits, "accuracy": r.accuracy, "accuracy_se": r.accuracy_se,
            "units": r.units, "origin": r.origin}


def compare(ev: Any, res: dict[str, Any]) -> None:
    """Per budget of each part: the ground truth's best uniform config and pnmix-paper, re-scored on
    the same items, and the campaign's best minus each (paired)."""
    from pnmix.tuner.scoring.stats import paired
    from pnmix.tuner.search.sweep import read_sweep

    truth = read_sweep(TRUTH)
    scores: dict[str, Any] = {}

    def score(cfg: PNMixConfig) -> dict[str, Any]:
        key = cfg.to_json()
        if key not in scores:
            s = ev.evaluate(cfg, measure=False)
            scores[key] = {"config": cfg.to_dict(), "label": cfg.label, "key_bits": s.key_bits,
                           "kv_bits": kv_bits(cfg, LAYERS, HEAD_DIM), "accuracy": s.accuracy,
                           "accuracy_se": s.accuracy_se, "units": s.units}
        return scores[key]

    paper = preset("pnmix-paper")
    for name in ("key", "kv"):
        for row in res.get(name, {}).get("rows", []):
            budget = row["budget"]
            figure = "kv_bits" if name == "kv" else "key_bits"

            def bits_of(cfg: PNMixConfig, figure: str = figure) -> float:
                return kv_bits(cfg, LAYERS, HEAD_DIM) if figure == "kv_bits" else mean_key_bits(cfg, LAYERS, HEAD_DIM)

            fits = [r for r in truth.records if bits_of(PNMixConfig.from_dict(r["config"])) <= budget + 1e-9]
            uniform = PNMixConfig.from_dict(max(fits, key=lambda r: r["accuracy"])["config"])
            row["uniform"] = score(uniform)
            row["paper"] = score(paper) if bits_of(paper) <= budget + 1e-9 else None
            row["minus"] = {}
            for other in ("uniform", "proxy", "paper"):
                if row.get(other):
                    diff, se = paired(row["best"]["units"], row[other]["units"])["accuracy"]
                    row["minus"][other] = [diff, se]
            log(f"{name} {budget:g}: best {row['best']['accuracy']:.3f} ({row['best']['label'][:60]}); "
                + "; ".join(f"- {k} {d:+.3f} +- {s:.3f}" for k, (d, s) in row["minus"].items()))


def write_picks(res: dict[str, Any], out: Path) -> None:
    picks = out / "picks"
    picks.mkdir(exist_ok=True)
    for name in ("key", "kv"):
        for row in res.get(name, {}).get("rows", []):
            cfg = stretch(config_from_dict(row["best"]["config"]))
            (picks / f"{name}-{row['budget']:g}.json").write_text(cfg.to_json() + "\n")


def report(path: Path) -> None:
    """The RESULTS table and the plot from a study JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(path.read_text())
    lines = ["| budget | campaign's best | bits | accuracy +- SE | minus best uniform | minus pure proxy allocation "
             "| minus pnmix-paper |", "| --- | --- | --- | --- | --- | --- | --- |"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name in zip(axes, ("key", "kv"), strict=True):
        rows = res.get(name, {}).get("rows", [])
        for row in rows:
            m = row.get("minus", {})

            def cell(k: str, m: dict[str, Any] = m) -> str:
                if k not in m:
                    return "-"
                d, s = m[k]
                return f"**{d:+.3f} +- {s:.3f}**" if abs(d) > 2 * s else f"{d:+.3f} +- {s:.3f}"

            b = row["best"]
            lines.append(f"| {row['budget']:g} {name} | {b['label']} | {b['bits']:.3f} | {b['accuracy']:.3f} +- "
                         f"{b['accuracy_se']:.3f} | {cell('uniform')} | {cell('proxy')} | {cell('paper')} |")
        for key, label, marker in (("best", "campaign's best", "D"), ("proxy", "pure proxy allocation", "s"),
                                   ("uniform", "best uniform (ground truth)", "o"), ("paper", "pnmix-paper", "^")):
            pts = [(r[key]["kv_bits" if name == "kv" else "key_bits"], r[key]["accuracy"], r[key]["accuracy_se"] or 0)
                   for r in rows if r.get(key)]
            if pts:
                xs, ys, es = zip(*pts, strict=True)
                ax.errorbar(xs, ys, yerr=es, fmt=marker, capsize=3, label=label)
        ax.set(xlabel="KV bits per element" if name == "kv" else "key bits per element", ylabel="accuracy (+- SE)",
               title=f"{name} budgets")
        ax.grid(alpha=0.3)
        if rows:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    rob = res.get("robustness")
    if rob:  # the key campaign at several seeds
        lines += ["", "| key budget | " + " | ".join(f"seed {s}: best, minus the best of all" for s in rob["seeds"])
                  + " | spread | every run within 1 SE |", "| --- |" + " --- |" * (len(rob["seeds"]) + 2)]
        for row in rob["rows"]:
            cells = [f"{b['label']} ({b['bits']:.3f}): {b['accuracy']:.3f}, {d:+.3f} +- {se:.3f}"
                     for b, (d, se) in zip(row["bests"], row["minus_top"], strict=True)]
            lines.append(f"| {row['budget']:g} | " + " | ".join(cells)
                         + f" | {row['spread']:.3f} | {'yes' if row['within_1se'] else 'no'} |")
        lines.append(f"\ncampaign seconds by seed: {', '.join(f'{x:.0f}' for x in rob['campaign_s'])}")
    table = "\n".join(lines)
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    for name in ("key", "kv"):
        part = res.get(name)
        if part:
            print(f"{name}: campaign {part['campaign_s']:.0f} s (sensitivity {part['sensitivity_s']:.1f} s in "
                  f"{part['sensitivity_tables']} tables; {part.get('kernels_compiled')} kernel specialisations "
                  f"compiled in {part.get('compile_s', 0):.0f} s)")
    print(f"model load {res.get('model_load_s', 0):.0f} s, preparation {res.get('preparation_s', 0):.0f} s; "
          f"{res.get('env')}")


def merge(paths: list[str], out: Path) -> None:
    """One study from studies run apart (one campaign seed each): every part (the first file's where
    two hold the same one), then the key parts' robustness across their seeds."""
    res: dict[str, Any] = {}
    for name in paths:
        for key, value in json.loads(Path(name).read_text()).items():
            res.setdefault(key, value)
    seeds = sorted(part["seed"] for key, part in res.items() if key.split("-")[0] == "key")
    if len(seeds) > 1:
        robustness(res, seeds)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "allocation_study.json"
    path.write_text(json.dumps(res))
    report(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--parts", default="key,kv,compare")
    ap.add_argument("--key-budgets", default=",".join(f"{b:g}" for b in KEY_BUDGETS))
    ap.add_argument("--kv-budgets", default=",".join(f"{b:g}" for b in KV_BUDGETS))
    ap.add_argument("--out", default=os.environ.get("OUT", "out/allocation_study"))
    ap.add_argument("--seeds", default="0", help="campaign seeds of the key part, comma-separated")
    ap.add_argument("--report", metavar="JSON")
    ap.add_argument("--merge", metavar="JSON", nargs="+", help="studies run apart, joined into --out")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, Path(args.out))
        return
    if args.report:
        report(Path(args.report))
        return
    import torch
    import transformers

    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "allocation_study.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    res["env"] = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    started = time.perf_counter()
    ev = Evaluator(MODEL, profile(args.profile), 0, device=args.device, progress=log)
    loaded = time.perf_counter()
    ev.prepare()
    res.setdefault("model_load_s", loaded - started)
    res.setdefault("preparation_s", time.perf_counter() - loaded)
    log(f"model load {loaded - started:.0f} s (the GGUF's conversion included on a fresh machine), "
        f"preparation {time.perf_counter() - loaded:.0f} s")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [(part_name("key", seed), args.key_budgets, seed) for seed in seeds] + [("kv", args.kv_budgets, 0)]
    for name, text, seed in runs:
        budgets = tuple(float(b) for b in text.split(","))
        if name.split("-")[0] in args.parts.split(",") and name not in res:
            run_part(name, ev, budgets, args.trials, out, res, seed)
            path.write_text(json.dumps(res))
    if len(seeds) > 1:
        robustness(res, seeds)
    if "compare" in args.parts.split(","):
        compare(ev, res)
        write_picks(res, out)
    path.write_text(json.dumps(res))
    report(path)


if __name__ == "__main__":
    main()
