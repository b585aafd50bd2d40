"""Decode attention over an unquantized static cache: the fp16/bf16 baseline of the static path.

k, v [B, H_kv, capacity, d] with per-sequence lengths in a device tensor. SDPA needs a mask for
unequal lengths, and with a mask it falls back to a kernel that does not split the sequence: on
an H200 that ran a 32K-token batch-1 step 20x slower than the bandwidth allows. This is the same
flash-decoding scheme as the PN-Mix kernels (`kernels.plan`), so the comparison isolates the
cache format: programs (b, h_kv, split) take the GQ query heads of KV head h_kv over a slice of
the tokens (one read of K/V per KV group), then `kernels.combine.combine_partials` merges the
slices. The grid depends only on the capacity, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix.kernels.combine import combine_partials, softmax_step
from pnmix.kernels.layout import next_pow2
from pnmix.kernels.plan import LOG2E, sm_count


@triton.jit(do_not_specialize=["tokens_per_split", "n_split"])  # one compile for every split plan
def _full_decode_kernel(
    q_ptr, stride_qb, stride_qh, k_ptr, v_ptr, stride_kb, stride_kh, stride_kt, len_ptr,
    pm_ptr, pl_ptr, pa_ptr, qk_scale, tokens_per_split, n_split,
    HKV: tl.constexpr, GQ: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (b * HKV + h, split): partial attention of query heads h * GQ .. over tokens
    [split * tokens_per_split, (split + 1) * tokens_per_split) of sequence b that it holds.

    q [B, HKV * GQ, D]; k, v [B, HKV, capacity, D] (same strides, channels contiguous); len int32 [B].
    Partials (`kernels.combine`): pm, pl fp32 [B * HKV, n_split, M_P], pa fp32 [..., D]. Reads every
    held K/V byte once; from batch 32 it runs at 95-100% of SDPA's speed on an H200 (docs/kernels.md).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    rows = tl.arange(0, M_P)
    c = tl.arange(0, D)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + (h * GQ + rows) * stride_qh
    # Padded query rows are zero, so their scores stay finite.
    q = tl.load(q_base[:, None] + c[None, :], mask=(rows < GQ)[:, None], other=0.0)
    # Tensor-core operands in fp16 whatever the cache dtype: the same code path on the GPU and in
    # the CPU interpreter (whose bf16 dot is wrong); bf16 caches pay one conversion per element.
    q = (q.to(tl.float32) * qk_scale).to(tl.float16)
    kv = b.to(tl.int64) * stride_kb + h * stride_kh
    n = tl.load(len_ptr + b)
    t_start = split * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, n)
    m_i = tl.full([M_P], float("-inf"), tl.float32)
    l_i = tl.zeros([M_P], tl.float32)
    acc = tl.zeros([M_P, D], tl.float32)
    for t0 in range(t_start, t_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < t_end
        off = kv + t[:, None] * stride_kt + c[None, :]
        k = tl.load(k_ptr + off, mask=ok[:, None], other=0.0).to(tl.float16)
        v = tl.load(v_ptr + off, mask=ok[:, None], other=0.0).to(tl.float16)
        scores = tl.where(ok[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        p, m_i, l_i, alpha = softmax_step(scores, m_i, l_i)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
    part = bh.to(tl.int64) * n_split + split
    tl.store(pa_ptr + (part * M_P + rows[:, None]) * D + c[None, :], acc)
    tl.store(pm_ptr + part * M_P + rows, m_i)
    tl.store(pl_ptr + part * M_P + rows, l_i)


def full_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                          num_splits: int | None = None, block_n: int = 64,
                          max_tokens: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over the first lengths[b] positions of k/v.

    q [B, H_q, d]; k, v [B, H_kv, capacity, d] (d a power of two >= 16, channels contiguous, same
    strides); lengths int32 [B] on the device -> [B, H_q, d] in q's dtype. num_splits: token
    slices per (b, h_kv); by default about four programs per SM. `max_tokens`, if given, bounds
    every length: the slices cover that many tokens instead of the capacity (tokens past it are
    not read).
    """
    bsz, hq, d = q.shape
    _, hkv, cap, d_k = k.shape
    if max_tokens is not None:
        cap = max(1, min(cap, max_tokens))
    if d_k != d or hq % hkv or d & (d - 1) or d < 16 or k.stride() != v.stride() or k.stride(-1) != 1:
        raise ValueError(f"unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)} (strides {k.stride()})")
    gq = hq // hkv
    m_p = max(16, next_pow2(gq))
    if num_splits is None:
        target = 4 * sm_count(q.device.index or 0) if q.is_cuda else 4
        num_splits = triton.cdiv(target, bsz * hkv)
    per_split = triton.cdiv(triton.cdiv(cap, max(1, num_splits)), block_n) * block_n
    num_splits = triton.cdiv(cap, per_split)
    dev = q.device
    pm = torch.empty((bsz * hkv, num_splits, m_p), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pa = torch.empty((bsz * hkv, num_splits, m_p, d), dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    _full_decode_kernel[(bsz * hkv, num_splits)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), k.stride(2), lengths,
        pm, pl, pa, scale * LOG2E, per_split, num_splits,
        HKV=hkv, GQ=gq, M_P=m_p, D=d, BLOCK_N=block_n, num_warps=4,
    )
    return combine_partials(pm, pl, pa, out, hkv)
