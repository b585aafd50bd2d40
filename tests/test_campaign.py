"""Campaigns: search space, budget constraint, warm start, resume after a kill, two PostgreSQL workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from tiny import save_tiny_llama
from transformers import AutoTokenizer

from pnmix import models
from pnmix.bits import LayerPlan, key_bits
from pnmix.config import PNMixConfig, preset
from pnmix.storage import Database, list_front_points, upgrade
from pnmix.storage.testing import postgres_skip_reason, temporary_postgres_url
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.record import read
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import finished, study_name

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path

optuna.logging.set_verbosity(optuna.logging.WARNING)
ENV = {**os.environ, "PNMIX_HEARTBEAT_S": "1", "PNMIX_GRACE_S": "3", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded):
    """A tiny random Llama (head_dim 64) with the embedded model's tokenizer, saved as a checkpoint."""
    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tok)


def spec_for(model: str, budgets, n_trials, **kw) -> CampaignSpec:
    return CampaignSpec(model=model, budgets=tuple(budgets), n_trials=n_trials, profile="smoke", tasks=("fidelity",),
                        **kw)


def sqlite_db(tmp_path: Path) -> Database:
    db = Database(f"sqlite:///{tmp_path / 'pnmix.db'}")
    upgrade(db)
    return db


@pytest.mark.parametrize("method", ["pnmix", "kivi", "kitty"])
def test_search_space_round_trips_through_trial_params(method):
    space = SearchSpace(method=method)
    for pair in space.bit_pairs():
        hi, lo = (int(x) for x in pair.split("/"))
        cfg = space.config(hi, lo, 64, 0.3 if hi > lo else 0.0, 0 if method == "kivi" else 32)
        assert space.contains(cfg)
        params = space.params_of(cfg)
        assert space.suggest(optuna.trial.FixedTrial(params)) == cfg
    assert len(SearchSpace("pnmix").bit_pairs()) == 10 and SearchSpace("kivi").bit_pairs() == ["1/1", "2/2"]
    assert SearchSpace("pnmix").min_bits(64) == pytest.approx(1.25)


def test_constraint_warm_start_and_front(tmp_path, tiny_dir):
    db = sqlite_db(tmp_path)
    spec = spec_for(tiny_dir, [2.3], n_trials=10)
    campaign_id = find_or_create_campaign(db, spec)
    ev = Evaluator(tiny_dir, profile("smoke"), tasks=("fidelity",))
    runner = CampaignRunner(db, db.url, campaign_id, spec, ev)
    study = runner.run()[2.3]
    trials = study.trials
    over_budget = [t for t in trials if t.user_attrs.get("skipped")]
    # Over-budget proposals are free and take no slot: 10 scored configs plus every proposal over budget.
    assert len(finished(study)) == 10 and len(trials) == 10 + len(over_budget)
    assert all("accuracy" in t.user_attrs or t.state == optuna.trial.TrialState.PRUNED for t in finished(study))
    # Warm start: the paper config and KIVI at the budget come first (kitty's 2.39 bits do not fit).
    warm = [t.user_attrs["config"] for t in trials if t.user_attrs.get("warm_start")]
    assert warm[0]["b_high"] == 3 and warm[0]["salient_ratio"] == 0.5 and warm[0]["n_sink"] == 32
    # then, per bit pair that fits, the config that fills the budget; at most half the trials.
    fullest = [c.label for c in spec.space.fullest_within(2.3, 64)]
    presets = ["3/1 G128 r0.5 s32", "2/2 G128 r0 s0", "1/1 G128 r0 s0"]
    assert [PNMixConfig.from_dict(c).label for c in warm] == list(dict.fromkeys(presets + fullest))[:5]
    # The constraint: a config over budget never runs inference and is infeasible.
    for t in trials:
        assert "key_bits" in t.user_attrs, (t.number, t.state, t.user_attrs, t.params)
        over = t.user_attrs["key_bits"] > 2.3
        assert (t.constraints["key_bits"] > 0) == over
        if over:
            assert "accuracy" not in t.user_attrs and t.user_attrs["skipped"]
    front = front_trials(study)
    assert front and all(t.user_attrs["key_bits"] <= 2.3 for t in front)
    with db.session(readonly=True) as s:
        stored = list_front_points(s, tiny_dir, campaign_id=campaign_id).items
        assert sorted(p.trial_number for p in stored) == sorted(t.number for t in front)
        for p in stored:
            assert p.key_bits == pytest.approx(key_bits(p.config, 64).total)
            assert 0 <= p.accuracy <= 1 and p.kv_bytes > 0 and p.backend == "torch-reference"


def test_every_score_reaches_every_budget_it_fits(tmp_path, tiny_dir):
    db = sqlite_db(tmp_path)
    # Every proposal fully scored; 12 trials: past the warm starts (presets, each pair's fullest config).
    spec = spec_for(tiny_dir, [3.0, 2.8], n_trials=12, multi_fidelity=False)
    campaign_id = find_or_create_campaign(db, spec)
    runner = CampaignRunner(db, db.url, campaign_id, spec, Evaluator(tiny_dir, profile("smoke"), tasks=("fidelity",)))
    # The config of the most key bits within 2.8, proposed in the 3.0 study only.
    rich = max((c for c in spec.space.configs() if key_bits(c, runner.head_dim).total <= 2.8),
               key=lambda c: key_bits(c, runner.head_dim).total)
    runner.study(3.0).enqueue_trial(SearchSpace().params_of(rich))
    studies = runner.run()
    assert list(studies) == [2.8, 3.0]  # from the lowest budget up
    key = json.dumps(rich.to_dict(), sort_keys=True)
    scored = {b: {json.dumps(t.user_attrs["config"], sort_keys=True): t for t in st.trials if read(t).original}
              for b, st in studies.items()}
    assert (key in scored[3.0]) != (key in scored[2.8])  # evaluated once, in one of the two studies
    for budget, study in studies.items():
        other = 3.0 if budget == 2.8 else 2.8
        held = {json.dumps(t.user_attrs["config"], sort_keys=True): t for t in study.trials
                if "accuracy" in t.user_attrs}
        fits = {k: t for k, t in scored[other].items() if t.user_attrs["key_bits"] <= budget}
        assert fits and fits.keys() <= held.keys()  # every score of the other budget that fits is here
        for k, t in fits.items():
            if k in scored[budget]:
                continue  # this budget's sampler proposed and scored it too, before the share arrived
            copy = held[k]
            source = f"{study_name(campaign_id, other)}#{t.number}"
            assert copy.user_attrs["shared"] and copy.user_attrs["score_from"] == source
            assert copy.values == t.values and copy.user_attrs["accuracy"] == t.user_attrs["accuracy"]
        # Shared copies take no slot: each budget still ran its own twelve.
        assert len(finished(study)) == 12
    # It has a score in the 2.8 study too, wherever it was scored.
    assert key in {json.dumps(t.user_attrs["config"], sort_keys=True) for t in studies[2.8].trials
                   if "accuracy" in t.user_attrs}
    with db.session(readonly=True) as s:
        for budget, study in studies.items():
            stored = {p.trial_number for p in list_front_points(s, tiny_dir, campaign_id=campaign_id).items
                      if p.budget == budget}
            assert stored == {t.number for t in front_trials(study)}


class FormulaEvaluator:
    """Scores a config by a fixed function of its fields, instantly: what the campaign's bookkeeping needs."""

    head_dim, num_layers = 64, 30
    plan = LayerPlan.full(30)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def evaluate(self, config, measure: bool = True):
        from pnmix.tuner.scoring.score import Score

        self.calls.append(json.dumps(config.to_dict(), sort_keys=True))
        acc = (config.b_high + 2 * config.b_low + config.salient_ratio + config.n_sink / 64) / 13
        acc -= config.group_size / 1e3
        return Score(config=config.to_dict(), accuracy=acc, parts={"fidelity": acc}, fidelity_agreement=0.0,
                     fidelity_kl=0.0, key_bits=key_bits(config, 64).total, kv_bytes=1, decode_tokens_per_s=1.0,
                     peak_memory_bytes=None, backend="t", device="cpu", versions={}, seconds=0.0, profile="smoke",
                     accuracy_se=0.01, units={"fidelity": [0.1, 0.2]})


def test_a_runner_sees_what_another_worker_adds_after_its_first_read(tmp_path):
    """Runners keep their studies (and Optuna's cache of finished trials); trials another worker
    finishes later still count, in progress and in the shared scores."""
    db = sqlite_db(tmp_path)
    spec = spec_for("smollm2-135m", [2.0, 3.0], n_trials=4, multi_fidelity=False)
    campaign_id = find_or_create_campaign(db, spec)
    a = CampaignRunner(db, db.url, campaign_id, spec, FormulaEvaluator())
    a.run()
    assert a.trials_done() == 8 == a.trials_done(fresh=True)
    # A second worker (its own storage and caches) of a longer run of the same campaign adds trials.
    longer = CampaignSpec(**{**spec.__dict__, "n_trials": 6})
    b = CampaignRunner(db, db.url, campaign_id, longer, FormulaEvaluator())
    b.run()
    a.spec = longer  # the first worker's cached studies must count the second's trials
    assert a.trials_done() == 12 == a.trials_done(fresh=True)
    low, high = optuna.load_study(study_name=study_name(campaign_id, 2.0), storage=db.url), optuna.load_study(
        study_name=study_name(campaign_id, 3.0), storage=db.url)
    held = {json.dumps(t.user_attrs["config"], sort_keys=True) for t in high.trials if "accuracy" in t.user_attrs}
    assert {json.dumps(t.user_attrs["config"], sort_keys=True) for t in low.trials if read(t).original} <= held
    # No config was evaluated twice across the two workers and both budgets.
    calls = a.evaluator.calls + b.evaluator.calls
    assert len(calls) == len(set(calls))


def test_a_budget_proposes_only_bit_pairs_that_can_fit_it():
    space = SearchSpace()
    assert space.pairs_within(1.5, 64) == ["1/1", "2/1", "3/1"]
    assert "4/4" not in space.pairs_within(3.0, 64) and space.pairs_within(5.0, 64) == space.bit_pairs()
    for budget in (1.3, 1.5, 2.0, 2.5):
        for pair in set(space.bit_pairs()) - set(space.pairs_within(budget, 64)):
            hi, lo = (int(x) for x in pair.split("/"))
            assert all(key_bits(c, 64).total > budget for c in space.configs() if (c.b_high, c.b_low) == (hi, lo))


def test_front_keeps_one_trial_per_config_and_exhaustion_is_bounded():
    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    from pnmix.tuner.search.studies import exhausted, over_budget_limit

    study = optuna.create_study(directions=["maximize", "minimize"])
    dist = {"x": FloatDistribution(0, 1)}
    cfg = preset("pnmix-paper").to_dict()
    for acc, bits in ((0.8, 2.263), (0.8, 2.263), (0.5, 1.25)):  # two workers scored one config side by side
        study.add_trial(create_trial(values=[acc, bits], params={"x": 0.5}, distributions=dist,
                                     user_attrs={"config": cfg if acc > 0.6 else {**cfg, "b_high": 1},
                                                 "accuracy": acc, "key_bits": bits}))
    assert [t.number for t in front_trials(study)] == [0, 2]
    assert not exhausted(study, 2)
    for _ in range(over_budget_limit(2)):
        study.add_trial(create_trial(values=[0.0, 9.0], params={"x": 0.5}, distributions=dist,
                                     user_attrs={"skipped": "over budget", "key_bits": 9.0}))
    assert exhausted(study, 2) and len(finished(study)) == 3


def test_budget_below_anything_feasible_gives_an_empty_front(tmp_path, tiny_dir):
    db = sqlite_db(tmp_path)
    spec = spec_for(tiny_dir, [0.5], n_trials=3)
    campaign_id = find_or_create_campaign(db, spec)
    messages: list[str] = []
    runner = CampaignRunner(db, db.url, campaign_id, spec, Evaluator(tiny_dir, profile("smoke"), tasks=("fidelity",)),
                            progress=messages.append)
    runner.run()
    assert any("no config of the pnmix space fits" in m and "1.250" in m for m in messages)
    with db.session(readonly=True) as s:
        assert list_front_points(s, tiny_dir, campaign_id=campaign_id).items == []
        from pnmix.storage import get_campaign

        assert get_campaign(s, campaign_id).status == "done"


def tune_cmd(model: str, url: str, trials: int, *extra: str) -> list[str]:
    return [*PNMIX, "tune", "--model", model, "--budgets", "3.0", "--trials", str(trials),
            "--profile", "smoke", "--tasks", "fidelity", "--storage", url, "--plot", os.devnull + ".png", *extra]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_resume_after_kill_reruns_nothing(tmp_path, tiny_dir):
    db = sqlite_db(tmp_path)
    url = db.url
    storage = optuna.storages.RDBStorage(url)

    def complete() -> list[optuna.trial.FrozenTrial]:
        try:
            study = optuna.load_study(study_name=study_name(1, 3.0), storage=storage)
        except KeyError:
            return []
        return study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))

    proc = subprocess.Popen(tune_cmd(tiny_dir, url, 8), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: len(complete()) >= 3, 240, "three finished trials")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {t.number: (t.params, t.values) for t in complete()}
    time.sleep(4)  # past the heartbeat grace period: the killed trial is now stale
    out = subprocess.run(tune_cmd(tiny_dir, url, 8), env=ENV, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-2000:]
    study = optuna.load_study(study_name=study_name(1, 3.0), storage=storage)
    assert len(finished(study)) == 8
    after = {t.number: (t.params, t.values) for t in study.trials}
    for number, state in before.items():
        assert after[number] == state, f"trial {number} changed on resume"
    # The stored front is the study's whole front, not a half-written one.
    with db.session(readonly=True) as s:
        stored = {p.trial_number for p in list_front_points(s, tiny_dir, campaign_id=1).items}
    assert stored == {t.number for t in front_trials(study)}


@pytest.mark.skipif(postgres_skip_reason() is not None and not os.environ.get("PNMIX_REQUIRE_POSTGRES"),
                    reason="no PostgreSQL server")
def test_two_workers_share_a_campaign_on_postgres(tiny_dir):
    with temporary_postgres_url() as url:
        upgrade(Database(url))
        queued = subprocess.run(tune_cmd(tiny_dir, url, 8, "--enqueue"), env=ENV, capture_output=True, text=True,
                                timeout=200)
        assert queued.returncode == 0, queued.stderr[-2000:]
        workers = [subprocess.Popen([*PNMIX, "worker", "--campaign", "1", "--storage", url],
                                    env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
        for w in workers:
            _, err = w.communicate(timeout=500)
            assert w.returncode == 0, err.decode()[-2000:]
        study = optuna.load_study(study_name=study_name(1, 3.0), storage=url)
        counted = finished(study)
        assert len(counted) == 8
        assert len({t.number for t in counted}) == 8
        assert all(t.state != optuna.trial.TrialState.RUNNING for t in study.trials)
        db = Database(url)
        with db.session(readonly=True) as s:
            from pnmix.storage import get_campaign

            row = get_campaign(s, 1)
            assert row.status == "done" and row.trials_done == 8


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--model", "no-such-model"), "unknown model"),
        (("--storage", "postgresql://pnmix:s3cret@127.0.0.1:1/nowhere"), "127.0.0.1:1"),
        (("--budgets", "-1"), "invalid --budgets '-1'"),
        (("--method", "magic"), "invalid --method 'magic'"),
    ],
)
def test_tune_bad_input_is_one_line(args, needle):
    out = subprocess.run([*PNMIX, "tune", "--trials", "2", *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "s3cret" not in out.stderr


def test_export_writes_a_loadable_config(tmp_path, tiny_dir):
    db = sqlite_db(tmp_path)
    spec = spec_for(tiny_dir, [3.0], n_trials=4)
    campaign_id = find_or_create_campaign(db, spec)
    CampaignRunner(db, db.url, campaign_id, spec, Evaluator(tiny_dir, profile("smoke"), tasks=("fidelity",))).run()
    target = tmp_path / "cfg.json"
    out = subprocess.run([*PNMIX, "export", "--model", tiny_dir, "--bits", "3.0", "-o",
                          str(target), "--storage", db.url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from pnmix.config import PNMixConfig

    cfg = PNMixConfig.from_json(target.read_text())
    assert key_bits(cfg, 64).total <= 3.0
    assert preset("fp16") != cfg
