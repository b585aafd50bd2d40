"""Multi-fidelity saving: the same campaign with and without proxy screening, same trial count and seed.

Runs two campaigns on a throwaway SQLite database (embedded model, one budget) and prints, for
each, the wall time, the number of full evaluations and the final hypervolume of the feasible
front in (accuracy up, key bits down) with reference point (accuracy 0, bits = budget).

    .venv/bin/python benchmarks/multifidelity.py [--budget 2.5] [--trials 12] [--profile quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import optuna

from storage import Database, upgrade
from tuner.campaign import CampaignRunner, CampaignSpec, front_trials, hypervolume_2d
from tuner.evaluate import Evaluator
from tuner.profiles import profile
from tuner.session import find_or_create_campaign


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=2.5)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="pnmix-mf-"))
    db = Database(f"sqlite:///{folder / 'mf.db'}")
    upgrade(db)
    evaluator = Evaluator("smollm2-135m", profile(args.profile), args.seed)
    evaluator.prepare()
    evaluator.proxy(CampaignSpec("smollm2-135m", (args.budget,), 1).space.config(3, 1, 128, 0.5, 32))  # trace
    rows = []
    for multi_fidelity in (True, False):
        spec = CampaignSpec(model="smollm2-135m", budgets=(args.budget,), n_trials=args.trials, profile=args.profile,
                            seed=args.seed, multi_fidelity=multi_fidelity)
        campaign_id = find_or_create_campaign(db, spec)
        start = time.perf_counter()
        study = CampaignRunner(db, db.url, campaign_id, spec, evaluator).run()[args.budget]
        wall = time.perf_counter() - start
        full = [t for t in study.trials if "accuracy" in t.user_attrs and "reused_from" not in t.user_attrs]
        pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
        front = front_trials(study)
        hv = hypervolume_2d([(t.user_attrs["accuracy"], t.user_attrs["key_bits"]) for t in front], args.budget)
        row = {"multi_fidelity": multi_fidelity, "wall_s": round(wall, 1), "full_evaluations": len(full),
               "pruned": len(pruned), "trials": len(study.trials), "hypervolume": round(hv, 4),
               "front": sorted((round(t.user_attrs["key_bits"], 3), round(t.user_attrs["accuracy"], 3))
                               for t in front)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    mf, full_eval = rows
    print(json.dumps({"time_ratio": round(mf["wall_s"] / full_eval["wall_s"], 3),
                      "hypervolume_ratio": round(mf["hypervolume"] / max(full_eval["hypervolume"], 1e-9), 3)}))


if __name__ == "__main__":
    main()
