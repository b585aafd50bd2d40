"""The search against its ground truth: the sweep file, the true front, racing, the replay benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig, preset
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.score import Score
from pnmix.tuner.search import racing
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.sweep import config_key, front, read_sweep, run_sweep, shard_configs, start_file, sweep_header

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "benchmarks" / "ground_truth" / "smollm2-135m-pnmix-full-seed0.jsonl.gz"


@pytest.fixture(scope="module")
def truth():
    return read_sweep(DATASET)


# -- the sweep file ------------------------------------------------------------------------------


class CountingEvaluator:
    """Scores a config by a fixed function of its fields: what the file mechanics need, and a
    count of how often each config was scored."""

    model_name, seed, tasks, head_dim, num_layers = "smollm2-135m", 0, ("passkey",), 64, 30
    plan = LayerPlan.full(30)

    class profile:  # noqa: N801 (the evaluator's profile attribute)
        name = "smoke"

    def __init__(self) -> None:
        self.scored: list[str] = []

    def prepare(self) -> None:
        pass

    def evaluate(self, config: PNMixConfig, measure: bool = True) -> Score:
        self.scored.append(config_key(config))
        acc = (config.b_high + config.b_low + config.salient_ratio) / 10
        return Score(config=config.to_dict(), accuracy=acc, parts={"passkey": acc}, fidelity_agreement=0.0,
                     fidelity_kl=0.0, key_bits=config.b_low + config.salient_ratio, kv_bytes=0,
                     decode_tokens_per_s=0.0, peak_memory_bytes=None, backend="t", device="cpu", versions={},
                     seconds=1.0, profile="smoke", accuracy_se=0.01, units={"passkey": [1.0, 0.0]})


def test_shards_cover_the_space_once_and_keep_kernel_specialisations_together():
    space = SearchSpace()
    shards = [shard_configs(space, (i, 4)) for i in range(4)]
    keys = [config_key(c) for s in shards for c in s]
    assert len(keys) == len(set(keys)) == len(space.configs()) == 870
    owner = {}
    for i, s in enumerate(shards):
        for c in s:
            assert owner.setdefault((c.b_high, c.b_low, c.group_size, c.salient_ratio), i) == i


def test_a_sweep_resumes_after_a_kill_and_skips_a_cut_line(tmp_path):
    space = SearchSpace(method="kitty")  # 27 configs
    path = tmp_path / "sweep.jsonl"
    ev = CountingEvaluator()
    assert run_sweep(ev, space, path, limit=5) == 5
    with path.open("a") as f:  # a kill in the middle of the sixth line
        f.write('{"kind": "score", "config": {"b_hi')
    sweep = read_sweep(path)
    assert len(sweep.records) == 5 and sweep.skipped_lines == 1
    ev2 = CountingEvaluator()
    assert run_sweep(ev2, space, path) == 22  # the five are not scored again
    assert not set(ev.scored) & set(ev2.scored)
    done = read_sweep(path)
    assert len(done.records) == 27 and {config_key(r["config"]) for r in done.records} == {
        config_key(c) for c in space.configs()}
    assert run_sweep(CountingEvaluator(), space, path) == 0
    header = sweep_header("smollm2-135m", space, "full", 0, ("passkey",))
    with pytest.raises(EvalError, match=r"holds another sweep: profile 'smoke' \(asked 'full'\)"):
        start_file(path, header)


def test_the_front_keeps_only_points_no_other_beats(truth):
    recs = truth.records
    whole = front(recs)
    for p in whole:
        assert not any(r["key_bits"] <= p["key_bits"] and r["accuracy"] > p["accuracy"] for r in recs)
    for budget in (3.0, 2.25, 1.5):
        f = front(recs, budget)
        assert f == [p for p in whole if p["key_bits"] <= budget]
        assert f[-1]["accuracy"] == max(r["accuracy"] for r in recs if r["key_bits"] <= budget)


def test_the_committed_ground_truth_is_the_whole_space_with_per_item_outcomes(truth):
    assert truth.header["method"] == "pnmix" and truth.header["profile"] == "full"
    assert len(truth.records) == 870 and truth.skipped_lines == 0
    for r in truth.records[:50]:
        assert len(r["units"]["passkey"]) == 100 and len(r["units"]["kv_lookup"]) == 98
        assert len(r["units"]["fidelity"]) == 8 and r["seconds"] > 0


# -- racing --------------------------------------------------------------------------------------


def _by_key(truth):
    return {config_key(r["config"]): r for r in truth.records}


def test_racing_stops_a_planted_dominated_config_at_the_first_rung(truth):
    recs = _by_key(truth)
    paper = recs[config_key(preset("pnmix-paper"))]
    # 4/1 G32 r0.1 s0 spends more key bits than pnmix-paper for far less accuracy.
    bad = recs[config_key(SearchSpace().config(4, 1, 32, 0.1, 0))]
    assert bad["key_bits"] > paper["key_bits"] and bad["accuracy"] < paper["accuracy"] - 0.2
    verdict = racing.judge(bad["units"], bad["key_bits"], [(paper["key_bits"], paper["units"])], racing.RUNGS[0])
    assert verdict.stop and verdict.share == racing.RUNGS[0] and verdict.beaten_by == 0
    diff, se = verdict.margin
    assert diff > verdict.z * se and verdict.z == pytest.approx(racing.threshold(3))
    # A point with more bits never stops it, however good.
    best = max(truth.records, key=lambda r: r["accuracy"])
    assert not racing.judge(bad["units"], bad["key_bits"], [(best["key_bits"] + 5, best["units"])], 0.125).stop


def test_racing_never_stops_the_true_best_of_any_budget(truth):
    recs = truth.records
    for budget in (3.0, 2.5, 2.25, 2.0, 1.5):
        best = front(recs, budget)[-1]
        # What it would meet: the front of every other config within the budget.
        others = [(r["key_bits"], r["units"]) for r in front([r for r in recs if r is not best], budget)]
        for share in racing.RUNGS:
            verdict = racing.judge(best["units"], best["key_bits"], others, share)
            assert not verdict.stop, (budget, share, verdict)


def test_racing_judges_on_the_first_units_of_each_part():
    units = {"passkey": [1.0] * 8 + [0.0] * 8, "fidelity": [0.1, 0.2, 0.3, 0.4]}
    assert racing.rung_sizes(units, 0.125) == {"passkey": 2, "fidelity": 2}  # at least two for an SE
    assert racing.rung_sizes(units, 0.5) == {"passkey": 8, "fidelity": 2}
    v = racing.judge(units, 2.0, [], 0.5)
    assert not v.stop and v.accuracy == pytest.approx((0.25 * 1.0 + 0.5 * 2.718281828 ** -0.15) / 0.75)


# -- the replay benchmark ------------------------------------------------------------------------


def test_bench_tuner_replays_every_strategy_on_the_ground_truth(tmp_path):
    out = tmp_path / "bt"
    strategies = "campaign-6,campaign-6+racing,random,tpe,nsga2,grid,tpe+racing"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tuner.py"), "--seeds", "2", "--quick",
                           "--strategies", strategies, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "bench_tuner.json").read_text())
    assert summary["configs"] == 870 and (out / "bench_tuner.png").stat().st_size > 10_000
    grid = summary["strategies"]["grid"]
    assert grid["evaluations"] == 870 and grid["share_to_target"] == [pytest.approx(grid["share_to_target"][0])]
    for name, row in summary["strategies"].items():
        for budget, vals in row["at_10pct"].items():
            assert all(0.0 <= v <= 1.0 + 1e-9 for v in vals), (name, budget)
    # A race pays for the rungs it scored: never more than scoring the same configs in full.
    raced = summary["strategies"]["campaign-6+racing"]
    assert all(0.0 < x <= 0.2 for x in raced["final_share"])
    # The whole sweep reaches the true front exactly; random search at 10% of its seconds does not.
    assert max(summary["strategies"]["random"]["at_10pct"]["2.25"]) < 1.0


# -- the campaign's own proposals ----------------------------------------------------------------


def test_fullest_within_fills_each_pairs_budget_without_passing_it():
    from pnmix.bits import key_bits
    from pnmix.tuner.search.space import RATIOS

    space = SearchSpace()
    for budget in (3.0, 2.5, 2.25, 2.0, 1.5):
        configs = space.fullest_within(budget, 64)
        pairs = {f"{c.b_high}/{c.b_low}" for c in configs}
        assert len(pairs) == len(configs) and pairs <= set(space.pairs_within(budget, 64))
        for c in configs:
            assert space.contains(c) and key_bits(c, 64).total <= budget
            if c.b_high > c.b_low and c.salient_ratio < RATIOS[-1]:  # one more step of r is over the budget
                richer = space.config(c.b_high, c.b_low, c.group_size, round(c.salient_ratio + 0.1, 1), 0)
                assert key_bits(richer, 64).total > budget, (budget, c.label)
    # At 3.0 bits the 4/2 pair's fullest config is the true best's own corner: G128, r0.3.
    top = {f"{c.b_high}/{c.b_low}": c for c in space.fullest_within(3.0, 64)}["4/2"]
    assert (top.group_size, top.salient_ratio) == (128, 0.3)


def test_neighbours_differ_by_one_step_of_one_knob():
    space = SearchSpace()
    cfg = space.config(3, 1, 64, 0.5, 16)
    got = {c.label for c in space.neighbours(cfg)}
    assert got == {"3/1 G64 r0.5 s8", "3/1 G64 r0.5 s32", "3/1 G64 r0.4 s16", "3/1 G64 r0.6 s16",
                   "3/1 G32 r0.5 s16", "3/1 G128 r0.5 s16"}
    edge = {c.label for c in space.neighbours(space.config(2, 2, 128, 0.0, 0))}
    assert edge == {"2/2 G128 r0 s8", "2/2 G64 r0 s0"}  # no ratio for a uniform pair; no step past an end
    assert {c.label for c in SearchSpace("kivi").neighbours(preset("kivi2"))} == {"2/2 G64 r0 s0"}


def test_a_reproposed_config_queues_an_unscored_neighbour(tmp_path, truth):
    """On the ground truth: every trial the campaign queued as a neighbour is one step from the config
    re-proposed before it, fits its budget, and is scored by its own run (no study held it before)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tuner import Replay, head_dim_of

    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.record import read
    from pnmix.tuner.search.session import find_or_create_campaign, open_db
    from pnmix.tuner.search.spec import CampaignSpec

    replay = Replay(truth.records, head_dim_of(truth.records), "full", 0)
    db = open_db(f"sqlite:///{tmp_path / 'r.db'}", upgrade=True)
    spec = CampaignSpec(model="smollm2-135m", budgets=(2.25, 3.0), n_trials=12, profile="full", seed=0,
                        multi_fidelity=False, space=SearchSpace())
    runner = CampaignRunner(db, db.url, find_or_create_campaign(db, spec), spec, replay)
    studies = runner.run()
    order = [key for key, _, _ in replay.ledger]  # every config the campaign paid for
    queued = 0
    for budget, study in studies.items():
        for t in study.get_trials(deepcopy=False):
            if "neighbour_of" not in t.user_attrs or t.user_attrs.get("shared"):  # not a copy another budget made
                continue
            queued += 1
            cfg = PNMixConfig.from_dict(t.user_attrs["config"])
            origin = next(c for c in SearchSpace().configs() if c.label == t.user_attrs["neighbour_of"])
            assert cfg.label in {c.label for c in SearchSpace().neighbours(origin)}
            assert t.user_attrs["key_bits"] <= budget
            assert read(t).original and config_key(cfg) in order  # run here, not a copy of an earlier score
    assert queued >= 5
    db.engine.dispose()
