"""Append one decode token per sequence to a static cache, in one launch (Triton).

A decode step writes each sequence's new key and value into the slot its length points to, in
the sink region while a sequence holds fewer than `n_sink` tokens and in the destination region
(the fp residual buffer, or the whole cache of the unquantized baseline) after, then advances
that length. Written with torch indexing this is about ten small kernels per layer and step (index
arithmetic, a gather for the kept slots, a select, a scatter, the length updates); inside a CUDA
graph each costs a few microseconds, which at batch 1 is a large part of the step. Here program
b moves sequence b's H_kv x d keys and values and then bumps its own length, so no other program
reads a length while it changes. A copy, so bit-exact with the torch reference
(`pnmix.static.append_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix.kernels.layout import next_pow2


@triton.jit
def _append_kernel(
    k_ptr, stride_kb, stride_kh, v_ptr, stride_vb, stride_vh,
    ks_ptr, vs_ptr, stride_sb, stride_sh, stride_st,
    kd_ptr, vd_ptr, stride_db, stride_dh, stride_dt,
    sink_len_ptr, dst_len_ptr,
    H: tl.constexpr, D: tl.constexpr, H_P: tl.constexpr, N_SINK: tl.constexpr,
):
    """Program b: key/value [B, H, 1, D] (channels contiguous, each its own strides) of sequence b
    into its sink slot sink_len[b] (when below N_SINK) or its destination slot dst_len[b]; that
    length += 1."""
    b = tl.program_id(0)
    h = tl.arange(0, H_P)
    c = tl.arange(0, D)
    ok = (h[:, None] < H) & (c[None, :] < D)  # [H_P, D]
    key = tl.load(k_ptr + b.to(tl.int64) * stride_kb + h[:, None] * stride_kh + c[None, :], mask=ok)
    value = tl.load(v_ptr + b.to(tl.int64) * stride_vb + h[:, None] * stride_vh + c[None, :], mask=ok)
    n_dst = tl.load(dst_len_ptr + b)
    n = 0  # sink_len[b], read once; with no sinks every token goes to the destination
    if N_SINK > 0:
        n = tl.load(sink_len_ptr + b)
    # Masks built at full tile shape (a scalar condition broadcast with & loses its bool type in
    # Triton's interpreter).
    n_sink = tl.zeros([H_P, D], tl.int32) + n
    in_sink = n_sink < N_SINK
    at = b.to(tl.int64) * stride_sb + h[:, None] * stride_sh + n_sink * stride_st + c[None, :]
    tl.store(ks_ptr + at, key.to(ks_ptr.dtype.element_ty), mask=ok & in_sink)
    tl.store(vs_ptr + at, value.to(vs_ptr.dtype.element_ty), mask=ok & in_sink)
    at = b.to(tl.int64) * stride_db + h[:, None] * stride_dh + n_dst * stride_dt + c[None, :]
    tl.store(kd_ptr + at, key.to(kd_ptr.dtype.element_ty), mask=ok & ~in_sink)
    tl.store(vd_ptr + at, value.to(vd_ptr.dtype.element_ty), mask=ok & ~in_sink)
    # The lengths, read above by this program only: sink_len[b] + 1 or dst_len[b] + 1.
    if N_SINK > 0:
        tl.store(sink_len_ptr + b, n + 1, mask=n < N_SINK)
        tl.store(dst_len_ptr + b, n_dst + 1, mask=n >= N_SINK)
    else:
        tl.store(dst_len_ptr + b, n_dst + 1)


def append_tokens(key: torch.Tensor, value: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                  dst_len: torch.Tensor, k_sink: torch.Tensor | None = None, v_sink: torch.Tensor | None = None,
                  sink_len: torch.Tensor | None = None) -> None:
    """Appends key/value [B, H, 1, d] in place: to k_sink/v_sink [B, H, n_sink, d] at sink_len
    where sink_len < n_sink, else to k_dst/v_dst [B, H, capacity, d] at dst_len; the length used
    grows by one. Lengths int32 [B] on the device. The caller keeps dst_len below the capacity.
    No sink buffers (or n_sink = 0): every token goes to the destination."""
    b, h, _, d = key.shape
    n_sink = 0 if k_sink is None else k_sink.shape[2]
    if n_sink == 0:
        k_sink, v_sink, sink_len = k_dst, v_dst, dst_len  # unread: the N_SINK = 0 branch is compiled out
    assert k_sink is not None and v_sink is not None and sink_len is not None
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_dst.stride(-1) != 1 or k_sink.stride(-1) != 1:
        raise ValueError("append_tokens: every tensor's channels must be contiguous")
    if v_dst.stride() != k_dst.stride() or v_sink.stride() != k_sink.stride():
        raise ValueError("append_tokens: key and value buffers must have equal strides")
    _append_kernel[(b,)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        k_sink, v_sink, k_sink.stride(0), k_sink.stride(1), k_sink.stride(2),
        k_dst, v_dst, k_dst.stride(0), k_dst.stride(1), k_dst.stride(2),
        sink_len, dst_len, H=h, D=d, H_P=next_pow2(h), N_SINK=n_sink, num_warps=1,
    )
