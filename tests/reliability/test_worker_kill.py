"""Item 1: kill -9 a `pnmix worker` in the middle of a trial.

The trial it was running keeps state RUNNING with a heartbeat that stops. Another worker fails it
once the heartbeat is older than the grace period and runs Optuna's retry (a WAITING copy with the
same parameters); the campaign ends with exactly the requested count, and every trial finished
before the kill, and the stored front, are intact. A campaign whose only worker died is reclaimed
by the next `pnmix worker` once the campaign's own heartbeat is stale (it used to stay `running`).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time

import optuna
from rel_helpers import PNMIX, stub_campaign, stub_worker_args, wait_for, worker_env

from pnmix.storage import Database, get_campaign, list_front_points, touch_campaign, upgrade
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import finished, study_name

TRIALS = 5
RUNNING, COMPLETE = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE


def keep_fresh(url: str, campaign_id: int, worker_id: str, stop: threading.Event) -> None:
    """Refreshes a campaign row's heartbeat, as its worker does, until `stop` is set."""
    db = Database(url)
    while not stop.wait(0.3):
        with db.session() as s:
            touch_campaign(s, campaign_id, worker_id)
    db.dispose()


@functools.cache
def storage(url: str) -> optuna.storages.RDBStorage:
    """One Optuna storage (one connection pool) per test database: `load` polls, and a storage made
    from the URL on every call keeps its own pool open until it is collected, which took the
    server near its 100 connections."""
    return optuna.storages.RDBStorage(url)


def load(url: str, campaign_id: int, budget: float) -> optuna.Study | None:
    try:
        return optuna.load_study(study_name=study_name(campaign_id, budget), storage=storage(url))
    except KeyError:
        return None


def mid_trial(url: str, campaign_id: int, budget: float, min_complete: int) -> list[optuna.trial.FrozenTrial] | None:
    """The RUNNING trials, once at least `min_complete` trials completed and one is being evaluated:
    its config and bits are written (`kv_bits` is the last of them), it fits the budget and no trial
    scored it before (an over-budget or already scored config completes at once, with no evaluation
    to be killed in)."""
    study = load(url, campaign_id, budget)
    if study is None:
        return None
    trials = study.get_trials(deepcopy=False)
    scored = [t.user_attrs.get("config") for t in trials if t.state == COMPLETE]
    running = [t for t in trials if t.state == RUNNING and "kv_bits" in t.user_attrs
               and t.user_attrs["bits"] <= budget and t.user_attrs["config"] not in scored]
    if sum(t.state == COMPLETE for t in trials) >= min_complete and running:
        return running
    return None


def left_running(url: str, campaign_id: int, budget: float) -> list[optuna.trial.FrozenTrial]:
    """The trials a killed worker left RUNNING, read after its death: a trial seen RUNNING before
    the kill may have completed in between (the study's load takes a while), so that earlier view
    is not the set to check. Asserts there is one, so that the test cannot pass vacuously."""
    running = [t for t in load(url, campaign_id, budget).get_trials() if t.state == RUNNING]
    assert running, "the worker was killed between trials; nothing was left running"
    return running


def snapshot(study: optuna.Study) -> dict[int, tuple]:
    return {t.number: (t.params, t.values, t.user_attrs.get("accuracy")) for t in study.get_trials(states=(COMPLETE,))}


def stored_front(db: Database, model: str, campaign_id: int) -> set[int]:
    with db.session(readonly=True) as s:
        return {p.trial_number for p in list_front_points(s, model, campaign_id=campaign_id).items}


def test_killed_worker_trial_is_retried_by_another_worker(pg_url, tiny_model_dir, procs):
    """Real workers on the tiny model, PostgreSQL: kill -9 during an evaluation, a second worker finishes."""
    db = Database(pg_url)
    upgrade(db)
    spec = CampaignSpec(model=tiny_model_dir, budgets=(3.0,), n_trials=TRIALS, profile="smoke", tasks=("fidelity",))
    campaign_id = find_or_create_campaign(db, spec, status="queued")
    env = worker_env()
    a = procs.start([*PNMIX, "worker", "--storage", pg_url], env, "worker-a")
    wait_for(lambda: mid_trial(pg_url, campaign_id, 3.0, 2), 180, "worker A evaluating its third trial", every=0.05)
    os.kill(a.pid, signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL
    killed = {t.number: t.params for t in left_running(pg_url, campaign_id, 3.0)}
    study = load(pg_url, campaign_id, 3.0)
    before = snapshot(study)
    assert len(before) >= 2 and set(killed) and not set(killed) & set(before)

    b = procs.start([*PNMIX, "worker", "--campaign", str(campaign_id), "--storage", pg_url], env, "worker-b")
    assert procs.finish(b, 240) == 0, procs.stderr(b)[-3000:]

    study = load(pg_url, campaign_id, 3.0)
    trials = {t.number: t for t in study.get_trials()}
    assert len(finished(study)) == TRIALS
    assert not [t for t in trials.values() if t.state == RUNNING]
    for number, params in killed.items():
        assert trials[number].state == optuna.trial.TrialState.FAIL  # failed as stale, by worker B
        retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == number]
        assert len(retries) == 1 and retries[0].params == params
        assert retries[0].state in (COMPLETE, optuna.trial.TrialState.PRUNED)
    after = snapshot(study)
    for number, state in before.items():
        assert after[number] == state, f"trial {number} changed"
    assert stored_front(db, tiny_model_dir, campaign_id) == {t.number for t in front_trials(study)}
    with db.session(readonly=True) as s:
        row = get_campaign(s, campaign_id)
        assert (row.status, row.trials_done) == ("done", TRIALS)
    db.dispose()


def test_campaign_of_a_dead_worker_is_reclaimed(pg_url, procs):
    """Stub workers: the campaign row stays `running` after kill -9 until its heartbeat is stale; then
    the next `pnmix worker` (claiming, no --campaign) takes it over and finishes it."""
    campaign_id = stub_campaign(pg_url, (3.0,), 4)
    env = worker_env(STUB_EVAL_S="0.5")
    a = procs.start(stub_worker_args(pg_url), env, "stub-a")
    wait_for(lambda: mid_trial(pg_url, campaign_id, 3.0, 1), 60, "worker A evaluating", every=0.05)
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    running = left_running(pg_url, campaign_id, 3.0)
    db = Database(pg_url)
    with db.session(readonly=True) as s:
        row = get_campaign(s, campaign_id)
        assert (row.status, row.worker_id) == ("running", f"{socket.gethostname()}:{a.pid}")

    # While the row's heartbeat is fresh, a claiming worker must leave the campaign alone. The row is
    # kept fresh here as A's would be had it lived a little longer: on a loaded machine a worker's
    # start alone can outlast PNMIX_GRACE_S, and then the campaign is rightly its to take.
    stop = threading.Event()
    fresh = threading.Thread(target=keep_fresh, args=(pg_url, campaign_id, row.worker_id, stop))
    fresh.start()
    try:
        early = procs.start(stub_worker_args(pg_url), env, "stub-early")
        assert procs.finish(early, 60) == 0
    finally:
        stop.set()
        fresh.join()
    assert "no queued campaign" in procs.stdout(early)
    time.sleep(3.5)  # past PNMIX_GRACE_S
    b = procs.start(stub_worker_args(pg_url), env, "stub-b")
    assert procs.finish(b, 120) == 0, procs.stderr(b)[-3000:]

    study = load(pg_url, campaign_id, 3.0)
    assert len(finished(study)) == 4
    for t in running:
        assert study.trials[t.number].state == optuna.trial.TrialState.FAIL
        assert any(r.system_attrs.get("failed_trial") == t.number and r.state != RUNNING for r in study.trials)
    with db.session(readonly=True) as s:
        row = get_campaign(s, campaign_id)
        assert (row.status, row.trials_done, row.worker_id) == ("done", 4, f"{socket.gethostname()}:{b.pid}")
    assert stored_front(db, "smollm2-135m", campaign_id) == {t.number for t in front_trials(study)}
    db.dispose()
