"""Fused decode attention on the CUDA cores ("simt" variant): no tensor cores, no layout shuffles.

Why a second kernel: the storage format packs key bits along tokens and value codes along
channels, which is the opposite of what a tensor-core MMA reduces over (channels for QK^T, tokens
for PV). The MMA kernel (kernels/decode.py) must therefore move every expanded code through shared
memory to reach the MMA operand layout; on an H200 that bound it at 0.45-0.52x SDPA
(benchmarks/RESULTS.md, section Kernels). Decode has only GQ query rows per KV head (3-8), so the
tensor cores' 16-row tiles are mostly padding anyway. This kernel instead gives every thread the
axis the format packs along and loops over the other axis, so every reduction is in registers:

- Keys: a thread owns one packed byte column (8 consecutive tokens of a group) and loops over the
  channels; per channel it loads one byte per bit plane, builds the 8 codes, dequantizes them
  (q * s + z, fp32) and adds u[c] * k[c, t] into the GQ x 8 scores it holds. The query value
  u[c] is the same for every thread (a broadcast load).
- Values: the tile's probabilities go through a small per-program scratch buffer (the one place
  where data changes hands between threads), then a thread owns one packed value byte (8 // b_V
  channels) and loops over tokens, adding p[u, t] * v[t, c] into the GQ x (8 // b_V) sums it holds.

Tensor shapes are ordered so that Triton's default layouts already are these ownerships (lanes and
warps on the last axis, everything else in registers); `benchmarks/bench_decode.py` times both
kernels. The grid, partials and combine step are those of kernels/decode.py (flash-decoding over
splits of the packed region; one extra split per (b, h_kv) takes the sinks and the residual).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.decode import _raw_block  # the fp sinks / residual block, shared with the MMA kernel


@triton.jit
def _key_codes(lo_col, hi_col, c, j, bit, col_ok, D: tl.constexpr, G8: tl.constexpr, NSC: tl.constexpr,
               B_LOW: tl.constexpr, NH: tl.constexpr):
    """Codes [8, NCOL] of channel c: B_LOW low planes (row c), then NH high planes (row j of the
    salient rows; NH = 0 for a non-salient channel). Bit b of byte column n is token 8 n + b."""
    code = tl.zeros(bit.shape, tl.int32)[:, None] + tl.zeros(col_ok.shape, tl.int32)[None, :]
    for p in tl.static_range(B_LOW):
        byte = tl.load(lo_col + (p * D + c) * G8, mask=col_ok, other=0).to(tl.int32)
        code |= ((byte[None, :] >> bit[:, None]) & 1) << p
    for p in tl.static_range(NH):
        byte = tl.load(hi_col + (p * NSC + j) * G8, mask=col_ok, other=0).to(tl.int32)
        code |= ((byte[None, :] >> bit[:, None]) & 1) << (B_LOW + p)
    return code


@triton.jit
def _decode_simt_kernel(
    q_ptr, stride_qb, stride_qh,
    klo_ptr, stride_lob, stride_loh,
    khi_ptr, stride_hib, stride_hih,
    ksc_ptr, kze_ptr, stride_ksb, stride_ksh,
    vp_ptr, stride_vpb, stride_vph,
    vsc_ptr, vze_ptr, stride_vsb, stride_vsh,
    order_ptr, stride_ob, stride_oh,
    n_groups_ptr, pm_ptr, pl_ptr, pa_ptr, scratch_ptr,
    qk_scale, groups_per_split, n_split,
    HKV: tl.constexpr, GQ: tl.constexpr, MS: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr,
    G: tl.constexpr, B_LOW: tl.constexpr, NH: tl.constexpr, NSC: tl.constexpr, BV: tl.constexpr,
    GV: tl.constexpr, TG: tl.constexpr, TCV: tl.constexpr,
):
    """Program (b * HKV + h, split): partial attention of the GQ query heads of KV head h.

    Operands and partials exactly as in `kernels.decode._decode_split_kernel` (same shapes and
    strides); the grid has n_split columns, and `_decode_raw_kernel` fills partial n_split.
    Packed splits run in tiles of TG groups (TOK = TG * G tokens, NCOL = TOK / 8 byte
    columns); MS = next_pow2(GQ) score rows, of which rows >= GQ are zero queries and are never
    stored. scratch fp32 [B * HKV * n_split, TOK, MS]: the probabilities of the current tile.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    part = bh.to(tl.int64) * (n_split + 1) + split
    if split < n_split:  # (always: the grid has n_split columns; kept for the shared indexing)
        G8: tl.constexpr = G // 8
        TOK: tl.constexpr = TG * G
        NCOL: tl.constexpr = TOK // 8
        NNS: tl.constexpr = D - NSC
        PB: tl.constexpr = 8 // BV  # value codes per byte
        VROW: tl.constexpr = D // PB  # value bytes per token
        NVG: tl.constexpr = D // GV
        rows = tl.arange(0, MS)
        row_ok = rows < GQ
        q_rows = q_ptr + b.to(tl.int64) * stride_qb + (h * GQ + rows) * stride_qh
        n_groups = tl.load(n_groups_ptr + b)
        g_start = split * groups_per_split
        g_end = tl.minimum(g_start + groups_per_split, n_groups)
        order = order_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
        klo = klo_ptr + b.to(tl.int64) * stride_lob + h * stride_loh
        khi = khi_ptr + b.to(tl.int64) * stride_hib + h * stride_hih
        ks_off = b.to(tl.int64) * stride_ksb + h * stride_ksh
        vp = vp_ptr + b.to(tl.int64) * stride_vpb + h * stride_vph
        vsc = vsc_ptr + b.to(tl.int64) * stride_vsb + h * stride_vsh
        vze = vze_ptr + b.to(tl.int64) * stride_vsb + h * stride_vsh
        scratch = scratch_ptr + (bh.to(tl.int64) * n_split + split) * (TOK * MS)
        # Key side: [MS, 8, NCOL], lanes and warps on the byte columns.
        cols = tl.arange(0, NCOL)
        bit = tl.arange(0, 8)
        # Value side: [MS, PB, TCV, VROW], lanes on the bytes of a token, warps on tokens.
        vk = tl.arange(0, PB)
        vt = tl.arange(0, TCV)
        vb = tl.arange(0, VROW)
        v_grp = (vb * PB) // GV  # value scale group of each byte
        m_i = tl.full([MS], float("-inf"), tl.float32)
        l_i = tl.zeros([MS], tl.float32)
        acc = tl.zeros([MS, PB, TCV, VROW], tl.float32)
        for g0 in range(g_start, g_end, TG):
            gidx = g0 + cols // G8
            col_ok = gidx < g_end
            lo_col = klo + gidx * (B_LOW * D * G8) + cols % G8
            hi_col = khi + gidx * (NH * NSC * G8) + cols % G8
            sc_col = ksc_ptr + ks_off + gidx * D
            ze_col = kze_ptr + ks_off + gidx * D
            scores = tl.zeros([MS, 8, NCOL], tl.float32)
            for j in range(0, NNS):  # non-salient channels: the B_LOW low planes
                c = tl.load(order + j)
                code = _key_codes(lo_col, hi_col, c, j, bit, col_ok, D, G8, NSC, B_LOW, 0)
                s = tl.load(sc_col + c, mask=col_ok, other=0.0).to(tl.float32)
                z = tl.load(ze_col + c, mask=col_ok, other=0.0).to(tl.float32)
                k = code.to(tl.float32) * s[None, :] + z[None, :]
                u = tl.load(q_rows + c, mask=row_ok, other=0.0).to(tl.float32) * qk_scale
                scores += u[:, None, None] * k[None, :, :]
            for j in range(0, NSC):  # salient channels: low planes, then their NH high planes
                c = tl.load(order + NNS + j)
                code = _key_codes(lo_col, hi_col, c, j, bit, col_ok, D, G8, NSC, B_LOW, NH)
                s = tl.load(sc_col + c, mask=col_ok, other=0.0).to(tl.float32)
                z = tl.load(ze_col + c, mask=col_ok, other=0.0).to(tl.float32)
                k = code.to(tl.float32) * s[None, :] + z[None, :]
                u = tl.load(q_rows + c, mask=row_ok, other=0.0).to(tl.float32) * qk_scale
                scores += u[:, None, None] * k[None, :, :]
            scores = tl.where(col_ok[None, None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(tl.max(scores, axis=1), axis=1))  # in-thread axis first
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(scores - m_new[:, None, None])
            l_i = l_i * alpha + tl.sum(tl.sum(p, axis=1), axis=1)
            m_i = m_new
            acc = acc * alpha[:, None, None, None]
            # Hand the probabilities to the value layout through the scratch tile (token 8 n + b).
            tl.store(scratch + (cols[None, None, :] * 8 + bit[None, :, None]) * MS + rows[:, None, None], p)
            tl.debug_barrier()
            t_base = g0 * G
            t_end = tl.minimum(g0 + TG, g_end) * G
            for t0 in range(t_base, t_end, TCV):
                t = t0 + vt
                t_ok = t < t_end
                raw = tl.load(vp + t[:, None] * VROW + vb[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
                codes = (raw[None, :, :] >> (vk * BV)[:, None, None]) & ((1 << BV) - 1)  # [PB, TCV, VROW]
                sz = t[:, None] * NVG + v_grp[None, :]
                vs = tl.load(vsc + sz, mask=t_ok[:, None], other=0.0).to(tl.float32)
                vz = tl.load(vze + sz, mask=t_ok[:, None], other=0.0).to(tl.float32)
                v = codes.to(tl.float32) * vs[None, :, :] + vz[None, :, :]
                pv = tl.load(scratch + (t - t_base)[None, :] * MS + rows[:, None],
                             mask=t_ok[None, :], other=0.0)  # [MS, TCV]
                acc += pv[:, None, :, None] * v[None, :, :, :]
            tl.debug_barrier()  # the next tile overwrites the scratch
        out = tl.reshape(tl.permute(tl.sum(acc, axis=2), (0, 2, 1)), [MS, D])  # channel = byte * PB + k
        c_all = tl.arange(0, D)
        tl.store(pa_ptr + (part * M_P + rows[:, None]) * D + c_all[None, :], out)
        tl.store(pm_ptr + part * M_P + rows, m_i)
        tl.store(pl_ptr + part * M_P + rows, l_i)


@triton.jit
def _decode_raw_kernel(
    q_ptr, stride_qb, stride_qh,
    ks_ptr, vs_ptr, stride_sb, stride_sh, stride_st,
    kr_ptr, vr_ptr, stride_rb, stride_rh, stride_rt,
    sink_len_ptr, res_len_ptr, pm_ptr, pl_ptr, pa_ptr, qk_scale, n_split,
    HKV: tl.constexpr, GQ: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program b * HKV + h: the fp sinks and residual of (b, h) into partial n_split.

    A separate launch from `_decode_simt_kernel`, so that its fp32 tensor-core blocks do not raise
    the register count (and lower the occupancy) of the packed-region programs.
    """
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    part = bh.to(tl.int64) * (n_split + 1) + n_split
    rows16 = tl.arange(0, M_P)
    c = tl.arange(0, D)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + (h * GQ + rows16) * stride_qh
    q32 = tl.load(q_base[:, None] + c[None, :], mask=(rows16 < GQ)[:, None], other=0.0).to(tl.float32)
    q32 = q32 * qk_scale
    m_r = tl.full([M_P], float("-inf"), tl.float32)
    l_r = tl.zeros([M_P], tl.float32)
    acc2 = tl.zeros([M_P, D], tl.float32)
    n_sink = tl.load(sink_len_ptr + b)
    s_off = b.to(tl.int64) * stride_sb + h * stride_sh
    for t0 in range(0, n_sink, BLOCK_R):
        m_r, l_r, acc2 = _raw_block(q32, ks_ptr + s_off, vs_ptr + s_off, stride_st, n_sink, t0,
                                    m_r, l_r, acc2, D, BLOCK_R)
    n_res = tl.load(res_len_ptr + b)
    r_off = b.to(tl.int64) * stride_rb + h * stride_rh
    for t0 in range(0, n_res, BLOCK_R):
        m_r, l_r, acc2 = _raw_block(q32, kr_ptr + r_off, vr_ptr + r_off, stride_rt, n_res, t0,
                                    m_r, l_r, acc2, D, BLOCK_R)
    tl.store(pa_ptr + (part * M_P + rows16[:, None]) * D + c[None, :], acc2)
    tl.store(pm_ptr + part * M_P + rows16, m_r)
    tl.store(pl_ptr + part * M_P + rows16, l_r)
