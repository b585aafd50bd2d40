"""Layer-wise PN-Mix (pnmix/layerwise.py): one config per layer, in the cache, the formula and the static path."""

from __future__ import annotations

import sys

import pytest
import torch
from test_static import SMALL, batch_of_three, until_eos
from tiny import tiny_model

from pnmix import backend
from pnmix.bits import ModelShape, key_bits, key_bits_by_layer, kv_cache_bytes, mean_key_bits
from pnmix.config import ConfigError, PNMixConfig
from pnmix.generation import cache_kwargs, generate, new_cache
from pnmix.layerwise import LayerRange, LayerwiseConfig, load_config
from pnmix.static import StaticGenerator

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path

# Layer 0 keeps more salient channels at 4/2 bits, layer 1 fewer at 2/1 and its values at 4 bits in
# groups of 8: the two layers' packed regions differ in size and content, keys and values.
MIXED = LayerwiseConfig(SMALL, (LayerRange.parse("0", {"b_high": 4, "b_low": 2, "salient_ratio": 0.25}),
                                LayerRange.parse("1", {"b_high": 2, "b_low": 1, "salient_ratio": 0.75,
                                                       "value_bits": 4, "value_group_size": 8})))


def test_every_layer_equal_gives_the_single_configs_tokens_and_bytes():
    model = tiny_model("llama")
    ids, mask = batch_of_three(model.config.vocab_size, seed=5)
    same = LayerwiseConfig(SMALL, (LayerRange.parse("0-1", {"b_high": SMALL.b_high, "salient_ratio": 0.5}),))
    assert same.uniform and not MIXED.uniform
    want, cache_one = generate(model, ids, SMALL, attention_mask=mask, max_new_tokens=40)
    got, cache_lw = generate(model, ids, same, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(got, want)
    assert cache_lw.nbytes() == cache_one.nbytes()
    for a, b in zip(cache_lw.layers, cache_one.layers, strict=True):
        for name, t in a.packed.items():
            assert torch.equal(t, b.packed[name]), name


def test_per_layer_bytes_match_the_formula():
    """After a prefill, each layer holds the bytes `kv_cache_bytes` gives for that layer's config."""
    model = tiny_model("qwen3")
    t = SMALL.n_sink + 3 * SMALL.group_size + 7  # three packed groups and a partial residual
    ids = torch.randint(3, model.config.vocab_size, (2, t), generator=torch.Generator().manual_seed(1))
    cache = new_cache(model, MIXED)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    held = cache.nbytes()["layers"]
    one = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    compared = ("packed_keys", "key_scales", "salient_sets", "packed_values", "value_scales")
    for i, layer in enumerate(held):
        want = kv_cache_bytes(MIXED.for_layer(i), one, batch=2, seq_len=t).as_dict()
        assert {k: layer[k] for k in compared} == {k: want[k] for k in compared}, i
    assert held[0]["packed_keys"] != held[1]["packed_keys"]
    assert held[1]["packed_values"] == 2 * held[0]["packed_values"]  # 4 value bits against 2
    # The whole-model figure is the sum of the layers'.
    shape = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    total = kv_cache_bytes(MIXED, shape, batch=2, seq_len=t)
    assert total.packed_keys == sum(layer["packed_keys"] for layer in held)


def test_value_and_kv_bits_are_the_mean_of_the_layers():
    from pnmix.bits import kv_bits, value_bits_total

    values = [value_bits_total(MIXED.for_layer(i)) for i in range(2)]
    assert values[1] > values[0]  # 4 bits in groups of 8 against 2 in groups of 16
    assert value_bits_total(MIXED, num_layers=2) == pytest.approx(sum(values) / 2)
    assert kv_bits(MIXED, 2, 16) == pytest.approx((mean_key_bits(MIXED, 2, 16) + sum(values) / 2) / 2)
    with pytest.raises(ValueError, match="num_layers"):
        value_bits_total(MIXED)


def test_the_kernels_take_a_layerwise_config_only_when_they_take_every_layer():
    from pnmix.backend import kernels_support

    assert kernels_support(MIXED, 16)
    wide = LayerwiseConfig(SMALL, (LayerRange.parse("1", {"value_group_size": 128}),))  # does not divide 64
    assert kernels_support(wide.default, 64) and not kernels_support(wide, 64)


def test_key_bits_per_layer_and_the_model_average():
    per = key_bits_by_layer(MIXED, 2, head_dim=16)
    assert [kb.total for kb in per] == [key_bits(MIXED.for_layer(i), 16).total for i in range(2)]
    assert mean_key_bits(MIXED, 2, 16) == pytest.approx((per[0].total + per[1].total) / 2)
    assert mean_key_bits(LayerwiseConfig(SMALL), 30, 16) == key_bits(SMALL, 16).total


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_path_equals_generate_for_a_layerwise_config(family):
    model = tiny_model(family)
    ids, mask = batch_of_three(model.config.vocab_size, seed=3)
    n = 80  # each row flushes at least once (groups of 32) and the short row fills its sinks
    want = generate(model, ids, MIXED, attention_mask=mask, max_new_tokens=n)[0]
    gen = StaticGenerator(model, MIXED, max_len=160)
    got = gen.generate(ids, mask, max_new_tokens=n)
    assert [layer.config for layer in gen.layers] == [MIXED.for_layer(0), MIXED.for_layer(1)]
    eos = model.generation_config.eos_token_id
    assert until_eos(got, eos) == until_eos(want, eos)


def test_static_kernel_path_runs_each_layer_with_its_own_constants():
    """PNMIX_BACKEND=triton: every layer's decode kernel (interpreted) launches with its own bits, and
    the tokens are those of `generate` on the torch reference."""
    model = tiny_model("qwen3")
    ids, mask = batch_of_three(model.config.vocab_size, seed=9)
    n = 34
    want = generate(model, ids, MIXED, attention_mask=mask, max_new_tokens=n)[0]
    backend.set_backend("triton")
    try:
        gen = StaticGenerator(model, MIXED, max_len=120)
        got = gen.generate(ids, mask, max_new_tokens=n)
        assert all(layer.use_kernels for layer in gen.layers)
    finally:
        backend.set_backend(None)
    eos = model.generation_config.eos_token_id
    assert until_eos(got, eos) == until_eos(want, eos)


def test_json_round_trip_and_either_form_loads():
    assert LayerwiseConfig.from_json(MIXED.to_json()) == MIXED
    assert load_config(MIXED.to_json()) == MIXED
    assert load_config(SMALL.to_json()) == SMALL
    assert MIXED.label == "3/1 G32 r0.5 s4 V2/16; 0: 4/2 r0.25; 1: 2/1 r0.75 V4/8"
    assert MIXED.values_per_layer and not LayerwiseConfig(SMALL, MIXED.ranges[:1]).values_per_layer
    # A range written "A-B" covers both ends; a layer no range names takes the default.
    lw = load_config('{"default": {}, "layers": {"2-4": {"b_low": 2}}}')
    assert isinstance(lw, LayerwiseConfig)
    assert [c.b_low for c in lw.per_layer(6)] == [1, 1, 2, 2, 2, 1]


@pytest.mark.parametrize(("text", "message"), [
    ('{"default": {}, "layers": {"4-2": {"b_low": 2}}}', "invalid layers='4-2': allowed a layer"),
    ('{"default": {}, "layers": {"x": {"b_low": 2}}}', "invalid layers='x'"),
    ('{"default": {}, "layers": {"0-3": {"group_size": 64}}}', "invalid layers 0-3: group_size=64: allowed the "
                                                               "same value in every layer"),
    ('{"default": {}, "layers": {"5": {"b_low": 4}}}', "invalid layers 5: b_low=4: allowed at most b_high=3"),
    ('{"default": {}, "layers": {"0-3": {"b_low": 2}, "3-5": {"b_high": 4}}}', "invalid layers 3-5="),
    ('{"default": {}, "layers": {"1": {}}}', "invalid layers 1={}"),
    ('{"default": {}, "layers": {"1": {"value_bits": 16}}}', "invalid layers 1: value_bits=16: allowed quantized "
                                                             "values in every layer or in none"),
    ('{"default": {}, "extra": 1}', "invalid extra=1: allowed default, layers"),
    ('{"default": {"b_low": 9}}', "invalid b_low=9"),
])
def test_bad_layer_ranges_give_one_line_naming_the_layer(text, message):
    with pytest.raises(ConfigError) as err:
        load_config(text)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_layers_value_group_that_does_not_divide_the_head_dim_is_refused_naming_the_layers():
    lw = LayerwiseConfig(SMALL, (LayerRange.parse("1", {"value_group_size": 32}),))
    with pytest.raises(ConfigError, match=r"^invalid layers 1: value_group_size=32: allowed a positive divisor of "
                                          r"head_dim=16$"):
        new_cache(tiny_model("llama"), lw)


def test_a_range_past_the_models_layers_is_refused_with_the_model_in_the_message():
    model = tiny_model("llama")  # 2 layers
    lw = LayerwiseConfig(SMALL, (LayerRange.parse("1-3", {"b_low": 1}),))
    with pytest.raises(ConfigError, match=r"^invalid layers 1-3=3: allowed layers 0-1 \(the model has 2\)$"):
        new_cache(model, lw)
    with pytest.raises(ConfigError, match="every layer"):  # the static path needs quantized keys everywhere
        StaticGenerator(model, LayerwiseConfig(SMALL, (LayerRange.parse("0", {"b_high": 16, "b_low": 16}),)), 64)
    assert isinstance(lw.default, PNMixConfig)


def test_bits_command_reports_each_layer_and_the_model_average(tmp_path):
    import json
    import subprocess

    path = tmp_path / "layers.json"
    path.write_text('{"default": {}, "layers": {"0-3": {"b_high": 4, "b_low": 2, "salient_ratio": 0.3}}}')

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*PNMIX, "bits", "--config", str(path), *args],
                              capture_output=True, text=True, timeout=120)

    out = run("--model", "smollm2-135m", "--json", "--seq-len", "1000")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["key_bits_by_layer"]
    assert report["layers"] == len(rows) == 30 and report["head_dim"] == 64
    high = key_bits(PNMixConfig(b_high=4, b_low=2, salient_ratio=0.3), 64).total
    assert [r["total"] for r in rows[:4]] == [high] * 4
    assert rows[4]["total"] == key_bits(PNMixConfig(), 64).total
    assert report["mean_key_bits"] == pytest.approx((4 * high + 26 * rows[4]["total"]) / 30)
    assert 0 < report["kv_bytes"]["total"] < report["kv_bytes"]["fp16_total"]
    out = run("--layers", "2")  # ranges past the stated layer count: one line, exit 2
    assert out.returncode == 2
    assert out.stderr.strip() == "error: invalid layers 0-3=3: allowed layers 0-1 (the model has 2)"


# -- allocation (tuner/search/layers.py) ----------------------------------------------------------------


def test_allocation_gives_the_bits_to_the_layer_that_needs_them():
    from pnmix.tuner.search.layers import allocate

    a = PNMixConfig(b_high=2, b_low=2, salient_ratio=0.0)
    b = PNMixConfig(b_high=4, b_low=2, salient_ratio=0.5)
    bits_a, bits_b = key_bits(a, 64).total, key_bits(b, 64).total
    kl = {a: [1.0, 1.0, 1.0, 1.0], b: [0.9, 0.1, 0.8, 0.95]}
    one_up = (3 * bits_a + bits_b) / 4
    assert allocate(kl, one_up, 64) == [a, b, a, a]  # layer 1 saves the most
    assert allocate(kl, (2 * bits_a + 2 * bits_b) / 4, 64) == [a, b, b, a]
    with pytest.raises(Exception, match="no allocation fits"):
        allocate(kl, bits_a - 0.01, 64)


def test_allocation_is_never_worse_than_the_best_uniform_choice_that_fits():
    from pnmix.bits import mean_key_bits
    from pnmix.tuner.search.layers import allocate, candidates_like
    from pnmix.tuner.search.space import SearchSpace

    gen = torch.Generator().manual_seed(4)
    cands = candidates_like(PNMixConfig(), SearchSpace())[:12]
    for trial in range(5):
        kl = {c: torch.rand(6, generator=gen).tolist() for c in cands}
        bits = {c: key_bits(c, 64).total for c in cands}
        budget = float(torch.empty(1).uniform_(min(bits.values()), max(bits.values()), generator=gen))
        choice = allocate(kl, budget, 64)
        assert mean_key_bits(LayerwiseConfig.from_layers(choice), 6, 64) <= budget + 1e-9
        fits = [c for c in cands if bits[c] <= budget]
        got = sum(kl[c][i] for i, c in enumerate(choice))
        assert got <= min(sum(kl[c]) for c in fits) + 1e-12, trial


# -- scoring (tuner/scoring/evaluate.py) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny import save_tiny_llama
    from transformers import AutoTokenizer

    from pnmix import models

    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tok)


def test_the_scoring_engine_scores_a_layerwise_config(tiny_dir):
    """Equal layers score exactly as the single config; mixed layers report the model's mean key
    bits, each layer's proxy KL under its own config, and the bytes of every layer's format."""
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile

    base = PNMixConfig(b_high=3, b_low=1, salient_ratio=0.5, group_size=32, n_sink=4, residual_len=32)
    mixed = LayerwiseConfig(base, (LayerRange.parse("1", {"b_high": 4, "b_low": 2, "salient_ratio": 0.25}),))
    ev = Evaluator(tiny_dir, profile("smoke"), tasks=("fidelity",))
    one = ev.evaluate(base)
    same = ev.evaluate(LayerwiseConfig(base, (LayerRange.parse("0", {"b_low": 1}),)))
    assert same.units == one.units and same.kv_bytes == one.kv_bytes and same.key_bits == one.key_bits
    lw = ev.evaluate(mixed)
    assert lw.key_bits == pytest.approx(mean_key_bits(mixed, 2, 64)) and lw.key_bits > one.key_bits
    assert lw.kv_bytes > one.kv_bytes and lw.config == mixed.to_dict()
    per_layer = ev.proxy_by_layer(mixed)
    assert per_layer[0] == pytest.approx(ev.proxy_by_layer(base)[0])
    assert per_layer[1] == pytest.approx(ev.proxy_by_layer(base.with_(b_high=4, b_low=2, salient_ratio=0.25))[1])


def test_layers_command_reports_sensitivity_and_writes_a_config_within_the_bits(tmp_path):
    import json
    import subprocess

    out = tmp_path / "layers.json"
    picture = tmp_path / "layers.png"
    proc = subprocess.run([*PNMIX, "layers", "--bits", "2.45", "-o", str(out), "--json",
                           "--plot", str(picture)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert picture.stat().st_size > 10_000
    report = json.loads(proc.stdout)
    lw = load_config(out.read_text())
    assert isinstance(lw, LayerwiseConfig) and lw.to_dict() == report["config"]
    assert report["key_bits"] == pytest.approx(mean_key_bits(lw, 30, 64)) and report["key_bits"] <= 2.45 + 1e-9
    assert len(report["sensitivity"]) == len(report["layer_kl"]) == 30
    assert sum(report["layer_kl"]) < sum(report["sensitivity"])  # more bits, and spent where the KL is
    proc = subprocess.run([*PNMIX, "layers", "--config", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give a single PNMixConfig as the base" in proc.stderr
