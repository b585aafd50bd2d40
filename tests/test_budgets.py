"""KV budgets, values in the search and layer groups: the bit formula, the search space, storage,
the service and a campaign of each kind."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import torch
from fastapi.testclient import TestClient

from pnmix.bits import LayerPlan, key_bits, kv_bits, mean_key_bits, value_bits_total
from pnmix.config import PNMixConfig, preset
from pnmix.layerwise import LayerRange, LayerwiseConfig, config_from_dict
from pnmix.storage import Database, FrontPointIn, create_campaign, recommend, replace_front, upgrade
from pnmix.storage.errors import InvalidValueError, NoFeasiblePointError
from pnmix.tuner.errors import EvalError
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.layers import allocate, candidates_like, group_layers, grouped_for_budget
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import study_name

optuna.logging.set_verbosity(optuna.logging.WARNING)
D = 64  # the embedded model's head_dim; it has 30 layers
PAPER_VALUES = (32768 * (2 + 32 / 32) + 32 * 16) / (32768 + 32)  # 2-bit values, G_V = 32, 32 fp16 sinks


# -- the formula ---------------------------------------------------------------------------------


def test_kv_bits_count_keys_and_values_alike():
    paper = preset("pnmix-paper")
    assert value_bits_total(paper) == pytest.approx(PAPER_VALUES)
    assert kv_bits(paper, 30, D) == pytest.approx((key_bits(paper, D).total + PAPER_VALUES) / 2)
    assert value_bits_total(preset("kivi2")) == 3.0  # no sinks: codes and scales only
    assert kv_bits(preset("fp16"), 30, D) == 16.0
    lw = LayerwiseConfig(paper, (LayerRange(0, 9, (("b_high", 4), ("b_low", 2))),))
    assert kv_bits(lw, 30, D) == pytest.approx((mean_key_bits(lw, 30, D) + PAPER_VALUES) / 2)
    cheap_values = paper.with_(value_bits=1, value_group_size=64)
    assert kv_bits(cheap_values, 30, D) < kv_bits(paper, 30, D)


# -- the search space ----------------------------------------------------------------------------


def test_values_are_searched_only_under_a_kv_budget():
    with pytest.raises(EvalError, match=r"needs a KV budget \(--budget-on kv\)"):
        SearchSpace(search_values=True)
    space = SearchSpace(budget_on="kv", search_values=True)
    assert (8, 64) in space.value_choices(D) and all(g != 128 for _, g in space.value_choices(D))
    assert space.value_choices(128)[-1] == (8, 128)
    # The floor: 1/1 keys in groups of 128, no sinks; 1-bit values in groups of 64.
    assert space.min_bits(D) == pytest.approx((1 + 32 / 128 + 1 + 32 / 64) / 2)
    assert SearchSpace(budget_on="kv").min_bits(D) == pytest.approx((1.25 + 3.0) / 2)
    high_keys = space.config(4, 4, 128, 0.0, 0, value_bits=1, value_group_size=64)
    assert space.cost(high_keys, D) == pytest.approx((4.25 + 1.5) / 2)
    assert space.cost(high_keys, D) < 3.0 < key_bits(high_keys, D).total
    assert space.contains(high_keys) and not SearchSpace().contains(high_keys)
    params = space.params_of(high_keys)
    assert (params["value_bits"], params["value_group_size"]) == (1, 64)
    assert space.suggest(optuna.trial.FixedTrial(params), head_dim=D) == high_keys
    steps = {(c.value_bits, c.value_group_size) for c in space.neighbours(high_keys)}
    assert {(2, 64), (1, 32), (1, 128)} <= steps
    on_model = {(c.value_bits, c.value_group_size) for c in space.neighbours(high_keys, D)}
    assert on_model == steps - {(1, 128)}  # groups of 128 values do not divide a head of 64
    # Warm starts: the paper's pair at every value format with room for it, most value bits first (4-bit
    # values leave no room within 2.64 KV bits), then every pair with the paper's values.
    fullest = space.fullest_within(2.64, D)
    formats = [(c.value_bits, c.value_group_size) for c in fullest if (c.b_high, c.b_low) == (3, 1)]
    assert formats[:4] == [(2, 32), (2, 64), (1, 32), (1, 64)] and all(space.cost(c, D) <= 2.64 for c in fullest)
    assert max(c.salient_ratio for c in fullest if (c.value_bits, c.value_group_size) == (1, 32)) == 0.9


def test_a_layered_config_round_trips_through_its_trial_parameters():
    space = SearchSpace(method="pnmix-layers", layer_groups=3).with_groups([[0, 3], [1], [2, 4, 5]])
    per_group = [space.config(4, 2, 64, 0.3, 16), space.config(2, 2, 64, 0.0, 16), space.config(3, 1, 64, 0.5, 16)]
    cfg = space.layerwise(per_group)
    assert isinstance(cfg, LayerwiseConfig)
    assert [c.b_high for c in cfg.per_layer(6)] == [4, 2, 3, 4, 3, 3]
    params = space.params_of(cfg)
    assert params["bits_1"] == "2/2" and "salient_ratio_1" not in params and params["salient_ratio_0"] == 0.3
    assert space.suggest(optuna.trial.FixedTrial(params), head_dim=D) == cfg
    assert space.contains(cfg) and space.cost(cfg, D) == pytest.approx(mean_key_bits(cfg, 6, D))
    assert space.layerwise([per_group[2]] * 3) == per_group[2]  # every group alike: the single config
    split = LayerwiseConfig.from_layers([per_group[0], per_group[1], per_group[2], per_group[1], per_group[2],
                                         per_group[2]])
    assert not space.contains(split)  # layers 0 and 3 share a group but not a config
    neighbours = space.neighbours(cfg)
    assert neighbours and all(space.contains(n) and n != cfg for n in neighbours)
    # one group's ratio moves alone: layers 2, 4 and 5 change together, the others stay
    moved = [n for n in neighbours if isinstance(n, LayerwiseConfig) and n.for_layer(2).salient_ratio == 0.6]
    assert len(moved) == 1 and moved[0].for_layer(0) == cfg.for_layer(0)
    with pytest.raises(EvalError, match="each layer 0..L-1 once"):
        space.with_groups([[0, 1], [1, 2]])


def test_layer_groups_rank_layers_by_sensitivity():
    assert group_layers([0.1, 0.9, 0.5, 0.7, 0.2], 2) == [[1, 2, 3], [0, 4]]
    assert group_layers([0.3] * 4, 8) == [[0], [1], [2], [3]]
    assert group_layers([0.3] * 7, 3) == [[0, 1, 2], [3, 4], [5, 6]]


def test_a_group_allocation_weighs_groups_by_their_layers():
    a = PNMixConfig(b_high=2, b_low=2, salient_ratio=0.0, n_sink=0)  # 2.25 key bits at d = 64
    b = PNMixConfig(b_high=4, b_low=4, salient_ratio=0.0, n_sink=0)  # 4.25
    kl = {a: [1.0, 1.0], b: [0.0, 0.5]}
    budget = (3 * 2.25 + 4.25) / 4  # room for the one-layer group only
    assert allocate(kl, budget, D, weights=[3, 1]) == [a, b]
    assert allocate(kl, budget, D) == [a, a]  # as two single layers, no upgrade fits


def test_a_grouped_allocation_is_within_the_budget_and_no_worse_than_uniform():
    gen = torch.Generator().manual_seed(7)
    space = SearchSpace(method="pnmix-layers", layer_groups=3).with_groups([[0, 5], [1, 2, 3], [4]])
    cands = candidates_like(space.config(3, 1, 128, 0.5, 32), space)[:14]
    for trial in range(4):
        kl_of = {c: torch.rand(6, generator=gen).tolist() for c in cands}
        costs = {c: space.cost(c, D) for c in cands}
        budget = float(torch.empty(1).uniform_(min(costs.values()), max(costs.values()), generator=gen))
        cfg = grouped_for_budget(space, kl_of, budget, D)
        assert space.contains(cfg) and space.cost(cfg, D) <= budget + 1e-9, trial
        layers = LayerwiseConfig.from_layers([cfg] * 6).per_layer(6) if isinstance(cfg, PNMixConfig) else \
            cfg.per_layer(6)
        got = sum(kl_of[c][i] for i, c in enumerate(layers))
        assert got <= min(sum(kl_of[c]) for c in cands if costs[c] <= budget) + 1e-9, trial
    assert grouped_for_budget(space, kl_of, 0.5, D) is None  # nothing fits half a bit


# -- storage and the service ---------------------------------------------------------------------


def point(config, trial: int, accuracy: float, se: float | None = 0.01) -> FrontPointIn:
    return FrontPointIn(config=config, accuracy=accuracy, kv_bytes=1000 + trial, throughput=10.0, trial_number=trial,
                        backend="torch", device="cpu", accuracy_se=se)


@pytest.fixture
def db(tmp_path: Path) -> Database:
    database = Database(f"sqlite:///{tmp_path / 'pnmix.db'}")
    upgrade(database)
    return database


def test_front_points_keep_a_layerwise_config_and_both_bit_figures(db):
    paper = preset("pnmix-paper")
    lw = LayerwiseConfig(paper, (LayerRange(0, 3, (("b_high", 4), ("b_low", 2), ("salient_ratio", 0.3))),))
    alike = LayerwiseConfig(paper, (LayerRange(5, 6, (("b_high", 3),)),))  # changes nothing: stored as single
    with db.session() as s:
        keyed = create_campaign(s, "smollm2-135m", [2.5], 4)
        replace_front(s, keyed.id, 2.5, [point(lw, 0, 0.8), point(alike, 1, 0.7)])
    with db.session(readonly=True) as s:
        best = recommend(s, "smollm2-135m", 2.5)
        assert best.config == lw and best.layers == {"0-3": {"b_high": 4, "b_low": 2, "salient_ratio": 0.3}}
        assert best.key_bits == pytest.approx(mean_key_bits(lw, 30, D)) and best.key_bits > key_bits(paper, D).total
        assert best.kv_bits == pytest.approx(kv_bits(lw, 30, D)) and best.budget_on == "key"
        from pnmix.storage import list_front_points

        other = next(p for p in list_front_points(s, "smollm2-135m").items if p.trial_number == 1)
        assert other.layers is None and other.config == paper
    refused = r"trial 0: invalid layers 0-3=3: allowed layers 0-1 \(the model has 2\)"
    with pytest.raises(InvalidValueError, match=refused), \
            db.session() as s:
        campaign = create_campaign(s, "smollm2-135m", [2.5], 4)
        campaign.model.num_layers = 2  # a model with two layers refuses ranges past them
        replace_front(s, campaign.id, 2.5, [point(lw, 0, 0.8)])


def test_a_kv_budget_bounds_kv_bits_and_recommend_answers_for_either(db):
    cheap_values = PNMixConfig(b_high=4, b_low=4, salient_ratio=0.0, n_sink=0, value_bits=1, value_group_size=64)
    paper = preset("pnmix-paper")
    with db.session() as s:
        kv = create_campaign(s, "smollm2-135m", [3.0], 4, budget_on="kv")
        assert kv.objectives == ["accuracy", "kv_bits"]  # key_bits stands for the budget's bits
        replace_front(s, kv.id, 3.0, [point(cheap_values, 0, 0.9), point(paper, 1, 0.6)])
        with pytest.raises(InvalidValueError, match=r"needs 9\.50000 kv bits, over the budget 3"):
            replace_front(s, kv.id, 3.0, [point(preset("fp16").with_(value_bits=2), 2, 0.99)])
    with db.session(readonly=True) as s:
        # 4.25 key bits: within 3 KV bits, not within 3 key bits
        assert recommend(s, "smollm2-135m", 3.0, bits_of="kv").config == cheap_values
        assert recommend(s, "smollm2-135m", 3.0).config == paper
        with pytest.raises(NoFeasiblePointError, match=r"KV bits <= 2: the smallest feasible KV bits is 2\.6"):
            recommend(s, "smollm2-135m", 2.0, bits_of="kv")
        with pytest.raises(InvalidValueError, match="invalid bits_of='values': allowed key, kv"):
            recommend(s, "smollm2-135m", 3.0, bits_of="values")
    with pytest.raises(InvalidValueError, match="invalid budget_on='value'"), db.session() as s:
        create_campaign(s, "smollm2-135m", [3.0], 4, budget_on="value")


def test_the_service_answers_for_kv_bits_and_enqueues_each_kind_of_campaign(db, monkeypatch):
    from pnmix.api.app import create_app
    from pnmix.api.settings import Settings

    with db.session() as s:
        c = create_campaign(s, "smollm2-135m", [3.0], 4, budget_on="kv")
        lw = LayerwiseConfig(preset("pnmix-paper"), (LayerRange(28, 28, (("b_high", 2),)),
                                                      LayerRange(29, 29, (("salient_ratio", 0.7),))))
        replace_front(s, c.id, 3.0, [point(lw, 0, 0.9)])
    with TestClient(create_app(Settings(database_url=db.url, api_token="t"))) as client:
        got = client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.7, "bits_of": "kv"})
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["bits_of"] == "kv"
        assert body["point"]["layers"] == {"28": {"b_high": 2}, "29": {"salient_ratio": 0.7}}
        assert type(body["point"]["layers"]["28"]["b_high"]) is int  # bit widths are served as integers
        assert body["point"]["kv_bits"] == pytest.approx(kv_bits(lw, 30, D)) and body["point"]["budget_on"] == "kv"
        assert config_from_dict(json.loads(body["pnmix_config"])) == lw
        assert client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.7}).status_code == 200
        assert client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.7,
                                                   "bits_of": "both"}).status_code == 422
        auth = {"Authorization": "Bearer t"}
        made = client.post("/v1/campaigns", headers=auth, json={
            "model": "smollm2-135m", "budgets": [2.5], "method": "pnmix-layers", "layer_groups": 3,
            "budget_on": "kv", "search_values": True})
        assert made.status_code == 201, made.text
        row = made.json()
        assert (row["budget_on"], row["method"], row["objectives"]) == ("kv", "pnmix-layers", ["accuracy", "kv_bits"])
        assert row["search_space"]["layer_groups"] == 3 and row["search_space"]["value_bits"] == [1, 2, 4, 8]
        with db.session(readonly=True) as s:
            from pnmix.storage import get_campaign

            spec = CampaignSpec.from_campaign(get_campaign(s, row["id"]))
        assert spec.space == SearchSpace(method="pnmix-layers", layer_groups=3, budget_on="kv", search_values=True)
        refused = client.post("/v1/campaigns", headers=auth, json={
            "model": "smollm2-135m", "budgets": [2.5], "search_values": True})
        assert refused.status_code == 422 and "needs a KV budget" in refused.text
        assert client.post("/v1/campaigns", headers=auth, json={
            "model": "smollm2-135m", "budgets": [2.5], "method": "pnmix-layers", "layer_groups": 9}).status_code == 422


# -- campaigns -----------------------------------------------------------------------------------

SENSITIVITY = [0.2 + (7 * i % 30) / 10 for i in range(30)]  # per layer, no two alike


class LayerFormulaEvaluator:
    """Scores a config, single or layer-wise, by a fixed function of each layer's fields weighted by
    that layer's sensitivity, instantly: what a layered campaign's bookkeeping needs."""

    head_dim, num_layers = D, 30
    plan = LayerPlan.full(30)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def layer_loss(self, c: PNMixConfig, i: int) -> float:
        bits = c.b_low + (c.b_high - c.b_low) * c.salient_ratio
        return SENSITIVITY[i] * 2.0 ** -bits + 0.5 / c.value_bits

    def proxy_by_layer(self, config):
        layers = config.per_layer(30) if isinstance(config, LayerwiseConfig) else [config] * 30
        return [self.layer_loss(c, i) for i, c in enumerate(layers)]

    def sensitivity(self, candidates):
        return {c: self.proxy_by_layer(c) for c in candidates}

    def evaluate(self, config, measure: bool = True):
        from pnmix.tuner.scoring.score import Score

        self.calls.append(json.dumps(config.to_dict(), sort_keys=True))
        acc = max(0.0, 1.0 - sum(self.proxy_by_layer(config)) / 30)
        return Score(config=config.to_dict(), accuracy=acc, parts={"fidelity": acc}, fidelity_agreement=0.0,
                     fidelity_kl=0.0, key_bits=mean_key_bits(config, 30, D), kv_bytes=1, decode_tokens_per_s=1.0,
                     peak_memory_bytes=None, backend="t", device="cpu", versions={}, seconds=0.0, profile="smoke",
                     accuracy_se=0.01, units={"fidelity": [0.1, 0.2]})


def run_campaign(db: Database, space: SearchSpace, budgets, n_trials: int) -> tuple[CampaignRunner, int]:
    spec = CampaignSpec(model="smollm2-135m", budgets=tuple(budgets), n_trials=n_trials, method=space.method,
                        profile="smoke", tasks=("fidelity",), space=space)
    campaign_id = find_or_create_campaign(db, spec)
    runner = CampaignRunner(db, db.url, campaign_id, spec, LayerFormulaEvaluator())
    runner.run()
    return runner, campaign_id


def test_a_layered_campaign_groups_layers_by_sensitivity_and_stores_layerwise_fronts(db):
    space = SearchSpace(method="pnmix-layers", layer_groups=3)
    runner, campaign_id = run_campaign(db, space, [2.0, 2.5], 8)
    expected = group_layers(LayerFormulaEvaluator().proxy_by_layer(space.config(3, 1, 128, 0.5, 32)), 3)
    assert runner.space.groups == tuple(tuple(g) for g in expected)
    with db.session(readonly=True) as s:
        from pnmix.storage import get_campaign, list_front_points

        assert get_campaign(s, campaign_id).search_space["groups"] == expected
        points = list_front_points(s, "smollm2-135m", campaign_id=campaign_id).items
        assert points and any(p.layers for p in points)
        for p in points:
            assert runner.space.contains(p.config) and p.key_bits <= p.budget + 1e-9
    for budget in (2.0, 2.5):
        study = optuna.load_study(study_name=study_name(campaign_id, budget), storage=db.url)
        # the grouped warm start (the proxy's allocation over the groups) is the budget's first trial
        first = min(study.trials, key=lambda t: t.number)
        assert isinstance(config_from_dict(first.user_attrs["config"]), LayerwiseConfig)
        best = max(front_trials(study), key=lambda t: t.user_attrs["accuracy"])
        uniform = [t for t in study.trials if "accuracy" in t.user_attrs and "layers" not in
                   json.dumps(t.user_attrs["config"]) and t.user_attrs["bits"] <= budget]
        assert best.user_attrs["accuracy"] > max(t.user_attrs["accuracy"] for t in uniform)
    # a second runner (another worker, or a resumed run) reads the stored groups instead of forming them
    again = CampaignRunner(db, db.url, campaign_id, runner.spec, LayerFormulaEvaluator())
    again.evaluator.proxy_by_layer = None  # type: ignore[assignment]  (never called)
    again.study(2.0)
    assert again.space.groups == runner.space.groups


def test_a_kv_campaign_searches_values_and_keeps_its_fronts_within_kv_bits(db):
    space = SearchSpace(budget_on="kv", search_values=True)
    runner, campaign_id = run_campaign(db, space, [2.5], 10)
    study = optuna.load_study(study_name=study_name(campaign_id, 2.5), storage=db.url)
    scored = [t for t in study.trials if "accuracy" in t.user_attrs]
    assert {t.user_attrs["config"]["value_bits"] for t in scored} != {2}  # values moved
    for t in scored:
        cfg = config_from_dict(t.user_attrs["config"])
        assert t.user_attrs["bits"] == pytest.approx(kv_bits(cfg, 30, D))
        assert t.user_attrs["bits"] <= 2.5
        assert t.user_attrs["key_bits"] == pytest.approx(mean_key_bits(cfg, 30, D))
    assert study.metric_names == ["accuracy", "kv_bits"]
    with db.session(readonly=True) as s:
        from pnmix.storage import list_front_points

        points = list_front_points(s, "smollm2-135m", campaign_id=campaign_id).items
        assert points and all(p.budget_on == "kv" and p.kv_bits <= 2.5 + 1e-9 for p in points)
