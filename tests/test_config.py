import json

import pytest

from pnmix.config import PRESETS, ConfigError, PNMixConfig, preset, salient_pair_count


def test_presets_are_valid_and_named():
    assert set(PRESETS) >= {"fp16", "kivi2", "pnmix-paper"}
    paper = preset("pnmix-paper")
    assert (paper.b_high, paper.b_low, paper.salient_ratio, paper.group_size) == (3, 1, 0.5, 128)
    assert (paper.n_sink, paper.residual_len, paper.value_bits) == (32, 128, 2)
    kivi = preset("kivi2")
    assert (kivi.b_high, kivi.b_low, kivi.salient_ratio, kivi.n_sink, kivi.group_size) == (2, 2, 0.0, 0, 128)
    fp16 = preset("fp16")
    assert not fp16.keys_quantized and not fp16.values_quantized


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip(name):
    cfg = PRESETS[name]
    assert PNMixConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["b_high"] == cfg.b_high


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"b_high": 1, "b_low": 3}, "b_low"),
        ({"b_high": 5}, "b_high"),
        ({"b_low": 0}, "b_low"),
        ({"b_high": 16, "b_low": 2}, "b_high"),
        ({"group_size": 48}, "group_size"),
        ({"salient_ratio": 1.5}, "salient_ratio"),
        ({"salient_ratio": -0.1}, "salient_ratio"),
        ({"n_sink": -1}, "n_sink"),
        ({"residual_len": 100}, "residual_len"),
        ({"residual_len": 0}, "residual_len"),
        ({"value_bits": 3}, "value_bits"),
        ({"value_group_size": 0}, "value_group_size"),
        ({"criterion": "magic"}, "criterion"),
        ({"b_high": 2.5}, "b_high"),
    ],
)
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        PNMixConfig(**changes)
    assert err.value.field == field
    msg = str(err.value)
    assert field in msg and "allowed" in msg and "\n" not in msg


def test_value_group_must_divide_head_dim():
    cfg = PNMixConfig(value_group_size=48)
    cfg.check_head_dim(96)
    with pytest.raises(ConfigError, match="value_group_size"):
        cfg.check_head_dim(128)


def test_malformed_json_is_refused_clearly():
    with pytest.raises(ConfigError, match="valid JSON"):
        PNMixConfig.from_json("{b_high: 3")
    with pytest.raises(ConfigError, match="bogus"):
        PNMixConfig.from_dict({"bogus": 1})


def test_salient_pair_count_rounds_half_up():
    assert salient_pair_count(0.5, 128) == 32
    assert salient_pair_count(0.375, 128) == 24
    assert salient_pair_count(0.1, 64) == 3  # 3.2
    assert salient_pair_count(0.15625, 64) == 5  # 5.0 exactly
    assert salient_pair_count(0.140625, 64) == 5  # 4.5 rounds up (banker's rounding would give 4)
    assert salient_pair_count(1.0, 64) == 32


def test_deeply_nested_json_is_a_config_error():
    with pytest.raises(ConfigError, match="flat JSON object"):
        PNMixConfig.from_json("[" * 100_000 + "]" * 100_000)


def test_cache_refuses_a_config_that_is_not_a_pnmixconfig():
    from transformers import LlamaConfig

    from pnmix.cache import PNMixCache

    model_config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                               intermediate_size=64, vocab_size=100)
    for bad in (preset("pnmix-paper").to_dict(), preset("pnmix-paper").to_json()):
        with pytest.raises(ConfigError, match="a PNMixConfig"):
            PNMixCache(model_config, bad)  # type: ignore[arg-type]


def test_label_names_the_searched_knobs():
    assert preset("pnmix-paper").label == "3/1 G128 r0.5 s32"
    assert PNMixConfig(b_high=2, b_low=2, group_size=64, salient_ratio=0.0, n_sink=0).label == "2/2 G64 r0 s0"
    assert preset("pnmix-paper").with_(value_bits=1, value_group_size=64).label == "3/1 G128 r0.5 s32 V1/64"
