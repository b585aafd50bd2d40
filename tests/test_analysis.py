import math

import torch
from tiny import tiny_model

from pnmix import analysis


def test_polar_and_pnmix_quantizers_approach_the_keys_with_more_bits():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((2, 128, 16), generator=gen)
    pairs = torch.tensor([[0, 3], [1, 2]])
    errors = [float(((analysis.quantize_polar(k, b, 64, "rotate_half") - k) ** 2).mean()) for b in (2, 4, 6)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-2
    pn = [float(((analysis.quantize_pnmix(k, pairs, b, b, 64, "rotate_half") - k) ** 2).mean()) for b in (1, 2, 4)]
    assert pn[0] > pn[1] > pn[2]
    # A ragged tail (128 = 2 groups of 64 here; 130 leaves 2 tokens) stays exact.
    k2 = torch.randn((2, 130, 16), generator=gen)
    out = analysis.quantize_pnmix(k2, pairs, 3, 1, 64, "rotate_half")
    assert torch.equal(out[:, 128:], k2[:, 128:])


def test_attention_kl_is_zero_for_identical_keys_and_positive_otherwise():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn((4, 40, 16), generator=gen), torch.randn((2, 40, 16), generator=gen)
    assert analysis.attention_kl(q, k, k, 10, 0.25) == 0.0
    assert analysis.attention_kl(q, k, k + 0.3 * torch.randn_like(k), 10, 0.25) > 0


def test_trace_and_analysis_on_a_tiny_model(tmp_path):
    model = tiny_model("llama", seed=2)
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    trace = analysis.record_trace(model, ids, new_tokens=12)
    assert len(trace.keys) == 2 and trace.keys[0].shape == (2, 32, 16) and trace.queries[0].shape == (4, 32, 16)
    assert trace.prefill_len == 20 and math.isclose(trace.scaling, 16 ** -0.5)
    result = analysis.analyze(trace, "rotate_half", group=32, n_sink=4)
    assert "kivi-2 uniform" in result["quantizers"] and "pnmix-3/1 qk_pair_norm (prefill)" in result["quantizers"]
    for row in result["quantizers"].values():
        assert row["attention_kl"] >= 0 and row["key_mse"] >= 0
    for j in result["jaccard_prefill_vs_decode"].values():
        assert 0 <= j["r=0.1"] <= 1 and 0 <= j["r=0.5"] <= 1
    shares = result["importance_share"]
    assert 0 < shares["top10"] <= shares["top30"] <= shares["top50"] <= 1
    paths = analysis.write_report(result, tmp_path, "tiny")
    assert [p.name for p in paths] == ["analysis.json", "analysis.md", "attention_kl.png"]
    assert paths[2].stat().st_size > 1000


def test_a_trace_from_the_engines_continuation_equals_one_from_generate():
    """The tuner records its proxy trace from the scoring engine's fp16 continuation (CUDA graphs on
    a GPU): the same tokens as `generate`'s, hence the same queries, keys and values."""
    from pnmix.tuner.scoring.engine import ScoringEngine

    model = tiny_model("llama", seed=2)
    model.config.eos_token_id = 7  # a token the random model emits: both paths must ban it
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    want = analysis.record_trace(model, ids, 24)
    tokens = ScoringEngine(model, tokenizer=None).continuations([ids[0].tolist()], 24)[0]
    got = analysis.record_trace(model, ids, 24, continuation=tokens)
    assert got.values is not None and want.values is not None
    for a, b in zip(want.queries + want.keys + want.values, got.queries + got.keys + got.values, strict=True):
        assert torch.equal(a, b)
