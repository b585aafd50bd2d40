"""The Gluon decode kernel for key groups of a multiple of 128 tokens (`_block_kernel`, launched by
`kernels.gluon.launch`). The values, the fp16 tail and the partials are `common`'s.

Keys are the A operand of S^T[t, h] = codes^T[t, c] @ U^T[c, h] (U = query x key scale, one per
group; the zero point is a per-head bias). A program walks blocks of 128 tokens: a channel's 16
bytes of a plane are eight 16-token runs of 16 bits. One ldmatrix.trans per 8 channels gives each
row group of lanes one run of both channels of its pairs in one register (`_plane_words`), so
every byte is read once. A tile's row r is a token of run r, row 8 + r the next one
(`_token_of_row`): tile h of step s (8 tiles a block) takes bits 4 s + 2 h and the next of every
run, masked where they lie and ORed into 1024 * 2^p, which gives 1024 * 2^p + 2^(p + k) * bit
exactly (`_plane_pairs`). Every plane adds into one accumulator, one MMA a plane: the low planes of
all channels against U, the salient channels' high planes against U[:, salient] * 2^b_low (code =
low + 2^b_low * high); it starts at minus the planes' constant part, and each row is scaled by 2^-k.
No channel reordering, no gather of packed bytes. A tile's rows span the block, so its tokens must
share a group's U: G a multiple of 128.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pnmix.kernels.gluon.common import (
    _REINTERPRET_IS_PUBLIC,
    MAX_GQA,
    _async_load,
    _fp16_tail,
    _head_operands,
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
    flat_layout,
    gl,
    gluon,
    linear_layout,
    mma_v2,
    shared_layouts,
)
from pnmix.kernels.layout import next_pow2

BLOCK_TOKENS = 128  # tokens of a key plane's 16 bytes per channel: the unit of copies and softmax updates
PLANE_DTYPE = torch.int16  # the key planes as the kernel reads them: a channel's 16-token runs
# Value slots of the ring (`VSLOTS`, from the launch plan): with 2 a block's value products follow
# its own scores; with 3 they run one block later, beside the next block's scores (independent
# chains for the scheduler), while the copies of the block after fill the third slot.
VALUE_SLOTS = 2
# compile-time constants besides the shared ones and VSLOTS (`launch.kernel_constants`)
CONSTANTS: dict[str, int] = {}


@functools.cache
def layouts(d: int, value_bits: int, value_group: int, n_sc_p: int, one_scale: bool) -> dict[str, Any]:
    """The kernel's layout arguments: `common.shared_layouts` and the block's own.

    RUNS_LO, RUNS_HI: a plane's words of a block as int16 [channels, 8 runs] (a channel's 16 bytes),
    loaded so that a thread gets its pairs' runs in one register (ldmatrix.trans, `_plane_words`).
    SMEM2: rank-2 shared buffers (key planes [planes, channels, 8 runs], value scales and zeros
    [slots, 8 tiles, row]). The copies, 4 bytes a lane where the source is contiguous (a 4-byte copy
    costs the L1 one wavefront per cache line it touches): CP_KEYS a plane [channels, 8 runs] 8
    channels a copy, CP_S a block's value scale or zero words [8 tiles, row] in memory order,
    CP_SAL the words of the salient channels' key scales [n_sc_p].
    """
    nvg = d // value_group

    def runs(channels: int) -> Any:
        """int16 [channels, 8 runs]: `PAIRS_*` with the channel's parity as the first register."""
        regs = [[1, 0]] + [[8 << i, 0] for i in range((channels // 8).bit_length() - 1)]
        return linear_layout(regs, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [channels, 8])

    # A block's value scale (or zero) words [8 tiles, 8 token pairs x groups // 2 words x 2 members]
    # (`_value_scale_pairs`), copied so that the 32 lanes of a copy read 32 consecutive words: the
    # bits of a word's address in the block (`_issue_block`, `_token_of_row`), lowest first, are the
    # word in the token, then the token's: pair bit 2, tile bits 0-2, member, pair bits 0-1.
    wsb = nvg.bit_length() - 2  # word bits of a token's scales
    s_bits = ([[0, 2 << j] for j in range(wsb)] + [[0, 8 << wsb], [1, 0], [2, 0], [4, 0], [0, 1], [0, 2 << wsb],
                                                   [0, 4 << wsb]])
    cp_s = linear_layout(s_bits[5:], s_bits[:5], [8, 8 * nvg])
    if one_scale:  # [8 tiles, 8 words]: word r of tile t is the block's word t + 8 r (tile-major lanes)
        cp_s = linear_layout([[0, 4]], [[1, 0], [2, 0], [4, 0], [0, 1], [0, 2]], [8, 8])
    own = dict(RUNS_LO=runs(d), RUNS_HI=runs(n_sc_p),
               SMEM2=gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
               CP_KEYS=gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]), CP_S=cp_s, CP_SAL=flat_layout(1))
    return shared_layouts(d, value_bits, value_group, n_sc_p, one_scale) | own


def ring_bytes(d: int, b_low: int, b_high: int, n_salient: int, value_bits: int, value_group: int,
               value_slots: int = VALUE_SLOTS) -> int:
    """Shared memory of one program: its block buffers and the query (see the kernel's buffers)."""
    nsc_p = next_pow2(max(n_salient, 16))
    key_words = next_pow2(b_low) * d  # 16 bytes per (plane, channel); the high planes' only where used
    if b_high > b_low and n_salient:
        key_words += next_pow2(b_high - b_low) * nsc_p
    # Value words, scales and zeros: `value_slots` slots. Key plane words, scale and zero rows and the
    # words of the salient channels' scales: one (read into registers at a block's start, then refilled).
    values = BLOCK_TOKENS * d * value_bits // 8 + 2 * 2 * BLOCK_TOKENS * (d // value_group)
    keys = 16 * key_words + 2 * 2 * d + 4 * nsc_p
    return value_slots * values + keys + 2 * MAX_GQA * (d + nsc_p)  # + the query's (salient) channels


@gluon.jit
def _low_half_f16(x):
    """int32 -> the fp16 whose bits are its low half."""
    return x.to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _pack_halves(lo, hi):
    """int16 x 2 -> int32 (lo in the low half). Free where both already share a register (ldmatrix)."""
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _token_of_row(m):
    """The token of row m of a tile's score and value products, from the tile's first token: row
    r < 8 is the tile's token in run r (tokens 16 r to 16 r + 15 of the block), row 8 + r the one
    after it, so that a thread's two rows are adjacent bits of the 16 it holds per channel
    (`_plane_pairs`). Tile h of step s starts at token 4 s + 2 h of the block."""
    return 16 * (m % 8) + m // 8


@gluon.jit
def _plane_pairs(x, K: gl.constexpr, magic_p):
    """One bit plane's A-operand registers [C // 2, 16] for a tile: int32 elements holding the
    fp16 pair (channel 2i low, 2i + 1 high) M_p + 2^(p + k) * bit.

    x [C // 2, 8 runs] holds both channels' 16 bits of each run (`_block_words`), shifted down by
    8 for the block's last two steps. Row r of the tile (and 8 + r) is bit K (and K + 1) of run
    r (`_token_of_row`; K = 4 (step % 2) + 2 tile): one masking per row takes the bit where it
    lies, at k = K + row // 8 (both channels at once), and ORed into magic_p = 1024 * 2^p it adds
    2^(p + k): no shift per element and no "- 1024"; `_tile_scores` takes the per-row factor
    2^-k and the constant out of the accumulator.
    """
    e = (x & (0x10001 << K)) | magic_p
    o = (x & (0x10001 << (K + 1))) | magic_p
    C2: gl.constexpr = x.shape[0]
    return gl.reshape(gl.permute(gl.join(e, o), [0, 2, 1]), [C2, 16])


@gluon.jit
def _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, S: gl.constexpr, H: gl.constexpr, magic,
                 B_LOW: gl.constexpr, NH: gl.constexpr, SAL: gl.constexpr, D: gl.constexpr,
                 NSC_P: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr):
    """Scores S^T [16 tokens, 8 heads] of tile H of step S (`_token_of_row`): the keys are the A
    operand and u^T [D, 8] the B operand (N = 8 heads: half the MMAs and accumulator registers
    of [16 heads, 16 tokens], since GQ <= 8).

    One MMA per bit plane: plane p's operand is 2^p * (1024 + 2^k * bit) (`_plane_pairs`); the
    low planes of every channel against u into one accumulator, the salient channels' high
    planes against u_hi = u[:, salient] * 2^b_low into a second one. They start at
    c0 = -1024 * (sum u * (2^b_low - 1) + sum u_hi * (2^NH - 1)) in total, the planes' constant
    part, which leaves 2^k * (codes @ u); inv_pos[H] = 2^-k per row and the zero-point bias
    finish it. The constant cancels in fp32 (up to ~2^13 times the smallest term, ~11 of 24
    bits); its cost in accuracy is
    in docs/kernels.md.
    """
    K: gl.constexpr = 4 * (S % 2) + 2 * H
    lw_s = lw[0] if S < 2 else lw[1]
    hw_s = hw[0] if S < 2 else hw[1]
    acc = c0
    for p in gl.static_range(B_LOW):
        x = _plane_pairs(lw_s[p], K, magic + p * 0x04000400)
        acc = mma_v2(_plane_operand(x, D, A_OP), u, acc)
    if NH > 0:
        if SAL:
            for p in gl.static_range(NH):
                x = _plane_pairs(hw_s[p], K, magic + p * 0x04000400)
                acc = mma_v2(_plane_operand(x, NSC_P, A_OP), u_hi, acc)
    return acc * inv_pos[(S % 2) * 2 + H][:, None] + bias


@gluon.jit
def _run_offsets(C: gl.constexpr, G32: gl.constexpr, L: gl.constexpr):
    """[channel, half-word] -> its offset in a plane of a group (a channel's words are G32 words)."""
    c = gl.arange(0, C, layout=gl.SliceLayout(1, L))
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, L))
    return c[:, None] * (2 * G32) + j[None, :]


@gluon.jit
def _salient_rows(js, n_sc, NSC_P: gl.constexpr, FEW: gl.constexpr):
    """Row js of the salient buffers [NSC_P, ...] -> the salient channel it holds (its index among
    the n_sc) and whether its query counts. The buffers' first half holds channels 0 .. NSC_P / 2 - 1
    and the second half the last NSC_P / 2, n_sc - NSC_P / 2 .. n_sc - 1: every row a real channel,
    so the plane copies need no mask and cost what a count filling its class costs; a channel held
    twice counts in the first half only. With FEW (n_sc < NSC_P / 2, only in the class of 16) row
    js holds channel js, and the rows from n_sc on are not copied."""
    HALF: gl.constexpr = NSC_P // 2
    if FEW:
        ch = js
        keep = js < n_sc
    else:
        ch = gl.where(js < HALF, js, js + (n_sc - NSC_P))
        keep = gl.where(js < HALF, js < n_sc, ch >= HALF)
    return ch, keep


@gluon.jit
def _issue_block(blk, valid, slot, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks, klo, khi, vp, vsc, vze,
                 ksc, kze, off_lo, off_hi, off_v, off_s, off_k, G32: gl.constexpr,
                 B_LOW: gl.constexpr, D: gl.constexpr, NH: gl.constexpr, n_sc, SAL: gl.constexpr, NW: gl.constexpr,
                 SW: gl.constexpr, PL_P: gl.constexpr, PH_P: gl.constexpr, NSC_P: gl.constexpr, FULL: gl.constexpr,
                 FEW: gl.constexpr):
    """Starts the asynchronous copies of block `blk` (128 tokens): into the one-slot key buffers
    its 16 bytes of every channel's (low) and salient channel's (high) plane words, and at a
    group's first block the group's key scale and zero rows; into value slot `slot` the value
    words of its 8 tiles and its value scales and zeros. `valid` False (past the split's end)
    copies nothing. klo and khi count int16 halves of the plane words; off_hi covers the salient rows,
    or half of them where the count does not fill its class (`_salient_rows` says which channels each
    half holds). The caller commits."""
    GB: gl.constexpr = G32 // 4  # blocks per group
    g = blk // GB
    q8 = (blk % GB) * 8  # the block's first half-word in a channel's words of the group
    lo = klo + g * (B_LOW * D * G32 * 2) + q8
    for p in gl.static_range(B_LOW):
        _async_load(buf_lo.index(p), lo + p * (D * G32 * 2) + off_lo, mask=(off_lo >= 0) & valid)
    if NH > 0:
        if SAL:
            hi = khi + g * (NH * n_sc * G32 * 2) + q8
            HALF: gl.constexpr = NSC_P // 2
            for p in gl.static_range(NH):
                plane = hi + p * (n_sc * G32 * 2)
                rows = buf_hi.index(p)
                if FULL:  # off_hi covers every row
                    _async_load(rows, plane + off_hi, mask=(off_hi >= 0) & valid)
                elif FEW:  # rows 0 .. n_sc - 1 of the first half
                    _async_load(rows.slice(0, HALF), plane + off_hi, mask=(off_hi < n_sc * G32 * 2) & valid)
                else:  # channels 0 .. HALF - 1, then the last HALF
                    _async_load(rows.slice(0, HALF), plane + off_hi, mask=(off_hi >= 0) & valid)
                    _async_load(rows.slice(HALF, HALF), plane + (n_sc - HALF) * (G32 * 2) + off_hi,
                                mask=(off_hi >= 0) & valid)
    for tile in gl.static_range(8):
        _async_load(buf_v.index(slot * 8 + tile), vp + (blk * 128 + 2 * tile) * NW + off_v,
                    mask=(off_v >= 0) & valid)
    _async_load(buf_sc.index(slot), vsc + blk * (8 * SW) + off_s, mask=(off_s >= 0) & valid)
    _async_load(buf_ze.index(slot), vze + blk * (8 * SW) + off_s, mask=(off_s >= 0) & valid)
    first = (off_k >= 0) & valid & (q8 == 0)
    _async_load(buf_ks.index(0), ksc + g * D + off_k, mask=first)
    _async_load(buf_ks.index(1), kze + g * D + off_k, mask=first)


@gluon.jit
def _issue_salient_scales(blk, valid, buf_ss, ksw, off_ss, G32: gl.constexpr, D: gl.constexpr):
    """At a group's first block, the copy of the words holding its salient channels' key scales
    (ksw: the scales as int32; off_ss -1 for padding). The caller commits."""
    GB: gl.constexpr = G32 // 4  # blocks per group
    _async_load(buf_ss.index(0), ksw + (blk // GB) * (D // 2) + off_ss,
                mask=(off_ss >= 0) & valid & (blk % GB == 0))


@gluon.jit
def _plane_words(slot, RUNS: gl.constexpr, PAIRS: gl.constexpr):
    """A ring slot's [channels, 8 runs] int16 of one plane -> [pairs, 8 runs] int32 (even channel low).
    RUNS puts a pair's two channels in one register's halves: ldmatrix.trans, 4 L1 wavefronts
    per 512 bytes with no byte read twice."""
    x = slot.load(RUNS)
    C: gl.constexpr = x.shape[0]
    lo, hi = gl.split(gl.permute(gl.reshape(x, [C // 2, 2, 8]), [0, 2, 1]))
    return gl.convert_layout(_pack_halves(lo, hi), PAIRS, assert_trivial=True)


@gluon.jit
def _block_words(buf, row0, N_PLANES: gl.constexpr, RUNS: gl.constexpr, PAIRS: gl.constexpr):
    """Plane words [pairs, 8 runs] of a block's slot of `buf` starting at row0, planes 0..3
    (unused planes repeat plane 0), in the order `_tile_scores` takes."""
    w0 = _plane_words(buf.index(row0), RUNS, PAIRS)
    w1 = w0
    w2 = w0
    w3 = w0
    if N_PLANES > 1:
        w1 = _plane_words(buf.index(row0 + 1), RUNS, PAIRS)
    if N_PLANES > 2:
        w2 = _plane_words(buf.index(row0 + 2), RUNS, PAIRS)
    if N_PLANES > 3:
        w3 = _plane_words(buf.index(row0 + 3), RUNS, PAIRS)
    return w0, w1, w2, w3


@gluon.jit
def _rows_view(buf, SHAPE: gl.constexpr, LAYOUT: gl.constexpr):
    """The same shared memory as [rows, row] (rank-1 layout), so that one index picks a row."""
    if _REINTERPRET_IS_PUBLIC:
        view = buf.reinterpret(gl.int32, SHAPE, LAYOUT)
    else:
        view = buf._reinterpret(gl.int32, SHAPE, LAYOUT)
    return view


@gluon.jit
def _softmax_step(s0, s1, m, l_t, row0, acc, acc_z, buf_v, sc_rows, ze_rows, sel, mask, VALUES: gl.constexpr,
                  D: gl.constexpr, NVG: gl.constexpr, ONE_SCALE: gl.constexpr, WPG: gl.constexpr,
                  MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V5: gl.constexpr,
                  VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr):
    """A step's probabilities P = 2^(s - m) of its two tiles' scores s0, s1 as the value product's
    P^T pairs (`_pt_pairs`), the softmax sums l_t with them added, and where VALUES their value
    product (rows row0, row0 + 1 of the value buffers) into acc, acc_z."""
    p0 = gl.exp2(s0 - m[None, :])
    p1 = gl.exp2(s1 - m[None, :])
    x0 = _pt_pairs(p0)
    x1 = _pt_pairs(p1)
    if VALUES:
        acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, row0, x0, x1, acc, acc_z, sel, mask, D, NVG, ONE_SCALE,
                                  WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
    return x0, x1, l_t + p0 + p1, acc, acc_z


@gluon.jit
def _block_values(buf_v, sc_rows, ze_rows, row0, x00, x01, x10, x11, x20, x21, x30, x31, acc, acc_z, sel, mask,
                  D: gl.constexpr, NVG: gl.constexpr, ONE_SCALE: gl.constexpr, WPG: gl.constexpr,
                  MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V5: gl.constexpr,
                  VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr):
    """The value products of a block's 4 steps (value rows row0 ..), P^T pairs x00 .. x31 by tile."""
    acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, row0, x00, x01, acc, acc_z, sel, mask, D, NVG, ONE_SCALE,
                              WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
    acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, row0 + 2, x10, x11, acc, acc_z, sel, mask, D, NVG, ONE_SCALE,
                              WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
    acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, row0 + 4, x20, x21, acc, acc_z, sel, mask, D, NVG, ONE_SCALE,
                              WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
    acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, row0 + 6, x30, x31, acc, acc_z, sel, mask, D, NVG, ONE_SCALE,
                              WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
    return acc, acc_z


# Runtime sizes are never specialised: one compile serves every salient count of a size class and
# every batch, context and split plan (a campaign trial decodes items at one batch and measures
# throughput at another; each would otherwise compile the same config again).
@gluon.jit(do_not_specialize=["n_sc", "groups_per_split", "n_parts", "n_tail", "tail_start"])
def _block_kernel(
    ops, pm_ptr, pl_ptr, pa_ptr, ksw_ptr,
    qk_scale, groups_per_split, n_parts, n_tail, tail_start, magic, n_sc,
    HKV: gl.constexpr, GQ: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
    B_LOW: gl.constexpr, NH: gl.constexpr, SAL: gl.constexpr, FULL: gl.constexpr, FEW: gl.constexpr,
    NSC_P: gl.constexpr,
    BV: gl.constexpr, GV: gl.constexpr, ONE_SCALE: gl.constexpr, BLOCK_R: gl.constexpr,
    VSLOTS: gl.constexpr,
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V5: gl.constexpr,
    VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr, PAIRS_LO: gl.constexpr,
    PAIRS_HI: gl.constexpr, RUNS_LO: gl.constexpr, RUNS_HI: gl.constexpr,
    PL_P: gl.constexpr, PH_P: gl.constexpr, SMEM1: gl.constexpr, SMEM2: gl.constexpr, CP_KEYS: gl.constexpr,
    CP_V: gl.constexpr, CP_S: gl.constexpr, CP_K: gl.constexpr, CP_SAL: gl.constexpr,
):
    """Program (b * HKV + h, split): partial attention of KV head h's GQ <= 8 query heads.

    ops      `kernels.operands.DecodeOperands` (shapes, dtypes, packing axes there), with klo, khi
             int16 views of the key planes (PLANE_DTYPE) and vp, vsc, vze int32 views; strides
             count those units
    ksw      int32 [B, HKV, NG_cap, D // 2]: the key scales as words (the salient ones are copied by word)
    pm, pl   fp32 [B * HKV, n_parts, 8], pa fp32 [B * HKV, n_parts, 8, D]: partials (`kernels.combine`);
             rows past GQ are not written
    Program `split` is one of n_tail programs for the sinks and the residual (from tail_start) or a
    packed split of groups_per_split groups (`_packed_split`); magic = `common.FP16_PAIR_1024`.
    A packed split copies block i + 1 (cp.async) while it computes block i: 8 tiles of scores (16
    independent MMA chains), one online-softmax update for the 128 tokens, 4 steps of value products.
    Bound by instruction issue and a warp's latency, not by bytes: 8 warps an SM (registers), about
    half the copy bandwidth at 32 x 32K on an H200 (docs/kernels.md).
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
    SW: gl.constexpr = 8 if ONE_SCALE else 8 * NVG  # words of a tile's value scales (or zeros)
    DELAY: gl.constexpr = VSLOTS == 3  # a block's value products run in the next block's loop
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)  # the columns of acc^T
    part = bh.to(gl.int64) * n_parts + split
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)  # acc^T: channels x the first 8 heads
    packed = _packed_split(split, n_tail, tail_start)
    if packed >= 0:  # else one of the fp16 tail's splits: short programs
        ks_off, klo, khi, vp, vsc, vze = _head_operands(ops, b, h)
        t_s = gl.arange(0, 16, layout=ROW)
        inv0 = gl.exp2(-(t_s // 8).to(gl.float32))  # 2^-k: the scores' per-row factor (`_plane_pairs`)
        inv_pos = (inv0, inv0 * 0.25, inv0 * 0.0625, inv0 * 0.015625)  # K = 0, 2, 4, 6
        v_sel, v_mask = _value_selectors(BV, V5)  # `_value_codes`
        # Shared memory for blocks of 128 tokens. Block i + 1's copies are issued at block i's
        # start, once its key words, key scale rows and salient scale words are in registers
        # (those buffers have one slot), and waited for at block i + 1's start: a whole block of
        # cover. The value buffers have VSLOTS slots: 2, block i's value products read one while
        # the copies fill the other; 3 (DELAY), block i's scores run beside block i - 1's value
        # products. Buffers of rows are [slots x rows, row], indexed by one row.
        buf_lo = gl.allocate_shared_memory(gl.int16, [PL_P, D, 8], SMEM2)  # plane: [channel, run]
        buf_hi = gl.allocate_shared_memory(gl.int16, [PH_P, NSC_P, 8], SMEM2)
        buf_v = gl.allocate_shared_memory(gl.int32, [VSLOTS * 8, 16 * NW], SMEM1)  # (slot, tile): [e, pair, word]
        # value scales, zeros: int32 words (two groups of a token), [token pair, word, pair member] a
        # tile; copied a block at a time, read a tile (row) at a time
        buf_sc = gl.allocate_shared_memory(gl.int32, [VSLOTS, 8, SW], SMEM2)
        buf_ze = gl.allocate_shared_memory(gl.int32, [VSLOTS, 8, SW], SMEM2)
        sc_rows = _rows_view(buf_sc, [VSLOTS * 8, SW], SMEM1)
        ze_rows = _rows_view(buf_ze, [VSLOTS * 8, SW], SMEM1)
        if DELAY:  # the slot "before block 0": block 0's loop reads it with P = 0, so its scales and
            # zeros must be finite (0 x NaN is NaN); codes always are. Block 2's copies refill it.
            buf_sc.index(VSLOTS - 1).store(gl.zeros([8, SW], gl.int32, layout=CP_S))
            buf_ze.index(VSLOTS - 1).store(gl.zeros([8, SW], gl.int32, layout=CP_S))
        buf_ks = gl.allocate_shared_memory(gl.float16, [2, D], SMEM1)  # key scale row, zero row
        buf_ss = gl.allocate_shared_memory(gl.int32, [1, NSC_P], SMEM1)  # the words of the salient scales
        # Element offsets of the copies, from the block's first word / token / row.
        off_lo = _run_offsets(D, G32, CP_KEYS)
        off_hi = _run_offsets(NSC_P if FULL else NSC_P // 2, G32, CP_KEYS)  # all rows, or a half
        # Value words, scales and zeros reach the ring in row order (`_token_of_row`), as the
        # scores' rows: P^T's token pairs are then the values' and the scales' as stored.
        n_v = gl.arange(0, 16 * NW, layout=CP_V)  # [member e, pair i, word] -> row 2 i + e (`_value_codes`)
        v_rows = 2 * ((n_v // NW) % 8) + n_v // (8 * NW)
        off_v = _token_of_row(v_rows) * NW + n_v % NW
        # [tile, (pair i, word w, member e)] -> word w of the tile's token 2 i + e (tile h of step s
        # starts at token 4 s + 2 h = 2 tile)
        tile_s = gl.arange(0, 8, layout=gl.SliceLayout(1, CP_S))
        n_s = gl.arange(0, SW, layout=gl.SliceLayout(0, CP_S))
        if ONE_SCALE:  # word r: the two tokens of rows r and 8 + r, 2 tile + 16 r and the next
            off_s = tile_s[:, None] + 8 * n_s[None, :]
        else:
            off_s = ((2 * tile_s[:, None] + _token_of_row((n_s[None, :] // NVG) * 2 + n_s[None, :] % 2))
                     * (NVG // 2) + (n_s[None, :] // 2) % (NVG // 2))
        off_k = gl.arange(0, D, layout=CP_K)
        # Block 0's copies first, before the lengths and the query are read: they overlap those
        # round trips to memory. Every split's first block lies within the capacity, so the copy
        # is safe before the length says whether the block is held (when not, the loop skips it).
        g_start = packed * groups_per_split
        b_start = g_start * (G32 // 4)
        _issue_block(b_start, b_start >= 0, 0, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks, klo, khi, vp,
                     vsc, vze, ops.ksc_ptr + ks_off, ops.kze_ptr + ks_off, off_lo, off_hi, off_v, off_s, off_k,
                     G32, B_LOW, D, NH, n_sc, SAL, NW, SW, PL_P, PH_P, NSC_P, FULL, FEW)
        async_copy.commit_group()
        n_groups = gl.load(ops.n_groups_ptr + b)
        g_end = gl.minimum(g_start + groups_per_split, n_groups)
        n_blk = gl.maximum(g_end - g_start, 0) * (G32 // 4)
        # The query as the key product's B operand, q^T [D, 8 heads] (padded heads zero), and its
        # salient channels' [NSC_P, 8]; kept in fp16 (half the registers of fp32): q * softmax
        # scale * log2 e is well inside its range.
        KCOL: gl.constexpr = gl.SliceLayout(1, B_OP)  # the channels (rows) of a B operand
        q_heads = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
        q_rows = ops.q_ptr + b.to(gl.int64) * ops.stride_qb + (h * GQ + q_heads) * ops.stride_qh
        q_c = gl.arange(0, D, layout=KCOL)
        q_t = (gl.load(q_rows[None, :] + q_c[:, None], mask=(q_heads < GQ)[None, :],
                       other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
        js = gl.arange(0, NSC_P, layout=KCOL)
        order = ops.order_ptr + b.to(gl.int64) * ops.stride_ob + h * ops.stride_oh
        js, keep = _salient_rows(js, n_sc, NSC_P, FEW)  # rows -> salient channels (js below: the channel)
        sal = gl.load(order + (D - n_sc) + js, mask=keep, other=0)
        q_sal = (gl.load(q_rows[None, :] + sal[:, None], mask=(q_heads < GQ)[None, :] & keep[:, None],
                         other=0.0).to(gl.float32) * (qk_scale * (1 << B_LOW))).to(gl.float16)
        # In shared memory, not registers: they are read once per group, and the loop's registers
        # decide how many programs an SM holds.
        buf_q = gl.allocate_shared_memory(gl.float16, [D, 8], SMEM2, q_t)
        buf_qs = gl.allocate_shared_memory(gl.float16, [NSC_P, 8], SMEM2, q_sal)
        js_cp, keep_cp = _salient_rows(gl.arange(0, NSC_P, layout=CP_SAL), n_sc, NSC_P, FEW)
        # Every row's word is copied (a row not kept holds a real channel's, or channel 0's with FEW), so
        # its scale is finite and the zero query of the row is the whole mask.
        off_ss = gl.load(order + (D - n_sc) + js_cp, mask=keep_cp, other=0) // 2
        # The words of the salient channels' scales need the channel order: their own copy group.
        _issue_salient_scales(b_start, n_blk > 0, buf_ss, ksw_ptr + ks_off // 2, off_ss, G32, D)
        async_copy.commit_group()
        u = gl.zeros([D, 8], gl.float16, layout=B_OP)  # u^T, u_hi^T: the first 8 heads
        u_hi = gl.zeros([NSC_P, 8], gl.float16, layout=B_OP)
        bias = gl.zeros([16, 8], gl.float32, layout=MMA)  # per head, the same in every row
        c0 = gl.zeros([16, 8], gl.float32, layout=MMA)
        m_h = gl.full([8], float("-inf"), gl.float32, layout=HEADS)
        l_t = gl.zeros([16, 8], gl.float32, layout=MMA)  # softmax sums per lane, reduced after the loop
        acc_z = gl.zeros([16, 8], gl.float32, layout=MMA)  # `_value_products`: the zeros' part
        # P^T pairs, one per tile (with DELAY, the previous block's: none before block 0).
        x00 = _pt_pairs(gl.zeros([16, 8], gl.float32, layout=MMA))
        x01 = x00
        x10 = x00
        x11 = x00
        x20 = x00
        x21 = x00
        x30 = x00
        x31 = x00
        # With DELAY the value slots rotate (previous, this block's, the next copies'): carried, so
        # that no slot number is taken modulo 3 in the loop.
        s_prev = VSLOTS - 1
        s_next = 1
        for i in range(0, n_blk):  # blocks: 128 tokens, 8 tiles of 16
            blk = b_start + i
            nxt = s_next if DELAY else 1 - i % 2  # (2 slots: the other one)
            async_copy.wait_group(0)  # this block's copies have landed ...
            _thread_barrier()  # ... for every lane, and every lane is done with the previous block's slot
            if blk % (G32 // 4) == 0:  # a new group: its scales fold into the query, its zeros into a bias
                # u = q x key scale (one fp16 rounding of an exact product);
                # the zero point's bias and the planes' constant part c0 as MMAs, sums over the
                # channels in fp32 like the scores' own (every row of those tiles is the same).
                q_t = buf_q.load(B_OP)
                u = q_t * buf_ks.index(0).load(KCOL)[:, None]
                z_a = gl.expand_dims(buf_ks.index(1).load(gl.SliceLayout(0, A_OP)), 0)
                bias = mma_v2(z_a + gl.zeros([16, D], gl.float16, layout=A_OP), q_t,
                              gl.zeros([16, 8], gl.float32, layout=MMA))  # zero: z @ q
                # The salient channels' scales: each in the low or high half of its copied word.
                s_word = buf_ss.index(0).load(KCOL)
                s_sal = _low_half_f16(s_word >> ((sal % 2) * 16))
                u_hi = buf_qs.load(B_OP) * s_sal[:, None]
                c0 = mma_v2(gl.full([16, D], -1024.0 * ((1 << B_LOW) - 1), gl.float16, layout=A_OP), u,
                            gl.zeros([16, 8], gl.float32, layout=MMA))
                c0 = mma_v2(gl.full([16, NSC_P], -1024.0 * ((1 << NH) - 1), gl.float16, layout=A_OP),
                            u_hi, c0)
            lw = _block_words(buf_lo, 0, B_LOW, RUNS_LO, PAIRS_LO)
            hw = _block_words(buf_hi, 0, NH, RUNS_HI, PAIRS_HI)
            # Bits 8-15 of the runs (steps 2 and 3) shifted into the fp16 mantissa once per block.
            lw = (lw, (lw[0] >> 8, lw[1] >> 8, lw[2] >> 8, lw[3] >> 8))
            hw = (hw, (hw[0] >> 8, hw[1] >> 8, hw[2] >> 8, hw[3] >> 8))
            _thread_barrier()  # every lane has read the key slots, which the next block's copies refill
            _issue_block(blk + 1, i + 1 < n_blk, nxt, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks,
                         klo, khi, vp, vsc, vze, ops.ksc_ptr + ks_off, ops.kze_ptr + ks_off, off_lo, off_hi,
                         off_v, off_s, off_k, G32, B_LOW, D, NH, n_sc, SAL, NW, SW, PL_P, PH_P, NSC_P, FULL, FEW)
            _issue_salient_scales(blk + 1, i + 1 < n_blk, buf_ss, ksw_ptr + ks_off // 2, off_ss, G32, D)
            async_copy.commit_group()
            # The block's 8 tiles of scores (16 independent MMA chains), with DELAY each step's pair
            # beside the value product of the previous block's step; one online-softmax update for
            # the 128 tokens; without DELAY then the value products of its 4 steps.
            s00 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 0, 0, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            s01 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 0, 1, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            if DELAY:
                acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, s_prev * 8, x00, x01, acc, acc_z, v_sel,
                                          v_mask, D, NVG, ONE_SCALE, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS,
                                          PAIRS4)
            s10 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 1, 0, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            s11 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 1, 1, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            if DELAY:
                acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, s_prev * 8 + 2, x10, x11, acc, acc_z, v_sel,
                                          v_mask, D, NVG, ONE_SCALE, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS,
                                          PAIRS4)
            s20 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 2, 0, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            s21 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 2, 1, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            if DELAY:
                acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, s_prev * 8 + 4, x20, x21, acc, acc_z, v_sel,
                                          v_mask, D, NVG, ONE_SCALE, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS,
                                          PAIRS4)
            s30 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 3, 0, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            s31 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 3, 1, magic, B_LOW, NH, SAL, D, NSC_P, MMA, A_OP)
            if DELAY:
                acc, acc_z = _step_values(buf_v, sc_rows, ze_rows, s_prev * 8 + 6, x30, x31, acc, acc_z, v_sel,
                                          v_mask, D, NVG, ONE_SCALE, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS,
                                          PAIRS4)
            s_max = gl.maximum(gl.maximum(gl.maximum(s00, s01), gl.maximum(s10, s11)),
                               gl.maximum(gl.maximum(s20, s21), gl.maximum(s30, s31)))
            m_new = gl.maximum(m_h, gl.max(s_max, axis=0))
            acc, acc_z, l_t = _rescaled(acc, acc_z, l_t, gl.exp2(m_h - m_new), ROW)  # all earlier blocks' sums
            m_h = m_new
            # Each step's probabilities; without DELAY then its value product (this block's slot).
            x00, x01, l_t, acc, acc_z = _softmax_step(s00, s01, m_new, l_t, (i % VSLOTS) * 8, acc, acc_z, buf_v,
                                                      sc_rows, ze_rows, v_sel, v_mask, not DELAY, D, NVG, ONE_SCALE,
                                                      WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
            x10, x11, l_t, acc, acc_z = _softmax_step(s10, s11, m_new, l_t, (i % VSLOTS) * 8 + 2, acc, acc_z, buf_v,
                                                      sc_rows, ze_rows, v_sel, v_mask, not DELAY, D, NVG, ONE_SCALE,
                                                      WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
            x20, x21, l_t, acc, acc_z = _softmax_step(s20, s21, m_new, l_t, (i % VSLOTS) * 8 + 4, acc, acc_z, buf_v,
                                                      sc_rows, ze_rows, v_sel, v_mask, not DELAY, D, NVG, ONE_SCALE,
                                                      WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
            x30, x31, l_t, acc, acc_z = _softmax_step(s30, s31, m_new, l_t, (i % VSLOTS) * 8 + 6, acc, acc_z, buf_v,
                                                      sc_rows, ze_rows, v_sel, v_mask, not DELAY, D, NVG, ONE_SCALE,
                                                      WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
            if DELAY:
                s_prev, s_next = 3 - s_prev - s_next, s_prev  # this block's slot, the previous one's
        async_copy.wait_group(0)  # nothing may be left writing shared memory when the program ends
        if DELAY:  # the last block's value products (or, for an empty split, P = 0 on the zeroed slot)
            _thread_barrier()  # (an empty split's loop had no barrier after the zeroed slot's stores)
            acc, acc_z = _block_values(buf_v, sc_rows, ze_rows, ((n_blk + VSLOTS - 1) % VSLOTS) * 8, x00, x01, x10,
                                       x11, x20, x21, x30, x31, acc, acc_z, v_sel, v_mask, D, NVG, ONE_SCALE, WPG,
                                       MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
        acc, c_r, m_fin, l_fin = _packed_partials(acc, acc_z, l_t, m_h, D, GV, BV, MMA)
    else:
        acc, c_r, m_fin, l_fin = _fp16_tail(ops, b, h, split - tail_start, n_tail, qk_scale, GQ, D, BLOCK_R,
                                            MMA, A_OP, B_OP)
    _store_partials(pm_ptr, pl_ptr, pa_ptr, part, acc, c_r, m_fin, l_fin, GQ, D, MMA)


KERNEL = _block_kernel
