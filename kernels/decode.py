"""Fused dequantize + attention for decode in Triton: the fallback for shapes the Gluon kernels
(`kernels.gluon`) do not take, and what CI runs under the interpreter.

Reads [fp sinks | packed groups | fp residual] of one layer once and dequantizes in registers;
no dequantized key or value reaches global memory. Per group of G tokens, channel c, code
q[c, t], scale s[c], zero z[c], query row u (pre-scaled by softmax scale x log2 e):
    score[u, t] = sum_c u[c] * (q[c, t] * s[c] + z[c]) = (u * s) @ q  +  u @ z
so the scale folds into the query (one [GQ, d] product per group) and the zero into a bias. The
codes are assembled from the bit planes into integers, made fp16 exactly (0x6400 | q is 1024 + q)
and fed to the tensor cores; channels in `channel_order`, so that the salient channels' high
planes line up. Values are dequantized in registers as q * s + z.

On CUDA the codes are expanded by inline PTX (two fp16 codes per 32-bit operation); the
interpreter, which has no inline assembly, runs the same expansion in Triton operations. Both give
the same fp16 values, so the kernel's output does not depend on which one ran.

The key dots reduce over at least MIN_KEY_CHANNELS channels (`key_tiles`), padding included: see
there for the Triton fault that a 16-channel reduction runs into on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pnmix.kernels.combine import combine_partials, softmax_step
from pnmix.kernels.layout import DecodeCache, next_pow2
from pnmix.kernels.operands import check_operands, decode_operands, offline_signature
from pnmix.kernels.plan import LOG2E, output_for, planned_groups, split_plan, splits_for_programs

BLOCK_T = 64  # packed tokens per inner step (or G, if smaller)
BLOCK_R = 32  # sink and residual tokens per step
NUM_WARPS = 2
PROGRAMS_PER_SM = 4  # the default split count's target

# The key dots reduce over channels: the salient ones (a tile of NSC_P) and the others (NNS_P).
# Their codes are expanded from bytes, so Triton's MMA v2 lowering treats them as upcast 8-bit
# operands and gives every thread kWidth = 8 consecutive channels of the reduction axis, 4 threads
# across it: 32 channels. Triton 3.6 (the GPU image's) does so for a reduction over 16 channels too
# (fixed upstream in triton-lang/triton#11691, which bounds kWidth by K): the operand is then
# replicated across lanes, and the one m16n8k16 MMA adds channels 0-3 and 8-11 twice and 4-7, 12-15
# not at all (relative error 0.6-0.9 on the GPU with 16 salient channels at d 64, while the
# interpreter's exact dot is right). So no key tile is narrower than 32 channels; the padding
# channels are masked (query, scale and codes 0). The value dot reduces over BLOCK_T >= 32 tokens
# (G is 32, 64 or 128), the sink and residual dots run in fp32 without MMA.
MIN_KEY_CHANNELS = 32


def key_tiles(head_dim: int, n_salient: int) -> tuple[int, int]:
    """(NSC_P, NNS_P): the salient and the non-salient channel tiles of the key dots, powers of two
    of at least MIN_KEY_CHANNELS (a tile whose channels are all absent is not used)."""
    return (next_pow2(max(n_salient, MIN_KEY_CHANNELS)),
            next_pow2(max(head_dim - n_salient, MIN_KEY_CHANNELS)))


def kernel_constants(head_dim: int, hkv: int, gqa: int, group_size: int, b_low: int, b_high: int, n_salient: int,
                     value_bits: int, value_group: int, ptx: bool) -> dict[str, int | bool]:
    """The compile-time constants of `_decode_kernel` for a layer of this shape (one compile each)."""
    nsc_p, nns_p = key_tiles(head_dim, n_salient)
    return dict(HKV=hkv, GQ=gqa, M_P=max(16, next_pow2(gqa)), D=head_dim, G=group_size, B_LOW=b_low,
                NH=b_high - b_low, SAL=n_salient > 0, NS=n_salient < head_dim, NSC_P=nsc_p, NNS_P=nns_p,
                BV=value_bits, GV=value_group, BLOCK_T=min(group_size, BLOCK_T), BLOCK_R=BLOCK_R, PTX=ptx)


def expand_with_ptx(q: torch.Tensor) -> bool:
    """Whether the kernel expands codes with inline PTX: on CUDA. The CPU tests replace this to run the
    PTX path under the interpreter with an emulation of the assembly."""
    return q.is_cuda


def _expand_asm(n_planes: int, width: int) -> str:
    """PTX that turns 4 packed bytes (one register per bit plane) into fp16 codes, two per register.

    Each byte holds 8 // width codes of `width` bits (LSB first); with several planes (width 1),
    plane p supplies bit p of every code. Output k (k = 0 .. 8 // width - 1) holds code k of each
    of the 4 bytes as fp16: two registers, bytes (0, 1) and (2, 3), element 0 in the low half.
    Codes are built as 1024 + code with the 0x6400 exponent trick and 1024 is then subtracted
    (exact in fp16), so no int->float conversion is issued. Operands: outputs $0 .. $(2n - 1),
    inputs (one register of 4 bytes per plane) after them.
    """
    n_out = 8 // width
    mask = ((1 << width) - 1) * 0x10001
    lines = ["{", f".reg .b32 lo<{n_planes}>, hi<{n_planes}>, t, u, k;", "mov.b32 k, 0x64006400;"]
    for p in range(n_planes):
        # zero-extend bytes into 16-bit lanes: lo = (byte0, byte1), hi = (byte2, byte3)
        lines.append(f"prmt.b32 lo{p}, ${2 * n_out + p}, 0, 0x4140;")
        lines.append(f"prmt.b32 hi{p}, ${2 * n_out + p}, 0, 0x4342;")
    for k in range(n_out):
        for half, src in enumerate(("lo", "hi")):
            lines.append(f"shr.b32 t, {src}0, {k * width};")
            lines.append(f"and.b32 t, t, {mask:#x};")
            for p in range(1, n_planes):
                shift = k - p
                op = f"shr.b32 u, {src}{p}, {shift};" if shift >= 0 else f"shl.b32 u, {src}{p}, {-shift};"
                lines += [op, f"and.b32 u, u, {0x10001 << p:#x};", "or.b32 t, t, u;"]
            lines.append("or.b32 t, t, k;")
            lines.append(f"sub.rn.f16x2 ${2 * k + half}, t, k;")
    lines.append("}")
    return "\n".join(lines)


def _expand_constraints(n_planes: int, width: int) -> str:
    return ",".join(["=r"] * (2 * (8 // width)) + ["r"] * n_planes)


# Inline PTX, selected by constexpr branches below (Triton reads only constexpr globals).
_ASM_P1 = tl.constexpr(_expand_asm(1, 1))
_ASM_P2 = tl.constexpr(_expand_asm(2, 1))
_ASM_P3 = tl.constexpr(_expand_asm(3, 1))
_ASM_P4 = tl.constexpr(_expand_asm(4, 1))
_ASM_W2 = tl.constexpr(_expand_asm(1, 2))
_ASM_W4 = tl.constexpr(_expand_asm(1, 4))
_ASM_W8 = tl.constexpr(_expand_asm(1, 8))
_CON_P1 = tl.constexpr(_expand_constraints(1, 1))
_CON_P2 = tl.constexpr(_expand_constraints(2, 1))
_CON_P3 = tl.constexpr(_expand_constraints(3, 1))
_CON_P4 = tl.constexpr(_expand_constraints(4, 1))
_CON_W2 = tl.constexpr(_expand_constraints(1, 2))
_CON_W4 = tl.constexpr(_expand_constraints(1, 4))
_CON_W8 = tl.constexpr(_expand_constraints(1, 8))


@triton.jit
def _codes_to_f16(q):
    """Integer codes 0..1023 (int32) -> the same values in fp16, exactly, without an int->float cvt."""
    return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _plane_bits(raw, R: tl.constexpr, T: tl.constexpr):
    """raw uint8 [R, T // 8] (8 tokens a byte, LSB first) -> int32 bits [R, T].

    Expanded with joins, which keep a byte's 8 tokens in the thread that loaded the byte
    (a broadcast shift against arange(8) would spread them over threads).
    """
    x = raw.to(tl.int32)
    x = tl.join(x, x >> 4)  # [R, T/8, 2]: bit offset 4a
    x = tl.join(x, x >> 2)  # [R, T/8, 2, 2]: + 2b
    x = tl.join(x, x >> 1)  # [R, T/8, 2, 2, 2]: + c; flat index 4a + 2b + c = bit
    return tl.reshape(x & 1, [R, T])


@triton.jit
def _load_planes(lo, lo_step, hi, hi_step, mask, B_LOW: tl.constexpr, NP: tl.constexpr):
    """The first NP bit planes of [rows, bytes] tiles: B_LOW at `lo` (lo_step apart), then the rest at
    `hi` (hi_step apart); unused planes repeat plane 0."""
    r0 = tl.load(lo, mask=mask, other=0)
    r1 = r0
    r2 = r0
    r3 = r0
    if B_LOW > 1:
        r1 = tl.load(lo + lo_step, mask=mask, other=0)
    elif NP > 1:
        r1 = tl.load(hi, mask=mask, other=0)
    if B_LOW > 2:
        r2 = tl.load(lo + 2 * lo_step, mask=mask, other=0)
    elif NP > 2:
        r2 = tl.load(hi + (2 - B_LOW) * hi_step, mask=mask, other=0)
    if B_LOW > 3:
        r3 = tl.load(lo + 3 * lo_step, mask=mask, other=0)
    elif NP > 3:
        r3 = tl.load(hi + (3 - B_LOW) * hi_step, mask=mask, other=0)
    return r0, r1, r2, r3


@triton.jit
def _join8(o0, o1, o2, o3, o4, o5, o6, o7, R: tl.constexpr, T: tl.constexpr):
    """Eight [R, T // 8] tensors (code j of each byte) -> [R, T], code j of byte i at 8 i + j."""
    x = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
    return tl.reshape(x, [R, T])


@triton.jit
def _planes_to_f16(r0, r1, r2, r3, NP: tl.constexpr, R: tl.constexpr, T: tl.constexpr, PTX: tl.constexpr):
    """NP bit planes (uint8 [R, T // 8] each, 8 tokens a byte) -> fp16 codes [R, T] (plane p = bit p)."""
    if PTX:
        if NP == 1:
            o = tl.inline_asm_elementwise(_ASM_P1, _CON_P1, [r0], (tl.float16,) * 8,
                                          True, 4)
        elif NP == 2:
            o = tl.inline_asm_elementwise(_ASM_P2, _CON_P2, [r0, r1], (tl.float16,) * 8,
                                          True, 4)
        elif NP == 3:
            o = tl.inline_asm_elementwise(_ASM_P3, _CON_P3, [r0, r1, r2],
                                          (tl.float16,) * 8, True, 4)
        else:
            o = tl.inline_asm_elementwise(_ASM_P4, _CON_P4, [r0, r1, r2, r3],
                                          (tl.float16,) * 8, True, 4)
        return _join8(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], R, T)
    else:
        code = _plane_bits(r0, R, T)
        if NP > 1:
            code |= _plane_bits(r1, R, T) << 1
        if NP > 2:
            code |= _plane_bits(r2, R, T) << 2
        if NP > 3:
            code |= _plane_bits(r3, R, T) << 3
        return _codes_to_f16(code)


@triton.jit
def _channel_codes(raw, BV: tl.constexpr):
    """raw int32 [R, n] bytes of 8 // BV codes each (LSB first) -> codes [R, n, ...] in channel order.

    Joins keep a byte's codes in the thread that loaded it; the caller reshapes to [R, n * 8 // BV].
    """
    x = raw
    if BV == 1:
        x = tl.join(x, x >> 4)
        x = tl.join(x, x >> 2)
        x = tl.join(x, x >> 1)
    elif BV == 2:
        x = tl.join(x, x >> 4)
        x = tl.join(x, x >> 2)
    elif BV == 4:
        x = tl.join(x, x >> 4)
    return x & ((1 << BV) - 1)


@triton.jit
def _bytes_to_f16(raw, BV: tl.constexpr, R: tl.constexpr, C: tl.constexpr, PTX: tl.constexpr):
    """uint8 [R, C * BV // 8], 8 // BV codes a byte (LSB first) -> fp16 codes [R, C]."""
    if PTX:
        if BV == 1:
            o = tl.inline_asm_elementwise(_ASM_P1, _CON_P1, [raw], (tl.float16,) * 8,
                                          True, 4)
            return _join8(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], R, C)
        elif BV == 2:
            o = tl.inline_asm_elementwise(_ASM_W2, _CON_W2, [raw], (tl.float16,) * 4, True, 4)
            return tl.reshape(tl.join(tl.join(o[0], o[2]), tl.join(o[1], o[3])), [R, C])
        elif BV == 4:
            o = tl.inline_asm_elementwise(_ASM_W4, _CON_W4, [raw], (tl.float16,) * 2, True, 4)
            return tl.reshape(tl.join(o[0], o[1]), [R, C])
        else:
            return tl.inline_asm_elementwise(_ASM_W8, _CON_W8, [raw], tl.float16, True, 4)
    else:
        return tl.reshape(_codes_to_f16(_channel_codes(raw.to(tl.int32), BV)), [R, C])


@triton.jit
def _raw_block(q32, k_base, v_base, stride_t, n_valid, t0, m_i, l_i, acc,
               D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Sinks or residual: tokens t0 .. t0 + BLOCK_R of an fp block [T, D] (n_valid held)."""
    t = t0 + tl.arange(0, BLOCK_R)
    ok = t < n_valid
    c = tl.arange(0, D)
    off = t[:, None] * stride_t + c[None, :]
    k = tl.load(k_base + off, mask=ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_R, D]
    v = tl.load(v_base + off, mask=ok[:, None], other=0.0).to(tl.float32)
    scores = tl.dot(q32, tl.trans(k), input_precision="ieee")
    scores = tl.where(ok[None, :], scores, float("-inf"))
    p, m_i, l_i, alpha = softmax_step(scores, m_i, l_i)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    return m_i, l_i, acc


# One compile serves every salient count of a size class and every split plan (batch, context).
@triton.jit(do_not_specialize=["NSC", "groups_per_split", "n_split"])
def _decode_kernel(
    ops, pm_ptr, pl_ptr, pa_ptr,
    qk_scale, groups_per_split, n_split, NSC,
    HKV: tl.constexpr, GQ: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    B_LOW: tl.constexpr, NH: tl.constexpr, SAL: tl.constexpr, NS: tl.constexpr, NSC_P: tl.constexpr,
    NNS_P: tl.constexpr,
    BV: tl.constexpr, GV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PTX: tl.constexpr,
):
    """Program (b * HKV + h, split): partial attention of the GQ query heads of KV head h.

    ops       `kernels.operands.DecodeOperands`: the query and the cache (shapes, dtypes, packing axes there)
    pm, pl    fp32 [B * HKV, n_split + 1, M_P]      partials (`kernels.combine`), M_P >= GQ rows
    pa        fp32 [B * HKV, n_split + 1, M_P, D]
    PTX       expand codes with inline PTX (CUDA) or Triton operations (the interpreter): same values
    Splits 0 .. n_split - 1 take groups_per_split packed groups each; split n_split the sinks and
    the residual. Bound by layout conversions, not bytes: the packed axis is the MMA's
    non-reduction axis on both sides, so the expanded codes reach the tensor cores through shared
    memory (about half of bf16 SDPA's speed on an H200; docs/kernels.md).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    G8: tl.constexpr = G // 8
    NNS = D - NSC
    NVG: tl.constexpr = D // GV
    rows = tl.arange(0, M_P)
    row_ok = rows < GQ
    c = tl.arange(0, D)
    q_base = ops.q_ptr + b.to(tl.int64) * ops.stride_qb + (h * GQ + rows) * ops.stride_qh
    # Padded query rows are zero, so their scores stay finite (never -inf - -inf).
    q32 = tl.load(q_base[:, None] + c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    part = bh.to(tl.int64) * (n_split + 1) + split
    m_i = tl.full([M_P], float("-inf"), tl.float32)
    l_i = tl.zeros([M_P], tl.float32)
    if split < n_split:
        n_groups = tl.load(ops.n_groups_ptr + b)
        g_start = split * groups_per_split
        g_end = tl.minimum(g_start + groups_per_split, n_groups)
        order = ops.order_ptr + b.to(tl.int64) * ops.stride_ob + h * ops.stride_oh
        jn = tl.arange(0, NNS_P)
        js = tl.arange(0, NSC_P)
        ns_idx = tl.load(order + jn, mask=jn < NNS, other=0)
        sal_idx = tl.load(order + NNS + js, mask=js < NSC, other=0)
        q_ns = tl.load(q_base[:, None] + ns_idx[None, :], mask=row_ok[:, None] & (jn < NNS)[None, :],
                       other=0.0).to(tl.float32) * qk_scale
        q_sal = tl.load(q_base[:, None] + sal_idx[None, :], mask=row_ok[:, None] & (js < NSC)[None, :],
                        other=0.0).to(tl.float32) * qk_scale
        klo = ops.klo_ptr + b.to(tl.int64) * ops.stride_lob + h * ops.stride_loh
        khi = ops.khi_ptr + b.to(tl.int64) * ops.stride_hib + h * ops.stride_hih
        ks_off = b.to(tl.int64) * ops.stride_ksb + h * ops.stride_ksh
        vp = ops.vp_ptr + b.to(tl.int64) * ops.stride_vpb + h * ops.stride_vph
        vsc = ops.vsc_ptr + b.to(tl.int64) * ops.stride_vsb + h * ops.stride_vsh
        vze = ops.vze_ptr + b.to(tl.int64) * ops.stride_vsb + h * ops.stride_vsh
        PB: tl.constexpr = 8 // BV  # value codes per byte
        VROW: tl.constexpr = D // PB  # bytes per token
        vbyte = tl.arange(0, VROW)
        vg = tl.arange(0, NVG)
        acc = tl.zeros([M_P, D], tl.float32)
        for g in range(g_start, g_end):
            sc = ops.ksc_ptr + ks_off + g * D
            zero = tl.load(ops.kze_ptr + ks_off + g * D + c).to(tl.float32)
            bias = tl.sum(q32 * zero[None, :], axis=1)  # u @ z  [M_P]
            s_ns = tl.load(sc + ns_idx, mask=jn < NNS, other=0.0).to(tl.float32)
            s_sal = tl.load(sc + sal_idx, mask=js < NSC, other=0.0).to(tl.float32)
            u_ns = (q_ns * s_ns[None, :]).to(tl.float16)  # (u * s), non-salient channels [M_P, NNS_P]
            u_sal = (q_sal * s_sal[None, :]).to(tl.float16)
            lo_g = klo + g * (B_LOW * D * G8)
            hi_g = khi + g * (NH * NSC * G8)
            for sub in tl.static_range(G // BLOCK_T):
                byte = sub * (BLOCK_T // 8) + tl.arange(0, BLOCK_T // 8)
                scores = tl.zeros([M_P, BLOCK_T], tl.float32) + bias[:, None]
                if NS:  # non-salient channels: the B_LOW low planes
                    lo_ns = lo_g + ns_idx[:, None] * G8 + byte[None, :]
                    r0, r1, r2, r3 = _load_planes(lo_ns, D * G8, lo_ns, 0, (jn < NNS)[:, None], B_LOW, B_LOW)
                    scores = tl.dot(u_ns, _planes_to_f16(r0, r1, r2, r3, B_LOW, NNS_P, BLOCK_T, PTX), scores)
                if SAL:  # salient channels: low planes, then the NH high planes (B_LOW + NH <= 4)
                    lo_s = lo_g + sal_idx[:, None] * G8 + byte[None, :]
                    hi_s = hi_g + js[:, None] * G8 + byte[None, :]
                    r0, r1, r2, r3 = _load_planes(lo_s, D * G8, hi_s, NSC * G8, (js < NSC)[:, None], B_LOW, B_LOW + NH)
                    k_sal = _planes_to_f16(r0, r1, r2, r3, B_LOW + NH, NSC_P, BLOCK_T, PTX)
                    scores = tl.dot(u_sal, k_sal, scores)
                p_blk, m_i, l_i, alpha = softmax_step(scores, m_i, l_i)
                # Values of the same tokens, dequantized in registers (fp16: q * s + z).
                t0 = g * G + sub * BLOCK_T
                t = t0 + tl.arange(0, BLOCK_T)
                raw_v = tl.load(vp + t[:, None] * VROW + vbyte[None, :])  # uint8 [BLOCK_T, VROW]
                v_codes = tl.reshape(_bytes_to_f16(raw_v, BV, BLOCK_T, D, PTX), [BLOCK_T, NVG, GV])
                sz = t[:, None] * NVG + vg[None, :]
                v_s = tl.load(vsc + sz)
                v_z = tl.load(vze + sz)
                v = tl.reshape(v_codes * v_s[:, :, None] + v_z[:, :, None], [BLOCK_T, D])
                acc = tl.dot(p_blk.to(tl.float16), v, acc * alpha[:, None])
        tl.store(pa_ptr + (part * M_P + rows[:, None]) * D + c[None, :], acc)
    else:
        acc2 = tl.zeros([M_P, D], tl.float32)
        n_sink = tl.load(ops.sink_len_ptr + b)
        s_off = b.to(tl.int64) * ops.stride_sb + h * ops.stride_sh
        for t0 in range(0, n_sink, BLOCK_R):
            m_i, l_i, acc2 = _raw_block(q32, ops.ks_ptr + s_off, ops.vs_ptr + s_off, ops.stride_st, n_sink, t0,
                                        m_i, l_i, acc2, D, BLOCK_R)
        n_res = tl.load(ops.res_len_ptr + b)
        r_off = b.to(tl.int64) * ops.stride_rb + h * ops.stride_rh
        for t0 in range(0, n_res, BLOCK_R):
            m_i, l_i, acc2 = _raw_block(q32, ops.kr_ptr + r_off, ops.vr_ptr + r_off, ops.stride_rt, n_res, t0,
                                        m_i, l_i, acc2, D, BLOCK_R)
        tl.store(pa_ptr + (part * M_P + rows[:, None]) * D + c[None, :], acc2)
    tl.store(pm_ptr + part * M_P + rows, m_i)
    tl.store(pl_ptr + part * M_P + rows, l_i)


def decode_attention(q: torch.Tensor, cache: DecodeCache, scale: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None, max_groups: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over a PN-Mix layer cache.

    q [B, H_q, d] float (H_q a multiple of H_kv; d a power of two >= 16) -> out [B, H_q, d] in q's
    dtype. `scale` is the softmax scale (usually d ** -0.5). num_splits: splits of the packed region
    per (b, h_kv); by default enough for about four programs per SM. `out`, if given, receives the
    result (q's shape, channels contiguous). `max_groups`, if given, bounds the packed groups any
    sequence holds: the splits cover that many groups instead of the capacity (groups past it are
    not read), so a short cache in large buffers is not split as a full one.
    """
    check_operands(q, cache)
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    g = cache.group_size
    n_sc = cache.n_salient_channels
    const = kernel_constants(d, hkv, hq // hkv, g, cache.b_low, cache.b_high, n_sc, cache.value_bits,
                             cache.value_group_size, expand_with_ptx(q))
    m_p = const["M_P"]
    ng_cap = planned_groups(cache.k_low.shape[2], max_groups)
    if num_splits is None:
        num_splits = splits_for_programs(q, bsz * hkv, ng_cap, PROGRAMS_PER_SM)
    groups_per_split, num_splits = split_plan(ng_cap, num_splits)
    n_parts = num_splits + 1
    dev = q.device
    pm = torch.empty((bsz * hkv, n_parts, m_p), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pa = torch.empty((bsz * hkv, n_parts, m_p, d), dtype=torch.float32, device=dev)
    out = output_for(q, out)
    _decode_kernel[(bsz * hkv, n_parts)](
        decode_operands(q, cache), pm, pl, pa,
        scale * LOG2E, groups_per_split, num_splits, n_sc, **const, num_warps=NUM_WARPS, num_stages=1,
    )
    return combine_partials(pm, pl, pa, out, hkv)


def compile_offline(d: int, group_size: int, b_low: int, b_high: int, n_salient: int, value_bits: int,
                    value_group: int, gqa: int, activation: str = "*bf16", arch: int = 90) -> Any:
    """Compiles the kernel (PTX expansion) for an NVIDIA GPU of compute capability `arch`, without one.

    For inspection and tests: the result's `asm` holds TTGIR, PTX and the cubin. Pointers and strides
    are specialized as divisible by 16, as the JIT does for real caches. Must run without
    TRITON_INTERPRET (it replaces the language's own functions).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = kernel_constants(d, 8, gqa, group_size, b_low, b_high, n_salient, value_bits, value_group, True)
    operand_types = {"klo_ptr": "*u8", "khi_ptr": "*u8", "vp_ptr": "*u8", "ksc_ptr": "*fp16", "kze_ptr": "*fp16",
                     "vsc_ptr": "*fp16", "vze_ptr": "*fp16", "order_ptr": "*i32", "sink_len_ptr": "*i32",
                     "n_groups_ptr": "*i32", "res_len_ptr": "*i32"}
    scalars = {"pm_ptr": "*fp32", "pl_ptr": "*fp32", "pa_ptr": "*fp32", "qk_scale": "fp32"}
    fn = _decode_kernel
    sig, attrs = offline_signature(fn, const, operand_types, activation, scalars)
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS, "num_stages": 1})
