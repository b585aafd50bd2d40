"""Item 2: PostgreSQL connections dropped under a running campaign.

A separate superuser connection kills the campaign database's backends (`pg_terminate_backend`),
as a server restart or a network cut does. Workers (the real `pnmix worker`, stub evaluator: the
database is under test, not the model) reconnect: pooled connections are pinged before use, a
transaction cut in flight is retried with backoff (`PNMIX_DB_RETRIES`), a trial heartbeat that
could not be written is skipped. When the database stays away past the retries, the worker stops
with one line and exit code 2; rerunning resumes. Nothing committed is ever lost.
"""

from __future__ import annotations

import json
import threading
import time

import optuna
import pytest
from rel_helpers import error_line, stub_campaign, stub_worker_args, wait_for, worker_env
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from pnmix.storage import Database, display_url, get_campaign, list_front_points
from pnmix.storage.testing import POSTGRES_ADMIN_URL
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.studies import finished, study_name

OBSERVER = "pnmix-test-observer"  # the test's own reads; the killer spares them
COMPLETE = optuna.trial.TrialState.COMPLETE


class Killer:
    """Terminates every backend of one database from a superuser connection on another database."""

    def __init__(self, url: str) -> None:
        self.name = make_url(url).database
        self.admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        self.killed = 0

    def kill(self) -> int:
        with self.admin.connect() as conn:
            n = len(conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %(db)s "
                "AND pid <> pg_backend_pid() AND application_name <> %(me)s", {"db": self.name, "me": OBSERVER}).all())
        self.killed += n
        return n

    def allow_connections(self, allowed: bool) -> None:
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS {str(allowed).lower()}')


@pytest.fixture
def killer(pg_url):
    k = Killer(pg_url)
    try:
        yield k
    finally:
        k.allow_connections(True)
        k.admin.dispose()


def observer_storage(url: str) -> optuna.storages.RDBStorage:
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"application_name": OBSERVER}})


def complete_trials(storage: optuna.storages.RDBStorage, campaign_id: int, budget: float) -> dict[int, tuple]:
    try:
        study = optuna.load_study(study_name=study_name(campaign_id, budget), storage=storage)
    except KeyError:
        return {}
    return {t.number: (t.params, t.values) for t in study.get_trials(states=(COMPLETE,))}


def check_campaign(url: str, campaign_id: int, budgets: tuple[float, ...], trials: int,
                   seen: dict[tuple[float, int], tuple]) -> None:
    storage = observer_storage(url)
    db = Database(url)
    with db.session(readonly=True) as s:
        points = list_front_points(s, "smollm2-135m", campaign_id=campaign_id).items
        row = get_campaign(s, campaign_id)
        assert (row.status, row.trials_done) == ("done", trials * len(budgets))
    for budget in budgets:
        study = optuna.load_study(study_name=study_name(campaign_id, budget), storage=storage)
        assert len(finished(study)) == trials
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
        now = {t.number: (t.params, t.values) for t in study.get_trials(states=(COMPLETE,))}
        for (b, number), state in seen.items():
            if b == budget:
                assert now.get(number) == state, f"committed trial {number} of budget {b:g} lost or changed"
        assert {p.trial_number for p in points if p.budget == budget} == {t.number for t in front_trials(study)}
    storage.engine.dispose()
    db.dispose()


def test_two_workers_ride_out_dropped_connections(pg_url, killer, procs, tmp_path):
    budgets, trials = (3.0,), 20
    campaign_id = stub_campaign(pg_url, budgets, trials)
    log = tmp_path / "evaluations.jsonl"
    env = worker_env(STUB_EVAL_S="0.15", STUB_LOG=str(log))
    workers = [procs.start(stub_worker_args(pg_url, "--campaign", str(campaign_id)), env, f"w{i}") for i in range(2)]
    storage = observer_storage(pg_url)
    wait_for(lambda: complete_trials(storage, campaign_id, 3.0), 60, "the first finished trial")

    seen: dict[tuple[float, int], tuple] = {}
    stop = threading.Event()

    def chaos() -> None:
        while not stop.wait(0.25):
            killer.kill()

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and any(w.poll() is None for w in workers):
            for budget in budgets:
                for number, state in complete_trials(storage, campaign_id, budget).items():
                    seen[(budget, number)] = state
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(5)
    for w in workers:
        assert procs.finish(w, 120) == 0, procs.stderr(w)[-3000:]
    stderr = "".join(procs.stderr(w) for w in workers)
    assert "Traceback" not in stderr, stderr[-3000:]
    retries = [line for line in stderr.splitlines() if line.startswith("warning: database fault")]
    print(f"\nbackends killed: {killer.killed}; retried transactions: {len(retries)}; committed trials watched: "
          f"{len(seen)}")
    assert killer.killed >= 10 and retries and seen
    check_campaign(pg_url, campaign_id, budgets, trials, seen)
    # Each COMPLETE trial's score is one that an evaluation produced.
    scores = {(json.dumps(r["config"], sort_keys=True), r["accuracy"]) for r in map(json.loads, log.open())}
    study = optuna.load_study(study_name=study_name(campaign_id, 3.0), storage=storage)
    for t in study.get_trials(states=(COMPLETE,)):
        if "accuracy" in t.user_attrs:
            assert (json.dumps(t.user_attrs["config"], sort_keys=True), t.user_attrs["accuracy"]) in scores
    storage.engine.dispose()


def test_outage_past_the_retries_stops_in_one_line_and_rerun_resumes(pg_url, killer, procs):
    budgets, trials = (3.0,), 8
    campaign_id = stub_campaign(pg_url, budgets, trials)
    env = worker_env(STUB_EVAL_S="0.3", PNMIX_DB_RETRIES="2")
    worker = procs.start(stub_worker_args(pg_url, "--campaign", str(campaign_id)), env, "w-outage")
    storage = observer_storage(pg_url)
    wait_for(lambda: len(complete_trials(storage, campaign_id, 3.0)) >= 3, 60, "three finished trials")
    killer.allow_connections(False)  # the server refuses this database: an outage longer than the retries
    killer.kill()
    before = {(3.0, n): s for n, s in complete_trials(storage, campaign_id, 3.0).items()}
    assert procs.finish(worker, 60) == 2
    line = error_line(procs.stderr(worker))
    assert line.startswith(f"error: gave up after 2 retries: database error on {display_url(pg_url)}: "), line
    assert "not currently accepting connections" in line
    assert len(procs.stderr(worker).splitlines()) <= 10  # the retries were announced, one line each

    killer.allow_connections(True)
    rerun = procs.start(stub_worker_args(pg_url, "--campaign", str(campaign_id)), env, "w-rerun")
    assert procs.finish(rerun, 120) == 0, procs.stderr(rerun)[-3000:]
    check_campaign(pg_url, campaign_id, budgets, trials, before)
    storage.engine.dispose()


def test_a_trial_orphaned_after_the_last_one_does_not_keep_the_campaign_running(pg_url, monkeypatch):
    """What a connection dropped inside Optuna's trial creation can leave: a RUNNING trial row that was
    committed but never reached the worker, so it has no heartbeat and is never told. It is placed
    here, in process, exactly when the budget's last trial has finished (the window where CI once
    caught it: every worker saw the orphan, none marked the campaign done). The last worker out must
    wait for it to go stale, fail it, and mark the campaign done."""
    from stub_worker import StubEvaluator

    from pnmix.tuner.search import campaign as campaign_module
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.spec import CampaignSpec

    monkeypatch.setattr(campaign_module, "HEARTBEAT_S", 1)
    monkeypatch.setattr(campaign_module, "GRACE_S", 3)
    budgets, trials = (3.0,), 4
    campaign_id = stub_campaign(pg_url, budgets, trials)
    db = Database(pg_url)
    spec = CampaignSpec(model="smollm2-135m", budgets=budgets, n_trials=trials, profile="smoke")
    runner = CampaignRunner(db, pg_url, campaign_id, spec, StubEvaluator())
    orphans: list[int] = []

    def orphan_after_the_last(budget: float, study: optuna.Study) -> None:
        if len(finished(study)) >= trials and not orphans:
            orphans.append(study._storage.create_new_trial(study._study_id))

    try:
        runner.run(orphan_after_the_last)
        study = optuna.load_study(study_name=study_name(campaign_id, 3.0), storage=runner.storage)
        with db.session(readonly=True) as s:
            row = get_campaign(s, campaign_id)
            assert (row.status, row.trials_done) == ("done", trials)
        assert len(orphans) == 1
        assert study._storage.get_trial(orphans[0]).state == optuna.trial.TrialState.FAIL
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
        assert len(finished(study)) == trials
    finally:
        runner.storage.engine.dispose()
        db.dispose()
