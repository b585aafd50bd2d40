"""Summary of every campaign in a database: per budget, trials by state, the feasible front, wall time.

Reads the Optuna studies (`pnmix:<campaign>:<budget>`) the campaign engine wrote. Wall time is from
the first trial's start to the last trial's end in the study (workers in parallel count once).

    python benchmarks/campaign_summary.py --storage sqlite:///path.db [--json F] [--markdown F]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import optuna

from pnmix.tuner.search import record
from pnmix.tuner.search.fronts import front_trials


def summarize(url: str) -> list[dict[str, Any]]:
    storage = optuna.storages.RDBStorage(url)
    rows = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if not summary.study_name.startswith("pnmix:"):
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        trials = study.get_trials(deepcopy=False)
        records = [record.read(t) for t in trials]
        states = Counter(t.state.name for t, r in zip(trials, records, strict=True) if r.kind != record.Kind.SURPLUS)
        copied = [r for r in records if r.source is not None]  # the score of a twin or of another budget
        full = [r for r in records if r.seconds is not None and r.source is None]
        starts = [t.datetime_start for t in trials if t.datetime_start]
        ends = [t.datetime_complete for t in trials if t.datetime_complete]
        wall = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
        front = sorted(map(record.read, front_trials(study)), key=lambda r: r.key_bits or 0.0)
        info = record.study_info(study)
        rows.append({
            "study": summary.study_name,
            "method": info.method,
            "budget": info.budget,
            "states": dict(states),
            "full_evaluations": len(full),
            "over_budget": sum(1 for r in records if r.kind == record.Kind.SKIPPED),
            "reused": len(copied),
            "eval_seconds_mean": round(sum(r.seconds or 0.0 for r in full) / len(full), 1) if full else None,
            "wall_s": round(wall, 1),
            "front": [{"trial": r.number, **_config(r.config_dict or {}),
                       "key_bits": round(r.key_bits or 0.0, 4),
                       "accuracy": round(r.accuracy or 0.0, 4),
                       "parts": {k: round(v, 3) for k, v in (r.parts or {}).items()},
                       "backend": r.backend, "device": r.device}
                      for r in front],
        })
    return rows


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg[k] for k in ("b_high", "b_low", "group_size", "salient_ratio", "n_sink")}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| study | method | budget | trials (state: n) | full evals | wall s "
             "| front: bits / accuracy (b_H/b_L G r sinks) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        front = "; ".join(f"{p['key_bits']:.3f} / {p['accuracy']:.3f} ({p['b_high']}/{p['b_low']} G{p['group_size']} "
                          f"r{p['salient_ratio']:g} s{p['n_sink']})" for p in r["front"]) or "(empty)"
        states = ", ".join(f"{k.lower()}: {v}" for k, v in sorted(r["states"].items()))
        lines.append(f"| {r['study']} | {r['method']} | {r['budget']:g} | {states} | {r['full_evaluations']} | "
                     f"{r['wall_s']} | {front} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = summarize(args.storage)
    text = markdown(rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
