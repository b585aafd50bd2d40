"""Quantize + pack kernels: keys into bit planes along tokens, values into bytes along channels.

The stored format is the one `pnmix/packing.py` defines; these kernels reproduce it bit for bit
(tests/test_kernels_pack.py compares them with `packing.quantize_keys` / `quantize_values`).

Quantizer, per group, all arithmetic in fp32 with correctly rounded division (`div_rn`), exactly
as the reference does it:
    z = fp16(min),  s = fp16((max - min) / (2^b - 1)),  q = clamp(floor((x - z) / s + 0.5), 0, 2^b - 1)
    (s == 0 -> q = 0). Triton's plain `/` is an approximate division on NVIDIA GPUs, hence div_rn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix.kernels.layout import PackedKeys, PackedValues


@triton.jit
def _quantize(x, levels):
    """x fp32 [R, N] quantized per row (min/max along axis 1); levels fp32 [R] or scalar.

    Returns (q fp32 [R, N] integer-valued, scale fp16 [R], zero fp16 [R]).
    """
    lo = tl.min(x, axis=1)
    hi = tl.max(x, axis=1)
    zero16 = lo.to(tl.float16)
    scale16 = tl.math.div_rn(hi - lo, levels).to(tl.float16)
    s = scale16.to(tl.float32)
    z = zero16.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)
    q = tl.floor(tl.math.div_rn(x - z[:, None], safe[:, None]) + 0.5)
    q = tl.where(s[:, None] > 0, q, 0.0)
    q = tl.minimum(tl.maximum(q, 0.0), levels[:, None])
    return q, scale16, zero16


@triton.jit
def _pack_tokens(q, bit: tl.constexpr, R: tl.constexpr, G: tl.constexpr):
    """Bit `bit` of q (fp32 codes [R, G]) -> uint8 [R, G // 8]: token t in byte t // 8, bit t % 8."""
    bits = (q.to(tl.int32) >> bit) & 1
    bits = tl.reshape(bits, [R, G // 8, 8])
    weights = 1 << tl.arange(0, 8)
    return tl.sum(bits * weights[None, None, :], axis=2).to(tl.uint8)


# The salient count, its share per program, the salient list's row stride and the group count are
# run-time values (never specialised), so configs that differ only in their salient ratio share one
# compile, and so do a prefill's many groups and decode's one.
@triton.jit(do_not_specialize=["stride_sn", "NSC", "JB", "n_groups"])
def _quantize_pack_keys_kernel(
    k_ptr, sal_ptr, is_sal_ptr, low_ptr, high_ptr, scale_ptr, zero_ptr,
    n_groups,
    stride_kn, stride_kt, stride_kc, stride_sn, NSC, JB,
    D: tl.constexpr, G: tl.constexpr, B_LOW: tl.constexpr, B_HIGH: tl.constexpr,
    SAL: tl.constexpr, BLOCK_C: tl.constexpr, JB_P: tl.constexpr,
):
    """Program (row * n_groups + group, channel block): one group of G tokens of one row
    (sequence x KV head), channels [cb * BLOCK_C, (cb + 1) * BLOCK_C), and the high planes of
    salient channels number [cb * JB, (cb + 1) * JB) of the row's list.

    k       float [N, T, D]            (any strides; T = n_groups * G)
    sal     int32 [N, NSC]             salient channels, ascending (row stride stride_sn, inner 1)
    is_sal  uint8 [N, D]               1 on salient channels (contiguous)
    low     uint8 [N, n_groups, B_LOW, D, G // 8]               contiguous; packed along tokens
    high    uint8 [N, n_groups, B_HIGH - B_LOW, NSC, G // 8]    contiguous; packed along tokens
    scale, zero fp16 [N, n_groups, D]                           contiguous
    Not memory-bound: about 280 GB/s of bf16 in + packed out on an H200 (docs/kernels.md); each bit
    plane is a reduction over the 8 tokens of a byte.
    """
    pid = tl.program_id(0)
    cb = tl.program_id(1)
    n = pid // n_groups
    g = pid % n_groups
    G8: tl.constexpr = G // 8
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t = g * G + tl.arange(0, G)
    k_row = k_ptr + n.to(tl.int64) * stride_kn
    x = tl.load(k_row + t[None, :] * stride_kt + c[:, None] * stride_kc).to(tl.float32)  # [BLOCK_C, G]
    lev_low: tl.constexpr = (1 << B_LOW) - 1
    lev_high: tl.constexpr = (1 << B_HIGH) - 1
    if SAL:
        is_sal = tl.load(is_sal_ptr + n * D + c) != 0
        levels = tl.where(is_sal, lev_high, lev_low).to(tl.float32)
    else:
        levels = tl.full([BLOCK_C], lev_low, tl.float32)
    q, scale16, zero16 = _quantize(x, levels)
    ng = n * n_groups + g  # flat (row, group) index of the contiguous outputs
    tl.store(scale_ptr + ng * D + c, scale16)
    tl.store(zero_ptr + ng * D + c, zero16)
    byte = tl.arange(0, G8)
    low_base = low_ptr + ng.to(tl.int64) * (B_LOW * D * G8)
    for p in tl.static_range(B_LOW):
        tl.store(low_base + p * (D * G8) + c[:, None] * G8 + byte[None, :], _pack_tokens(q, p, BLOCK_C, G))
    if B_HIGH > B_LOW and SAL:
        # Salient channels again, gathered: the same fp32 arithmetic on the same inputs gives the
        # same codes, and the gathered rows come out in the stored (ascending) order.
        jl = tl.arange(0, JB_P)
        j = cb * JB + jl
        jm = (jl < JB) & (j < NSC)
        sal = tl.load(sal_ptr + n * stride_sn + j, mask=jm, other=0)
        xs = tl.load(k_row + t[None, :] * stride_kt + sal[:, None] * stride_kc, mask=jm[:, None], other=0.0)
        qs, _, _ = _quantize(xs.to(tl.float32), tl.full([JB_P], lev_high, tl.float32))
        high_base = high_ptr + ng.to(tl.int64) * ((B_HIGH - B_LOW) * NSC * G8)
        for p in tl.static_range(B_HIGH - B_LOW):
            tl.store(high_base + p * (NSC * G8) + j[:, None] * G8 + byte[None, :],
                     _pack_tokens(qs, B_LOW + p, JB_P, G), mask=jm[:, None])


def _check_out(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"out.{name}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")


def quantize_pack_keys(
    k: torch.Tensor,
    salient_channels: torch.Tensor,
    b_low: int,
    b_high: int,
    group_size: int,
    out: PackedKeys | None = None,
) -> PackedKeys:
    """Keys k float [..., n_groups * G, d] -> `PackedKeys`: bit planes packed along tokens.

    salient_channels: int [..., n_sc], ascending per row, same leading dims as k (n_sc may be 0).
    Returns low uint8 [..., n_groups, b_low, d, G // 8], high uint8 [..., n_groups, b_high - b_low,
    n_sc, G // 8], scale/zero fp16 [..., n_groups, d], all contiguous. d must be a power of two.
    `out`, if given, receives the result (contiguous tensors of exactly those shapes).
    """
    *lead, t, d = k.shape
    n_sc = salient_channels.shape[-1]
    if d & (d - 1) or group_size not in (32, 64, 128) or t % group_size:
        raise ValueError(f"unsupported key shape d={d}, T={t}, G={group_size}")
    if not 1 <= b_low <= b_high <= 4:
        raise ValueError(f"unsupported key bits b_low={b_low}, b_high={b_high}")
    n_groups = t // group_size
    k3 = k.reshape(-1, t, d)
    rows = k3.shape[0]
    sal = salient_channels.reshape(rows, n_sc).to(torch.int32).contiguous()
    is_sal = torch.zeros((rows, d), dtype=torch.uint8, device=k.device)
    if n_sc:
        is_sal.scatter_(-1, sal.long(), 1)
    dev, g8 = k.device, group_size // 8
    if out is None:
        out = PackedKeys(
            torch.empty((*lead, n_groups, b_low, d, g8), dtype=torch.uint8, device=dev),
            torch.empty((*lead, n_groups, b_high - b_low, n_sc, g8), dtype=torch.uint8, device=dev),
            torch.empty((*lead, n_groups, d), dtype=torch.float16, device=dev),
            torch.empty((*lead, n_groups, d), dtype=torch.float16, device=dev),
        )
    _check_out("low", out.low, (*lead, n_groups, b_low, d, g8), torch.uint8)
    _check_out("high", out.high, (*lead, n_groups, b_high - b_low, n_sc, g8), torch.uint8)
    _check_out("scale", out.scale, (*lead, n_groups, d), torch.float16)
    _check_out("zero", out.zero, (*lead, n_groups, d), torch.float16)
    if rows * n_groups:
        block_c = min(d, 32)  # channels per program: a [32, G] fp32 tile keeps registers low
        n_blocks = d // block_c
        jb = triton.cdiv(n_sc, n_blocks) if n_sc else 1
        _quantize_pack_keys_kernel[(rows * n_groups, n_blocks)](
            k3, sal, is_sal, out.low, out.high, out.scale, out.zero,
            n_groups,
            k3.stride(0), k3.stride(1), k3.stride(2), max(sal.stride(0), 1), n_sc, jb,
            D=d, G=group_size, B_LOW=b_low, B_HIGH=b_high, SAL=n_sc > 0, BLOCK_C=block_c,
            JB_P=block_c, num_warps=4,  # jb <= block_c: one tile size for every salient count
        )
    return out


@triton.jit(do_not_specialize=["n_rows"])  # a prefill's many rows and decode's few share one compile
def _quantize_pack_values_kernel(
    v_ptr, packed_ptr, scale_ptr, zero_ptr,
    n_rows, stride_vr,
    D: tl.constexpr, BITS: tl.constexpr, GV: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program quantizes BLOCK_R tokens (rows), each per group of GV consecutive channels.

    v       float [n_rows, D]                     (row stride stride_vr, channels contiguous)
    packed  uint8 [n_rows, D * BITS // 8]         contiguous; packed along channels, LSB first
    scale, zero fp16 [n_rows, D // GV]            contiguous
    About 1050 GB/s of bf16 in + packed out on an H200 (docs/kernels.md).
    """
    NVG: tl.constexpr = D // GV
    PB: tl.constexpr = 8 // BITS  # channels per byte
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    c = tl.arange(0, D)
    x = tl.load(v_ptr + r.to(tl.int64)[:, None] * stride_vr + c[None, :], mask=ok[:, None], other=0.0)
    x = tl.reshape(x.to(tl.float32), [BLOCK_R * NVG, GV])
    q, scale16, zero16 = _quantize(x, tl.full([BLOCK_R * NVG], (1 << BITS) - 1, tl.float32))
    vg = tl.arange(0, NVG)
    sz_off = r.to(tl.int64)[:, None] * NVG + vg[None, :]
    tl.store(scale_ptr + sz_off, tl.reshape(scale16, [BLOCK_R, NVG]), mask=ok[:, None])
    tl.store(zero_ptr + sz_off, tl.reshape(zero16, [BLOCK_R, NVG]), mask=ok[:, None])
    q = tl.reshape(q.to(tl.int32), [BLOCK_R, D // PB, PB])
    shifts = tl.arange(0, PB) * BITS
    packed = tl.sum(q << shifts[None, None, :], axis=2).to(tl.uint8)
    nb = tl.arange(0, D // PB)
    tl.store(packed_ptr + r.to(tl.int64)[:, None] * (D // PB) + nb[None, :], packed, mask=ok[:, None])


def quantize_pack_values(
    v: torch.Tensor, bits: int, group_size: int, out: PackedValues | None = None
) -> PackedValues:
    """Values v float [..., T, d] -> `PackedValues`: packed uint8 [..., T, d * bits // 8] (codes along
    channels), scale/zero fp16 [..., T, d // G_V].

    Per token, groups of `group_size` consecutive channels; bits in {1, 2, 4, 8}; d and group_size
    powers of two (group_size divides d). `out`, if given, receives the result (contiguous).
    """
    *lead, t, d = v.shape
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"unsupported value bits {bits}")
    if d & (d - 1) or group_size & (group_size - 1) or d % group_size or d * bits < 8:
        raise ValueError(f"unsupported value shape d={d}, group_size={group_size}")
    v2 = v.reshape(-1, d)
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    rows = v2.shape[0]
    dev = v.device
    if out is None:
        out = PackedValues(
            torch.empty((*lead, t, d * bits // 8), dtype=torch.uint8, device=dev),
            torch.empty((*lead, t, d // group_size), dtype=torch.float16, device=dev),
            torch.empty((*lead, t, d // group_size), dtype=torch.float16, device=dev),
        )
    _check_out("packed", out.packed, (*lead, t, d * bits // 8), torch.uint8)
    _check_out("scale", out.scale, (*lead, t, d // group_size), torch.float16)
    _check_out("zero", out.zero, (*lead, t, d // group_size), torch.float16)
    block_r = max(1, min(64, 4096 // d))
    if rows:
        _quantize_pack_values_kernel[(triton.cdiv(rows, block_r),)](
            v2, out.packed, out.scale, out.zero, rows, v2.stride(0),
            D=d, BITS=bits, GV=group_size, BLOCK_R=block_r, num_warps=4,
        )
    return out
