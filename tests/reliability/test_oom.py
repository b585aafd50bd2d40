"""Item 5: out of memory during a trial.

The trial is recorded FAILED with the reason in its user attribute `error` ("out of memory: ...");
another trial takes its place, so the campaign still ends with the requested count; a failed
trial never reaches the stored front. Three ways to run out: torch's CPU allocator refusing a real
allocation inside the model's forward pass, a CUDA out-of-memory error raised there (what a GPU
host sees), and a process capped by RLIMIT_AS whose allocation fails (MemoryError). A campaign
whose every trial runs out of memory stops, marked failed with the reason, in one line.
"""

from __future__ import annotations

import optuna
import torch
from rel_helpers import error_line, stub_campaign, stub_worker_args, worker_env

from pnmix.storage import Database, get_campaign, list_front_points, upgrade
from pnmix.storage.testing import sqlite_url
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import finished

FAIL = optuna.trial.TrialState.FAIL
TRIALS = 4


class Exhausting:
    """Wraps an Evaluator: on chosen evaluation calls the model's forward pass runs out of memory."""

    def __init__(self, evaluator: Evaluator, failures: dict[int, str]) -> None:
        self.inner, self.failures, self.calls = evaluator, failures, 0
        self.head_dim, self.num_layers, self.plan = evaluator.head_dim, evaluator.num_layers, evaluator.plan

    def proxy(self, config):
        return self.inner.proxy(config)

    def evaluate(self, config):
        self.calls += 1
        kind = self.failures.get(self.calls)
        if kind is None:
            return self.inner.evaluate(config)

        def hook(module, args):
            if kind == "cpu":
                torch.empty(1 << 46, dtype=torch.uint8)  # 64 TiB: the allocator refuses it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total)")

        handle = self.inner.model.register_forward_pre_hook(hook)
        try:
            return self.inner.evaluate(config)
        finally:
            handle.remove()


def test_out_of_memory_trials_fail_with_the_reason_and_the_campaign_continues(tmp_path, tiny_model_dir):
    db = Database(sqlite_url(tmp_path))
    upgrade(db)
    spec = CampaignSpec(model=tiny_model_dir, budgets=(3.0,), n_trials=TRIALS, profile="smoke", tasks=("fidelity",),
                        multi_fidelity=False)
    campaign_id = find_or_create_campaign(db, spec)
    evaluator = Exhausting(Evaluator(tiny_model_dir, profile("smoke"), tasks=("fidelity",)), {2: "cpu", 4: "cuda"})
    study = CampaignRunner(db, db.url, campaign_id, spec, evaluator).run()[3.0]

    failed = study.get_trials(states=(FAIL,))
    assert [t.user_attrs["error"] for t in failed] == [
        "out of memory: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 70368744177664 bytes. Error code 12 (Cannot allocate memory)",
        "out of memory: CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total)",
    ]
    assert all("config" in t.user_attrs and "accuracy" not in t.user_attrs for t in failed)
    assert len(finished(study)) == TRIALS and evaluator.calls >= 2 + 2  # the two failures were replaced
    with db.session(readonly=True) as s:
        stored = {p.trial_number for p in list_front_points(s, tiny_model_dir, campaign_id=campaign_id).items}
        row = get_campaign(s, campaign_id)
    assert stored == {t.number for t in front_trials(study)} and not stored & {t.number for t in failed}
    assert (row.status, row.trials_done) == ("done", TRIALS)
    db.dispose()


def test_memory_capped_worker_records_memory_error_and_finishes(tmp_path, procs):
    """A real MemoryError: the worker process is capped by RLIMIT_AS and one evaluation allocates past it."""
    url = sqlite_url(tmp_path)
    campaign_id = stub_campaign(url, (3.0,), TRIALS)
    env = worker_env(STUB_RLIMIT_AS_MB="256", STUB_OOM_CALLS="3")
    worker = procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), env, "capped")
    assert procs.finish(worker, 60) == 0, procs.stderr(worker)[-3000:]
    study = optuna.load_study(study_name=f"pnmix:{campaign_id}:3", storage=url)
    failed = study.get_trials(states=(FAIL,))
    assert [t.user_attrs["error"] for t in failed] == ["out of memory: MemoryError"]
    assert procs.stderr(worker).strip().splitlines() == [
        f"warning: budget 3: trial {failed[0].number} failed: out of memory: MemoryError"]
    assert len(finished(study)) == TRIALS
    db = Database(url)
    with db.session(readonly=True) as s:
        assert get_campaign(s, campaign_id).status == "done"
    db.dispose()


def test_campaign_whose_every_trial_runs_out_of_memory_stops_marked_failed(tmp_path, procs):
    url = sqlite_url(tmp_path)
    campaign_id = stub_campaign(url, (3.0,), 3)
    env = worker_env(STUB_OOM_CALLS=",".join(str(i) for i in range(1, 50)))
    worker = procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), env, "hopeless")
    assert procs.finish(worker, 60) == 2
    reason = "budget 3: 3 trials failed, the last with out of memory: stub: allocation refused"
    assert error_line(procs.stderr(worker)) == f"error: campaign {campaign_id} stopped: {reason}"
    db = Database(url)
    with db.session(readonly=True) as s:
        row = get_campaign(s, campaign_id)
        assert (row.status, row.message, row.trials_done) == ("failed", reason, 0)
    db.dispose()
