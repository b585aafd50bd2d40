"""Hybrid models (Gemma 3): sliding-window layers beside full-attention ones, on a tiny random
Gemma 3 text decoder on the CPU. The sliding layers keep their window in the model's dtype (transformers'
own layer); PN-Mix quantizes the full-attention layers; bit figures weight each layer by what it holds."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_gemma3, tiny_model

from pnmix import PNMixConfig, generate, preset
from pnmix.bits import (
    LayerPlan,
    held_tokens,
    key_bits,
    kv_bits,
    mean_key_bits,
    weighted_key_bits,
    weighted_kv_bits,
)
from pnmix.cache import PNMixCache, PNMixLayer, WindowLayer
from pnmix.config import ConfigError
from pnmix.families import UnsupportedModelError, layer_kinds
from pnmix.layerwise import LayerwiseConfig, as_layerwise, load_config

SMALL = PNMixConfig(b_high=3, b_low=1, salient_ratio=0.5, group_size=32, n_sink=4, residual_len=32, value_bits=2,
                    value_group_size=16)
WINDOW = 8


def left_padded(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 40 and 30 real tokens, both longer than the window."""
    ids = torch.randint(3, vocab, (2, 40), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    return ids, mask


def test_fp16_generation_equals_transformers_cache_on_both_layer_kinds():
    model = tiny_gemma3(window=WINDOW)
    assert layer_kinds(model.config) == ["sliding_attention"] * 5 + ["full_attention"]
    ids, mask = left_padded(model.config.vocab_size, seed=1)
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                          pad_token_id=0)[:, ids.shape[1]:]
    got, cache = generate(model, ids, preset("fp16"), attention_mask=mask, max_new_tokens=24)
    assert torch.equal(got, want)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [WindowLayer] * 5 + [PNMixLayer]
    # A sliding layer keeps the last window - 1 tokens between steps, as transformers' own does.
    assert all(layer.keys.shape[2] == WINDOW - 1 for layer in cache.layers[:5])


def test_quantized_full_layers_beside_exact_windows():
    """PN-Mix quantizes the full-attention layer only: its every real token is held (sinks, groups,
    residual), the sliding layers hold their window in the model's dtype, and the bytes say so."""
    model = tiny_gemma3(window=WINDOW)
    ids, mask = left_padded(model.config.vocab_size, seed=2)
    new = 60
    got, cache = generate(model, ids, SMALL, attention_mask=mask, max_new_tokens=new)
    assert got.shape == (2, new)
    full = cache.layers[5]
    assert isinstance(full, PNMixLayer) and int(full.n_groups[0]) >= 2
    real = mask.sum(1) + new - 1  # the last new token is never fed back
    held = [min(SMALL.n_sink, n) + int(full.n_groups[b]) * SMALL.group_size + full.res_len[b]
            for b, n in enumerate(full.lengths)]
    assert full.lengths == held == real.tolist()
    regions = cache.nbytes()["regions"]
    d, elt = 16, 4  # fp32 on the CPU
    assert regions["window"] == 5 * 2 * 1 * (WINDOW - 1) * d * elt * 2  # 5 layers, 2 rows, 1 KV head, K and V
    assert regions["packed_keys"] > 0 and cache.nbytes()["total"] == sum(regions.values())


WINDOWS = LayerwiseConfig(SMALL, windows=(0, 1, 2, 3, 4))  # every window quantized too


@pytest.mark.parametrize("config", [preset("fp16"), SMALL, WINDOWS], ids=["fp16", "small", "windows"])
def test_the_batched_engine_answers_a_hybrid_model_as_generate_does(config, monkeypatch):
    """The scoring engine's batch (sequences of different lengths, each sliding layer a
    `BatchWindowLayer` built from the recorded prefill) gives every sequence the tokens `generate`
    gives it alone with transformers' own window layer; its teacher-forced replay gives the live
    replay's distributions; its bytes are the live cache's. Few spare slots, so that the windows
    are compacted every few decode steps and inside the teacher-forced pass."""
    from pnmix.cache import BatchWindowLayer
    monkeypatch.setattr(BatchWindowLayer, "SPARE", 3)
    from pnmix.generation import new_cache
    from pnmix.prefill import build_cache
    from pnmix.tuner.scoring.cost import COST_NEW_TOKENS, COST_PROMPT_TOKENS, live_cost
    from pnmix.tuner.scoring.engine import ScoringEngine, Trajectory
    from pnmix.tuner.scoring.fidelity import replay

    model = tiny_gemma3(window=WINDOW, max_position_embeddings=2048, vocab_size=4096)  # the cost prompt's ids < 4000
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (1, n), generator=gen) for n in (5, 40, 23, 70)]
    engine = ScoringEngine(model, None)
    states = engine._prefill(prompts)
    new = 45  # past the full layer's first residual flush, many windows past every prompt
    got = engine.greedy(config, states, new, stop=False)
    for row, ids in enumerate(prompts):
        want, _ = generate(model, ids, config, max_new_tokens=new, min_new_tokens=new)
        assert torch.equal(got[row], want[0]), row
    kinds = [type(layer) for layer in build_cache(model, config, states).layers]
    assert kinds == [PNMixLayer if config == WINDOWS else BatchWindowLayer] * 5 + [PNMixLayer]
    # Teacher forcing: the whole continuation in one forward pass per batch, as the live replay token by token.
    trajs = [Trajectory(p[0].tolist(), got[i, :30].tolist(), torch.randn(30, model.config.vocab_size, generator=gen))
             for i, p in enumerate(prompts)]
    engine.add_trajectories(trajs)
    batched = engine.fidelity(config)
    for (agree, kl), traj in zip(batched, trajs, strict=True):
        live = replay(model, torch.tensor([traj.prompt_ids]), traj.tokens, config, traj.reference_logits)
        assert agree == live.agreement and kl == pytest.approx(live.mean_kl, rel=1e-4)
    held, _, _ = engine.measure_cost(config)
    live, _, _ = live_cost(model, lambda: new_cache(model, config), lambda c: int(c.nbytes()["total"]))
    assert held == live
    window = 5 * 2 * 1 * (WINDOW - 1) * 16 * 4  # 5 layers, K and V, 1 KV head, head dim 16, fp32
    full_fp16 = 2 * (COST_PROMPT_TOKENS + COST_NEW_TOKENS - 1) * 16 * 4
    if config == preset("fp16"):
        assert held == window + full_fp16
    elif config == WINDOWS:  # each window as a store of its last 7 tokens holds them, in 16-bit words:
        quantized = engine.measure_cost(SMALL)[0] - window  # fewer than a group: all in the residual,
        assert held - quantized == 5 * (7 * 16 * 2 * 2 + 4 * 2)  # K and V; 4 salient pairs as int16
    else:
        assert window < held < window + full_fp16


def test_quantized_windows_attend_over_their_last_window_of_stored_tokens():
    """A quantized window stores its tokens as a full-attention layer does (sinks, groups, residual)
    and a query sees the last `window` positions of them only: its attention equals a float64
    softmax over exactly those dequantized positions; the windows' bytes are what a store of the
    last window - 1 tokens holds; and the tokens are not the exact windows' ones."""
    model = tiny_gemma3(window=WINDOW)
    ids, mask = left_padded(model.config.vocab_size, seed=5)
    new = 50  # past the residual's first flush in every window
    got, cache = generate(model, ids, WINDOWS, attention_mask=mask, max_new_tokens=new)
    exact, _ = generate(model, ids, SMALL, attention_mask=mask, max_new_tokens=new)
    assert not torch.equal(got, exact)
    layer = cache.layers[2]
    assert isinstance(layer, PNMixLayer) and layer.window == WINDOW and min(layer.n_groups) >= 1
    query = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(6))
    out = layer.attend(query, 0.25)  # [B, 1, Hq, d]
    for b, n in enumerate(layer.lengths):
        k = layer.view_k[b, 0, n - WINDOW:n].double()  # the last WINDOW positions, the query's own included
        v = layer.view_v[b, 0, n - WINDOW:n].double()
        want = torch.softmax(query[b, :, 0].double() @ k.T * 0.25, dim=-1) @ v  # [Hq, d]
        torch.testing.assert_close(out[b, 0].double(), want, rtol=1e-5, atol=1e-6)
    # What each window holds: WINDOW - 1 tokens, no sinks left, fewer than a group of G = 32: all in
    # the residual, counted in 16-bit words as the bit formula counts them (2 rows, K and V, d 16).
    regions = layer.nbytes()
    assert regions["sinks"] == regions["packed_keys"] == 0
    assert regions["residual"] == 2 * 2 * (WINDOW - 1) * 16 * 2


def test_quantized_windows_count_in_the_weighted_bits():
    """A quantized window holds window - 1 tokens at its config's figure, no sinks once it has
    dropped them: 2 payload bits (half the pairs at 3, half at 1), 1 bit of scales (2 fp16 per
    channel per 32 tokens) and the salient mask's d/2 bits over 7 x d elements."""
    plan = LayerPlan(("sliding_attention",) * 5 + ("full_attention",), WINDOW)
    t_q = 1000
    full = key_bits(SMALL, 16, t_q).total
    window = 2 + 1 + 8 / (7 * 16)
    want = (5 * 7 * window + (t_q + 4) * full) / (5 * 7 + t_q + 4)
    assert weighted_key_bits(WINDOWS, plan, 16, t_q) == pytest.approx(want, rel=1e-12)
    assert weighted_key_bits(WINDOWS, plan, 16, t_q) < weighted_key_bits(SMALL, plan, 16, t_q)
    one = LayerwiseConfig(SMALL, windows=(3,))
    assert weighted_key_bits(one, plan, 16, t_q) == pytest.approx(
        (4 * 7 * 16 + 7 * window + (t_q + 4) * full) / (5 * 7 + t_q + 4), rel=1e-12)
    # Before a window has dropped anything it holds the sinks as a full layer does.
    young = LayerPlan(plan.kinds, 4096)
    assert weighted_key_bits(WINDOWS, young, 16, t_q) == pytest.approx(full, rel=1e-12)


def test_windows_in_a_config_are_checked_against_the_model_in_one_line():
    model = tiny_gemma3(window=WINDOW)
    with pytest.raises(ConfigError, match=r"invalid windows='5': allowed sliding-window layers \(0, 1, 2, 3, 4\)"):
        PNMixCache(model.config, LayerwiseConfig(SMALL, windows=(4, 5)))
    with pytest.raises(ConfigError, match=r"invalid windows='0': allowed sliding-window layers \(none\)"):
        PNMixCache(tiny_model("llama").config, LayerwiseConfig(SMALL, windows=(0,)))
    with pytest.raises(ConfigError, match="invalid windows=9: allowed layers 0-5"):
        PNMixCache(model.config, LayerwiseConfig(SMALL, windows=(9,)))
    for bad in ('"all"', "[1, 1]", "[-1]", "[true]"):
        with pytest.raises(ConfigError, match="invalid windows="):
            load_config('{"default": {}, "windows": ' + bad + "}")
    # A range may set a quantized window's bits; JSON keeps the windows, and a config without
    # any keeps the spelling it had before windows could be quantized.
    text = ('{"default": {"group_size": 32, "n_sink": 4, "residual_len": 32, "value_group_size": 16}, '
            '"layers": {"2": {"b_low": 2}}, "windows": [3, 2]}')
    config = load_config(text)
    assert config.windows == (2, 3) and load_config(config.to_json()) == config
    assert [c is not None for c in config.held_configs(layer_kinds(model.config))] == [0, 0, 1, 1, 0, 1]
    assert isinstance(PNMixCache(model.config, config).layers[2], PNMixLayer)
    assert "windows" not in LayerwiseConfig(SMALL).to_dict() and as_layerwise(SMALL).uniform
    assert not WINDOWS.uniform and "5 windows quantized" in WINDOWS.label


def test_bytes_weighted_key_bits_equal_a_hand_count_of_the_cache():
    """The weighted key bits of the config on this model equal the key bytes the cache holds over the
    key elements it holds (bf16: sinks and windows at 16 bits, as the formula counts them)."""
    model = tiny_gemma3(window=WINDOW, dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (1, 4 + 2 * 32 + 10), generator=torch.Generator().manual_seed(3))
    _, cache = generate(model, ids, SMALL, max_new_tokens=40)
    full = cache.layers[5]
    t_q = int(full.n_groups[0]) * SMALL.group_size
    assert t_q == 3 * 32
    per_layer = cache.nbytes()["layers"]
    key_bytes = sum(layer["window"] / 2 for layer in per_layer[:5])
    key_bytes += per_layer[5]["packed_keys"] + per_layer[5]["key_scales"] + per_layer[5]["sinks"] / 2
    d = 16
    elements = 5 * (WINDOW - 1) * d + (t_q + SMALL.n_sink) * d  # one sequence, one KV head
    kinds = layer_kinds(model.config)
    want = weighted_key_bits(SMALL, LayerPlan(tuple(kinds), WINDOW), d, quantized_tokens=t_q, metadata=False)
    assert key_bytes * 8 / elements == pytest.approx(want, rel=1e-12)
    assert held_tokens(kinds, WINDOW, t_q + 4) == [7] * 5 + [100]
    # The plain mean would count the fp16 windows as if they held as many tokens as the full layer.
    assert want != pytest.approx(mean_key_bits(SMALL, 6, d, t_q))


@pytest.mark.parametrize("config", [preset("pnmix-paper"), preset("kivi2"), preset("kitty"),
                                    load_config('{"default": {}, "layers": {"0-4": {"b_low": 2}}}')])
def test_full_attention_models_keep_their_figures_to_the_last_digit(config):
    full = LayerPlan.full(30)
    assert weighted_key_bits(config, full, 64) == mean_key_bits(config, 30, 64)
    assert weighted_kv_bits(config, full, 64) == kv_bits(config, 30, 64)
    assert full.full_layer_budget(2.25, 32) == 2.25
    single = config.default if isinstance(config, LayerwiseConfig) else config
    assert weighted_key_bits(single, full, 64) == key_bits(single, 64).total


def test_layer_kinds_pn_mix_cannot_serve_are_refused_in_one_line():
    from transformers import Qwen3NextConfig

    linear = Qwen3NextConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="linear_attention layers: PN-Mix supports full-attention"):
        PNMixCache(linear, SMALL)
    capped = tiny_gemma3(attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        PNMixCache(capped.config, SMALL)
    model = tiny_gemma3(window=WINDOW)
    # A layer-wise config that sets the bits of a window it does not quantize cannot apply to it.
    sets_a_window = load_config('{"default": {"group_size": 32, "n_sink": 4, "residual_len": 32, '
                                '"value_group_size": 16}, "layers": {"2": {"b_low": 2}}}')
    with pytest.raises(ConfigError, match=r"invalid layers='2': allowed full-attention layers \(5\) or sliding"):
        PNMixCache(model.config, sets_a_window)
    from types import SimpleNamespace

    from pnmix.static import StaticGenerator

    with pytest.raises(UnsupportedModelError, match="linear_attention layers: PN-Mix supports full-attention"):
        StaticGenerator(SimpleNamespace(config=linear), SMALL, max_len=64)
    # Full-attention models are untouched: every layer is one kind.
    assert layer_kinds(tiny_model("llama").config) == ["full_attention"] * 2


def test_the_registry_knows_gemma3_layers_without_its_weights():
    from pnmix.bits import KVBytes, kv_cache_bytes, layer_bytes
    from pnmix.models import layer_plan, model_shape
    from pnmix.names import FULL, SLIDING

    plan, shape = layer_plan("gemma3-270m"), model_shape("gemma3-270m")
    assert plan.hybrid and plan.window == 512 and len(plan.kinds) == shape.num_layers == 18
    assert [i for i, k in enumerate(plan.kinds) if k == FULL] == [5, 11, 17] and plan.kinds.count(SLIDING) == 15
    # Hand count at 8192 tokens, batch 2: a sliding layer holds 511 tokens of keys and values in fp16
    # (1 KV head, d 256); a full layer holds all 8192 under the config.
    paper = preset("pnmix-paper")
    per_layer = layer_bytes(paper, shape, 2, 8192, plan)
    sliding = 2 * 511 * 256 * 2 * 2
    assert [b.total for b, k in zip(per_layer, plan.kinds, strict=True) if k == SLIDING] == [sliding] * 15
    one_full = kv_cache_bytes(paper, shape.__class__(1, 4, 1, 256), 2, 8192)
    assert [b for b, k in zip(per_layer, plan.kinds, strict=True) if k == FULL] == [one_full] * 3
    total = kv_cache_bytes(paper, shape, 2, 8192, plan)
    assert isinstance(total, KVBytes) and total.total == 15 * sliding + 3 * one_full.total
    assert total.fp16_total == 15 * sliding + 3 * 2 * 8192 * 256 * 2 * 2


def test_full_attention_models_keep_their_bytes_to_the_last_digit():
    from pnmix.bits import kv_cache_bytes
    from pnmix.models import layer_plan, model_shape

    plan, shape = layer_plan("smollm2-135m"), model_shape("smollm2-135m")
    assert not plan.hybrid
    lw = load_config(b'{"default": {"b_high": 3, "b_low": 1}, "layers": {"0-9": {"b_high": 4}}}')
    for config in (preset("pnmix-paper"), preset("kivi2"), lw):
        assert kv_cache_bytes(config, shape, 3, 5000, plan) == kv_cache_bytes(config, shape, 3, 5000)
        assert weighted_key_bits(config, plan, 64) == mean_key_bits(config, 30, 64)


def test_bits_for_gemma3_shows_what_each_layer_holds(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-P", "-m", "pnmix.api.cli", "bits", "--preset", "pnmix-paper", "--model",
                          "gemma3-270m", "--seq-len", "8192", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["layers_held"]
    assert [r["tokens"] for r in rows] == [511 if i % 6 != 5 else 8192 for i in range(18)]
    assert sum(r["bytes"] for r in rows) == report["kv_bytes"]["total"]
    # 3 full layers of 8192 + 15 windows of 511 key elements: the weighted mean of 2.263 and 16 bits
    full = key_bits(preset("pnmix-paper"), 256, 8192 - 32).total
    assert report["weighted_key_bits"] == pytest.approx((3 * 8192 * full + 15 * 511 * 16) / (3 * 8192 + 15 * 511))
    # Two windows quantized: their rows say so, hold fewer bytes, and the weighted figure falls.
    path = tmp_path / "windows.json"
    path.write_text(LayerwiseConfig(preset("pnmix-paper"), windows=(0, 1)).to_json())
    out = subprocess.run([sys.executable, "-P", "-m", "pnmix.api.cli", "bits", "--config", str(path), "--model",
                          "gemma3-270m", "--seq-len", "8192", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    quantized = json.loads(out.stdout)
    labels = [r["config"] for r in quantized["layers_held"]]
    assert labels[:3] == [preset("pnmix-paper").label] * 2 + ["fp16 (window)"]
    assert quantized["layers_held"][0]["bytes"] < rows[0]["bytes"] / 2  # 127 of its 511 tokens in the residual
    window = key_bits(preset("pnmix-paper").with_(n_sink=0), 256, 511).total  # its sinks dropped long ago
    assert quantized["weighted_key_bits"] == pytest.approx(
        (3 * 8192 * full + 13 * 511 * 16 + 2 * 511 * window) / (3 * 8192 + 15 * 511))


@pytest.mark.slow
def test_the_evaluator_scores_a_hybrid_model(tmp_path, embedded):
    """The evaluator scores a model with sliding-window layers on the batched engine: fp16 replays
    its own trajectories exactly, a quantized config does not (and the live path agrees), and its
    bytes count the quantized full-attention layer beside the fp16 windows."""
    from transformers import AutoTokenizer

    from pnmix import models
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile

    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    model = tiny_gemma3(window=WINDOW, vocab_size=len(tok), max_position_embeddings=2048, eos_token_id=tok.eos_token_id)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ev = Evaluator(str(tmp_path), profile("smoke"), tasks=("fidelity",))
    assert ev.plan.hybrid
    fp16, small = ev.evaluate(preset("fp16")), ev.evaluate(SMALL)
    assert fp16.parts["fidelity"] == pytest.approx(1.0, abs=1e-5) and fp16.fidelity_agreement == 1.0
    assert small.parts["fidelity"] < 0.999 and len(small.units["fidelity"]) == 2
    live = ev.evaluate(SMALL, reference=True, measure=False).units["fidelity"]  # generate's path, token by token
    assert live == pytest.approx(small.units["fidelity"], rel=1e-4)
    # 512 prompt + 31 new tokens: 5 sliding layers hold 7 tokens in fp32 (CPU), the full layer all 543.
    window_bytes = 5 * 2 * 1 * (WINDOW - 1) * 16 * 4
    assert fp16.kv_bytes == window_bytes + 2 * 543 * 16 * 4
    assert window_bytes < small.kv_bytes < fp16.kv_bytes
    # The proxy weighs the full-attention layer alone: the windows are exact.
    trace, _, _ = ev.tables.quantized_trace(SMALL)
    assert len(trace.keys) == 1 and len(ev.trace().keys) == 6 and torch.equal(trace.keys[0], ev.trace().keys[5])
    assert ev.proxy(SMALL) > 0 and ev.proxy(preset("fp16")) == 0
    assert ev.proxy_by_layer(SMALL) == [ev.proxy(SMALL)]
    # Quantized windows are weighed too, each query over its window: the allocator's table rows.
    one_window = LayerwiseConfig(SMALL, windows=(2,))
    assert ev.proxy_by_layer(one_window) == [pytest.approx(ev.sensitivity([SMALL])[SMALL][i]) for i in (2, 5)]
    assert ev.proxy_by_layer(one_window)[0] > 0
    # `pnmix layers` allocates the full-attention layer alone, within the weighted budget.
    import json
    import subprocess
    import sys

    (tmp_path / "small.json").write_text(SMALL.to_json())
    out = subprocess.run([sys.executable, "-P", "-m", "pnmix.api.cli", "layers", "--model", str(tmp_path), "--config",
                          str(tmp_path / "small.json"), "--bits", "2.5", "--profile", "smoke", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["layers"] == [5] and len(report["sensitivity"]) == 1
    config = load_config(json.dumps(report["config"]))
    assert report["key_bits"] == weighted_key_bits(config, ev.plan, 16) <= 2.5 + 1e-9
    assert not as_layerwise(config).named_layers(6)


def test_layer_groups_on_a_hybrid_model_are_refused_in_one_line():
    from pnmix.tuner.errors import EvalError
    from pnmix.tuner.search.queue import check_layer_kinds
    from pnmix.tuner.search.space import ALLOCATED, LAYERED, SearchSpace

    says = ("method pnmix-layers groups the layers, for full-attention models only: 'gemma3-270m' has "
            "sliding-window layers; use --method pnmix-alloc")
    with pytest.raises(EvalError, match=says):
        check_layer_kinds(SearchSpace(method=LAYERED), "gemma3-270m")
    for method in (ALLOCATED, "pnmix"):
        check_layer_kinds(SearchSpace(method=method), "gemma3-270m")
    check_layer_kinds(SearchSpace(method=LAYERED), "smollm2-135m")


# -- budgets by the bytes each layer holds --------------------------------------------------------


GEMMA = LayerPlan(tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)), 512)


def test_a_hybrid_models_budget_leaves_its_full_layers_what_the_windows_do_not_hold():
    """At 32K tokens Gemma 3 270M's 15 windows hold 15 * 511 of its key elements at 16 bits; what a
    budget leaves the 3 full layers is a hand count of that, and a config at exactly that figure
    fills the budget; KV bits count the windows' values at 16 bits too."""
    paper = preset("pnmix-paper")
    windows, full = 15 * 511, 3 * (32768 + 32)
    want = (3.0 * (windows + full) - 16 * windows) / full
    assert GEMMA.full_layer_budget(3.0, 32) == pytest.approx(want - 1e-8, abs=1e-12)
    weighted = weighted_key_bits(paper, GEMMA, 256)
    assert weighted == pytest.approx((full * key_bits(paper, 256).total + windows * 16) / (full + windows), rel=1e-14)
    assert GEMMA.full_layer_budget(weighted, 32) == pytest.approx(key_bits(paper, 256).total - 1e-8, abs=1e-12)
    # `budget_for` is its inverse, rounded down: the counterpart of a full-attention model's budget
    for bits in (1.5, 2.0, 2.25, 3.0):
        assert bits - 2e-3 < GEMMA.full_layer_budget(GEMMA.budget_for(bits), 32) <= bits
        assert LayerPlan.full(30).budget_for(bits) == bits
    from pnmix.bits import value_bits_total

    values = (full * value_bits_total(paper) + windows * 16) / (full + windows)
    assert weighted_kv_bits(paper, GEMMA, 256) == pytest.approx((weighted + values) / 2, rel=1e-14)


def test_a_hybrid_models_budgets_below_its_floor_are_refused_in_one_line():
    from pnmix.tuner.errors import EvalError
    from pnmix.tuner.search.queue import check_budgets_reachable
    from pnmix.tuner.search.space import SearchSpace

    space = SearchSpace(method="pnmix")
    floor = space.with_plan(GEMMA).min_bits(256)
    # uniform configs keep the windows exact: their 7.2% of the elements at 16 bits put the floor
    # well above the plain one
    assert floor == pytest.approx(0.0723 * 16 + 0.9277 * space.min_bits(256), abs=2e-3)
    with pytest.raises(EvalError, match=rf"invalid budget 2: .* allowed budgets >= {floor:.5f} key bits"):
        check_budgets_reachable(space.with_plan(GEMMA), [2.0], 256, "gemma3-270m")
    check_budgets_reachable(space, [2.0], 256, "gemma3-270m")  # the plain space would have taken it
    # The allocator quantizes windows too: its floor is every layer at the cheapest config, a window
    # without the sinks it has dropped (so a little under the plain floor), and 2.0 is reachable.
    alloc = SearchSpace(method="pnmix-alloc").with_plan(GEMMA)
    assert alloc.min_bits(256) == pytest.approx(space.min_bits(256), abs=0.02) and alloc.min_bits(256) < 2.0
    check_budgets_reachable(alloc, [2.0], 256, "gemma3-270m")


class HybridFormulaEvaluator:
    """Gemma 3 270M's layout scored by a formula of each full layer's bits (the last layer the most
    sensitive; the windows exact), instantly: what the allocator's bookkeeping on a hybrid needs."""

    head_dim, num_layers, plan = 256, 18, GEMMA

    def __init__(self) -> None:
        self.calls: list[str] = []

    def layer_loss(self, c: PNMixConfig | None, i: int) -> float:
        if c is None or not c.keys_quantized:  # an exact window
            return 0.0
        bits = c.b_low + (c.b_high - c.b_low) * c.salient_ratio
        weight = 1 + i if self.plan.kinds[i] == "full_attention" else 0.05  # the windows barely matter
        return weight * 2.0 ** -bits

    def per_layer(self, config) -> list[PNMixConfig | None]:
        return as_layerwise(config).held_configs(self.plan.kinds)

    def sensitivity(self, candidates):  # every layer's row, as the proxy's trace records them
        return {c: [self.layer_loss(c, i) for i in range(18)] for c in candidates}

    def proxy(self, config) -> float:
        return sum(self.layer_loss(c, i) for i, c in enumerate(self.per_layer(config)))

    def evaluate(self, config, measure: bool = True):
        from pnmix.tuner.scoring.score import Score

        self.calls.append(config.label)
        acc = max(0.0, 1.0 - self.proxy(config) / 10)
        return Score(config=config.to_dict(), accuracy=acc, parts={"fidelity": acc}, fidelity_agreement=0.0,
                     fidelity_kl=0.0, key_bits=weighted_key_bits(config, GEMMA, 256), kv_bytes=1,
                     decode_tokens_per_s=1.0, peak_memory_bytes=None, backend="t", device="cpu", versions={},
                     seconds=0.0, profile="smoke", accuracy_se=0.01, units={"fidelity": [0.1, 0.2]})


def test_the_allocator_on_a_hybrid_model_spends_the_budget_on_every_layer(tmp_path):
    """A pnmix-alloc campaign on Gemma 3's layout, its windows in the knapsack: every stored point's
    key bits are the weighted figure, within its budget, at a budget the exact windows alone
    would not leave room for; no config names a window it does not quantize; the windows, which
    barely matter here, take the fewest bits and leave the full layers more than the budget; the
    most sensitive full layer gets the most bits; and the front is served by budget as on any model."""
    from fastapi.testclient import TestClient

    from pnmix.api.app import create_app
    from pnmix.api.settings import Settings
    from pnmix.storage import Database, get_campaign, list_front_points, recommend, upgrade
    from pnmix.storage.testing import sqlite_url
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.session import find_or_create_campaign
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    db = Database(sqlite_url(tmp_path))
    upgrade(db)
    spec = CampaignSpec(model="gemma3-270m", budgets=(2.0, 3.0), n_trials=6, method="pnmix-alloc",
                        profile="smoke", tasks=("fidelity",), space=SearchSpace(method="pnmix-alloc"))
    campaign_id = find_or_create_campaign(db, spec)
    CampaignRunner(db, db.url, campaign_id, spec, HybridFormulaEvaluator()).run()
    with db.session(readonly=True) as s:
        assert get_campaign(s, campaign_id).model.plan == GEMMA
        points = list_front_points(s, "gemma3-270m", campaign_id=campaign_id).items
        assert {p.budget for p in points} == {2.0, 3.0}
        assert GEMMA.budget_for(1.0) > 2.0  # exact windows would leave the full layers under 1 bit
        for p in points:
            lw = as_layerwise(p.config)
            assert p.key_bits == weighted_key_bits(p.config, GEMMA, 256) <= p.budget + 1e-9
            assert not set(lw.named_layers(18)) - {5, 11, 17} - set(lw.windows)
        best = recommend(s, "gemma3-270m", 3.0)
        lw = as_layerwise(best.config)
        assert len(lw.windows) == 15  # every window quantized
        layers = lw.per_layer(18)
        assert key_bits(layers[17], 256).total > key_bits(layers[5], 256).total
        full_mean = sum(key_bits(layers[i], 256).total for i in (5, 11, 17)) / 3
        assert full_mean > 3.0 > max(key_bits(layers[i], 256).total for i in range(18) if i not in (5, 11, 17))
    # The service says what the model's layers hold, and answers by the weighted figure.
    with TestClient(create_app(Settings(database_url=sqlite_url(tmp_path)))) as client:
        model = client.get("/v1/models").json()["items"][0]
        assert (model["layer_kinds"], model["sliding_window"]) == (list(GEMMA.kinds), 512)
        answer = client.get("/v1/recommend", params={"model": "gemma3-270m", "target_bits": 3.0}).json()
        assert answer["point"]["key_bits"] == best.key_bits


class HybridKVFormulaEvaluator(HybridFormulaEvaluator):
    """`HybridFormulaEvaluator` with value formats scored too (a layer's loss halves per value bit,
    a window's only where the config quantizes it): what the joint KV knapsack on a hybrid needs."""

    def __init__(self) -> None:
        super().__init__()
        self.configs: list = []

    def sensitivity(self, candidates, measure=None):
        return super().sensitivity(candidates)

    def value_sensitivity(self, formats, shared):
        return {f: [self.weight(i) * 2.0 ** -f[0] for i in range(18)] for f in formats}

    def weight(self, i: int) -> float:
        return 1 + i if self.plan.kinds[i] == "full_attention" else 0.05

    def proxy(self, config) -> float:
        values = sum(self.weight(i) * 2.0 ** -c.value_bits for i, c in enumerate(self.per_layer(config))
                     if c is not None)
        return super().proxy(config) + values

    def evaluate(self, config, measure: bool = True):
        self.configs.append(config)
        return super().evaluate(config, measure)


def test_the_joint_kv_allocator_on_a_hybrid_model_quantizes_windows_keys_and_values_together(tmp_path):
    """A pnmix-alloc campaign under KV budgets with per-layer value formats on Gemma 3's layout, at
    2.0 weighted KV bits, which exact windows alone would not leave room for: its floor is under
    the budget, every stored point's KV bits are the weighted figure within its budget, every window
    of a 2.0 point is quantized (keys and values, under its layer's config), and the joint
    allocation is among the trials, its value formats differing by layer."""
    from pnmix.storage import Database, list_front_points, upgrade
    from pnmix.storage.testing import sqlite_url
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.session import find_or_create_campaign
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    space = SearchSpace(method="pnmix-alloc", budget_on="kv", search_values=True)
    assert GEMMA.budget_for(1.0) > 2.0  # exact windows alone hold more than the budget allows
    assert space.with_plan(GEMMA).min_bits(256) < 2.0
    db = Database(sqlite_url(tmp_path))
    upgrade(db)
    spec = CampaignSpec(model="gemma3-270m", budgets=(2.0, 3.0), n_trials=5, method="pnmix-alloc",
                        profile="smoke", tasks=("fidelity",), objectives=("accuracy", "kv_bits"), space=space)
    campaign_id = find_or_create_campaign(db, spec)
    ev = HybridKVFormulaEvaluator()
    CampaignRunner(db, db.url, campaign_id, spec, ev).run()
    with db.session(readonly=True) as s:
        points = list_front_points(s, "gemma3-270m", campaign_id=campaign_id).items
        assert {p.budget for p in points} == {2.0, 3.0}
        for p in points:
            lw = as_layerwise(p.config)
            assert p.kv_bits == pytest.approx(weighted_kv_bits(p.config, GEMMA, 256), abs=1e-12)
            assert p.kv_bits <= p.budget + 1e-9
            assert not set(lw.named_layers(18)) - {5, 11, 17} - set(lw.windows)
            if p.budget == 2.0:
                assert len(lw.windows) == 15
                assert all(c.keys_quantized and c.values_quantized for c in lw.per_layer(18))
    formats = [{(c.value_bits, c.value_group_size) for c in as_layerwise(cfg).per_layer(18)} for cfg in ev.configs]
    assert any(len(f) > 1 for f in formats)


@pytest.mark.slow
def test_pnmix_tune_on_a_hybrid_checkpoint_stores_fronts_by_the_weighted_figure(tmp_path, embedded):
    """`pnmix tune` (the allocator, the default method) on a local hybrid checkpoint, end to end
    through the real evaluator on the live path: the model row keeps its layer kinds, every stored
    point's key bits are the weighted figure within the budget, no config names a window, and
    `pnmix recommend` answers from that front."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from pnmix import models
    from pnmix.storage import Database, list_front_points

    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    model = tiny_gemma3(window=WINDOW, head_dim=32, vocab_size=len(tok), max_position_embeddings=2048,
                        eos_token_id=tok.eos_token_id)
    folder = tmp_path / "tiny-gemma3"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    cli = [sys.executable, "-P", "-m", "pnmix.api.cli"]
    out = subprocess.run([*cli, "tune", "--model", str(folder), "--profile", "smoke", "--tasks", "fidelity",
                          "--budgets", "2.5", "--trials", "3", "--storage", url],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = LayerPlan(tuple(layer_kinds(model.config)), WINDOW)
    db = Database(url)
    with db.session(readonly=True) as s:
        points = list_front_points(s, str(folder)).items
        assert points and points[0].campaign.model.plan == plan
        for p in points:
            assert p.key_bits == weighted_key_bits(p.config, plan, 32) <= 2.5 + 1e-9
            assert not set(as_layerwise(p.config).named_layers(6)) - {5}
    db.dispose()
    out = subprocess.run([*cli, "recommend", "--model", str(folder), "--bits", "2.5", "--storage", url, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["key_bits"] in {p.key_bits for p in points}


@pytest.mark.parametrize("config", [preset("fp16"), SMALL], ids=["fp16", "small"])
def test_the_static_path_takes_over_the_engines_windows(config, monkeypatch):
    """The scoring engine's batch handed to the static path (`StaticGenerator.start`, its windows
    rebuilt as rings from each sequence's `BatchWindowLayer`) decodes the tokens the batched dynamic
    cache does, as it will on CUDA; on the CPU the step runs eagerly."""
    from pnmix.tuner.scoring import cost
    from pnmix.tuner.scoring.engine import ScoringEngine

    model = tiny_gemma3(window=WINDOW, max_position_embeddings=2048, vocab_size=4096)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, model.config.vocab_size, (1, n), generator=gen) for n in (5, 40, 23, 70)]
    engine = ScoringEngine(model, None)
    states = engine._prefill(prompts)
    dynamic = engine.greedy(config, states, 45, stop=False)
    monkeypatch.setattr(cost, "static_path_of", lambda m, p, c, d: "fp16" if c == preset("fp16") else c)
    assert torch.equal(engine.greedy(config, states, 45, stop=False), dynamic)
