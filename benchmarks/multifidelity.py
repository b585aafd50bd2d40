"""Multi-fidelity saving: the same campaign with and without proxy screening, same trial count and seed.

Runs two campaigns on a throwaway SQLite database (embedded model, one budget) and prints, for
each, the wall time, the number of full evaluations and the final hypervolume of the feasible
front in (accuracy up, key bits down) with reference point (accuracy 0, bits = budget).

    .venv/bin/python benchmarks/multifidelity.py [--budget 2.5] [--trials 12] [--profile quick]
        [--device cpu|cuda] [--parallel]

--parallel runs the two modes at once in two processes (same machine load for both; on a GPU host
with cores to spare this halves the wall time of the comparison), then prints the same ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

from pnmix.storage import Database, upgrade
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile
from pnmix.tuner.search import record
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.fronts import front_trials, hypervolume_2d
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.spec import CampaignSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=2.5)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=("both", "mf", "full"), default="both")
    parser.add_argument("--parallel", action="store_true")
    args = parser.parse_args()
    if args.parallel:
        return run_parallel(sys.argv[1:])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="pnmix-mf-"))
    db = Database(f"sqlite:///{folder / 'mf.db'}")
    upgrade(db)
    evaluator = Evaluator("smollm2-135m", profile(args.profile), args.seed, device=args.device)
    evaluator.prepare()
    evaluator.proxy(CampaignSpec("smollm2-135m", (args.budget,), 1).space.config(3, 1, 128, 0.5, 32))  # trace
    rows = []
    modes = {"both": (True, False), "mf": (True,), "full": (False,)}[args.mode]
    for multi_fidelity in modes:
        spec = CampaignSpec(model="smollm2-135m", budgets=(args.budget,), n_trials=args.trials, profile=args.profile,
                            seed=args.seed, multi_fidelity=multi_fidelity)
        campaign_id = find_or_create_campaign(db, spec)
        start = time.perf_counter()
        study = CampaignRunner(db, db.url, campaign_id, spec, evaluator).run()[args.budget]
        wall = time.perf_counter() - start
        full = [r for r in map(record.read, study.trials) if r.stands_for_its_config]
        pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
        front = [record.read(t) for t in front_trials(study)]
        hv = hypervolume_2d([(r.accuracy or 0.0, r.key_bits or 0.0) for r in front], args.budget)
        row = {"multi_fidelity": multi_fidelity, "wall_s": round(wall, 1), "full_evaluations": len(full),
               "pruned": len(pruned), "trials": len(study.trials), "hypervolume": round(hv, 4),
               "front": sorted((round(r.key_bits or 0.0, 3), round(r.accuracy or 0.0, 3)) for r in front)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(rows) == 2:
        print_ratios(*rows)


def print_ratios(mf: dict, full_eval: dict) -> None:  # type: ignore[type-arg]
    print(json.dumps({"time_ratio": round(mf["wall_s"] / full_eval["wall_s"], 3),
                      "hypervolume_ratio": round(mf["hypervolume"] / max(full_eval["hypervolume"], 1e-9), 3)}))


def run_parallel(argv: list[str]) -> None:
    base = [sys.executable, __file__, *[a for a in argv if a != "--parallel"]]
    procs = [subprocess.Popen([*base, "--mode", mode], stdout=subprocess.PIPE, text=True) for mode in ("mf", "full")]
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            raise SystemExit(f"multifidelity run failed (exit {proc.returncode})")
        rows.append(json.loads(lines[-1]))
        print(lines[-1], flush=True)
    print_ratios(*rows)


if __name__ == "__main__":
    main()
