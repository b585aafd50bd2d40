"""The split-combine kernel (`kernels.combine.combine_partials`) vs a torch reference.

Every decode kernel ends with it. The decode tests reach at most a few splits; the GPU launches
use hundreds at batch 1, read in blocks (of 256 or 128 splits for the maxima, 64 or 32 for the
values, by the row count), so here the split count crosses and misses multiples of those blocks.
Runs under TRITON_INTERPRET=1 on fresh random partials, output poisoned first.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # set before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from pnmix.kernels.combine import combine_partials  # noqa: E402


def reference(pm: torch.Tensor, pl: torch.Tensor, pa: torch.Tensor, gq: int) -> torch.Tensor:
    """softmax-weighted merge of partial (max, sum, weighted values) triples, in float64."""
    m = pm.double().amax(dim=1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(pm.double() - m)  # [BH, parts, M_P]
    num = (w[..., None] * pa.double()).sum(dim=1)
    den = (w * pl.double()).sum(dim=1)
    return (num / den.clamp_min(1e-300)[..., None])[:, :gq]


@pytest.mark.parametrize("n_parts,m_p,gq,d",
                         [(1, 8, 4, 64), (50, 8, 3, 64), (33, 16, 3, 128), (70, 8, 8, 128), (300, 8, 2, 64),
                          (140, 16, 1, 64)])
def test_combine_matches_reference(n_parts, m_p, gq, d):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    bsz, hkv = 2, 3
    n_bh = bsz * hkv
    pm = torch.randn((n_bh, n_parts, m_p), generator=gen) * 4
    pl = torch.rand((n_bh, n_parts, m_p), generator=gen) * 10 + 0.1
    pa = torch.randn((n_bh, n_parts, m_p, d), generator=gen) * pl[..., None]
    if n_parts > 1:  # splits that held no token: max -inf, nothing summed
        empty = torch.rand((n_bh, n_parts), generator=gen) < 0.3
        empty[:, 0] = False
        pm[empty] = float("-inf")
        pl[empty] = 0.0
        pa[empty] = 0.0
    out = torch.full((bsz, hkv * gq, d), float("nan"))
    combine_partials(pm, pl, pa, out, hkv)
    assert torch.isfinite(out).all(), "unwritten or non-finite output elements"
    want = reference(pm, pl, pa, gq).reshape(bsz, hkv * gq, d)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_combine_leaves_a_row_without_tokens_at_zero():
    pm = torch.full((1, 20, 8), float("-inf"))
    pl = torch.zeros((1, 20, 8))
    pa = torch.zeros((1, 20, 8, 64))
    out = torch.full((1, 2, 64), float("nan"))
    combine_partials(pm, pl, pa, out, 1)
    assert torch.equal(out, torch.zeros_like(out))
