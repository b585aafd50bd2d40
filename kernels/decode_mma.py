"""Fused decode attention with the dequantization done in MMA operand registers (Gluon, CUDA only).

The same computation, partials and combine step as `kernels/decode.py` (read its docstring first),
written in Gluon so that the layouts are explicit. The Triton kernel expands the codes in a
blocked layout, and `tl.dot` then moves them to the tensor cores' operand layout through shared
memory; that round trip and the layout shuffles cost more than the bytes saved (it runs at
0.45-0.58x of bf16 SDPA; benchmarks/RESULTS.md, Kernels). Here every code is expanded by the
thread whose `mma.sync` fragment holds it:

- keys, B operand of S[h, t] = U[h, c] @ codes[c, t] (U = query x key scale, one [16, D] per
  group): a thread holds channel pairs of one token. It loads, per channel and bit plane, the
  32-bit word holding 32 tokens (8 a byte, LSB first), and shifts its own token's bit out. The low
  planes of all channels are one product; the salient channels' high planes a second one with
  U[:, salient] * 2^b_low, since code = low + 2^b_low * high. No channel reordering, no gather of
  packed bytes.
- values, B operand of acc[h, c] += P[h, t] @ V[t, c]: a thread holds token pairs of one channel.
  It loads the 32-bit words of its tokens' rows (32 // b_V channels each) and shifts out its
  channels; scale and zero are applied in fp16 in the same registers.
- P leaves the score accumulator in the A-operand layout, as in flash attention: no data movement.

One warp per program, program (b * H_kv + h, split): each warp owns a slice of the packed groups
and keeps its own online softmax, so no shared memory and no barrier is used in the loop. The last
split handles the sinks and the residual (fp16 MMA on the raw tokens). Partials go to
`decode._combine_kernel`.

Limits (the caller falls back to the Triton kernel otherwise): CUDA with compute capability >= 8.0,
Triton with Gluon, group size G a multiple of 32, head dim a multiple of 16, at most 16 query
heads per KV head, value groups spanning whole 32-bit words (G_V * b_V >= 32). The CPU
interpreter cannot run Gluon, so CI tests the Triton kernel; `benchmarks/bench_decode.py` checks
this one against the torch reference on the GPU.
"""

from __future__ import annotations

import functools

import torch

from kernels.layout import DecodeCache, next_pow2

try:  # Gluon is Triton's explicit-layout dialect (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - older Triton
    gluon = None

LOG2E = 1.4426950408889634
WORD_TOKENS = 32  # tokens per 32-bit word of a key bit plane: the inner step of the loop
M_ROWS = 16  # query heads of a KV head, padded to the MMA's M


def available() -> bool:
    return gluon is not None and torch.cuda.is_available()


def supports(cache: DecodeCache, q: torch.Tensor) -> bool:
    """Whether `decode_attention_mma` handles this shape (else use `kernels.decode.decode_attention`)."""
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    return (available() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8
            and d % 16 == 0 and d >= 32 and hq % hkv == 0 and hq // hkv <= M_ROWS
            and cache.group_size % WORD_TOKENS == 0
            and cache.value_bits in (1, 2, 4, 8) and (d * cache.value_bits) % 32 == 0
            and cache.value_group_size * cache.value_bits >= 32 and d % cache.value_group_size == 0
            and cache.k_low.shape[-1] % 4 == 0)


@functools.cache
def _layouts(d: int, value_bits: int, block_t: int):
    """(MMA, A operand, B operand, value-word 3-D layout) for head dim d, b_V value bits and
    block_t (16 or 32) tokens per step.

    The 3-D layout views the values' B operand [block_t tokens, d] as [block_t, words, codes per word]; its
    bases are the B operand's (token t, channel c) bases with c split into (c // cpw, c % cpw), so
    reshaping it back to [32, d] gives the B operand layout itself (checked: assert_trivial).
    The B operand of mma.sync m16n8k16 for a [K, N] tile, per warp: register bases k+1, k+8, then the
    K tiles, then the N tiles; lane bases k+2, k+4, n+1, n+2, n+4.
    """
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    cpw = 32 // value_bits
    regs = [[1, 0], [8, 0]] + ([[16, 0]] if block_t == 32 else []) + [[0, 8 << i]
                                                                       for i in range((d // 8).bit_length() - 1)]
    lanes = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]

    def split(basis: list[int]) -> list[int]:
        t, c = basis
        return [t, c // cpw, c % cpw]

    words3 = gl.DistributedLinearLayout(reg_bases=[split(b) for b in regs], lane_bases=[split(b) for b in lanes],
                                        warp_bases=[], block_bases=[], shape=[block_t, d // cpw, cpw])
    return mma, a_op, b_op, words3


if gluon is not None:

    @gluon.jit
    def _codes_f16(code):
        """Integer codes 0..15 (int32) -> fp16, exactly: 0x6400 | q is 1024 + q in fp16."""
        return (code | 0x6400).to(gl.int16).to(gl.float16, bitcast=True) - 1024.0

    @gluon.jit
    def _key_tile(w_ptr, plane_stride, mask, j, N_PLANES: gl.constexpr):
        """Codes [C, BT] (B operand) from N_PLANES bit planes: word pointers [C], j = bit of each token [BT]."""
        w = gl.load(w_ptr, mask=mask, other=0)
        code = (w[:, None] >> j[None, :]) & 1
        for p in gl.static_range(1, N_PLANES):
            w = gl.load(w_ptr + p * plane_stride, mask=mask, other=0)
            code |= ((w[:, None] >> j[None, :]) & 1) << p
        return _codes_f16(code)

    @gluon.jit
    def _mma_split_kernel(
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
        HKV: gl.constexpr, GQ: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
        B_LOW: gl.constexpr, NH: gl.constexpr, NSC: gl.constexpr, NSC_P: gl.constexpr,
        BV: gl.constexpr, GV: gl.constexpr, BT: gl.constexpr, BLOCK_R: gl.constexpr,
        MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, W3: gl.constexpr,
    ):
        """Operands as in `decode._decode_split_kernel`, except: klo, khi and vp are int32 views of
        the packed bytes (strides in words), and partials use M_ROWS = 16 rows."""
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        G32: gl.constexpr = G // 32  # words per channel and plane in a group
        CPW: gl.constexpr = 32 // BV  # value codes per word
        NW: gl.constexpr = D // CPW  # value words per token
        NVG: gl.constexpr = D // GV
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        # Query-side operands are computed in the accumulator layout (reductions need it) and moved
        # to the A-operand layout, which for 16-bit data holds the same elements in the same registers.
        rows_a = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        cols_a = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
        q_base = q_ptr + b.to(gl.int64) * stride_qb + (h * GQ + rows_a) * stride_qh
        # Padded query rows are zero, so their scores stay finite (never -inf - -inf).
        rows_c = gl.arange(0, 16, layout=ROW)
        cols_c = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
        part = bh.to(gl.int64) * (n_split + 1) + split
        m_i = gl.full([16], float("-inf"), gl.float32, layout=ROW)
        l_i = gl.zeros([16], gl.float32, layout=ROW)
        acc = gl.zeros([16, D], gl.float32, layout=MMA)
        if split < n_split:
            n_groups = gl.load(n_groups_ptr + b)
            g_start = split * groups_per_split
            g_end = gl.minimum(g_start + groups_per_split, n_groups)
            ks_off = b.to(gl.int64) * stride_ksb + h * stride_ksh
            klo = klo_ptr + b.to(gl.int64) * stride_lob + h * stride_loh
            khi = khi_ptr + b.to(gl.int64) * stride_hib + h * stride_hih
            vp = vp_ptr + b.to(gl.int64) * stride_vpb + h * stride_vph
            vsc = vsc_ptr + b.to(gl.int64) * stride_vsb + h * stride_vsh
            vze = vze_ptr + b.to(gl.int64) * stride_vsb + h * stride_vsh
            ch_b = gl.arange(0, D, layout=gl.SliceLayout(1, B_OP))
            j_b = gl.arange(0, BT, layout=gl.SliceLayout(0, B_OP))
            js_a = gl.arange(0, NSC_P, layout=gl.SliceLayout(0, MMA))
            js_b = gl.arange(0, NSC_P, layout=gl.SliceLayout(1, B_OP))
            order = order_ptr + b.to(gl.int64) * stride_ob + h * stride_oh
            sal_a = gl.load(order + (D - NSC) + js_a, mask=js_a < NSC, other=0)
            WL: gl.constexpr = gl.SliceLayout(2, W3)
            tv = gl.arange(0, BT, layout=gl.SliceLayout(1, WL))
            wv = gl.arange(0, NW, layout=gl.SliceLayout(0, WL))
            kv = gl.arange(0, CPW, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
            shift3 = (kv * BV)[None, None, :]
            for g in range(g_start, g_end):
                s_row = gl.load(ksc_ptr + ks_off + g * D + cols_a).to(gl.float32)
                z_row = gl.load(kze_ptr + ks_off + g * D + cols_a).to(gl.float32)
                # The query is read again per group (an L1 hit): kept live, it would push the loop into spills.
                q32 = gl.load(q_base[:, None] + cols_a[None, :], mask=(rows_a < GQ)[:, None],
                              other=0.0).to(gl.float32) * qk_scale
                u = gl.convert_layout((q32 * s_row[None, :]).to(gl.float16), A_OP)  # scale folded into the query
                bias = gl.sum(q32 * z_row[None, :], axis=1)  # zero: u @ z
                s_sal = gl.load(ksc_ptr + ks_off + g * D + sal_a, mask=js_a < NSC, other=0.0).to(gl.float32)
                q_sal = gl.load(q_base[:, None] + sal_a[None, :], mask=(rows_a < GQ)[:, None] & (js_a < NSC)[None, :],
                                other=0.0).to(gl.float32) * (qk_scale * (1 << B_LOW))
                u_hi = gl.convert_layout((q_sal * s_sal[None, :]).to(gl.float16), A_OP)
                lo_g = klo + g * (B_LOW * D * G32)
                hi_g = khi + g * (NH * NSC * G32)
                for st in range(G // BT):
                    word = (st * BT) // 32  # this step's tokens: bits j_b + bit0 of that word
                    bit0 = (st * BT) % 32
                    scores = gl.zeros([16, BT], gl.float32, layout=MMA) + bias[:, None]
                    k_lo = _key_tile(lo_g + ch_b * G32 + word, D * G32, ch_b < D, j_b + bit0, B_LOW)
                    scores = mma_v2(u, k_lo, scores)
                    if NH > 0:
                        if NSC > 0:
                            k_hi = _key_tile(hi_g + js_b * G32 + word, NSC * G32, js_b < NSC, j_b + bit0, NH)
                            scores = mma_v2(u_hi, k_hi, scores)
                    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
                    alpha = gl.exp2(m_i - m_new)
                    p = gl.exp2(scores - m_new[:, None])
                    l_i = l_i * alpha + gl.sum(p, axis=1)
                    m_i = m_new
                    p16 = gl.convert_layout(p.to(gl.float16), A_OP)  # the accumulator layout: no movement
                    # Values of the same BT tokens: words [BT, NW] -> codes [BT, NW, CPW] -> [BT, D].
                    t = g * G + st * BT + tv
                    words = gl.load(vp + t[:, None] * NW + wv[None, :])
                    sz = t[:, None] * NVG + ((wv * CPW) // GV)[None, :]
                    v_s = gl.load(vsc + sz)
                    v_z = gl.load(vze + sz)
                    codes = _codes_f16((words[:, :, None] >> shift3) & ((1 << BV) - 1))
                    v3 = codes * v_s[:, :, None] + v_z[:, :, None]
                    v = gl.convert_layout(gl.reshape(v3, [BT, D]), B_OP, assert_trivial=True)
                    acc = mma_v2(p16, v, acc * alpha[:, None])
        else:
            q32 = gl.load(q_base[:, None] + cols_a[None, :], mask=(rows_a < GQ)[:, None],
                          other=0.0).to(gl.float32) * qk_scale
            u0 = gl.convert_layout(q32.to(gl.float16), A_OP)
            t_b = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, B_OP))  # key tokens (columns)
            c_b = gl.arange(0, D, layout=gl.SliceLayout(1, B_OP))
            tr_b = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, B_OP))  # value tokens (rows)
            cc_b = gl.arange(0, D, layout=gl.SliceLayout(0, B_OP))
            tcol = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, MMA))
            for region in gl.static_range(2):
                if region == 0:
                    n_tok = gl.load(sink_len_ptr + b)
                    off = b.to(gl.int64) * stride_sb + h * stride_sh
                    k_base = ks_ptr + off
                    v_base = vs_ptr + off
                    stride_t = stride_st
                else:
                    n_tok = gl.load(res_len_ptr + b)
                    off = b.to(gl.int64) * stride_rb + h * stride_rh
                    k_base = kr_ptr + off
                    v_base = vr_ptr + off
                    stride_t = stride_rt
                for t0 in range(0, n_tok, BLOCK_R):
                    kt = gl.load(k_base + (t0 + t_b)[None, :] * stride_t + c_b[:, None],
                                 mask=(t0 + t_b < n_tok)[None, :], other=0.0).to(gl.float16)
                    scores = mma_v2(u0, kt, gl.zeros([16, BLOCK_R], gl.float32, layout=MMA))
                    scores = gl.where((t0 + tcol < n_tok)[None, :], scores, float("-inf"))
                    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
                    alpha = gl.exp2(m_i - m_new)
                    p = gl.exp2(scores - m_new[:, None])
                    l_i = l_i * alpha + gl.sum(p, axis=1)
                    m_i = m_new
                    p16 = gl.convert_layout(p.to(gl.float16), A_OP)
                    vt = gl.load(v_base + (t0 + tr_b)[:, None] * stride_t + cc_b[None, :],
                                 mask=(t0 + tr_b < n_tok)[:, None], other=0.0).to(gl.float16)
                    acc = mma_v2(p16, vt, acc * alpha[:, None])
        gl.store(pa_ptr + (part * 16 + rows_c[:, None]) * D + cols_c[None, :], acc)
        gl.store(pm_ptr + part * 16 + rows_c, m_i)
        gl.store(pl_ptr + part * 16 + rows_c, l_i)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _words(t: torch.Tensor) -> torch.Tensor:
    """The int32 view of packed bytes (last dim a multiple of 4); strides then count words."""
    return t.view(torch.int32) if t.numel() else torch.empty(t.shape[:-1] + (t.shape[-1] // 4,), dtype=torch.int32,
                                                             device=t.device)


def decode_attention_mma(q: torch.Tensor, cache: DecodeCache, scale: float, num_splits: int | None = None,
                         programs_per_sm: int = 16, block_t: int = 16,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.decode.decode_attention` with this kernel; call only where `supports(cache, q)`.

    num_splits: splits of the packed region per (b, h_kv); by default enough for about
    `programs_per_sm` one-warp programs per SM. block_t: tokens per inner step (16 or 32).
    """
    import triton

    from kernels.decode import _combine_kernel

    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    gq = hq // hkv
    ng_cap = cache.k_low.shape[2]
    n_sc = cache.n_salient_channels
    if num_splits is None:
        target = programs_per_sm * _sm_count(q.device.index or 0)
        num_splits = max(1, min(ng_cap, triton.cdiv(target, bsz * hkv)))
    num_splits = max(1, min(num_splits, max(ng_cap, 1)))
    groups_per_split = triton.cdiv(ng_cap, num_splits) if ng_cap else 0
    num_splits = triton.cdiv(ng_cap, groups_per_split) if ng_cap else 0
    n_parts = num_splits + 1
    pm = torch.empty((bsz * hkv, n_parts, M_ROWS), dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pa = torch.empty((bsz * hkv, n_parts, M_ROWS, d), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    klo, khi, vp = _words(cache.k_low), _words(cache.k_high), _words(cache.v_packed)
    mma, a_op, b_op, words3 = _layouts(d, cache.value_bits, block_t)
    _mma_split_kernel[(bsz * hkv, n_parts)](
        q, q.stride(0), q.stride(1),
        cache.k_sink, cache.v_sink, cache.k_sink.stride(0), cache.k_sink.stride(1), cache.k_sink.stride(2),
        cache.k_res, cache.v_res, cache.k_res.stride(0), cache.k_res.stride(1), cache.k_res.stride(2),
        klo, klo.stride(0), klo.stride(1),
        khi, khi.stride(0), khi.stride(1),
        cache.k_scale, cache.k_zero, cache.k_scale.stride(0), cache.k_scale.stride(1),
        vp, vp.stride(0), vp.stride(1),
        cache.v_scale, cache.v_zero, cache.v_scale.stride(0), cache.v_scale.stride(1),
        cache.channel_order, cache.channel_order.stride(0), cache.channel_order.stride(1),
        cache.sink_len, cache.n_groups, cache.res_len,
        pm, pl, pa,
        scale * LOG2E, groups_per_split, num_splits,
        HKV=hkv, GQ=gq, D=d, G=cache.group_size, B_LOW=cache.b_low, NH=cache.b_high - cache.b_low,
        NSC=n_sc, NSC_P=next_pow2(max(n_sc, 16)), BV=cache.value_bits, GV=cache.value_group_size,
        BT=block_t, BLOCK_R=32,
        MMA=mma, A_OP=a_op, B_OP=b_op, W3=words3,
        num_warps=1,
    )
    _combine_kernel[(bsz * hkv,)](
        pm, pl, pa, out, out.stride(0), out.stride(1), n_parts,
        HKV=hkv, GQ=gq, M_P=M_ROWS, D=d, num_warps=4,
    )
    return out
