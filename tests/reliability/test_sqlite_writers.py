"""Item 3: four processes writing trials and fronts into one SQLite file at once.

Four real `pnmix worker` processes (stub evaluator, so trials are milliseconds and the database is
the bottleneck) share one campaign on a WAL-mode SQLite file. Every transaction,
ours and Optuna's, starts with `BEGIN IMMEDIATE` and waits for the write lock (busy timeout), so
no "database is locked" reaches a user (not even as a retry warning), two workers never run the
same enqueued trial (which they did with the driver's deferred transactions: "Cannot tell a
COMPLETE trial"), and no trial or front row is lost.
"""

from __future__ import annotations

import json
from collections import Counter

import optuna
from rel_helpers import stub_campaign, stub_worker_args, worker_env

from pnmix.storage import Database, get_campaign, list_front_points
from pnmix.storage.testing import sqlite_url
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.studies import finished, study_name

BUDGETS = (3.0,)
TRIALS = 20
WORKERS = 4


def test_four_sqlite_writers_lose_nothing(tmp_path, procs):
    url = sqlite_url(tmp_path)
    campaign_id = stub_campaign(url, BUDGETS, TRIALS)
    log = tmp_path / "evaluations.jsonl"
    env = worker_env(STUB_EVAL_S="0.01", STUB_LOG=str(log), PNMIX_GRACE_S="60")  # nobody dies here
    workers = [procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), env, f"w{i}")
               for i in range(WORKERS)]
    for w in workers:
        assert procs.finish(w, 180) == 0, procs.stderr(w)[-3000:]
    outputs = "".join(procs.stderr(w) + procs.stdout(w) for w in workers)
    assert "locked" not in outputs.lower() and "Traceback" not in outputs and "warning" not in outputs, outputs

    storage = optuna.storages.RDBStorage(url)
    evaluated = Counter()
    for line in log.read_text().splitlines():
        row = json.loads(line)
        evaluated[(json.dumps(row["config"], sort_keys=True), row["accuracy"])] += 1
    stored = Counter()
    per_budget = {}
    for budget in BUDGETS:
        study = optuna.load_study(study_name=study_name(campaign_id, budget), storage=storage)
        per_budget[budget] = study
        assert len(finished(study)) == TRIALS  # exactly the requested count, across four workers
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL))
        for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
            reused = "reused_from" in t.user_attrs or "score_from" in t.user_attrs  # copied, not evaluated
            if "accuracy" in t.user_attrs and not reused:
                stored[(json.dumps(t.user_attrs["config"], sort_keys=True), t.user_attrs["accuracy"])] += 1
    # Every evaluation a worker finished is a COMPLETE trial with its score, and nothing else is.
    assert stored == evaluated and sum(evaluated.values()) >= 8
    assert len({r["pid"] for r in map(json.loads, log.read_text().splitlines())}) >= 2  # they really shared it

    db = Database(url)
    with db.session(readonly=True) as s:
        for budget, study in per_budget.items():
            rows = [p for p in list_front_points(s, "smollm2-135m", campaign_id=campaign_id).items
                    if p.budget == budget]
            assert sorted(p.trial_number for p in rows) == sorted(t.number for t in front_trials(study))
            assert rows
        row = get_campaign(s, campaign_id)
        assert (row.status, row.trials_done, row.trials_total) == ("done", TRIALS * len(BUDGETS), TRIALS * len(BUDGETS))
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    db.dispose()
