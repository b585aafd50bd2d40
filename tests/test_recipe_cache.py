"""Engine recipes as transformers caches (pnmix/recipe_cache.py) on tiny random models."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tiny import tiny_gemma3, tiny_model
from transformers import DynamicCache

from pnmix import kv_formats as kv
from pnmix.kv_formats import KVFormat
from pnmix.recipe_cache import FormatLayer, RecipeCache
from pnmix.recipes import EngineRecipe, LayerFormats, RecipeError

F = KVFormat


def _greedy(model, ids, cache=None, n=12):
    kwargs = {} if cache is None else {"past_key_values": cache}
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("make", [lambda: tiny_model("llama", dtype=torch.bfloat16, head_dim=32),
                                  lambda: tiny_gemma3(dtype=torch.bfloat16, window=8, head_dim=32)])
def test_bf16_everywhere_gives_generates_tokens(make):
    model = make()
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    recipe = EngineRecipe.uniform(model.config.num_hidden_layers, F.BF16)
    assert torch.equal(_greedy(model, ids, RecipeCache(model.config, recipe)), _greedy(model, ids))


def test_the_prompt_is_stored_in_each_layers_formats_with_scales_calibrated_on_it():
    model = tiny_model("llama", head_dim=32)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    plain = DynamicCache(config=model.config)
    model(ids, past_key_values=plain, use_cache=True)
    recipe = EngineRecipe.of([(F.FP8, F.Q4_0), (F.NVFP4, F.Q8_0)])
    cache = RecipeCache(model.config, recipe)
    model(ids, past_key_values=cache, use_cache=True)
    # Layer 0 sees the same inputs in both runs (no attention before it): its stored states are the
    # plain run's, round-tripped.
    k, v = plain.layers[0].keys, plain.layers[0].values
    assert torch.equal(cache.layers[0].keys, kv.fp8(k, float(k.abs().max()) / 448))
    assert torch.equal(cache.layers[0].values, kv.q4_0(v))
    assert cache.layers[0].scales == (pytest.approx(float(k.abs().max()) / 448), None)
    assert cache.layers[1].scales[0] == pytest.approx(float(cache.layers[1].keys.abs().max()) / 2688, rel=0.05)
    assert not torch.equal(cache.layers[1].keys, plain.layers[1].keys)


def test_later_tokens_keep_the_prompts_scales_and_saturate_beyond_them():
    layer = FormatLayer(LayerFormats(F.FP8, F.FP8))
    first = torch.randn(1, 2, 6, 32)
    layer.update(first, first)
    scale = float(first.abs().max()) / 448
    late = first[:, :, :1] * 10  # ten times the prompt's amax: saturates at 448 * scale
    keys, _ = layer.update(late, late)
    assert torch.equal(keys[:, :, -1:], kv.fp8(late, scale))
    assert float(keys[:, :, -1:].abs().max()) == pytest.approx(448 * scale)
    one = FormatLayer(LayerFormats(F.FP8, F.BF16), fp8_scale="one")
    one.update(first, first)
    assert one.scales == (1.0, None) and torch.equal(one.keys, kv.fp8(first, 1.0))


def test_sliding_layers_keep_their_window_in_their_format():
    model = tiny_gemma3(window=8, head_dim=32)
    recipe = EngineRecipe.uniform(6, F.Q8_0).with_layers({5: F.BF16})
    cache = RecipeCache(model.config, recipe)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    model(ids, past_key_values=cache, use_cache=True)
    assert cache.layers[0].keys.shape[-2] == 7 and cache.layers[5].keys.shape[-2] == 20  # window - 1; all
    assert torch.equal(cache.layers[0].keys, kv.q8_0(cache.layers[0].keys))  # stored values are q8_0 points


def test_recipes_a_model_cannot_hold_are_refused_in_one_line():
    model = tiny_model("llama")  # head_dim 16
    with pytest.raises(RecipeError, match="q4_0 stores blocks of 32 along head_dim; this model's head_dim is 16"):
        RecipeCache(model.config, EngineRecipe.uniform(2, F.Q4_0))
    with pytest.raises(RecipeError, match="the recipe has 3 layers, the model 2"):
        RecipeCache(model.config, EngineRecipe.uniform(3, F.FP8))
    with pytest.raises(RecipeError, match="invalid fp8_scale 'max'"):
        RecipeCache(model.config, EngineRecipe.uniform(2, F.FP8), fp8_scale="max")  # type: ignore[arg-type]


def test_engine_recipe_peers_are_named_on_the_command_line():
    from pnmix.tuner.errors import EvalError
    from pnmix.tuner.scoring.peers import RecipePeer, is_peer, peer

    p = peer("engine:fp8+bf16@29.0")
    assert isinstance(p, RecipePeer) and (p.key, p.value, p.bf16_layers) == (F.FP8, F.FP8, (0, 29))
    assert p.recipe(30) == EngineRecipe.uniform(30, F.FP8).with_layers({0: F.BF16, 29: F.BF16})
    assert p.kv_bits(LayerPlanOf(30)) == pytest.approx((28 * 8 + 2 * 16) / 30)
    assert peer("engine:fp8/nvfp4").key_bits(64, LayerPlanOf(30)) == 8.0
    assert peer("engine:fp8/nvfp4").kv_bits(LayerPlanOf(30)) == pytest.approx(6.25)
    assert is_peer("engine:q4_0") and not is_peer("kivi2")
    for bad, needle in (("engine:fp9", "formats are among bf16, fp8, nvfp4, q8_0, q4_0"),
                        ("engine:fp8+bf16@", "expected engine:KEY[/VALUE][+bf16@L.L...]")):
        with pytest.raises(EvalError, match=re.escape(needle)):
            peer(bad)
    with pytest.raises(EvalError, match="the model has layers 0-29"):
        peer("engine:fp8+bf16@30").recipe(30)


def LayerPlanOf(n):  # noqa: N802  (a plan of n full-attention layers)
    from pnmix.bits import LayerPlan

    return LayerPlan.full(n)


@pytest.mark.slow
def test_engine_recipes_are_scored_by_real_inference_like_peers(tmp_path, embedded):
    """On a tiny checkpoint with the embedded model's tokenizer (fp32 on the CPU, smoke profile):
    bf16 storage barely moves the fp32 model's distributions, q4_0 moves them more, and the bytes
    follow the formats' effective bits."""
    from tiny import save_tiny_llama
    from transformers import AutoTokenizer

    from pnmix import models
    from pnmix.tuner.scoring import peers
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile

    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    ev = Evaluator(save_tiny_llama(tmp_path, tok), profile("smoke"), tasks=("fidelity",))
    bf16, q4 = (peers.score(ev, peers.peer(name)) for name in ("engine:bf16", "engine:q4_0"))
    assert bf16.fidelity_kl < 1e-3 and bf16.fidelity_agreement >= 0.95
    assert q4.fidelity_kl > 10 * bf16.fidelity_kl
    assert bf16.kv_bytes / q4.kv_bytes == pytest.approx(16 / 4.5)
    assert math.isnan(q4.decode_tokens_per_s) and (bf16.key_bits, q4.key_bits) == (16.0, 4.5)
    assert set(q4.parts) == {"fidelity"} and q4.config["key"] == "q4_0"
