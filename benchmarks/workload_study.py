"""Own-workload study: held-out scores of a campaign's picks, and the texts part's cost per token.

    python -P benchmarks/workload_study.py --part holdout --out out/workload [--trials 5] [--device cuda]
    python -P benchmarks/workload_study.py --part cost --out out/workload [--device cuda]

holdout: the default campaign (`pnmix tune --profile full`, its default budgets and method, a
quarter of every task's units held out) with --trials trials a budget, run through the CLI into a
fresh SQLite database in OUT; then each budget's recommended point: its in-search accuracy, its
held-out accuracy, the gap (held-out minus in-search, with the SE of both) in standard errors, and
pnmix-paper on the held-out units. Writes OUT/holdout.json and OUT/holdout.md.

cost: one evaluator with the fidelity part and a texts part (the repository's own documentation
as the texts, one document a file, the default lengths: the model's context / 8 and / 16, at most
1024 and 512 tokens), each config scored twice (the first compiles kernels); seconds per
teacher-forced token of each part from the second score's timings. Writes OUT/cost.json and
OUT/cost.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = ("README.md", "docs/*.md", "benchmarks/RESULTS.md")


def environment() -> dict[str, str]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.now(UTC).strftime("%Y-%m-%d")}


def holdout(out: Path, trials: int, model: str) -> None:
    db = out / "campaign.db"
    db.unlink(missing_ok=True)
    url = f"sqlite:///{db}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-m", "pnmix.api.cli", "tune", "--model", model, "--profile", "full",
                    "--trials", str(trials), "--storage", url, "--plot", str(out / "campaign.png")], check=True)
    seconds = time.perf_counter() - t0
    from pnmix.storage import Database, list_front_points

    rows = []
    database = Database(url)
    with database.session(readonly=True) as s:
        points = list_front_points(s, model, limit=500).items
        for p in sorted((p for p in points if p.holdout_accuracy is not None), key=lambda p: p.budget):
            held = p.holdout_summary()
            assert held is not None
            gap, gap_se = held["minus_in_search"], held["minus_in_search_se"]
            paper = held["pnmix_paper"] or {}
            rows.append({"budget": p.budget, "config": p.config.label, "key_bits": p.key_bits,
                         "in_search": p.accuracy, "in_search_se": p.accuracy_se,
                         "held_out": held["accuracy"], "held_out_se": held["accuracy_se"], "units": held["units"],
                         "gap": gap, "gap_se": gap_se, "gap_in_se": gap / gap_se if gap_se else None,
                         "holds": held["holds"], "paper_held_out": paper.get("accuracy"),
                         "minus_paper": paper.get("diff"), "minus_paper_se": paper.get("diff_se")})
    database.dispose()
    report = {"environment": environment(), "model": model, "trials": trials, "seconds": seconds, "rows": rows}
    (out / "holdout.json").write_text(json.dumps(report, indent=1))
    lines = ["| budget | pick | key bits | in-search | held-out | held-out - in-search | in SE | "
             "pick - pnmix-paper (held-out, paired) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        paper = (f"{r['minus_paper']:+.3f} +- {r['minus_paper_se']:.3f}" if r["minus_paper"] is not None
                 and r["minus_paper_se"] is not None else "-")
        lines.append(f"| {r['budget']:g} | {r['config']} | {r['key_bits']:.3f} | {r['in_search']:.3f} +- "
                     f"{r['in_search_se']:.3f} | {r['held_out']:.3f} +- {r['held_out_se']:.3f} | {r['gap']:+.3f} +- "
                     f"{r['gap_se']:.3f} | {r['gap_in_se']:+.1f} | {paper} |")
    (out / "holdout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"campaign {seconds:.0f} s; held-out units {rows[0]['units'] if rows else '-'}")


def cost(out: Path, device: str, model: str) -> None:
    from pnmix.config import PNMixConfig, preset
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.scoring.texts import TextsTask

    docs = out / "docs.jsonl"
    files = sorted({p for pattern in DOC_FILES for p in ROOT.glob(pattern)})
    docs.write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in files))
    configs = {"pnmix-paper": preset("pnmix-paper"),
               "2/1 G64 r0.5": PNMixConfig(b_high=2, b_low=1, group_size=64, salient_ratio=0.5, n_sink=32,
                                           residual_len=128),
               "fp16": preset("fp16")}
    rows = []
    # The default lengths, then a prefix as short as the fidelity prompts (~40 tokens), which
    # separates the machinery's cost from that of the longer context the texts part quantizes.
    for task in (TextsTask(str(docs)), TextsTask(str(docs), 40, 512)):
        ev = Evaluator(model, profile("full"), tasks=("fidelity", "texts"), texts=task, device=device)
        ev.prepare()
        prefix, _ = task.lengths(ev.engine.context)
        fid_tokens = sum(int(t.tokens.numel()) for t in ev.engine.replays["fidelity"])
        text_tokens = sum(int(t.tokens.numel()) for t in ev.engine.replays["texts"])
        fid_prompt = sum(len(t.prompt_ids) for t in ev.engine.replays["fidelity"]) / len(ev.engine.trajectories)
        for name, config in configs.items():
            ev.evaluate(config, measure=False)  # compiles the kernel specialisations of this config
            best: dict[str, float] = {}
            for _ in range(3):
                t = ev.evaluate(config, measure=False).timings
                for part in ("fidelity", "texts"):
                    best[part] = min(best.get(part, float("inf")), t[part])
            per = {part: best[part] / n for part, n in (("fidelity", fid_tokens), ("texts", text_tokens))}
            rows.append({"config": name, "texts_prefix": prefix, "fidelity_prompt": fid_prompt,
                         "documents": len(ev.engine.replays["texts"]), "trajectories": len(ev.engine.trajectories),
                         "fidelity_s": best["fidelity"], "texts_s": best["texts"],
                         "fidelity_us_per_token": per["fidelity"] * 1e6, "texts_us_per_token": per["texts"] * 1e6,
                         "texts_over_fidelity": per["texts"] / per["fidelity"]})
        del ev
    report = {"environment": environment(), "model": model, "rows": rows}
    (out / "cost.json").write_text(json.dumps(report, indent=1))
    lines = ["| config | texts prefix | fidelity s (8 x 512) | texts s (docs x 512) | fidelity us/token | "
             "texts us/token | texts / fidelity |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['config']} | {r['texts_prefix']} | {r['fidelity_s']:.3f} | {r['texts_s']:.3f} | "
              f"{r['fidelity_us_per_token']:.1f} | {r['texts_us_per_token']:.1f} | {r['texts_over_fidelity']:.2f} |"
              for r in rows]
    (out / "cost.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(report["environment"]), rows[0]["documents"], "documents,", rows[0]["trajectories"],
          "trajectories")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("holdout", "cost"), required=True)
    parser.add_argument("--out", type=Path, default=Path("out/workload"))
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "holdout":
        holdout(args.out, args.trials, args.model)
    else:
        cost(args.out, args.device, args.model)


if __name__ == "__main__":
    main()
