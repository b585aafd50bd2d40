"""PNMixCache inside `model.generate`: equivalence, batching, storage, accounting."""

import pytest
import torch
from tiny import FAMILIES, tiny_model
from transformers import DynamicCache

from pnmix import packing
from pnmix.bits import key_bits
from pnmix.config import PNMixConfig, preset
from pnmix.generation import cache_kwargs, new_cache

# Small groups so that tiny prompts reach the packed region and the residual flushes.
SMALL = PNMixConfig(b_high=3, b_low=1, group_size=32, salient_ratio=0.5, n_sink=4, residual_len=32,
                    value_bits=2, value_group_size=16)


def greedy(model, ids, mask, cache, n):
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                              **cache_kwargs(model, cache))


def reference(model, ids, mask, n):
    model.set_attn_implementation("sdpa")
    return greedy(model, ids, mask, DynamicCache(config=model.config), n)


@pytest.mark.parametrize("family", FAMILIES)
def test_unquantized_matches_dynamic_cache_tiny(family):
    model = tiny_model(family)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ref = reference(model, ids, mask, 24)
    out = greedy(model, ids, mask, new_cache(model, preset("fp16")), 24)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_unquantized_matches_dynamic_cache_embedded(embedded):
    tok = embedded.tokenizer
    enc = tok(["The history of the printing press begins"], return_tensors="pt")
    ref = reference(embedded.model, enc["input_ids"], enc["attention_mask"], 24)
    out = greedy(embedded.model, enc["input_ids"], enc["attention_mask"], new_cache(embedded.model, preset("fp16")), 24)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def left_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_equals_single_sequences_tiny(family):
    # float64: in fp32, batched matmuls round differently from single ones (~1e-7), and one code that
    # sits on a quantization boundary then flips, which moves a random tiny model's next token.
    model = tiny_model(family, seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (75, 41, 100)]
    ids, mask = left_padded(rows)
    batch = greedy(model, ids, mask, new_cache(model, SMALL), 40).sequences[:, ids.shape[1]:]
    for i, r in enumerate(rows):
        one = torch.tensor([r])
        alone = greedy(model, one, torch.ones_like(one), new_cache(model, SMALL), 40).sequences[0, len(r):]
        assert torch.equal(batch[i], alone), f"row {i} differs"


def test_left_padded_batch_equals_single_sequences_embedded(embedded):
    tok, model = embedded.tokenizer, embedded.model
    texts = [
        "Write a detailed essay about the history of the bicycle. " * 12,
        "Explain how photosynthesis works, step by step, for a student. " * 5,
    ]
    rows = [tok(t)["input_ids"] for t in texts]
    ids, mask = left_padded(rows)
    cfg = preset("pnmix-paper")
    cache = new_cache(model, cfg)
    batch = greedy(model, ids, mask, cache, 30).sequences[:, ids.shape[1]:]
    layer = cache.layers[0]
    assert layer.lengths == [len(rows[0]) + 29, len(rows[1]) + 29]  # the last token is never fed back
    assert layer.n_groups[0] >= 1  # the long row reached the packed region
    # Each row chose its own salient pairs.
    assert not torch.equal(layer.salient_pairs[0], layer.salient_pairs[1])
    for i, r in enumerate(rows):
        one = torch.tensor([r])
        alone = greedy(model, one, torch.ones_like(one), new_cache(model, cfg), 30).sequences[0, len(r):]
        assert torch.equal(batch[i], alone), f"row {i} differs"


def test_regions_and_stored_bytes_decode_to_the_view():
    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 128, (1, 83), generator=torch.Generator().manual_seed(2))
    cache = new_cache(model, SMALL)
    greedy(model, ids, torch.ones_like(ids), cache, 30)
    layer = cache.layers[1]
    # 112 tokens held (the last generated token is never fed back): 4 sinks; prefill 79 -> 2 groups
    # + 15 residual; 29 decoded -> the residual reaches 32 and is flushed -> 12 left.
    assert layer.lengths == [112]
    assert layer.n_groups == [3] and layer.res_len == [12]
    p = layer.packed
    channels = layer.salient_channels(0)
    stored = packing.PackedKeys(p["k_low"][0], p["k_high"][0], p["k_scale"][0], p["k_zero"][0])
    k_hat = packing.dequantize_keys(stored, channels, SMALL.b_low)
    torch.testing.assert_close(layer.view_k[0, :, 4:4 + 96], k_hat, rtol=0, atol=0)
    # Sinks and residual are exact copies of what the view holds at their positions.
    assert torch.equal(layer.view_k[0, :, :4], layer.k_sink[0])
    assert torch.equal(layer.view_k[0, :, 100:112], layer.k_res[0, :, :12])
    assert layer.salient_pairs.shape == (1, 2, 4) and layer.salient_pairs.dtype == torch.int16


def test_nbytes_matches_the_bit_formula(embedded):
    model, d = embedded.model, 64
    cfg = preset("pnmix-paper")
    ids = torch.randint(100, 4000, (1, 32 + 3 * 128 + 50), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model, cfg)
    greedy(model, ids, torch.ones_like(ids), cache, 1)
    held = cache.nbytes()
    layers, heads, t_q = 30, 3, 3 * 128
    kb = key_bits(cfg, head_dim=d, quantized_tokens=t_q)
    elements = (t_q + cfg.n_sink) * d * heads * layers
    formula_payload_and_scales = (kb.payload + kb.scales) * elements / 8
    assert held["regions"]["packed_keys"] + held["regions"]["key_scales"] == pytest.approx(
        formula_payload_and_scales, rel=1e-9)
    # Sinks are held in the model's dtype (fp32 here), keys and values: the formula counts fp16 keys.
    elt = model.dtype.itemsize
    assert held["regions"]["sinks"] == layers * heads * cfg.n_sink * d * elt * 2
    assert kb.sinks * elements / 8 * (elt / 2) * 2 == held["regions"]["sinks"]
    assert held["regions"]["residual"] == layers * heads * cfg.residual_len * d * elt * 2
    assert held["regions"]["packed_values"] == layers * heads * t_q * d * 2 // 8
    assert held["regions"]["value_scales"] == layers * heads * t_q * (d // 32) * 2 * 2
    assert held["regions"]["salient_sets"] == layers * heads * 16 * 2
    assert held["total"] == sum(held["regions"].values())
    assert len(held["layers"]) == layers


def test_quantized_cache_changes_logits_but_stays_close(embedded):
    tok, model = embedded.tokenizer, embedded.model
    enc = tok(["A long story about a lighthouse keeper and the sea. " * 15], return_tensors="pt")
    ref = reference(model, enc["input_ids"], enc["attention_mask"], 8)
    out = greedy(model, enc["input_ids"], enc["attention_mask"], new_cache(model, preset("pnmix-paper")), 8)
    first_ref, first = ref.logits[0].log_softmax(-1), out.logits[0].log_softmax(-1)
    # Prefill attention is exact, so the first token's logits are identical.
    torch.testing.assert_close(first, first_ref)
    kl = [(a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum().item()
          for a, b in zip(ref.logits[1:], out.logits[1:], strict=True)]
    assert 0 < max(kl) < 1.0, kl


@pytest.mark.parametrize("config", [
    preset("pnmix-paper"),
    preset("kivi2"),
    PNMixConfig(b_high=4, b_low=2, group_size=32, salient_ratio=0.25, n_sink=4, residual_len=64),
], ids=lambda c: c.label)
def test_batched_append_equals_appending_each_sequence(config):
    """The batched decode-time append (every sequence's full residual blocks quantized in one call)
    leaves exactly what appending sequence by sequence leaves: bytes, view, residual, flushed blocks."""
    from pnmix.cache import PNMixLayer
    from pnmix.saliency import Pairing

    heads, d, lengths = 2, 64, [40, 170, 300]
    keys = [torch.randn(heads, t, d) for t in lengths]
    values = [torch.randn(heads, t, d) for t in lengths]
    scores = torch.rand(len(lengths), heads, d // 2)
    batched, per_row = (PNMixLayer(config, next(iter(Pairing)), 0) for _ in range(2))
    for layer in (batched, per_row):
        layer.multi_token = True
        layer.load_prefill(keys, values, scores)
    flushes = 0
    for n in [1, 7, 130, 300, 1, 255]:
        k, v = torch.randn(len(lengths), heads, n, d), torch.randn(len(lengths), heads, n, d)
        batched.append(k, v)
        per_row.flushed = []
        for b in range(len(lengths)):
            per_row._append(b, k[b], v[b], keep_flushed=n > 1)
        assert (batched.lengths, batched.res_len, batched.n_groups) == (per_row.lengths, per_row.res_len,
                                                                         per_row.n_groups)
        for name, t in batched.packed.items():
            assert torch.equal(t, per_row.packed[name]), name
        end = max(batched.lengths)
        assert torch.equal(batched.view_k[:, :, :end], per_row.view_k[:, :, :end])
        assert torch.equal(batched.view_v[:, :, :end], per_row.view_v[:, :, :end])
        for b, held in enumerate(batched.res_len):
            assert torch.equal(batched.k_res[b, :, :held], per_row.k_res[b, :, :held])
            assert torch.equal(batched.v_res[b, :, :held], per_row.v_res[b, :, :held])
        assert [(f.row, f.start) for f in batched.flushed] == [(f.row, f.start) for f in per_row.flushed]
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(batched.flushed, per_row.flushed, strict=True))
        assert batched.nbytes() == per_row.nbytes()
        flushes += len(batched.flushed)
    assert flushes >= 6  # the steps above do quantize blocks
