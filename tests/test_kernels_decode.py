"""Fused decode attention vs dequantize-then-attend in fp32 (`pnmix.backend.decode_reference`).

Runs the Triton kernel under TRITON_INTERPRET=1 on small shapes. Relative error (Frobenius) must
stay <= 1e-2. Fresh random inputs per case; the output is poisoned (NaN) before every run, so an
unwritten element fails. The interpreter is slow, so the parametrization is a chosen subset rather
than the full product; every case has a batch of 3 sequences with unequal lengths (one of them
with an empty packed region), and between them the cases cover:
- bit pairs (1,3) (2,2) (1,4) (4,4) (1,1) (2,3) (3,4); G 32 / 64 / 128;
- salient ratios 0, 0.5, 1; sinks 0 and 32 (capacity; a short sequence holds fewer);
- residual empty / partial / full; GQA ratios 1, 3, 4; head_dim 64 and 128;
- value bits 1, 2, 4, 8 and value groups 16 / 32 / 64; fp32, bf16, fp16 activations;
- splits of the packed region 1, 2 and more splits than some sequences have groups.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # set before the kernels are decorated; only these tests use Triton

import dataclasses  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pnmix import packing  # noqa: E402
from pnmix.backend import decode_reference  # noqa: E402
from pnmix.kernels.decode import decode_attention  # noqa: E402
from pnmix.kernels.layout import DecodeCache, channel_order  # noqa: E402


@dataclass(frozen=True)
class Case:
    b_low: int = 1
    b_high: int = 3
    group_size: int = 32
    ratio: float = 0.5
    n_sink: int = 32
    residual: str = "partial"  # empty | partial | full
    gqa: int = 4
    head_dim: int = 64
    value_bits: int = 2
    value_group: int = 32
    dtype: torch.dtype = torch.float32
    splits: int | None = 2


CASES = [
    Case(),
    Case(b_low=2, b_high=2, ratio=0.0, residual="empty", gqa=1),
    Case(b_low=1, b_high=4, group_size=64, ratio=1.0, residual="full", gqa=3, value_bits=1, splits=1),
    Case(b_low=4, b_high=4, group_size=128, ratio=0.0, n_sink=0, value_bits=8, value_group=64, splits=7),
    Case(b_low=1, b_high=1, ratio=0.0, n_sink=0, residual="full", gqa=1, value_bits=4, dtype=torch.bfloat16),
    Case(b_low=2, b_high=3, group_size=64, ratio=0.5, residual="empty", gqa=3, value_group=16, dtype=torch.float16),
    Case(b_low=3, b_high=4, group_size=128, ratio=1.0, gqa=4, head_dim=128, splits=None),
    Case(b_low=1, b_high=3, group_size=128, ratio=0.5, gqa=4, head_dim=128, dtype=torch.bfloat16, splits=3),
    Case(b_low=1, b_high=3, group_size=32, ratio=0.5, n_sink=0, residual="empty", gqa=3, value_bits=8),
    Case(b_low=2, b_high=4, group_size=32, ratio=0.5, gqa=1, head_dim=128, value_bits=1, value_group=16,
         dtype=torch.float16, splits=5),
    Case(b_low=1, b_high=2, group_size=64, ratio=0.5, n_sink=0, residual="full", gqa=4, value_bits=4),
    Case(b_low=3, b_high=3, group_size=128, ratio=0.0, residual="empty", gqa=3, head_dim=128, value_group=64,
         dtype=torch.bfloat16),
    Case(b_low=1, b_high=3, group_size=64, ratio=1.0, n_sink=0, residual="partial", gqa=1, value_bits=2,
         value_group=16, splits=1),
    Case(b_low=2, b_high=3, group_size=128, ratio=0.5, residual="full", gqa=3, value_bits=8, dtype=torch.float16,
         splits=None),
    Case(b_low=1, b_high=4, group_size=32, ratio=0.5, residual="empty", gqa=4, head_dim=128, value_bits=4,
         value_group=32, splits=4),
    Case(b_low=1, b_high=3, group_size=32, ratio=0.0, n_sink=32, residual="full", gqa=4, value_bits=1,
         value_group=64, dtype=torch.bfloat16),
]


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def build(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, DecodeCache]:
    """Three sequences with unequal lengths: (groups, sinks held, residual held) differ per sequence."""
    bsz, hkv, d, g = 3, 2, case.head_dim, case.group_size
    ng_cap, res_cap = 3, 2 * g
    n_groups = [3, 1, 0]
    res_fill = {"empty": [0, 0, 0], "partial": [g // 2, 1, 5], "full": [res_cap, res_cap, res_cap]}[case.residual]
    sinks = [case.n_sink, case.n_sink, min(case.n_sink, 7)]  # the short sequence holds fewer sinks
    if case.residual == "empty" and case.n_sink == 0:
        n_groups[2] = 1  # every sequence holds at least one token
    n_pairs = round(case.ratio * d / 2) if case.b_high > case.b_low else 0

    k = torch.randn((bsz, hkv, ng_cap * g, d), generator=gen) * 2 + 0.3
    v = torch.randn((bsz, hkv, ng_cap * g, d), generator=gen)
    if n_pairs:
        pairs = torch.rand((bsz, hkv, d // 2), generator=gen).topk(n_pairs, dim=-1).indices.sort(-1).values
        salient = torch.cat([pairs, pairs + d // 2], dim=-1)
    else:
        salient = torch.zeros((bsz, hkv, 0), dtype=torch.long)
    pk = packing.quantize_keys(k, salient, case.b_low, case.b_high, g)
    pv = packing.quantize_values(v, case.value_bits, case.value_group)

    def fp(n: int) -> torch.Tensor:
        return (torch.randn((bsz, hkv, n, d), generator=gen) * 1.5).to(case.dtype)

    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    cache = DecodeCache(
        k_sink=fp(case.n_sink), v_sink=fp(case.n_sink), k_res=fp(res_cap), v_res=fp(res_cap),
        k_low=pk.low, k_high=pk.high, k_scale=pk.scale, k_zero=pk.zero,
        v_packed=pv.packed, v_scale=pv.scale, v_zero=pv.zero, channel_order=channel_order(salient, d),
        sink_len=as_i32(sinks), n_groups=as_i32(n_groups), res_len=as_i32(res_fill),
        b_low=case.b_low, b_high=case.b_high, group_size=g, value_bits=case.value_bits,
        value_group_size=case.value_group,
    )
    q = (torch.randn((bsz, hkv * case.gqa, d), generator=gen) * 1.5).to(case.dtype)
    return q, cache


@pytest.mark.parametrize("case", CASES, ids=lambda c: (
    f"b{c.b_low}{c.b_high}-G{c.group_size}-r{c.ratio}-s{c.n_sink}-{c.residual}-gqa{c.gqa}-d{c.head_dim}"
    f"-v{c.value_bits}g{c.value_group}-{str(c.dtype)[6:]}-sp{c.splits}"))
def test_decode_matches_dequantize_then_attend(case):
    gen = fresh_generator()
    q, cache = build(case, gen)
    scale = case.head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, cache, scale, num_splits=case.splits, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == case.dtype
    assert torch.isfinite(out).all(), "unwritten or non-finite output elements"
    want = decode_reference(q, cache, scale)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"relative error {err:.3e}"
    per_seq = ((out.float() - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)))
    assert (per_seq <= 2e-2).all(), f"per-sequence relative errors {per_seq.tolist()}"


def garble_past_held_tokens(cache: DecodeCache) -> None:
    """Overwrites everything beyond what sequences 1 and 2 of `build`'s partial-residual cache hold
    (1 and 0 groups, residuals of 1 and 5 tokens, 7 sinks for sequence 2), packed bytes included."""
    cache.k_low[1:, :, 1:] = 0xFF
    cache.k_high[1:, :, 1:] = 0xFF
    cache.k_scale[1:, :, 1:] = 1e4
    cache.v_packed[1:, :, 32:] = 0xFF
    cache.v_scale[1:, :, 32:] = 1e4
    cache.k_res[1, :, 1:] = 1e4
    cache.k_res[2, :, 5:] = 1e4
    cache.k_sink[2, :, 7:] = 1e4


def test_decode_reads_only_held_tokens():
    """Bytes past each sequence's lengths are garbage; the output must not change."""
    gen = fresh_generator()
    q, cache = build(Case(residual="partial"), gen)
    scale = 0.125
    before = decode_attention(q, cache, scale, num_splits=2)
    garble_past_held_tokens(cache)
    after = decode_attention(q, cache, scale, num_splits=2)
    assert torch.equal(before, after)


def test_decode_plans_for_a_bound_on_the_groups_held():
    """max_groups: the splits cover that many packed groups, not the capacity (3 here). Where every
    sequence holds at most that many, one split reads what it read before (bit for bit), and the
    groups past the bound are never read."""
    q, cache = build(Case(residual="partial"), fresh_generator())
    cache = dataclasses.replace(cache, n_groups=torch.tensor([1, 1, 0], dtype=torch.int32))
    scale = 0.125
    whole = decode_attention(q, cache, scale, num_splits=1)
    for name in ("k_low", "k_high"):
        getattr(cache, name)[:, :, 1:] = 0xFF
    cache.k_scale[:, :, 1:] = float("nan")
    cache.v_scale[:, :, cache.group_size:] = float("nan")
    assert torch.equal(decode_attention(q, cache, scale, num_splits=1, max_groups=1), whole)
    assert torch.equal(decode_attention(q, cache, scale, max_groups=1), whole)  # planned: one split
    want = decode_reference(q, cache, scale)
    assert ((whole.float() - want).norm() / want.norm()).item() <= 1e-2


def test_decode_rejects_bad_shapes():
    q, cache = build(Case(), fresh_generator())
    with pytest.raises(ValueError, match="unsupported decode shape"):
        decode_attention(q[:, :, :32], cache, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        decode_attention(q, cache, 0.1, out=torch.empty(1))
