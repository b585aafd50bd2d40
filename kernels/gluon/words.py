"""The Gluon decode kernel for key groups of 32 or 64 tokens (`_words_kernel`, launched by
`kernels.gluon.launch`). The values, the fp16 tail and the partials are `common`'s.

The keys differ from `block`'s: a 128-token block of a channel's plane words spans several groups
here, so a tile of runs would hold tokens of different groups, whose query operands differ. This
kernel walks word steps of 32 tokens instead: every lane loads both channels' words of its pairs
(`_smem_pair_words`, 8 lanes a word) and one prmt per pair and half puts a row pair's byte side by
side (`_plane_pairs`). Rows are tokens in the order 2 (m % 8) + m // 8 (`_token_of_row`). The ring
holds STAGES word steps, copied STAGES - 2 steps ahead; a step's value product runs during the next
step, beside its scores.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pnmix.kernels.gluon.common import (
    _async_load,
    _first_heads,
    _fp16_tail,
    _head_operands,
    _p_operand,
    _packed_partials,
    _packed_split,
    _plane_operand,
    _pt_pairs,
    _rescaled,
    _step_values,
    _store_partials,
    _thread_barrier,
    _value_selectors,
    async_copy,
    gl,
    gluon,
    linear_layout,
    mma_v2,
    shared_layouts,
)
from pnmix.kernels.layout import next_pow2

# Word steps (32 tokens) in a program's shared-memory ring. Copies run STAGES - 2 steps ahead: a step
# reads its own slot (scores) and the slot of the step before (values; see the kernel's loop).
STAGES = 4
PLANE_DTYPE = torch.int32  # the key planes as the kernel reads them: a channel's 32-token words
CONSTANTS = {"STAGES": STAGES}  # compile-time constants besides the shared ones (`launch.kernel_constants`)


@functools.cache
def layouts(d: int, value_bits: int, value_group: int, n_sc_p: int, one_scale: bool) -> dict[str, Any]:
    """The kernel's layout arguments: `common.shared_layouts` and the ring's own (key plane slots
    and their copies, the value scales' per-step copies)."""
    # 32 lanes on 32 consecutive channels (parity fastest): a copy spans 32 x G / 8 bytes of memory
    cp_rows = gl.BlockedLayout([1, 1], [2, 16], [1, 1], [0, 1])

    def slot_rows(channels: int) -> Any:
        """[parity, pairs] words of one plane: the copy's 32 lanes write 16 pairs of both rows
        (`_issue_step`); rows 32 or more words long would share banks, so the odd row's 16-pair
        halves are swapped (chunk index XOR row)."""
        return gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=2 if channels // 2 >= 32 else 1, order=[1, 0])

    def par_load(channels: int) -> Any:
        regs = [[1, 0]] + [[0, 4 << i] for i in range((channels // 2).bit_length() - 3)]
        return linear_layout(regs, [[0, 1], [0, 2], [0, 0], [0, 0], [0, 0]], [2, channels // 2])

    scale_words = 8 if one_scale else 8 * (d // value_group)  # a half step's (`SW` in the kernel)
    own = dict(ROWS_LO=slot_rows(d), ROWS_HI=slot_rows(n_sc_p), PAR_LO=par_load(d), PAR_HI=par_load(n_sc_p),
               CP_LO=cp_rows, CP_HI=cp_rows, CP_S=gl.BlockedLayout([max(1, scale_words // 32)], [32], [1], [0]))
    return shared_layouts(d, value_bits, value_group, n_sc_p, one_scale) | own


def ring_bytes(d: int, b_low: int, b_high: int, n_salient: int, value_bits: int, value_group: int) -> int:
    """Shared memory of one program: its ring of STAGES word steps (see the kernel's buffers)."""
    nsc_p = next_pow2(max(n_salient, 16))
    key_words = next_pow2(b_low) * d  # (parity, plane) rows; the high planes' only where used
    if b_high > b_low and n_salient:
        key_words += next_pow2(b_high - b_low) * nsc_p
    words = key_words + d * value_bits  # + 32 tokens of value words
    halves = 2 * 32 * (d // value_group) + 2 * d  # value scales and zeros, key scale and zero rows
    return STAGES * (4 * words + 2 * halves)


@gluon.jit
def _byte_perm_by(a, b, sel):
    """`_byte_perm` with the selector a tensor (a register), for selectors that vary by thread."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _token_of_row(m):
    """The token (within its 16-token half step) of row m of the score and value products: 2 (m % 8)
    + m // 8, so that a thread's two rows r, 8 + r are adjacent tokens (`_plane_pairs`)."""
    return 2 * (m % 8) + m // 8


@gluon.jit
def _plane_pairs(we, wo, sel, bit_e, bit_o, magic_p):
    """One bit plane's A-operand registers [C // 2, 16] for a half step: int32 elements holding
    the fp16 pair (channel 2i low, 2i + 1 high) M_p + 2^(p + k) * bit.

    Row m of the operand is token 2 (m % 8) + m // 8 of the half (`token_rows`), so that the
    two rows of a thread (r and 8 + r) are tokens 2r and 2r + 1, in the same byte of the plane
    words: one prmt (selector `sel` [8], per row r) puts that byte of both channels' words
    we, wo [C // 2] (32 tokens each) side by side (even channel in the low half), and one
    masking per row takes a token's bit where it lies, at k = its token % 8 (`bit_e`, `bit_o`
    = 0x10001 << k). ORed into magic_p = 1024 * 2^p, a bit at mantissa position k adds
    2^(p + k): no shift and no "- 1024" per element; `_half_scores` takes the per-row factor
    2^-k and the constant out of the accumulator.
    """
    w = _byte_perm_by(we[:, None], wo[:, None], sel[None, :])  # [C // 2, 8]
    x = gl.join((w & bit_e[None, :]) | magic_p, (w & bit_o[None, :]) | magic_p)
    C2: gl.constexpr = w.shape[0]
    return gl.reshape(gl.permute(x, [0, 2, 1]), [C2, 16])


@gluon.jit
def _half_scores(u, u_hi, c0, bias, lw, hw, sel_lo, sel_hi, bits_lo, bits_hi, inv_pos, half: gl.constexpr, magic,
                 B_LOW: gl.constexpr, NH: gl.constexpr, SAL: gl.constexpr, D: gl.constexpr,
                 NSC_P: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr):
    """Scores S^T [16 tokens, 8 heads] of half step `half` of a 32-token word: the keys are the A
    operand and u^T [D, 8] the B operand (N = 8 heads: half the MMAs and accumulator registers
    of [16 heads, 16 tokens], since GQ <= 8).

    One MMA per bit plane: plane p's operand is 2^p * (1024 + 2^k * bit) (`_plane_pairs`,
    k = token % 8; rows are tokens in `_token_of_row` order); the low planes of every channel
    against u into one accumulator, the salient channels' high planes against
    u_hi = u[:, salient] * 2^b_low into a second one. They start
    at c0 = -1024 * (sum u * (2^b_low - 1) + sum u_hi * (2^NH - 1)) in total, the planes'
    constant part, which leaves 2^k * (codes @ u); inv_pos = 2^-k per token (row) and the
    zero-point bias finish it. The constant cancels in fp32 (up to ~2^13 times the smallest
    term, ~11 of 24 bits); its cost in accuracy is
    in docs/kernels.md.
    """
    acc = gl.zeros([16, 8], gl.float32, layout=MMA) + c0[None, :]
    for p in gl.static_range(B_LOW):
        x = _plane_pairs(lw[2 * p], lw[2 * p + 1], sel_lo + half * 0x0202, bits_lo[0], bits_lo[1],
                         magic + p * 0x04000400)
        acc = mma_v2(_plane_operand(x, D, A_OP), u, acc)
    if NH > 0:
        if SAL:
            # A second accumulator: two shorter dependent MMA chains instead of one long one.
            acc_hi = gl.zeros([16, 8], gl.float32, layout=MMA)
            for p in gl.static_range(NH):
                x = _plane_pairs(hw[2 * p], hw[2 * p + 1], sel_hi + half * 0x0202, bits_hi[0], bits_hi[1],
                                 magic + p * 0x04000400)
                acc_hi = mma_v2(_plane_operand(x, NSC_P, A_OP), u_hi, acc_hi)
            acc = acc + acc_hi
    return acc * inv_pos[:, None] + bias[None, :]


@gluon.jit
def _parity_offsets(C2: gl.constexpr, G32: gl.constexpr, L: gl.constexpr):
    """[parity, pair] -> the offset of channel 2 pair + parity's word in a plane (channels G32 words apart)."""
    par = gl.arange(0, 2, layout=gl.SliceLayout(1, L))
    pair = gl.arange(0, C2, layout=gl.SliceLayout(0, L))
    return (par[:, None] + 2 * pair[None, :]) * G32


@gluon.jit
def _issue_step(step, valid, stage, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks, klo, khi, vp, vsc, vze, ksc,
                kze, off_lo, off_hi, m_hi, off_v, off_s, off_k, G32: gl.constexpr, B_LOW: gl.constexpr,
                D: gl.constexpr, NH: gl.constexpr, n_sc, SAL: gl.constexpr, NW: gl.constexpr, SW: gl.constexpr,
                PL_P: gl.constexpr, PH_P: gl.constexpr):
    """Starts the asynchronous copies of word step `step` (32 tokens) into ring slot `stage`: the
    plane words of every channel (low) and salient channel (high), the value words, scales and
    zeros, and at a group's first step the group's key scale and zero rows. `valid` False (past
    the split's end) copies nothing; the commit is still made, so the group count stays regular.

    A plane's words are copied 32 consecutive channels at a time (both parities of 16 pairs,
    `cp_rows`), 4 B each, G / 8 bytes apart: 4 cache lines a copy at G = 128, where a copy of
    one parity's words would touch 8 (the L1's work is one wavefront per line)."""
    g = step // G32
    wd = step % G32
    lo = klo + g * (B_LOW * D * G32) + wd
    for p in gl.static_range(B_LOW):
        _async_load(buf_lo.index(stage * PL_P + p), lo + p * (D * G32) + off_lo, mask=(off_lo >= 0) & valid)
    if NH > 0:
        if SAL:
            hi = khi + g * (NH * n_sc * G32) + wd
            for p in gl.static_range(NH):
                _async_load(buf_hi.index(stage * PH_P + p), hi + p * (n_sc * G32) + off_hi, mask=m_hi & valid)
    for half in gl.static_range(2):
        t0 = step * 32 + half * 16
        _async_load(buf_v.index(stage * 2 + half), vp + t0 * NW + off_v,
                                               mask=(off_v >= 0) & valid)
        _async_load(buf_sc.index(stage * 2 + half), vsc + (t0 // 2) * (SW // 8) + off_s,
                                               mask=(off_s >= 0) & valid)
        _async_load(buf_ze.index(stage * 2 + half), vze + (t0 // 2) * (SW // 8) + off_s,
                                               mask=(off_s >= 0) & valid)
    first = (off_k >= 0) & valid & (wd == 0)
    _async_load(buf_ks.index(stage * 2), ksc + g * D + off_k, mask=first)
    _async_load(buf_ks.index(stage * 2 + 1), kze + g * D + off_k, mask=first)
    async_copy.commit_group()


@gluon.jit
def _parity_words(slot, PAR: gl.constexpr, L: gl.constexpr):
    """A ring slot's [parity, pairs] words of one plane -> the even and the odd channels' words [pairs], in L."""
    e, o = gl.split(gl.permute(slot.load(PAR), [1, 0]))
    return gl.convert_layout(e, L, assert_trivial=True), gl.convert_layout(o, L, assert_trivial=True)


@gluon.jit
def _smem_pair_words(buf, row0, N_PLANES: gl.constexpr, PAR: gl.constexpr, L: gl.constexpr):
    """Plane words [pairs] of the even and odd channels from a step's slots (plane) of `buf`
    starting at row0, planes 0..3 (unused planes repeat plane 0), in the order `_half_scores` takes."""
    e0, o0 = _parity_words(buf.index(row0), PAR, L)
    e1 = e0
    o1 = o0
    e2 = e0
    o2 = o0
    e3 = e0
    o3 = o0
    if N_PLANES > 1:
        e1, o1 = _parity_words(buf.index(row0 + 1), PAR, L)
    if N_PLANES > 2:
        e2, o2 = _parity_words(buf.index(row0 + 2), PAR, L)
    if N_PLANES > 3:
        e3, o3 = _parity_words(buf.index(row0 + 3), PAR, L)
    return e0, o0, e1, o1, e2, o2, e3, o3


@gluon.jit(do_not_specialize=["n_sc"])  # one compile serves every salient count of a size class
def _words_kernel(
    ops, pm_ptr, pl_ptr, pa_ptr, ksw_ptr,
    qk_scale, groups_per_split, n_parts, n_tail, tail_start, magic, n_sc,
    HKV: gl.constexpr, GQ: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
    B_LOW: gl.constexpr, NH: gl.constexpr, SAL: gl.constexpr, FULL: gl.constexpr, NSC_P: gl.constexpr,
    BV: gl.constexpr, GV: gl.constexpr, ONE_SCALE: gl.constexpr, BLOCK_R: gl.constexpr,
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V5: gl.constexpr,
    VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr, PAIRS_LO: gl.constexpr,
    PAIRS_HI: gl.constexpr, ROWS_LO: gl.constexpr, ROWS_HI: gl.constexpr, PAR_LO: gl.constexpr,
    PAR_HI: gl.constexpr,
    STAGES: gl.constexpr, PL_P: gl.constexpr, PH_P: gl.constexpr, SMEM1: gl.constexpr, CP_LO: gl.constexpr,
    CP_HI: gl.constexpr, CP_V: gl.constexpr, CP_S: gl.constexpr, CP_K: gl.constexpr,
):
    """Program (b * HKV + h, split): partial attention of KV head h's GQ <= 8 query heads.

    ops      `kernels.operands.DecodeOperands` (shapes, dtypes, packing axes there), with klo, khi
             int32 views of the key planes (PLANE_DTYPE) and vp, vsc, vze int32 views; strides
             count words
    ksw      not read (the block kernel's salient key scales)
    pm, pl   fp32 [B * HKV, n_parts, 8], pa fp32 [B * HKV, n_parts, 8, D]: partials (`kernels.combine`);
             rows past GQ are not written
    Program `split` is one of n_tail programs for the sinks and the residual (from tail_start) or a
    packed split of groups_per_split groups (`_packed_split`); magic = `common.FP16_PAIR_1024`.
    Bound like the block kernel by instruction issue and a warp's latency, with more instructions
    per token: 16-27% slower than it on the benchmark shapes (docs/kernels.md).
    """
    if FULL:  # the count fills its size class: a constant, as the compiler folds it into masks and offsets
        n_sc = NSC_P
    bh = gl.program_id(0)
    split = gl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    G32: gl.constexpr = G // 32  # words per channel and plane in a group
    CPW: gl.constexpr = 32 // BV  # value codes per word
    NW: gl.constexpr = D // CPW  # value words per token
    WPG: gl.constexpr = GV // CPW  # value words per value group
    NVG: gl.constexpr = D // GV
    SW: gl.constexpr = 8 if ONE_SCALE else 8 * NVG  # words of a half step's value scales (or zeros)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    # Query-side operands are computed in the accumulator layout (reductions need it) and moved
    # to the A-operand layout, which for 16-bit data holds the same elements in the same registers.
    rows_a = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    cols_a = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
    q_base = ops.q_ptr + b.to(gl.int64) * ops.stride_qb + (h * GQ + rows_a) * ops.stride_qh
    # Padded query rows are zero, so their scores stay finite (never -inf - -inf).
    # Kept in fp16 (half the registers of fp32): q * softmax scale * log2 e is well inside its range.
    q16 = (gl.load(q_base[:, None] + cols_a[None, :], mask=(rows_a < GQ)[:, None],
                   other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)  # the columns of acc^T
    part = bh.to(gl.int64) * n_parts + split
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)  # acc^T: channels x the first 8 heads
    packed = _packed_split(split, n_tail, tail_start)
    if packed >= 0:  # else one of the fp16 tail's splits: short programs
        n_groups = gl.load(ops.n_groups_ptr + b)
        g_start = packed * groups_per_split
        g_end = gl.minimum(g_start + groups_per_split, n_groups)
        ks_off, klo, khi, vp, vsc, vze = _head_operands(ops, b, h)
        # `_plane_pairs`, per row pair r: the byte of tokens 2r, 2r + 1 in the first half's two
        # bytes (both channels' words), and where each token's bit lies in it.
        r_lo = gl.arange(0, 8, layout=gl.SliceLayout(0, PAIRS_LO))
        r_hi = gl.arange(0, 8, layout=gl.SliceLayout(0, PAIRS_HI))
        sel_lo = (r_lo // 4) * 0x0101 + 0x0400
        sel_hi = (r_hi // 4) * 0x0101 + 0x0400
        bits_lo = (0x10001 << ((2 * r_lo) % 8), 0x10001 << ((2 * r_lo + 1) % 8))
        bits_hi = (0x10001 << ((2 * r_hi) % 8), 0x10001 << ((2 * r_hi + 1) % 8))
        t_s = gl.arange(0, 16, layout=ROW)
        inv_pos = gl.exp2(-(_token_of_row(t_s) & 7).to(gl.float32))  # 2^-k: the scores' per-row factor
        js_a = gl.arange(0, NSC_P, layout=gl.SliceLayout(0, MMA))
        order = ops.order_ptr + b.to(gl.int64) * ops.stride_ob + h * ops.stride_oh
        sal_a = gl.load(order + (D - n_sc) + js_a, mask=js_a < n_sc, other=0)
        q_sal = (gl.load(q_base[:, None] + sal_a[None, :], mask=(rows_a < GQ)[:, None] & (js_a < n_sc)[None, :],
                         other=0.0).to(gl.float32) * (qk_scale * (1 << B_LOW))).to(gl.float16)
        v_sel, v_mask = _value_selectors(BV, V5)  # `_value_codes`
        # Ring of STAGES word steps (32 tokens each) in shared memory, filled by asynchronous
        # copies STAGES - 2 steps ahead: the loads of a step are in flight while earlier steps
        # compute, instead of stalling the warp that needs them (and no registers hold them).
        # Every buffer but the plane words' is [slots x rows, row], indexed by one row number: a row is
        # one copy; the plane words' is [slots, parity, pairs], a slot (step, plane) one copy.
        buf_lo = gl.allocate_shared_memory(gl.int32, [STAGES * PL_P, 2, D // 2], ROWS_LO)  # slot (step, plane)
        buf_hi = gl.allocate_shared_memory(gl.int32, [STAGES * PH_P, 2, NSC_P // 2], ROWS_HI)
        buf_v = gl.allocate_shared_memory(gl.int32, [STAGES * 2, 16 * NW], SMEM1)  # half: [member, pair, word]
        # value scales, zeros: int32 words (two groups of a token), [token pair, word, pair member]
        buf_sc = gl.allocate_shared_memory(gl.int32, [STAGES * 2, SW], SMEM1)
        buf_ze = gl.allocate_shared_memory(gl.int32, [STAGES * 2, SW], SMEM1)
        buf_ks = gl.allocate_shared_memory(gl.float16, [STAGES * 2, D], SMEM1)  # key scale row, zero row
        # Element offsets of one row's copy, from the step's first word / token / row.
        off_lo = _parity_offsets(D // 2, G32, CP_LO)
        off_hi = _parity_offsets(NSC_P // 2, G32, CP_HI)
        m_hi = off_hi < n_sc * G32
        # Value words, scales and zeros reach the ring in row order (`_token_of_row`), as the
        # scores' rows: P^T's token pairs are then the values' and the scales' as stored.
        n_v = gl.arange(0, 16 * NW, layout=CP_V)  # [member e, pair i, word] -> row 2 i + e (`_value_codes`)
        v_rows = 2 * ((n_v // NW) % 8) + n_v // (8 * NW)
        off_v = _token_of_row(v_rows) * NW + n_v % NW
        n_s = gl.arange(0, SW, layout=CP_S)
        if ONE_SCALE:  # word r: the two tokens of rows r and 8 + r, 2 r and 2 r + 1
            off_s = n_s
        else:  # (pair i, word w, member e) -> word w of token 2i + e
            off_s = _token_of_row((n_s // NVG) * 2 + n_s % 2) * (NVG // 2) + (n_s // 2) % (NVG // 2)
        off_k = gl.arange(0, D, layout=CP_K)
        w_start = g_start * G32
        w_end = g_end * G32
        # The slot of the step before the first: the loop's first value product reads it with
        # P = 0, so its scales and zeros must be finite (0 x NaN would be NaN); codes always are.
        for half in gl.static_range(2):
            buf_sc.index((STAGES - 1) * 2 + half).store(gl.zeros([SW], gl.int32, layout=CP_S))
            buf_ze.index((STAGES - 1) * 2 + half).store(gl.zeros([SW], gl.int32, layout=CP_S))
        for i in gl.static_range(STAGES - 2):
            _issue_step(w_start + i, w_start + i < w_end, i, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks,
                        klo, khi, vp, vsc, vze, ops.ksc_ptr + ks_off, ops.kze_ptr + ks_off,
                        off_lo, off_hi, m_hi, off_v, off_s, off_k,
                        G32, B_LOW, D, NH, n_sc, SAL, NW, SW, PL_P, PH_P)
        u = gl.zeros([D, 8], gl.float16, layout=B_OP)  # u^T, u_hi^T: the first 8 heads
        u_hi = gl.zeros([NSC_P, 8], gl.float16, layout=B_OP)
        bias = gl.zeros([8], gl.float32, layout=HEADS)
        c0 = gl.zeros([8], gl.float32, layout=HEADS)
        m_h = gl.full([8], float("-inf"), gl.float32, layout=HEADS)
        l_t = gl.zeros([16, 8], gl.float32, layout=MMA)  # softmax sums per lane, reduced after the loop
        x0 = _pt_pairs(gl.zeros([16, 8], gl.float32, layout=MMA))  # P^T pairs of the step before: none
        x1 = x0
        acc_z = gl.zeros([16, 8], gl.float32, layout=MMA)  # `_value_products`: the zeros' part
        for w in range(w_start, w_end):  # word steps: 32 tokens each, G32 per group
            stage = (w - w_start) % STAGES
            before = (w - w_start + STAGES - 1) % STAGES  # the step before's slot
            async_copy.wait_group(STAGES - 3)  # this step's copies have landed ...
            _thread_barrier()  # ... for every lane, and every lane is done with the step before
            nxt = w + STAGES - 2
            _issue_step(nxt, nxt < w_end, (nxt - w_start) % STAGES, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks,
                        klo, khi, vp, vsc, vze, ops.ksc_ptr + ks_off, ops.kze_ptr + ks_off,
                        off_lo, off_hi, m_hi, off_v, off_s, off_k,
                        G32, B_LOW, D, NH, n_sc, SAL, NW, SW, PL_P, PH_P)
            g = w // G32
            if w % G32 == 0:  # a new group: its scales fold into the query, its zeros into a bias
                s_row = buf_ks.index(stage * 2).load(gl.SliceLayout(0, MMA)).to(gl.float32)
                z_row = buf_ks.index(stage * 2 + 1).load(gl.SliceLayout(0, MMA)).to(gl.float32)
                q32 = q16.to(gl.float32)
                u16 = (q32 * s_row[None, :]).to(gl.float16)
                u = _p_operand(u16, D, B_OP)
                bias = _first_heads(gl.sum(q32 * z_row[None, :], axis=1), HEADS)  # zero: u @ z
                # A gather the copies cannot do (2-byte elements); the row was just copied, so it hits cache.
                s_sal = gl.load(ops.ksc_ptr + ks_off + g * D + sal_a, mask=js_a < n_sc, other=0.0).to(gl.float32)
                u_hi16 = (q_sal.to(gl.float32) * s_sal[None, :]).to(gl.float16)
                u_hi = _p_operand(u_hi16, NSC_P, B_OP)
                # The planes' constant part (`_half_scores`), from the fp16 operands the MMAs see.
                c0 = _first_heads(-1024.0 * (gl.sum(u16.to(gl.float32), axis=1) * ((1 << B_LOW) - 1)
                                             + gl.sum(u_hi16.to(gl.float32), axis=1) * ((1 << NH) - 1)), HEADS)
            lw = _smem_pair_words(buf_lo, stage * PL_P, B_LOW, PAR_LO, gl.SliceLayout(1, PAIRS_LO))
            hw = _smem_pair_words(buf_hi, stage * PH_P, NH, PAR_HI, gl.SliceLayout(1, PAIRS_HI))
            # Both 16-token halves' scores (four independent MMA chains), then the value product
            # of the step before (its P^T pairs x0, x1): independent work for the scheduler to
            # interleave with this step's dependent chains (a warp has few neighbours to hide
            # them: 8 per SM). Then one online-softmax update for the 32 tokens.
            s0 = _half_scores(u, u_hi, c0, bias, lw, hw, sel_lo, sel_hi, bits_lo, bits_hi, inv_pos, 0, magic, B_LOW,
                              NH, SAL, D, NSC_P, MMA, A_OP)
            s1 = _half_scores(u, u_hi, c0, bias, lw, hw, sel_lo, sel_hi, bits_lo, bits_hi, inv_pos, 1, magic, B_LOW,
                              NH, SAL, D, NSC_P, MMA, A_OP)
            acc, acc_z = _step_values(buf_v, buf_sc, buf_ze, before * 2, x0, x1, acc, acc_z, v_sel, v_mask, D, NVG,
                                      ONE_SCALE, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
            m_new = gl.maximum(m_h, gl.max(gl.maximum(s0, s1), axis=0))
            alpha = gl.exp2(m_h - m_new)
            p0 = gl.exp2(s0 - m_new[None, :])
            p1 = gl.exp2(s1 - m_new[None, :])
            # Rescaled at every step, not under a branch: alpha is mostly 1, but the branch's
            # warp-wide test and its block boundary cost more than the 40 multiplications.
            acc, acc_z, l_t = _rescaled(acc, acc_z, l_t, alpha, ROW)
            l_t = l_t + p0 + p1
            m_h = m_new
            x0 = _pt_pairs(p0)
            x1 = _pt_pairs(p1)
        async_copy.wait_group(0)  # nothing may be left writing shared memory when the program ends
        # The last step's values (or, for an empty split, the zeroed slot before the first step).
        last = (gl.maximum(w_end - w_start, 0) + STAGES - 1) % STAGES
        acc, acc_z = _step_values(buf_v, buf_sc, buf_ze, last * 2, x0, x1, acc, acc_z, v_sel, v_mask, D, NVG,
                                  ONE_SCALE, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
        acc, c_r, m_fin, l_fin = _packed_partials(acc, acc_z, l_t, m_h, D, GV, BV, MMA)
    else:
        acc, c_r, m_fin, l_fin = _fp16_tail(ops, b, h, split - tail_start, n_tail, qk_scale, GQ, D, BLOCK_R,
                                            MMA, A_OP, B_OP)
    _store_partials(pm_ptr, pl_ptr, pa_ptr, part, acc, c_r, m_fin, l_fin, GQ, D, MMA)


KERNEL = _words_kernel
