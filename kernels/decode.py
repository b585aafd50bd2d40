"""Fused dequantize + attention for decode: one new query token per sequence.

Reads [fp sinks | packed groups | fp residual] of one layer (`DecodeCache`) once, dequantizes in
registers, never writes a dequantized key or value to global memory. Flash-decoding: program
(b, h_kv, split) handles every query head of KV head h_kv (GQA: one read of K/V per KV group)
over a slice of the packed groups; one extra split per (b, h_kv) handles the sinks and the
residual; `_combine_kernel` merges the splits. Per-sequence lengths are device tensors and the
grid depends only on capacities, so a step needs no host synchronisation.

How the packed keys are used without unpacking them to floats in memory (per group of G tokens,
per channel c, code q[c, t], scale s[c], zero z[c]; query row u, pre-scaled by softmax_scale*log2 e):
    score[u, t] = sum_c u[c] * (q[c, t] * s[c] + z[c]) = (u * s) @ q  +  u @ z
so the scale folds into the query (one [GQ, d] product per group) and the zero into a bias. The
codes are assembled from the bit planes into integers (exact in fp16, via the 0x6400 magic
number, 1024 + q), channels in `channel_order` (non-salient, then salient with their high planes
aligned), and fed to the tensor cores. Values are dequantized in registers as q * s + z.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.layout import DecodeCache, next_pow2

LOG2E = 1.4426950408889634


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
def _softmax_step(scores, m_i, l_i):
    """Online softmax (base 2) over a block of scores [M, T]; returns (p, m_new, l_new, alpha)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_new, alpha


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
    p, m_i, l_i, alpha = _softmax_step(scores, m_i, l_i)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    return m_i, l_i, acc


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
def _join8(o0, o1, o2, o3, o4, o5, o6, o7, R: tl.constexpr, T: tl.constexpr):
    """Eight [R, T // 8] tensors (code j of each byte) -> [R, T], code j of byte i at 8 i + j."""
    x = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
    return tl.reshape(x, [R, T])


@triton.jit
def _planes_to_f16(r0, r1, r2, r3, NP: tl.constexpr, R: tl.constexpr, T: tl.constexpr, FAST: tl.constexpr):
    """NP bit planes (uint8 [R, T // 8] each, 8 tokens a byte) -> fp16 codes [R, T] (plane p = bit p)."""
    if FAST:
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
def _bytes_to_f16(raw, BV: tl.constexpr, R: tl.constexpr, C: tl.constexpr, FAST: tl.constexpr):
    """uint8 [R, C * BV // 8], 8 // BV codes a byte (LSB first) -> fp16 codes [R, C]."""
    if FAST:
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
def _decode_split_kernel(
    q_ptr, stride_qb, stride_qh,
    ks_ptr, vs_ptr, stride_sb, stride_sh, stride_st,
    kr_ptr, vr_ptr, stride_rb, stride_rh, stride_rt,
    klo_ptr, stride_lob, stride_loh,
    khi_ptr, stride_hib, stride_hih,
    ksc_ptr, kze_ptr, stride_ksb, stride_ksh,
    vp_ptr, stride_vpb, stride_vph,
    vsc_ptr, vze_ptr, stride_vsb, stride_vsh,
    order_ptr, stride_ob, stride_oh,
    sink_len_ptr, n_groups_ptr, res_len_ptr,
    pm_ptr, pl_ptr, pa_ptr,
    qk_scale, groups_per_split, n_split,
    HKV: tl.constexpr, GQ: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    B_LOW: tl.constexpr, NH: tl.constexpr, NSC: tl.constexpr, NSC_P: tl.constexpr, NNS_P: tl.constexpr,
    BV: tl.constexpr, GV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, FAST: tl.constexpr,
):
    """Program (b * HKV + h, split): partial attention of the GQ query heads of KV head h.

    q        float [B, HKV * GQ, D]                   (head stride stride_qh, channels contiguous)
    sinks    float [B, HKV, S_cap, D] for k and v      (strides stride_s*, channels contiguous)
    residual float [B, HKV, R_cap, D] for k and v      (strides stride_r*, channels contiguous)
    klo      uint8 [B, HKV, NG_cap, B_LOW, D, G // 8]  bit planes along tokens (inner contiguous)
    khi      uint8 [B, HKV, NG_cap, NH, NSC, G // 8]   salient channels' upper planes
    ksc, kze fp16  [B, HKV, NG_cap, D]
    vp       uint8 [B, HKV, NG_cap * G, D * BV // 8]   values packed along channels
    vsc, vze fp16  [B, HKV, NG_cap * G, D // GV]
    order    int32 [B, HKV, D]                         non-salient channels, then salient (ascending)
    sink_len, n_groups, res_len int32 [B]
    partials (P = n_split + 1 per (b, h)): pm, pl fp32 [B * HKV, P, M_P]; pa fp32 [B * HKV, P, M_P, D]
    Splits 0 .. n_split - 1 take groups_per_split packed groups each; split n_split takes the
    sinks and the residual.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    G8: tl.constexpr = G // 8
    NNS: tl.constexpr = D - NSC
    NVG: tl.constexpr = D // GV
    rows = tl.arange(0, M_P)
    row_ok = rows < GQ
    c = tl.arange(0, D)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + (h * GQ + rows) * stride_qh
    # Padded query rows are zero, so their scores stay finite (never -inf - -inf).
    q32 = tl.load(q_base[:, None] + c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    part = bh.to(tl.int64) * (n_split + 1) + split
    m_i = tl.full([M_P], float("-inf"), tl.float32)
    l_i = tl.zeros([M_P], tl.float32)
    if split < n_split:
        n_groups = tl.load(n_groups_ptr + b)
        g_start = split * groups_per_split
        g_end = tl.minimum(g_start + groups_per_split, n_groups)
        order = order_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
        jn = tl.arange(0, NNS_P)
        js = tl.arange(0, NSC_P)
        ns_idx = tl.load(order + jn, mask=jn < NNS, other=0)
        sal_idx = tl.load(order + NNS + js, mask=js < NSC, other=0)
        q_ns = tl.load(q_base[:, None] + ns_idx[None, :], mask=row_ok[:, None] & (jn < NNS)[None, :],
                       other=0.0).to(tl.float32) * qk_scale
        q_sal = tl.load(q_base[:, None] + sal_idx[None, :], mask=row_ok[:, None] & (js < NSC)[None, :],
                        other=0.0).to(tl.float32) * qk_scale
        klo = klo_ptr + b.to(tl.int64) * stride_lob + h * stride_loh
        khi = khi_ptr + b.to(tl.int64) * stride_hib + h * stride_hih
        ks_off = b.to(tl.int64) * stride_ksb + h * stride_ksh
        vp = vp_ptr + b.to(tl.int64) * stride_vpb + h * stride_vph
        vsc = vsc_ptr + b.to(tl.int64) * stride_vsb + h * stride_vsh
        vze = vze_ptr + b.to(tl.int64) * stride_vsb + h * stride_vsh
        PB: tl.constexpr = 8 // BV  # value codes per byte
        VROW: tl.constexpr = D // PB  # bytes per token
        vbyte = tl.arange(0, VROW)
        vg = tl.arange(0, NVG)
        acc = tl.zeros([M_P, D], tl.float32)
        for g in range(g_start, g_end):
            sc = ksc_ptr + ks_off + g * D
            zero = tl.load(kze_ptr + ks_off + g * D + c).to(tl.float32)
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
                if NNS > 0:  # non-salient channels: the B_LOW low planes
                    lo_ns = lo_g + ns_idx[:, None] * G8 + byte[None, :]
                    m_ns = (jn < NNS)[:, None]
                    r0 = tl.load(lo_ns, mask=m_ns, other=0)
                    r1 = r0
                    r2 = r0
                    r3 = r0
                    if B_LOW > 1:
                        r1 = tl.load(lo_ns + D * G8, mask=m_ns, other=0)
                    if B_LOW > 2:
                        r2 = tl.load(lo_ns + 2 * D * G8, mask=m_ns, other=0)
                    if B_LOW > 3:
                        r3 = tl.load(lo_ns + 3 * D * G8, mask=m_ns, other=0)
                    scores = tl.dot(u_ns, _planes_to_f16(r0, r1, r2, r3, B_LOW, NNS_P, BLOCK_T, FAST), scores)
                if NSC > 0:  # salient channels: low planes, then the NH high planes (B_LOW + NH <= 4)
                    lo_s = lo_g + sal_idx[:, None] * G8 + byte[None, :]
                    hi_s = hi_g + js[:, None] * G8 + byte[None, :]
                    m_s = (js < NSC)[:, None]
                    r0 = tl.load(lo_s, mask=m_s, other=0)
                    r1 = r0
                    r2 = r0
                    r3 = r0
                    if B_LOW > 1:
                        r1 = tl.load(lo_s + D * G8, mask=m_s, other=0)
                    elif NH > 0:
                        r1 = tl.load(hi_s, mask=m_s, other=0)
                    if B_LOW > 2:
                        r2 = tl.load(lo_s + 2 * D * G8, mask=m_s, other=0)
                    elif B_LOW + NH > 2:
                        r2 = tl.load(hi_s + (2 - B_LOW) * (NSC * G8), mask=m_s, other=0)
                    if B_LOW > 3:
                        r3 = tl.load(lo_s + 3 * D * G8, mask=m_s, other=0)
                    elif B_LOW + NH > 3:
                        r3 = tl.load(hi_s + (3 - B_LOW) * (NSC * G8), mask=m_s, other=0)
                    k_sal = _planes_to_f16(r0, r1, r2, r3, B_LOW + NH, NSC_P, BLOCK_T, FAST)
                    scores = tl.dot(u_sal, k_sal, scores)
                p_blk, m_i, l_i, alpha = _softmax_step(scores, m_i, l_i)
                # Values of the same tokens, dequantized in registers (fp16: q * s + z).
                t0 = g * G + sub * BLOCK_T
                t = t0 + tl.arange(0, BLOCK_T)
                raw_v = tl.load(vp + t[:, None] * VROW + vbyte[None, :])  # uint8 [BLOCK_T, VROW]
                v_codes = tl.reshape(_bytes_to_f16(raw_v, BV, BLOCK_T, D, FAST), [BLOCK_T, NVG, GV])
                sz = t[:, None] * NVG + vg[None, :]
                v_s = tl.load(vsc + sz)
                v_z = tl.load(vze + sz)
                v = tl.reshape(v_codes * v_s[:, :, None] + v_z[:, :, None], [BLOCK_T, D])
                acc = tl.dot(p_blk.to(tl.float16), v, acc * alpha[:, None])
        tl.store(pa_ptr + (part * M_P + rows[:, None]) * D + c[None, :], acc)
    else:
        acc2 = tl.zeros([M_P, D], tl.float32)
        n_sink = tl.load(sink_len_ptr + b)
        s_off = b.to(tl.int64) * stride_sb + h * stride_sh
        for t0 in range(0, n_sink, BLOCK_R):
            m_i, l_i, acc2 = _raw_block(q32, ks_ptr + s_off, vs_ptr + s_off, stride_st, n_sink, t0,
                                        m_i, l_i, acc2, D, BLOCK_R)
        n_res = tl.load(res_len_ptr + b)
        r_off = b.to(tl.int64) * stride_rb + h * stride_rh
        for t0 in range(0, n_res, BLOCK_R):
            m_i, l_i, acc2 = _raw_block(q32, kr_ptr + r_off, vr_ptr + r_off, stride_rt, n_res, t0,
                                        m_i, l_i, acc2, D, BLOCK_R)
        tl.store(pa_ptr + (part * M_P + rows[:, None]) * D + c[None, :], acc2)
    tl.store(pm_ptr + part * M_P + rows, m_i)
    tl.store(pl_ptr + part * M_P + rows, l_i)


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


@triton.jit
def _combine_kernel(
    pm_ptr, pl_ptr, pa_ptr, out_ptr, stride_ob, stride_oh, n_parts,
    HKV: tl.constexpr, GQ: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
    S_MAX: tl.constexpr, S_BLK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Program (b * HKV + h, channel block): merges the n_parts partials (max-rescaled sums) into
    out[b, h*GQ : (h+1)*GQ, DC channels].

    partials as in `_decode_split_kernel`; out [B, HKV * GQ, D] (channels contiguous), any float dtype.
    Partials are read many splits at a time (S_MAX maxima, then S_BLK values): each pass is a few
    load round trips. A loop of one dependent load per split was latency-bound (235 us for 256
    splits at batch 1 on an H200, five times the split kernel; RESULTS.md, Kernels).
    ONE_PASS (all parts fit one pass of S_BLK): every load issued at once, one round trip.
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
    """Merges split partials pm, pl [B * H_kv, parts, M_P], pa [B * H_kv, parts, M_P, d] (every
    split kernel writes them so) into out [B, H_kv * GQ, d]."""
    n_bh, n_parts, m_p, d = pa.shape
    # Channel blocks of 16, narrower (down to 4) while the programs would not cover every SM twice:
    # at batch 1 (8 KV heads) 64 programs of 16 channels took 11 us, a quarter of the call (ncu).
    dc = min(d, 16)
    if pa.is_cuda:
        while dc > 4 and n_bh * (d // dc) < 2 * _sm_count(pa.device.index or 0):
            dc //= 2
    # Partials read in as few passes as fit 64 registers a thread: each pass is a dependent round trip
    # to memory, and at batch 1 (130 splits) four of them made the combine 8.5 us, a quarter of the
    # call (ncu, H200). Sized to the parts there are, so small splits read no masked-off rows.
    parts_p = next_pow2(n_parts)
    s_blk = max(1, min(8192 // (m_p * dc), parts_p))
    _combine_kernel[(n_bh, d // dc)](
        pm, pl, pa, out, out.stride(0), out.stride(1), n_parts,
        HKV=hkv, GQ=out.shape[1] // hkv, M_P=m_p, D=d, DC=dc, S_MAX=min(2048 // m_p, parts_p),
        S_BLK=s_blk, ONE_PASS=s_blk >= n_parts, num_warps=4,
    )
    return out


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_inner_contiguous(name: str, t: torch.Tensor, n_inner: int) -> None:
    if t.numel() == 0:
        return
    expected = 1
    for size, stride in zip(reversed(t.shape[-n_inner:]), reversed(t.stride()[-n_inner:]), strict=True):
        if size > 1 and stride != expected:
            raise ValueError(f"{name}: inner {n_inner} dims must be contiguous, got strides {t.stride()}")
        expected *= size


def check_operands(q: torch.Tensor, cache: DecodeCache) -> None:
    """The shapes, value formats and strides the decode kernels (this one and `decode_mma`) assume;
    a one-line ValueError otherwise."""
    bsz, hq, d = q.shape
    _, hkv, _, d_cache = cache.k_sink.shape
    if d_cache != d or hq % hkv or d & (d - 1) or d < 16:
        raise ValueError(f"unsupported decode shape q {tuple(q.shape)}, cache head_dim {d_cache}, H_kv {hkv}")
    if cache.value_group_size & (cache.value_group_size - 1) or d % cache.value_group_size:
        raise ValueError(f"value_group_size {cache.value_group_size} must be a power of two dividing {d}")
    if cache.value_bits not in (1, 2, 4, 8):
        raise ValueError(f"unsupported value bits {cache.value_bits}")
    for name, t, n in (("q", q, 1), ("k_sink", cache.k_sink, 1), ("v_sink", cache.v_sink, 1),
                       ("k_res", cache.k_res, 1), ("v_res", cache.v_res, 1), ("k_low", cache.k_low, 4),
                       ("k_high", cache.k_high, 4), ("k_scale", cache.k_scale, 2), ("k_zero", cache.k_zero, 2),
                       ("v_packed", cache.v_packed, 2), ("v_scale", cache.v_scale, 2), ("v_zero", cache.v_zero, 2),
                       ("channel_order", cache.channel_order, 1)):
        _check_inner_contiguous(name, t, n)
    if cache.k_sink.stride() != cache.v_sink.stride() or cache.k_res.stride() != cache.v_res.stride():
        raise ValueError("keys and values of the sinks and of the residual must share strides")
    if cache.k_scale.stride() != cache.k_zero.stride() or cache.v_scale.stride() != cache.v_zero.stride():
        raise ValueError("scales and zeros must share strides")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, checked to take the result (q's shape, contiguous channels), or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous channels")
    return out


def split_plan(q: torch.Tensor, cache: DecodeCache, num_splits: int | None,
               programs_per_sm: int) -> tuple[int, int]:
    """(groups per split, splits) of the packed region per (b, h_kv). num_splits None: enough for
    about `programs_per_sm` packed-region programs per SM. Only capacities decide, never lengths."""
    n_bh = q.shape[0] * cache.k_sink.shape[1]
    ng_cap = cache.k_low.shape[2]
    if num_splits is None:
        target = programs_per_sm * (_sm_count(q.device.index or 0) if q.is_cuda else 1)
        num_splits = max(1, min(ng_cap, -(-target // n_bh)))
    num_splits = max(1, min(num_splits, max(ng_cap, 1)))
    groups_per_split = -(-ng_cap // num_splits) if ng_cap else 0
    return groups_per_split, (-(-ng_cap // groups_per_split) if ng_cap else 0)


def cache_operands(q: torch.Tensor, cache: DecodeCache, k_low: torch.Tensor, k_high: torch.Tensor,
                   v_packed: torch.Tensor) -> tuple:
    """The split kernels' leading arguments, in their order: the query, the cache tensors with their
    batch/head strides, the lengths. The packed tensors are passed in so that a kernel can take
    other views of them (`decode_mma` reads int32 words and int16 halves); strides are then in those
    elements."""
    return (
        q, q.stride(0), q.stride(1),
        cache.k_sink, cache.v_sink, cache.k_sink.stride(0), cache.k_sink.stride(1), cache.k_sink.stride(2),
        cache.k_res, cache.v_res, cache.k_res.stride(0), cache.k_res.stride(1), cache.k_res.stride(2),
        k_low, k_low.stride(0), k_low.stride(1),
        k_high, k_high.stride(0), k_high.stride(1),
        cache.k_scale, cache.k_zero, cache.k_scale.stride(0), cache.k_scale.stride(1),
        v_packed, v_packed.stride(0), v_packed.stride(1),
        cache.v_scale, cache.v_zero, cache.v_scale.stride(0), cache.v_scale.stride(1),
        cache.channel_order, cache.channel_order.stride(0), cache.channel_order.stride(1),
        cache.sink_len, cache.n_groups, cache.res_len,
    )


def decode_attention(
    q: torch.Tensor,
    cache: DecodeCache,
    scale: float,
    num_splits: int | None = None,
    block_t: int | None = None,
    num_warps: int = 2,
    num_stages: int = 1,
    out: torch.Tensor | None = None,
    fast_unpack: bool | None = None,
    max_registers: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over a PN-Mix layer cache.

    q [B, H_q, d] float (H_q a multiple of H_kv; d in {64, 128}, or any power of two >= 16) ->
    out [B, H_q, d] in q's dtype. `scale` is the softmax scale (usually d ** -0.5).
    num_splits: splits of the packed region per (b, h_kv); by default enough to give every SM of
    the GPU about four programs. Only capacities (tensor shapes) shape the launch, never lengths.
    block_t (tokens per inner step, divides G), num_warps, num_stages: launch tuning.
    `out`, if given, receives the result (same shape as q, channels contiguous).
    fast_unpack: expand codes with inline PTX (default on CUDA); the portable Triton path is the
    one the CPU interpreter runs, which has no inline assembly. max_registers caps registers per
    thread (ptxas maxnreg) to trade a few spills for occupancy; None: no cap.
    The defaults (64-token steps, 2 warps, 1 stage, no register cap) were the fastest of the
    variants measured on an H200 on every benchmark shape, 10-15% faster than the earlier
    4 warps / 128 registers from batch 32 up (benchmarks/RESULTS.md, section Kernels).
    """
    check_operands(q, cache)
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    g = cache.group_size
    gq = hq // hkv
    m_p = max(16, next_pow2(gq))
    n_sc = cache.n_salient_channels
    groups_per_split, num_splits = split_plan(q, cache, num_splits, 4)  # about four programs per SM
    if block_t is None:
        block_t = min(g, 64)
    n_parts = num_splits + 1
    dev = q.device
    pm = torch.empty((bsz * hkv, n_parts, m_p), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pa = torch.empty((bsz * hkv, n_parts, m_p, d), dtype=torch.float32, device=dev)
    out = output_for(q, out)
    _decode_split_kernel[(bsz * hkv, n_parts)](
        *cache_operands(q, cache, cache.k_low, cache.k_high, cache.v_packed),
        pm, pl, pa,
        scale * LOG2E, groups_per_split, num_splits,
        HKV=hkv, GQ=gq, M_P=m_p, D=d, G=g, B_LOW=cache.b_low, NH=cache.b_high - cache.b_low,
        NSC=n_sc, NSC_P=next_pow2(max(n_sc, 16)), NNS_P=next_pow2(max(d - n_sc, 16)),
        BV=cache.value_bits, GV=cache.value_group_size, BLOCK_T=block_t, BLOCK_R=32,
        FAST=q.is_cuda if fast_unpack is None else fast_unpack,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": max_registers} if max_registers else {}),
    )
    return combine_partials(pm, pl, pa, out, hkv)
