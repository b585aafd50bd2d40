import pytest

from pnmix.bits import ModelShape, key_bits, kv_cache_bytes, value_bits
from pnmix.config import PNMixConfig, preset


def cfg(b_high, b_low, g, r, sinks):
    return PNMixConfig(b_high=b_high, b_low=b_low, group_size=g, salient_ratio=r, n_sink=sinks)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (cfg(3, 1, 128, 0.5, 32), 2.26341),
        (cfg(3, 1, 64, 0.375, 32), 2.26341),
        (cfg(2, 2, 128, 0.0, 0), 2.25),
        (cfg(2, 2, 32, 0.0, 0), 3.0),
        (cfg(4, 2, 128, 0.0625, 32), 2.38829),
    ],
)
def test_design_check_values(config, expected):
    kb = key_bits(config, head_dim=128, quantized_tokens=32768)
    assert kb.key_bits == pytest.approx(expected, abs=5e-6)
    assert kb.key_bits == pytest.approx(kb.payload + kb.sinks + kb.scales, rel=1e-12)
    assert kb.total == pytest.approx(kb.key_bits + kb.metadata, rel=1e-12)


def test_metadata_is_a_half_dim_mask_per_head():
    kb = key_bits(cfg(3, 1, 128, 0.5, 32), head_dim=128, quantized_tokens=32768)
    assert kb.metadata == pytest.approx(64 / (32800 * 128))
    assert key_bits(cfg(2, 2, 128, 0.0, 0)).metadata == 0


def test_terms_of_the_paper_config():
    kb = key_bits(preset("pnmix-paper"), 128)
    assert kb.salient_fraction == 0.5
    assert kb.payload == pytest.approx(32768 * 2 / 32800)
    assert kb.sinks == pytest.approx(32 * 16 / 32800)
    assert kb.scales == pytest.approx(256 * 32 / 32800)


def test_value_bits():
    assert value_bits(preset("pnmix-paper")) == pytest.approx(2 + 32 / 32)
    assert value_bits(PNMixConfig(value_bits=4, value_group_size=64)) == pytest.approx(4.5)
    assert value_bits(preset("fp16")) == 16
    assert key_bits(preset("fp16")).total == 16


def test_kv_bytes_of_a_model():
    shape = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    fp16 = kv_cache_bytes(preset("fp16"), shape, batch=2, seq_len=1000)
    assert fp16.total == fp16.fp16_total == 30 * 3 * 2 * 1000 * 64 * 2 * 2
    kv = kv_cache_bytes(preset("pnmix-paper"), shape, batch=2, seq_len=1000)
    slots = 30 * 3 * 2
    # 32 sinks, 7 groups of 128 (896 tokens), 72 residual tokens; 16 salient pairs of 32.
    assert kv.sinks == slots * 32 * 64 * 4
    assert kv.residual == slots * 72 * 64 * 4
    assert kv.packed_keys == slots * 896 * (64 * 1 + 32 * 2) // 8
    assert kv.key_scales == slots * 7 * 64 * 4
    assert kv.packed_values == slots * 896 * 64 * 2 // 8
    assert kv.value_scales == slots * 896 * 2 * 4
    assert kv.salient_sets == slots * 16 * 2
    assert kv.total < fp16.total / 3
