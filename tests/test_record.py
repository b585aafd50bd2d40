"""The trial record is the only door to a trial's attributes, and campaigns stored by earlier
versions of the tuner read and resume through it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import optuna
import pytest
from test_budgets import LayerFormulaEvaluator

from pnmix.storage import Database, get_campaign, list_campaigns, list_front_points, upgrade
from pnmix.tuner.search import record
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import finished, study_name

ROOT = Path(__file__).resolve().parents[1]
DOOR = re.compile(r"\b(user_attrs|set_user_attr|system_attrs)\b")


def test_only_the_record_touches_trial_attributes():
    """Every module of the product and its benchmarks reads and writes a trial's (or a study's)
    attributes through tuner/search/record.py: no other one names `user_attrs`, `set_user_attr` or
    `system_attrs`."""
    offenders = []
    for folder in ("pnmix", "kernels", "tuner", "storage", "api", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "tuner" / "search" / "record.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if DOOR.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    record = ROOT / "tuner" / "search" / "record.py"
    assert DOOR.search(record.read_text()), "the pattern no longer finds the record's own use"


def test_campaigns_stored_by_earlier_versions_read_and_resume(tmp_path):
    """tests/data/stored_campaigns.db: three campaigns as the tuner stored them before its trial
    record covered every attribute (pnmix-alloc over budgets 3.0 and 2.25, 6 trials each; pnmix at
    2.5, 8 trials; pnmix-layers at 2.5, 6 trials), each stopped partway as a killed run leaves it,
    scored by test_budgets' formula evaluator. Every stored trial reads as a record, the campaigns
    resume to their counts with no stored trial changed, and the stored fronts are the studies'."""
    path = tmp_path / "stored.db"
    shutil.copy(ROOT / "tests" / "data" / "stored_campaigns.db", path)
    db = Database(f"sqlite:///{path}")
    upgrade(db)
    with db.session(readonly=True) as s:
        rows = {c.id: CampaignSpec.from_campaign(get_campaign(s, c.id)) for c in list_campaigns(s).items}
    assert sorted(spec.method for spec in rows.values()) == ["pnmix", "pnmix-alloc", "pnmix-layers"]
    before: dict[tuple[int, float], dict[int, tuple]] = {}
    short = []  # budgets a killed run left below their count
    for cid, spec in rows.items():
        for budget in spec.budgets:
            study = optuna.load_study(study_name=study_name(cid, budget), storage=db.url)
            records = [record.read(t) for t in study.trials]
            assert records and all(r.kind in record.Kind for r in records)
            scored = [r for r in records if r.has_score]
            assert scored and all(r.config is not None and r.bits is not None and r.units for r in scored)
            if spec.method == "pnmix-alloc":
                assert {r.origin for r in scored} <= set(record.Origin) and any(r.warm_start for r in records)
            before[cid, budget] = {t.number: (t.state, t.params, t.values, t.user_attrs) for t in study.trials
                                   if t.state.is_finished()}
            short.append(len(finished(study)) < spec.n_trials)
    assert sum(short) >= 3
    for cid, spec in rows.items():
        runner = CampaignRunner(db, db.url, cid, spec, LayerFormulaEvaluator())
        studies = runner.run()
        for budget, study in studies.items():
            assert len(finished(study)) == spec.n_trials
            now = {t.number: (t.state, t.params, t.values, t.user_attrs) for t in study.trials}
            for number, old in before[cid, budget].items():
                assert now[number] == old, f"campaign {cid}, budget {budget:g}: trial {number} changed on resume"
            with db.session(readonly=True) as s:
                stored = {p.trial_number for p in list_front_points(s, "smollm2-135m", campaign_id=cid).items
                          if p.budget == budget}
            assert stored == {t.number for t in front_trials(study)}
        with db.session(readonly=True) as s:
            assert get_campaign(s, cid).status == "done"


@pytest.mark.parametrize("name", ["accuracy", "units", "origin", "proposal", "neighbour_of", "rung", "pruned_at",
                                  "sensitivity_s", "proxy_kl", "kv_bytes", "decode_tokens_per_s"])
def test_every_attribute_the_tuner_writes_is_a_record_field(name):
    """Each attribute name the tuner writes reaches a typed field of `TrialRecord` (here: set alone
    on a trial, it shows in the record and nowhere as an untyped leftover)."""
    values = {"accuracy": 0.5, "units": {"passkey": [1.0]}, "origin": "move", "proposal": {"b_high": 3},
              "neighbour_of": "G64 3/1 r0.25", "rung": {"units": {}, "agreements": [], "seconds": 1.0},
              "pruned_at": 0.25, "sensitivity_s": 2.0, "proxy_kl": 0.1, "kv_bytes": 123,
              "decode_tokens_per_s": 9.0}
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(values=[0.0], user_attrs={name: values[name]}))
    r = record.read(study.trials[0])
    field = {"decode_tokens_per_s": "throughput"}.get(name, name)
    assert getattr(r, field) == values[name]
