"""kill -9 a racing worker between two rungs of a candidate: the finished rung is not scored again.

Each finished rung is stored on the trial; Optuna's retry of the dead worker's trial (a WAITING copy
with the same parameters and user attributes) resumes after it.
"""

from __future__ import annotations

import json
import os
import signal

import optuna
from rel_helpers import stub_campaign, stub_worker_args, wait_for, worker_env

from pnmix.storage.testing import sqlite_url
from pnmix.tuner.search.studies import finished, study_name

TRIALS = 16  # past the warm starts (they are not raced)


def rows(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_race_resumes_after_its_last_finished_rung(tmp_path, procs):
    url = sqlite_url(tmp_path)
    log = tmp_path / "evaluations.jsonl"
    campaign_id = stub_campaign(url, (3.0,), TRIALS, racing=True, multi_fidelity=False)
    env = worker_env(STUB_LOG=str(log), STUB_RUNG_S="0.5")

    def second_rung_started():  # a rung that starts from a finished one: the worker is mid-race
        return next((r for r in rows(log) if r.get("event") == "rung_start" and r["held"] > 0), None)

    a = procs.start(stub_worker_args(url), env, "stub-a")
    mid = wait_for(second_rung_started, 240, "a candidate in its second rung")
    os.kill(a.pid, signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL
    killed_at = len(rows(log))
    b = procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), env, "stub-b")
    assert b.wait(300) == 0
    after = rows(log)[killed_at:]
    again = [r for r in after if r.get("config") == mid["config"] and r.get("event") == "rung_start"]
    # The retried trial starts from the rung finished before the kill, never from nothing.
    assert again and again[0]["held"] == mid["held"], (mid, again)
    assert not [r for r in again if r["held"] == 0]
    study = optuna.load_study(study_name=study_name(campaign_id, 3.0), storage=url)
    assert len(finished(study)) == TRIALS
