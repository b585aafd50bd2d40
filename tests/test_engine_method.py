"""The engine method: campaigns whose answers are serving engines' per-layer KV formats, scored by
real inference, stored on the fronts beside PN-Mix configs, recommended and exported per engine."""

from __future__ import annotations

import json

import optuna
import pytest
from tiny import save_tiny_llama
from transformers import AutoTokenizer

from pnmix import models
from pnmix.recipes import EngineRecipe, expresses, parse
from pnmix.storage import Database, list_front_points, recommend, upgrade
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.methods import METHODS, POOLS, UNIFORM
from pnmix.tuner.search.record import Origin, read
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import finished

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded):
    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tok)


def test_every_method_is_a_typed_object_and_the_engine_method_is_on_kv_bits_only():
    assert [m for m in METHODS if METHODS[m].recipes] == ["engine"]
    assert METHODS["kivi"].pairs == ("1/1", "2/2") and METHODS["kitty"].criterion == "k_magnitude"
    with pytest.raises(EvalError, match="engine method's budgets are on kv bits"):
        SearchSpace(method="engine")
    space = SearchSpace(method="engine", budget_on="kv").with_layers(4)
    mixed = EngineRecipe.of([("bf16", "bf16"), ("fp8", "nvfp4"), ("fp8", "fp8"), ("nvfp4", "nvfp4")])
    assert space.contains(mixed) and space.params_of(mixed) == {"pool": "modelopt"}
    assert space.cost(mixed, 64) == pytest.approx((16 + 6.25 + 8 + 4.5) / 4)
    assert not space.contains(EngineRecipe.of([("fp8", "q4_0")] * 4))  # no engine stores that pair
    assert space.min_bits(64) == 4.5
    # vLLM's pool: one quantized dtype; llama.cpp's: another type for the first and last layers only
    assert POOLS["vllm"].holds(EngineRecipe.of([("bf16", "bf16"), ("fp8", "fp8"), ("fp8", "fp8"), ("bf16", "bf16")]))
    assert not POOLS["vllm"].holds(EngineRecipe.of([("nvfp4",) * 2, ("fp8",) * 2, ("fp8",) * 2, ("fp8",) * 2]))
    assert not POOLS["llamacpp"].holds(EngineRecipe.of([("q8_0",) * 2, ("q4_0",) * 2, ("q8_0",) * 2,
                                                        ("q4_0",) * 2]))


def test_an_engine_campaign_tunes_stores_recommends_and_exports(tmp_path, tiny_dir):
    db = Database(f"sqlite:///{tmp_path / 'pnmix.db'}")
    upgrade(db)
    space = SearchSpace(method="engine", budget_on="kv")
    spec = CampaignSpec(model=tiny_dir, budgets=(6.25,), n_trials=5, profile="smoke", tasks=("fidelity",),
                        method="engine", space=space, objectives=("accuracy", "kv_bits"))
    campaign_id = find_or_create_campaign(db, spec)
    evaluator = Evaluator(tiny_dir, profile("smoke"), tasks=("fidelity",))
    runner = CampaignRunner(db, db.url, campaign_id, spec, evaluator)
    study = runner.run()[6.25]
    n = evaluator.num_layers
    records = [read(t) for t in finished(study)]
    assert len(records) == 5
    recipes = [r.config for r in records]
    assert all(isinstance(c, EngineRecipe) and c.effective_bits() <= 6.25 + 1e-9 for c in recipes)
    # Each pool's allocation first, then Model-Optimizer's rule (its knapsack over each layer's forward KL)
    loop = runner.allocator
    origins = [r.origin for r in records]
    assert origins[:3] == [Origin.ALLOCATION] * 3 and origins[3] == Origin.PROPOSAL
    rule = loop.kl_rule(6.25)
    assert recipes[3] == rule and POOLS["modelopt"].holds(rule) and rule.effective_bits() <= 6.25 + 1e-9
    assert [study.trials[i].params["pool"] for i in range(3)] == list(POOLS)
    for recipe, pool in zip(recipes[:3], POOLS.values(), strict=True):
        assert pool.holds(recipe)
    # The rule's table: zero for bf16, positive otherwise, and the coarser NVFP4 costs more than FP8
    kl = evaluator.format_kl(list(POOLS["modelopt"].pairs))
    rows = {f"{p.key}/{p.value}": row for p, row in kl.items()}
    assert rows["bf16/bf16"] == [0.0] * n and all(x > 0 for x in rows["nvfp4/nvfp4"])
    assert sum(rows["fp8/fp8"]) < sum(rows["fp8/nvfp4"]) < sum(rows["nvfp4/nvfp4"])
    # The knapsack never does worse by the proxy than a uniform recipe of its pool that fits.
    fits = [EngineRecipe.uniform(n, k, v) for k, v in UNIFORM]
    fits = [r for r in fits if r.effective_bits() <= 6.25 and POOLS["modelopt"].holds(r)]
    assert fits and loop.harm(recipes[0]) <= min(loop.harm(r) for r in fits) + 1e-12
    with db.session(readonly=True) as s:
        stored = list_front_points(s, tiny_dir, campaign_id=campaign_id).items
        assert stored and all(isinstance(p.config, EngineRecipe) and p.b_high is None for p in stored)
        assert all(p.kv_bits == pytest.approx(p.config.effective_bits()) for p in stored)
        best = recommend(s, tiny_dir, 6.25, bits_of="kv").config
        assert isinstance(best, EngineRecipe)
        vllm = recommend(s, tiny_dir, 6.25, bits_of="kv", engine="vllm").config
        assert expresses(vllm, "vllm")
    from typer.testing import CliRunner

    from pnmix.api.cli import app

    cli = CliRunner()
    out = cli.invoke(app, ["export", "--model", tiny_dir, "--bits", "6.25", "--bits-of", "kv", "--format", "vllm",
                           "--storage", db.url])
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if x.startswith("--kv-cache-dtype"))
    assert line.startswith("--kv-cache-dtype ") and parse(line, "vllm", n) == vllm
    rec = cli.invoke(app, ["recommend", "--model", tiny_dir, "--bits", "6.25", "--bits-of", "kv", "--format",
                           "modelopt", "--json", "--storage", db.url])
    assert rec.exit_code == 0, rec.output
    row = json.loads(next(x for x in rec.output.splitlines() if x.startswith("{")))
    served = json.loads(row["engine_config"])
    assert served["kv_cache_quant_algo"] == "MIXED_PRECISION"
    assert parse(row["engine_config"], "modelopt", n) == EngineRecipe.from_dict(row["config"])
    # Without --format, export writes the best point as JSON, here a recipe, which validate reads.
    target = tmp_path / "recipe.json"
    assert cli.invoke(app, ["export", "--model", tiny_dir, "--bits", "6.25", "--bits-of", "kv", "-o", str(target),
                            "--storage", db.url]).exit_code == 0
    assert EngineRecipe.from_dict(json.loads(target.read_text())) == best
    checked = cli.invoke(app, ["validate", "--config", str(target), "--model", tiny_dir, "--profile", "smoke",
                               "--tasks", "fidelity", "--json"])
    assert checked.exit_code == 0, checked.output
    text = checked.output
    verdict = json.loads(text[text.index('{"model"'):].splitlines()[0])  # after the model loader's progress bar
    assert verdict["config"] == best.to_dict()
    assert verdict["scores"]["config"]["key_bits"] == pytest.approx(best.key_bits())
