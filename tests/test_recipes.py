"""Engine recipes (pnmix/recipes.py): effective bits, each engine's syntax, round trips and refusals."""

from __future__ import annotations

import json
import random
import re

import pytest

from pnmix.bits import LayerPlan
from pnmix.kv_formats import KVFormat
from pnmix.recipes import ENGINES, EngineRecipe, RecipeError, export, expresses, parse

F = KVFormat
N = 30  # SmolLM2-135M's layers


def test_effective_bits_follow_modelopts_table_and_weigh_layers_by_tokens_held():
    assert EngineRecipe.uniform(N, F.FP8).effective_bits() == 8.0
    assert EngineRecipe.uniform(N, F.FP8, F.NVFP4).effective_bits() == pytest.approx(6.25)  # modelopt's 6.25
    assert EngineRecipe.uniform(N, F.Q8_0).effective_bits() == 8.5
    two = EngineRecipe.uniform(N, F.FP8).with_layers({0: F.BF16, 29: F.BF16})
    assert two.effective_bits() == pytest.approx((28 * 8 + 2 * 16) / 30)
    # A hybrid: 5 sliding layers of window 512 beside one global layer, at 32768 tokens.
    plan = LayerPlan(("sliding",) * 5 + ("full",), 512)
    recipe = EngineRecipe.uniform(6, F.BF16).with_layers({5: F.NVFP4})
    held = plan.held(32768)
    assert recipe.effective_bits(plan) == pytest.approx((sum(held[:5]) * 16 + held[5] * 4.5) / sum(held))
    with pytest.raises(RecipeError, match="the recipe has 30 layers, the model 6"):
        EngineRecipe.uniform(N, F.FP8).effective_bits(plan)


def test_vllm_line_is_one_dtype_and_a_skip_list():
    recipe = EngineRecipe.uniform(N, F.FP8).with_layers({0: F.BF16, 1: F.BF16, 23: F.BF16})
    line = export(recipe, "vllm")
    assert line == "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 1 23"
    # vllm/config/cache.py: CacheConfig.cache_dtype is a CacheDType literal ("auto", "fp8", "nvfp4", ...)
    # and kv_cache_dtype_skip_layers a list[str] of layer indices (or attention type names).
    words = line.split()
    assert words[1] in ("auto", "fp8", "nvfp4") and all(w.isdigit() for w in words[3:])
    assert export(EngineRecipe.uniform(N, F.BF16), "vllm") == "--kv-cache-dtype auto"
    with pytest.raises(RecipeError, match="one quantized KV dtype"):
        export(recipe.with_layers({5: F.NVFP4}), "vllm")


def test_modelopt_config_lists_the_quantized_layers():
    recipe = EngineRecipe.uniform(4, F.FP8).with_layers({1: F.BF16, 2: (F.FP8, F.NVFP4), 3: F.NVFP4})
    data = json.loads(export(recipe, "modelopt"))
    # Model-Optimizer's modelopt/torch/export/convert_hf_config.py keeps this map as written.
    assert data == {"kv_cache_quant_algo": "MIXED_PRECISION", "kv_cache_schema_version": 1,
                    "kv_cache_quantized_layers": {"model.layers.0.self_attn": {"quant_algo": "FP8"},
                                                  "model.layers.2.self_attn": {"quant_algo": "FP8_K_NVFP4_V"},
                                                  "model.layers.3.self_attn": {"quant_algo": "NVFP4"}}}
    with pytest.raises(RecipeError, match="no KV algorithm for nvfp4 keys with fp8 values"):
        export(recipe.with_layers({0: (F.NVFP4, F.FP8)}), "modelopt")
    with pytest.raises(RecipeError, match="no KV algorithm for q8_0 keys"):
        export(recipe.with_layers({0: F.Q8_0}), "modelopt")


def test_trtllm_and_sglang_strings():
    recipe = EngineRecipe.uniform(36, F.NVFP4).with_layers({i: F.FP8 for i in range(4)})
    assert export(recipe, "trtllm") == "0-3:fp8,4-35:nvfp4"
    line = export(recipe.with_layers({0: F.BF16, 1: F.BF16}), "sglang")
    assert line == "--kv-cache-dtype fp4_e2m1 --kv-cache-per-layer-dtype 0-1:bf16,2-3:fp8_e4m3"
    assert re.fullmatch(r"(\d+(-\d+)?:\w+)(,\d+(-\d+)?:\w+)*", line.split()[-1])
    for engine in ("trtllm", "sglang", "vllm"):
        with pytest.raises(RecipeError, match=f"{engine} stores a layer's keys and values in one dtype"):
            export(recipe.with_layers({7: (F.FP8, F.NVFP4)}), engine)


def test_llamacpp_flags_take_first_and_last_layers_only():
    recipe = EngineRecipe.uniform(N, F.Q4_0, F.Q8_0).with_layers(
        {0: (F.Q8_0, F.Q8_0), 1: (F.Q8_0, F.Q8_0), 29: (F.BF16, F.Q8_0)})
    line = export(recipe, "llamacpp")
    assert line == "-ctk q4_0 --cache-type-k-first q8_0,2 --cache-type-k-last bf16,1 -ctv q8_0"
    with pytest.raises(RecipeError, match="key types change 4 times"):
        export(recipe.with_layers({10: (F.Q8_0, F.Q8_0)}), "llamacpp")
    with pytest.raises(RecipeError, match="llamacpp has no KV-cache dtype for fp8"):
        export(recipe.with_layers({3: F.FP8}), "llamacpp")


def _random_recipe(rng: random.Random, engine: str) -> EngineRecipe:
    """A recipe drawn among those `engine` can express."""
    pool = {"vllm": [F.BF16, F.FP8], "modelopt": [F.BF16, F.FP8, F.NVFP4, (F.FP8, F.NVFP4)],
            "trtllm": [F.BF16, F.FP8, F.NVFP4], "sglang": [F.BF16, F.FP8, F.NVFP4]}.get(engine)
    if pool is None:  # llamacpp: a middle type and ends, per side
        cut = sorted(rng.sample(range(1, N), 2))
        sides = []
        for _ in range(2):
            a, b, c = (rng.choice([F.BF16, F.Q8_0, F.Q4_0]) for _ in range(3))
            sides.append([a] * cut[0] + [b] * (cut[1] - cut[0]) + [c] * (N - cut[1]))
        return EngineRecipe.of(list(zip(*sides, strict=True)))
    return EngineRecipe.uniform(N, F.BF16).with_layers({i: rng.choice(pool) for i in range(N)})


@pytest.mark.parametrize("engine", ENGINES)
def test_every_export_parses_back_to_the_same_recipe(engine):
    rng = random.Random(f"recipes-{engine}")
    for _ in range(50):
        recipe = _random_recipe(rng, engine)
        assert expresses(recipe, engine)
        assert parse(export(recipe, engine), engine, N) == recipe, export(recipe, engine)


def test_recipes_read_back_from_their_dict_and_refuse_bad_ones_in_one_line():
    recipe = EngineRecipe.uniform(3, F.FP8).with_layers({2: (F.FP8, F.NVFP4)})
    assert EngineRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    for bad in ({"layers": [["fp9", "fp8"]]}, {"layer": []}, [1, 2]):
        with pytest.raises(RecipeError, match="not an engine recipe") as info:
            EngineRecipe.from_dict(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(RecipeError, match="unknown engine 'tgi'"):
        export(recipe, "tgi")
