"""One trial's wall time by part: the batched scoring engine against the per-item reference path.

    python benchmarks/bench_trial.py --device cpu --profile quick --out DIR
    python benchmarks/bench_trial.py --device cuda --profile full --reference pnmix-paper \\
        --equality-items 24 --shape-model qwen3-8b-shape --out DIR

For the embedded model it prepares the profile (filtered items, fp16 trajectories, one exact
prefill per prompt), then scores every config of --configs through the engine (accuracy parts
with standard errors, cost workload included) and the configs of --reference also through the
per-item reference path on the same items, in the same run. --equality-items N compares the
engine's greedy answers with per-item `generate` answers on the first N items of each task for
every config, with the model in fp32 (the equality figure of the engine). --shape-model times a
full-profile-sized synthetic workload on a random-weight model (items of the embedded profile's
prompt lengths, random token ids; timing only, its answers mean nothing), engine and reference
(the reference on --shape-reference-items items a task, per-item time reported).
Writes bench_trial.json and bench_trial.log to --out; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

CONFIGS = "fp16,kivi2,pnmix-paper,kitty,kivi1"
LOG: list[str] = []
LOG_FILE: list[Path] = []  # written through, so a run cut short keeps what it measured


def log(message: str) -> None:
    print(message, flush=True)
    LOG.append(message)
    if LOG_FILE:
        with LOG_FILE[0].open("a") as f:
            f.write(message + "\n")


def environment(device: str) -> dict[str, Any]:
    import transformers

    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": device}
    if device == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, triton=triton.__version__)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_embedded(args: argparse.Namespace, res: dict[str, Any]) -> Any:
    from pnmix.config import preset
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile

    t0 = time.perf_counter()
    ev = Evaluator("smollm2-135m", profile(args.profile), seed=0, device=args.device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = ev.prepare()
    sync(args.device)
    prep_s = time.perf_counter() - t0
    counts = {k: len(v) for k, v in data["items"].items()}
    res["embedded"] = {"load_s": load_s, "prepare_s": prep_s, "items": counts,
                       "trajectories": len(data["trajectories"]), "state_bytes": ev.engine.state_bytes(),
                       "configs": {}}
    log(f"embedded model, profile {args.profile}: load {load_s:.1f} s, prepare {prep_s:.1f} s, items {counts}, "
        f"{len(data['trajectories'])} trajectories, states {ev.engine.state_bytes() / 2**20:.0f} MiB")
    for name in args.configs.split(","):
        row: dict[str, Any] = {}
        row["first_seconds"] = float("nan")
        if args.device == "cuda":
            # First use of a config compiles its kernel specialisations (cached on disk after): timed apart.
            sync(args.device)
            t0 = time.perf_counter()
            ev.evaluate(preset(name))
            sync(args.device)
            row["first_seconds"] = time.perf_counter() - t0
        for path in ("engine", "reference") if name in args.reference.split(",") else ("engine",):
            sync(args.device)
            t0 = time.perf_counter()
            score = ev.evaluate(preset(name), reference=path == "reference")
            sync(args.device)
            row[path] = {"seconds": time.perf_counter() - t0, "timings": score.timings, "accuracy": score.accuracy,
                         "accuracy_se": score.accuracy_se, "parts": score.parts, "parts_se": score.parts_se,
                         "units": score.units, "kv_bytes": score.kv_bytes,
                         "tokens_per_s": score.decode_tokens_per_s, "peak_bytes": score.peak_memory_bytes}
            parts = " ".join(f"{k} {v:.3f}+-{(score.parts_se.get(k) or 0):.3f}" for k, v in score.parts.items())
            log(f"  {name:12s} {path:9s} {row[path]['seconds']:7.2f} s (first {row['first_seconds']:.1f} s)  "
                f"accuracy {score.accuracy:.3f} +- "
                f"{score.accuracy_se or 0:.3f}  {parts}  by part "
                + " ".join(f"{k} {v:.2f}" for k, v in score.timings.items()))
        if "reference" in row:
            same = {k: sum(a == b for a, b in zip(row["engine"]["units"][k], row["reference"]["units"][k],
                                                  strict=True)) / len(row["engine"]["units"][k])
                    for k in row["engine"]["units"] if k != "fidelity"}
            kl = [abs(a - b) for a, b in zip(row["engine"]["units"].get("fidelity", []),
                                             row["reference"]["units"].get("fidelity", []), strict=True)]
            row["same_outcomes"] = same
            row["fidelity_kl_max_abs_diff"] = max(kl, default=0.0)
            row["speedup"] = row["reference"]["seconds"] / row["engine"]["seconds"]
            log(f"  {name}: reference / engine = {row['speedup']:.1f}x; same item outcomes {same}; "
                f"fidelity KL max |diff| {row['fidelity_kl_max_abs_diff']:.2e}")
        res["embedded"]["configs"][name] = row
    return ev


def bench_equality(args: argparse.Namespace, ev: Any, res: dict[str, Any]) -> None:
    """Engine answers vs per-item `generate` answers, model in fp32, first N items of each task."""
    from pnmix import models
    from pnmix.config import preset
    from pnmix.tuner.scoring import tasks
    from pnmix.tuner.scoring.engine import ScoringEngine

    lm = models.load("smollm2-135m", dtype=torch.float32, device=args.device)
    engine = ScoringEngine(lm.model, lm.tokenizer)
    items = {name: its[: args.equality_items] for name, its in ev.prepare()["items"].items()}
    for name, its in items.items():
        engine.add_items(name, its)
    same = total = 0
    per_config = {}
    for cfg_name in args.configs.split(","):
        cfg = preset(cfg_name)
        s = t = 0
        for task, its in items.items():
            for item, text in zip(its, engine.answers(cfg, task), strict=True):
                s += text == tasks.answer(lm.model, lm.tokenizer, cfg, item)
                t += 1
        per_config[cfg_name] = (s, t)
        same, total = same + s, total + t
        log(f"  equality fp32 {cfg_name}: {s}/{t} answers equal")
    res["equality_fp32"] = {"same": same, "total": total, "per_config": per_config}
    log(f"equality fp32: {same}/{total} = {same / total:.3f} of engine answers equal the per-item answers")
    del lm, engine


def bench_shape(args: argparse.Namespace, ev: Any, res: dict[str, Any]) -> None:
    """A full-profile-sized synthetic workload on a random-weight model: timing only."""
    from pnmix import models
    from pnmix.config import preset
    from pnmix.generation import generate
    from pnmix.tuner.scoring.engine import ScoringEngine, Trajectory
    from pnmix.tuner.scoring.fidelity import reference_logits, replay
    from pnmix.tuner.scoring.tasks import Item

    lm = models.load(args.shape_model, purpose="performance", dtype=torch.bfloat16, device=args.device)
    model = lm.model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    engine = ScoringEngine(model, None)
    t0 = time.perf_counter()
    lengths: dict[str, list[int]] = {}
    for task in ("passkey", "kv_lookup"):
        its = ev.engine.items[task]
        lengths[task] = [s.length for s in ev.engine.states[task]]
        ids = [torch.randint(100, vocab - 1, (n,), generator=gen).tolist() for n in lengths[task]]
        engine.add_items(task, [Item(task, "", "-", it.max_new_tokens) for it in its], prompt_ids=ids)
    trajs = []
    for t in ev.engine.trajectories:
        prompt = torch.randint(100, vocab - 1, (1, t.state.length), generator=gen)
        cont = torch.randint(100, vocab - 1, (int(t.tokens.numel()),), generator=gen).tolist()
        trajs.append(Trajectory(prompt[0].tolist(), cont, reference_logits(model, prompt, cont)))
    engine.add_trajectories(trajs)
    sync(args.device)
    prep_s = time.perf_counter() - t0
    out: dict[str, Any] = {"model": args.shape_model, "prepare_s": prep_s, "state_bytes": engine.state_bytes(),
                           "items": {k: len(v) for k, v in lengths.items()}, "configs": {}}
    log(f"{args.shape_model}: synthetic workload prepared in {prep_s:.1f} s, states "
        f"{engine.state_bytes() / 2**30:.1f} GiB, items {out['items']}, {len(trajs)} trajectories")
    for i, name in enumerate(["pnmix-paper", "pnmix-paper", "kivi2", "kivi2", "fp16", "fp16"]):
        cfg = preset(name)
        timings = {}
        sync(args.device)
        t_all = time.perf_counter()
        t0 = time.perf_counter()
        engine.all_outcomes(cfg, {t: range(len(engine.items[t])) for t in ("passkey", "kv_lookup")})
        sync(args.device)
        timings["items"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.fidelity(cfg)
        sync(args.device)
        timings["fidelity"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.measure_cost(cfg)
        timings["cost"] = time.perf_counter() - t0
        total = time.perf_counter() - t_all
        if i % 2 == 0:  # first use: kernel specialisations compile
            log(f"  first use {name}: {total:.2f} s")
            continue
        out["configs"][name] = {"seconds": total, "timings": timings}
        log(f"  {name:12s} engine {total:6.2f} s  " + " ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    # The reference path on a few items a task (generate item by item), and one trajectory replay.
    cfg = preset("pnmix-paper")
    n = args.shape_reference_items
    per_item: dict[str, float] = {}
    for task in ("passkey", "kv_lookup"):
        t0 = time.perf_counter()
        for state, item in list(zip(engine.states[task], engine.items[task], strict=True))[:n]:
            ids = torch.randint(100, vocab - 1, (1, state.length), generator=gen)
            generate(model, ids, cfg, max_new_tokens=item.max_new_tokens, min_new_tokens=item.max_new_tokens)
        sync(args.device)
        per_item[task] = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    replay(model, torch.tensor([trajs[0].prompt_ids]), trajs[0].tokens, cfg, trajs[0].reference_logits)
    sync(args.device)
    per_item["fidelity"] = time.perf_counter() - t0
    estimate = sum(per_item[t] * len(lengths[t]) for t in lengths) + per_item["fidelity"] * len(trajs)
    out["reference"] = {"per_item_s": per_item, "items_timed": n, "full_workload_estimate_s": estimate}
    log(f"  reference pnmix-paper: {per_item['passkey']:.2f} / {per_item['kv_lookup']:.2f} s a passkey / kv item, "
        f"{per_item['fidelity']:.2f} s a trajectory (first {n} items a task): about {estimate:.0f} s for the "
        f"whole workload")
    res["shape"] = out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--reference", default="pnmix-paper,kivi2", help="configs also scored by the reference path")
    ap.add_argument("--equality-items", type=int, default=0)
    ap.add_argument("--shape-model", default="")
    ap.add_argument("--shape-reference-items", type=int, default=4)
    ap.add_argument("--out", default="out/bench_trial")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG_FILE.append(out / "bench_trial.log")
    LOG_FILE[0].write_text("")
    res: dict[str, Any] = {"env": environment(args.device), "args": vars(args)}
    log(json.dumps(res["env"]))
    def save() -> None:
        (out / "bench_trial.json").write_text(json.dumps(res, indent=1, default=str))

    try:
        ev = bench_embedded(args, res)
        save()
        if args.shape_model:
            bench_shape(args, ev, res)
            save()
        if args.equality_items:
            bench_equality(args, ev, res)
    finally:
        save()
    emb = res["embedded"]["configs"]
    log("\n| config | engine s | reference s | ratio | accuracy +- SE |")
    log("| --- | --- | --- | --- | --- |")
    for name, row in emb.items():
        ref = row.get("reference", {}).get("seconds")
        ref_s, ratio = ("", "") if ref is None else (f"{ref:.2f}", f"{row['speedup']:.1f}x")
        eng = row["engine"]
        log(f"| {name} | {eng['seconds']:.2f} | {ref_s} | {ratio} | {eng['accuracy']:.3f} +- "
            f"{eng['accuracy_se'] or 0:.3f} |")
    secs = [row["engine"]["seconds"] for row in emb.values()]
    log(f"engine seconds per trial: median {statistics.median(secs):.2f}")


if __name__ == "__main__":
    main()
