"""Flash-decoding partials: the online-softmax step of the Triton split kernels, and the merge.

A split program writes, per query head (row), the running max m of its base-2 scores, the sum l
of 2^(s - m) and the sum of 2^(s - m) x value; `combine_partials` rescales every split to the
common max and divides once. The Gluon kernels write the same partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix.kernels.layout import next_pow2
from pnmix.kernels.plan import sm_count


@triton.jit
def softmax_step(scores, m_i, l_i):
    """Online softmax (base 2) over a block of scores [M, T]; returns (p, m_new, l_new, alpha)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@triton.jit
def _load_partials(pm_ptr, pl_ptr, pa_ptr, base, parts, rows, c, n_parts, real, M_P: tl.constexpr, D: tl.constexpr):
    """The maxima, sums [len(parts), M_P] and channels c of the sums of values [.., M_P, len(c)] of
    partials `parts` of the (b, h_kv) whose first partial is `base`; past n_parts and in padding
    rows (`real` False): -inf, 0, 0."""
    valid = (parts < n_parts)[:, None] & real
    part = (base + parts)[:, None] * M_P + rows[None, :]
    m = tl.load(pm_ptr + part, mask=valid, other=float("-inf"))
    lw = tl.load(pl_ptr + part, mask=valid, other=0.0)
    a = tl.load(pa_ptr + part[:, :, None] * D + c[None, None, :], mask=valid[:, :, None], other=0.0)
    return m, lw, a


@triton.jit(do_not_specialize=["n_parts"])
def _combine_kernel(
    pm_ptr, pl_ptr, pa_ptr, out_ptr, stride_ob, stride_oh, n_parts,
    HKV: tl.constexpr, GQ: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
    S_MAX: tl.constexpr, S_BLK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Program (b * HKV + h, channel block): out[b, h*GQ : (h+1)*GQ, DC channels] from n_parts partials.

    pm, pl  fp32 [B * HKV, n_parts, M_P]      max and sum per split and row (M_P >= GQ rows, padding unread)
    pa      fp32 [B * HKV, n_parts, M_P, D]   sum of values per split and row
    out     [B, HKV * GQ, D], channels contiguous, any float dtype
    Latency-bound (a few KB per program): partials are read many splits a load, S_MAX maxima then
    S_BLK values a pass, and with ONE_PASS (every split fits one pass) all loads are issued at once.
    """
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    rows = tl.arange(0, M_P)
    c = tl.program_id(1) * DC + tl.arange(0, DC)
    base = bh.to(tl.int64) * n_parts
    real = (rows < GQ)[None, :]  # rows past the query heads are padding: not read
    s = tl.arange(0, S_BLK)
    if ONE_PASS:  # every partial in one pass: all loads issued before the first is used, one round trip
        m, lw, a = _load_partials(pm_ptr, pl_ptr, pa_ptr, base, s, rows, c, n_parts, real, M_P, D)
        m_all = tl.max(m, axis=0)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # a row with no token at all stays 0
        w = tl.math.exp2(m - m_all[None, :])
        l_all = tl.sum(w * lw, axis=0)
        o = tl.sum(w[:, :, None] * a, axis=0)
    else:
        m_all = tl.full([M_P], float("-inf"), tl.float32)
        sm = tl.arange(0, S_MAX)
        for s0 in range(0, n_parts, S_MAX):
            valid = (s0 + sm < n_parts)[:, None] & real
            m = tl.load(pm_ptr + (base + s0 + sm)[:, None] * M_P + rows[None, :], mask=valid, other=float("-inf"))
            m_all = tl.maximum(m_all, tl.max(m, axis=0))
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # a row with no token at all stays 0
        l_all = tl.zeros([M_P], tl.float32)
        o = tl.zeros([M_P, DC], tl.float32)
        for s0 in range(0, n_parts, S_BLK):
            m, lw, a = _load_partials(pm_ptr, pl_ptr, pa_ptr, base, s0 + s, rows, c, n_parts, real, M_P, D)
            w = tl.math.exp2(m - m_all[None, :])
            l_all += tl.sum(w * lw, axis=0)
            o += tl.sum(w[:, :, None] * a, axis=0)
    o = o / tl.where(l_all > 0, l_all, 1.0)[:, None]
    out = out_ptr + b.to(tl.int64) * stride_ob + (h * GQ + rows)[:, None] * stride_oh + c[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=(rows < GQ)[:, None])


def combine_partials(pm: torch.Tensor, pl: torch.Tensor, pa: torch.Tensor, out: torch.Tensor, hkv: int) -> torch.Tensor:
    """Merges split partials pm, pl [B * H_kv, parts, M_P], pa [B * H_kv, parts, M_P, d] into
    out [B, H_kv * GQ, d] and returns it."""
    n_bh, n_parts, m_p, d = pa.shape
    # Channel blocks of 16, narrower (down to 4) while the programs would not cover every SM twice.
    dc = min(d, 16)
    if pa.is_cuda:
        while dc > 4 and n_bh * (d // dc) < 2 * sm_count(pa.device.index or 0):
            dc //= 2
    # As few passes over the partials as fit 64 registers a thread (each pass is a dependent round
    # trip to memory), sized to the parts there are so that small splits read no masked-off rows.
    parts_p = next_pow2(n_parts)
    s_blk = max(1, min(8192 // (m_p * dc), parts_p))
    _combine_kernel[(n_bh, d // dc)](
        pm, pl, pa, out, out.stride(0), out.stride(1), n_parts,
        HKV=hkv, GQ=out.shape[1] // hkv, M_P=m_p, D=d, DC=dc, S_MAX=min(2048 // m_p, parts_p),
        S_BLK=s_blk, ONE_PASS=s_blk >= n_parts, num_warps=4,
    )
    return out
