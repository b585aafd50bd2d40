"""What both Gluon decode kernels share: Gluon itself, the fragment layouts, the value product,
the fp16 tail (sinks and residual) and the partials.

`block` (groups of a multiple of 128 tokens) and `words` (32 or 64) differ only in how they read
the keys. One warp a program; everything is held in mma.sync m16n8k16 fragments, transposed so
that N is the at most 8 query heads of a KV head: scores S^T [16 tokens, 8 heads], values
acc^T [d, 8 heads] (half the MMAs and registers of [16 heads, ...]).

Values are the A operand of acc^T += V^T @ (P^T x scale). A code is masked where it lies in its
byte (bit k) and read as the subnormal fp16 2^(k - 24) q, exactly, with no offset (an offset would
grow in the accumulator, whose sums the tensor cores truncate). A value group's scale varies along
the MMA's K (tokens), so each group has its own MMA, whose B operand is P^T's fp16 pairs times that
group's scale pairs; the zeros' part is one MMA per pair of groups; 2^(24 - k) and the zeros are
applied once, at a program's end. Design and measurements: docs/kernels.md.
"""

from __future__ import annotations

import functools
from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Names that changed after Triton 3.6 (the GPU image's): the barrier of a program's threads, the
# asynchronous global -> shared copy (same arguments), and the shared-memory view of another type.
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # `_reinterpret` in 3.6

# 1024.0 in both fp16 halves. Passed as a kernel argument (`magic`), not written as a literal: the
# compiler then keeps it in a register, and "mask the bits, or in the exponent" is one LOP3 (two
# with an immediate) per pair of codes.
FP16_PAIR_1024 = 0x64006400
TAIL_TOKENS = 32  # sink and residual tokens per chunk of the fp16 tail (`_fp16_tail`)
MAX_GQA = 8  # query heads per KV head: the MMAs' N; partials hold this many rows


def linear_layout(reg: list[list[int]], lane: list[list[int]], shape: list[int]) -> Any:
    """A one-warp layout given by its register and lane bases."""
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[], block_bases=[], shape=shape)


def flat_layout(vec: int) -> Any:
    """A rank-1 layout of `vec` consecutive elements a lane."""
    return gl.BlockedLayout([vec], [32], [1], [0])


@functools.cache
def shared_layouts(d: int, value_bits: int, value_group: int, n_sc_p: int, one_scale: bool) -> dict[str, Any]:
    """The layout arguments both kernels take, by name: head dim d, values of b_V bits in groups of
    G_V channels (16 tokens a tile; `launch.kernel_value_group`: half the head where one stored group
    spans it, `one_scale`), n_sc_p (padded) salient channels.

    Per warp, mma.sync m16n8k16 operands have (Gluon's `to_linear_layout`): A [M, K]: register
    bases k+1, m+8, k+8, then the M tiles; lane bases k+2, k+4, m+1, m+2, m+4. B [K, N]: register
    bases k+1, k+8, then the K tiles, then the N tiles; lane bases k+2, k+4, n+1, n+2, n+4.
    Values are the A operand of acc^T[c, h] += V^T[c, t] @ P^T[t, h] (M = d channels, K = 16 tokens);
    its first register basis (t+1) becomes the two halves of an int32, and splitting each channel
    basis c into (c // G_V, (c % G_V) // cpw, (c % cpw) // cpb, c % cpb) views those int32
    registers as [groups, words, bytes, codes in a byte, 8 token pairs] (V5), so the codes can be
    built there from one word per token and one scale/zero pair per (group, token pair), and
    reshaping back gives the A operand itself (the kernel asserts that the conversion is trivial).
    Row m is not channel m: `split5` orders a row's bits byte, word, code, group, so that the lanes
    of a row group differ in the byte or word they read.
    The load layouts (VWP_LOAD, VS_WORDS) hold the same elements per thread with the pair member
    (even/odd token) as the first register, so that `split` gives each token's words and scales.
    For keys (A operand, M = 16 tokens, K = channels) the first register basis is c+1: a thread's
    register holds channels c and c+1 of one token. The pair layouts (PAIRS_LO, PAIRS_HI) drop that
    basis and halve the channel bases, so one int32 element there is that register: both codes are
    built in its two halves at once, and splitting the halves gives the A operand with no data
    movement (only the register order differs).
    """
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    cpw = 32 // value_bits
    cpb = 8 // value_bits  # codes per byte
    layout = linear_layout

    # The values' A operand without its first register basis (t+1: the two fp16 halves of an int32),
    # tokens halved, rows m split into (group, word, byte, code in the byte): the row's channel
    # (`_value_channel`) has its byte in m's two lowest bits, then its word in the group, its code
    # in the byte, its group. So the row lanes m+1, m+2, m+4 pick different bytes and words, and
    # the codes of a byte sit in one thread's registers: a thread reads half or less of the words
    # it would read with the lanes m+1, m+2, m+4 on code bits (each word loaded by 8 lanes).
    wb = (value_group // cpw).bit_length() - 1  # word bits in a group
    cb = cpb.bit_length() - 1  # code bits in a byte

    def split5(m: int, p: int) -> list[int]:
        """Row m (0 or a power of two) and token pair p as [group, word, byte, code, pair]."""
        out = [0, 0, 0, 0, p]
        if m:
            i = m.bit_length() - 1
            dim, bit = (2, i) if i < 2 else (1, i - 2) if i < 2 + wb else (3, i - 2 - wb) if i < 2 + wb + cb else (
                0, i - 2 - wb - cb)
            out[dim] = 1 << bit
        return out

    v_regs = [split5(8, 0), split5(0, 4)] + [split5(16 << i, 0) for i in range((d // 16).bit_length() - 1)]
    v_lanes = [split5(0, 1), split5(0, 2), split5(1, 0), split5(2, 0), split5(4, 0)]
    shape5 = [d // value_group, value_group // cpw, 4, cpb, 8]

    def keep(bases: list[list[int]], dims: list[int], is_reg: bool) -> list[list[int]]:
        """The bases of the slice keeping `dims`: registers along a dropped dim vanish, lanes broadcast."""
        out = []
        for base in bases:
            kept = [base[i] for i in dims]
            if all(base[i] == 0 for i in range(5) if i not in dims):
                out.append(kept)
            elif not is_reg:
                out.append([0] * len(dims))
        return out

    def member_first(bases: list[list[int]]) -> list[list[int]]:
        """Adds the pair member (even/odd token) as a trailing dim held in the first register."""
        return [[0] * len(bases[0]) + [1]] + [b + [0] for b in bases]

    wd = [0, 1, 4]
    words_pairs = layout(member_first(keep(v_regs, wd, True)), [b + [0] for b in keep(v_lanes, wd, False)],
                         [shape5[0], shape5[1], 8, 2])
    nvg = d // value_group
    group_bits = [1 << i for i in range(nvg.bit_length() - 1)]
    # Value scales and zeros: int32 words (two value groups each) of the even and odd token of each
    # pair, [2, 4, groups // 2, 2] (pair 4j + b, member last), and the fp16 pairs built from them,
    # [2, 8, 4, groups], in P^T's pair layout (`_pt_pairs`: token pair 4j + b of head a) with the
    # groups as registers (`_value_products`).
    scale_words = layout([[0, 0, 0, 1]] + [[0, 0, g, 0] for g in group_bits[:-1]] + [[1, 0, 0, 0]],
                         [[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], [2, 4, nvg // 2, 2])
    if one_scale:  # one stored group a head: a tile's 8 words of two tokens' scales, [4 pairs, member]
        scale_words = layout([[0, 1]], [[1, 0], [2, 0], [0, 0], [0, 0], [0, 0]], [4, 2])
    pairs4 = layout([[0, 0, 0, g] for g in group_bits] + [[1, 0, 0, 0]],
                    [[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], [2, 8, 4, nvg])

    def pairs(channels: int) -> Any:
        """[channels // 2 pairs, 8 row pairs] int32: each element two A-operand registers' fp16 pairs."""
        k_regs = [[8, 0]] + [[16 << i, 0] for i in range((channels // 16).bit_length() - 1)]
        k_lanes = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
        return layout([[c // 2, t] for c, t in k_regs], [[c // 2, t] for c, t in k_lanes], [channels // 2, 8])

    return dict(
        MMA=mma, A_OP=a_op, B_OP=b_op, V5=layout(v_regs, v_lanes, shape5), VWP_LOAD=words_pairs,
        VS_WORDS=scale_words, PAIRS4=pairs4, PAIRS_LO=pairs(d), PAIRS_HI=pairs(n_sc_p),
        SMEM1=gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]),  # buffers of rows
        CP_V=flat_layout(4),  # value words [16 tokens x words]: 16-byte copies
        CP_K=flat_layout(8),  # a key scale or zero row [d]
    )


@gluon.jit
def _halves_f16(x):
    """int32 [R, T] holding two fp16 bit patterns -> fp16 [R, T, 2], the low half first."""
    lo = x.to(gl.int16).to(gl.float16, bitcast=True)
    hi = (x >> 16).to(gl.int16).to(gl.float16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _byte_perm(a, b, sel: gl.constexpr):
    """PTX prmt: bytes of {b, a} (a's are 0-3) picked by the nibbles of sel, one instruction
    (shifts and masks of the same take two)."""
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _plane_operand(x, C: gl.constexpr, A_OP: gl.constexpr):
    """int32 pairs [C // 2, 16] -> the fp16 A operand [16 tokens, C] (the same registers)."""
    codes = gl.reshape(gl.permute(_halves_f16(x), [0, 2, 1]), [C, 16])
    return gl.convert_layout(gl.permute(codes, [1, 0]), A_OP, assert_trivial=True)


@gluon.jit
def _value_pairs(we, wo, sel, mask):
    """The values' A-operand registers: int32 pairs (token 2i low, 2i + 1 high) of fp16 codes.

    we, wo: the two tokens' words holding the channel; sel: a byte permutation putting the
    channel's byte of we in byte 0 and of wo in byte 2; mask: the code's bits there (both halves).
    Masked where it lies, at bit k of an fp16 with a zero exponent, the code q reads as the
    subnormal 2^(k - 24) q, exactly (the tensor cores take subnormal inputs; products are exact
    in fp32). Two instructions per register; the scale and zero are applied outside the operand
    (`_value_products`), the 2^(k - 24) at the packed branch's end (`_values_finished`).
    """
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; prmt.b32 t, $1, $2, $3; and.b32 $0, t, $4; }",
        "=r,r,r,r,r", [we, wo, sel, mask], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _mul_pairs(x, y):
    """The product of two int32 tensors holding fp16 pairs, as fp16 pairs (one HMUL2)."""
    return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [x, y], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _value_selectors(BV: gl.constexpr, V5: gl.constexpr):
    """`_value_codes`' per byte of a word (b) and code in the byte (j): the byte permutation
    and the code's mask, in the slices of V5 they broadcast from."""
    CPB: gl.constexpr = 8 // BV
    bv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, gl.SliceLayout(4, V5)))))
    sel = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(bv | ((bv + 4) << 8), 0), 0), 3), 4)
    jv = gl.arange(0, CPB, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(4, V5)))))
    mask = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        (((1 << BV) - 1) * 0x10001) << (jv * BV), 0), 0), 0), 4)
    return sel, mask


@gluon.jit
def _value_codes(buf_v, row, sel, mask, D: gl.constexpr, NVG: gl.constexpr, WPG: gl.constexpr,
                 A_OP: gl.constexpr, V5: gl.constexpr, VWP_LOAD: gl.constexpr):
    """V^T codes [D, 16] fp16 (A operand) of 16 tokens from row `row` of the value-word ring
    [2 pair members, 8 token pairs, NW words]: 2^(k - 24) q for the code q of channel c,
    k = (c % codes per byte) * b_V, in row order (row m holds channel `_value_channel`(m)).

    Member-major: the 4 lanes of a load that read different token pairs then read adjacent
    rows, in distinct banks (pair-major, rows 2i would be 64 bytes apart at NW = 8: a 2-way bank
    conflict on every load).

    A register holds one channel of rows 2i and 2i + 1 (`_value_pairs`); the code is masked
    where it lies in its byte (k + b_V <= 8 stays in the fp16 mantissa).
    """
    G4: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, V5))  # [groups, words, 8 pairs]
    pw = buf_v.index(row).reshape([2, 8, NVG, WPG]).permute([2, 3, 1, 0]).load(VWP_LOAD)
    we, wo = gl.split(pw)  # [NVG, WPG, 8 token pairs]: even and odd tokens' words
    we = gl.expand_dims(gl.expand_dims(gl.convert_layout(we, G4), 2), 3)
    wo = gl.expand_dims(gl.expand_dims(gl.convert_layout(wo, G4), 2), 3)
    x = _value_pairs(we, wo, sel, mask)  # [NVG, WPG, 4, CPB, 8]
    x = gl.permute(x, [0, 3, 1, 2, 4])  # rows m = ((group, code), word, byte): `_value_channel`
    codes = gl.reshape(_halves_f16(gl.reshape(x, [D, 8])), [D, 16])
    return gl.convert_layout(codes, A_OP, assert_trivial=True)


@gluon.jit
def _value_scale_pairs(buf, row, NVG: gl.constexpr, ONE_SCALE: gl.constexpr, VS_WORDS: gl.constexpr,
                       PAIRS4: gl.constexpr):
    """Scale (or zero) fp16 pairs [2, 1, 4, NVG] of 16 tokens for `_value_products`: element
    (j, 0, b, g) holds value group g of the tile's rows 8j + 2b (low half) and 8j + 2b + 1.

    The ring row holds int32 words (two groups of one token) ordered (token pair, word, member),
    so one load gives a thread both members' words, and one prmt per pair takes a group's
    halves of both. ONE_SCALE (one stored group a head, computed as NVG = 2 halves): the row
    holds the tile's 8 stored words, word r the scales of rows r and 8 + r (two adjacent
    tokens in both kernels' row orders); one prmt per j takes rows 8j + 2b and 8j + 2b + 1
    from words 2b and 2b + 1, and both halves of the head get the pair."""
    if ONE_SCALE:
        ev, od = gl.split(buf.index(row).reshape([4, 2]).load(VS_WORDS))  # words 2b, 2b + 1
        x = gl.permute(gl.join(_byte_perm(ev, od, 0x5410), _byte_perm(ev, od, 0x7632)), [1, 0])  # [j, b]
        x = gl.convert_layout(gl.join(x, x), gl.SliceLayout(1, PAIRS4))  # registers reordered, no lanes
    else:
        ev, od = gl.split(buf.index(row).reshape([2, 4, NVG // 2, 2]).load(VS_WORDS))
        x = gl.reshape(gl.join(_byte_perm(ev, od, 0x5410), _byte_perm(ev, od, 0x7632)), [2, 4, NVG])
        x = gl.convert_layout(x, gl.SliceLayout(1, PAIRS4), assert_trivial=True)
    return gl.expand_dims(x, 1)


@gluon.jit
def _row_halves(x):
    """[R, C] -> rows [0, R/2) and [R/2, R): the top row bit is a register basis, so no data moves."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [2, R // 2, C]), [1, 2, 0]))


@gluon.jit
def _rows_joined(a, b, L: gl.constexpr):
    """The inverse of `_row_halves`, in layout L."""
    R: gl.constexpr = a.shape[0]
    C: gl.constexpr = a.shape[1]
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(a, b), [2, 0, 1]), [2 * R, C]), L,
                             assert_trivial=True)


@gluon.jit
def _column_sums(pair: gl.constexpr, NVG: gl.constexpr, B_OP: gl.constexpr):
    """B operand [16 tokens, 8] fp16 that sums a `_pair_rows` operand for value-group pair `pair`:
    1024 where column n is in the pair's block of 16 // NVG columns and the token half (k >= 8)
    matches the column's half of that block (first half: the pair's first group), else 0."""
    C: gl.constexpr = 16 // NVG
    k = gl.arange(0, 16, layout=gl.SliceLayout(1, B_OP))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
    mine = ((n // C) == pair)[None, :] & (((n % C) >= C // 2)[None, :] == (k >= 8)[:, None])
    return gl.where(mine, 1024.0, 0.0).to(gl.float16)


@gluon.jit
def _pair_rows(x, A_OP: gl.constexpr):
    """fp16 pairs [2, 8, 4, 2] of two value groups (P^T pairs x scale or zero, the B-operand
    registers of both groups side by side) -> the A operand [16, 16] that holds the same registers:
    row 8 j + a, column 8 g + 2 b + e = group g's element (token 8 j + 2 b + e, head a)."""
    y = gl.permute(gl.reshape(_halves_f16(x), [2, 8, 4, 2, 2]), [0, 1, 3, 2, 4])
    return gl.convert_layout(gl.reshape(y, [16, 16]), A_OP, assert_trivial=True)


@gluon.jit
def _pairs_operand(x, B_OP: gl.constexpr):
    """P^T-pairs [16, 4] (`_pt_pairs`, possibly scaled) -> the B operand [16 tokens, 8] fp16 (no data moves)."""
    y = gl.reshape(_halves_f16(gl.reshape(x, [16, 4])), [2, 8, 4, 2])  # (j, a, b, e) = P[8j + 2b + e, a]
    return gl.convert_layout(gl.reshape(gl.permute(y, [0, 2, 3, 1]), [16, 8]), B_OP, assert_trivial=True)


@gluon.jit
def _value_products(codes, xs, xz, acc, acc_z, pair: gl.constexpr, NVG: gl.constexpr, MMA: gl.constexpr,
                    A_OP: gl.constexpr, B_OP: gl.constexpr):
    """acc^T += codes @ (P^T x scale), value group by value group, and the zeros' part
    acc_z += 1024 * sum_t P^T x zero per head and group (`_values_finished` reads it).

    codes [R, 16] (R: the channels of NG groups), acc [R, 8]; xs, xz [2, 8, 4, NG]: P^T's fp16
    pairs (`_pt_pairs`) times each group's scale and zero pairs. A group's scale varies along the
    tokens (the MMA's K), so it is folded into its own B operand: one MMA per group. (The codes
    carry no offset, `_value_pairs`: an offset such as the keys' 1024 would grow in acc with
    every step, and the tensor cores' accumulation truncates: docs/kernels.md.) Groups are split
    off two at a time (register renames; recursing on NG). For a pair, the zeros' sums take one
    MMA: both groups' registers as one A operand (`_pair_rows`) against `_column_sums`.
    """
    NG: gl.constexpr = xs.shape[3]
    c0, c1 = _row_halves(codes)
    a0, a1 = _row_halves(acc)
    a0 = gl.convert_layout(a0, MMA, assert_trivial=True)
    a1 = gl.convert_layout(a1, MMA, assert_trivial=True)
    if NG == 2:
        s0, s1 = gl.split(xs)
        a0 = mma_v2(gl.convert_layout(c0, A_OP, assert_trivial=True), _pairs_operand(s0, B_OP), a0)
        a1 = mma_v2(gl.convert_layout(c1, A_OP, assert_trivial=True), _pairs_operand(s1, B_OP), a1)
        acc_z = mma_v2(_pair_rows(xz, A_OP), _column_sums(pair, NVG, B_OP), acc_z)
    else:
        s0, s1 = gl.split(gl.permute(gl.reshape(xs, [2, 8, 4, 2, NG // 2]), [0, 1, 2, 4, 3]))
        z0, z1 = gl.split(gl.permute(gl.reshape(xz, [2, 8, 4, 2, NG // 2]), [0, 1, 2, 4, 3]))
        a0, acc_z = _value_products(gl.convert_layout(c0, A_OP, assert_trivial=True), s0, z0, a0, acc_z, pair,
                                    NVG, MMA, A_OP, B_OP)
        a1, acc_z = _value_products(gl.convert_layout(c1, A_OP, assert_trivial=True), s1, z1, a1, acc_z,
                                    pair + NG // 4, NVG, MMA, A_OP, B_OP)
    return _rows_joined(a0, a1, MMA), acc_z


@gluon.jit
def _step_values(buf_v, buf_sc, buf_ze, row0, x0, x1, acc, acc_z, sel, mask, D: gl.constexpr, NVG: gl.constexpr,
                 ONE_SCALE: gl.constexpr, WPG: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr,
                 B_OP: gl.constexpr, V5: gl.constexpr, VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr,
                 PAIRS4: gl.constexpr):
    """The value product of a step: its two tiles, rows row0 and row0 + 1 of the ring's value
    buffers, with their P^T pairs x0, x1 (`_pt_pairs`)."""
    for half in gl.static_range(2):
        row = row0 + half
        x = x0 if half == 0 else x1
        x = gl.expand_dims(gl.convert_layout(gl.reshape(x, [2, 8, 4]), gl.SliceLayout(3, PAIRS4),
                                             assert_trivial=True), 3)
        xs = _mul_pairs(x, _value_scale_pairs(buf_sc, row, NVG, ONE_SCALE, VS_WORDS, PAIRS4))
        xz = _mul_pairs(x, _value_scale_pairs(buf_ze, row, NVG, ONE_SCALE, VS_WORDS, PAIRS4))
        codes = _value_codes(buf_v, row, sel, mask, D, NVG, WPG, A_OP, V5, VWP_LOAD)
        acc, acc_z = _value_products(codes, xs, xz, acc, acc_z, 0, NVG, MMA, A_OP, B_OP)
    return acc, acc_z


@gluon.jit
def _f16_pairs_rounded(even, odd):
    """fp32 x 2 -> int32 holding both rounded to fp16 (even low): one cvt.rn.f16x2.f32."""
    return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _transposed_blocks(x):
    """PTX movmatrix.trans on every register of x (int32 fp16 pairs, the m16n8 accumulator's
    register order): each 8 x 8 block of the warp's fragment is transposed across lanes."""
    return gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _pt_pairs(p):
    """S^T-shaped P [16 tokens, 8 heads] (score accumulator) -> P^T's fp16 pairs [16, 4], as the
    B operand of the value product holds them: X[8j + a, b] = (P[8j + 2b, a], P[8j + 2b + 1, a]).

    The accumulator gives a thread two heads of one token, the operand two tokens of one head:
    the transpose of each 8-token block. movmatrix does it in one instruction per block; its
    result, read in the accumulator's own register order, is that logical permutation, which
    leaves every element where the B operand wants it (`_pairs_operand` asserts it).
    """
    even, odd = gl.split(gl.reshape(p, [16, 4, 2]))
    return _transposed_blocks(_f16_pairs_rounded(even, odd))


@gluon.jit
def _p_operand(p, T: gl.constexpr, B_OP: gl.constexpr):
    """X [16 heads, T] in the accumulator layout -> X^T [T, 8] fp16 as a B operand, the first 8
    heads: P^T of the fp16 tail's value product, and u^T of the key product. Each thread
    already holds its operand elements (asserted)."""
    first, _ = gl.split(gl.permute(gl.reshape(p.to(gl.float16), [2, 8, T]), [1, 2, 0]))
    return gl.convert_layout(gl.permute(first, [1, 0]), B_OP, assert_trivial=True)


@gluon.jit
def _first_heads(x, COLS: gl.constexpr):
    """[16] per-head values (rows of the score accumulator) -> the first 8, as [8] in COLS."""
    first, _ = gl.split(gl.permute(gl.reshape(x, [2, 8]), [1, 0]))
    return gl.convert_layout(first, COLS)


@gluon.jit
def _value_channel(m, GV: gl.constexpr, BV: gl.constexpr):
    """The channel and the code-in-byte index of row m of the values' product (`split5` in
    `shared_layouts`): m = ((group * codes per byte + code) * words per group + word) * 4 + byte."""
    CPB: gl.constexpr = 8 // BV
    WPG: gl.constexpr = GV * BV // 32
    code = (m // (4 * WPG)) % CPB
    return (m // GV) * GV + ((m // 4) % WPG) * (32 // BV) + (m % 4) * CPB + code, code


@gluon.jit
def _values_finished(acc, acc_z, code, D: gl.constexpr, GV: gl.constexpr, BV: gl.constexpr, MMA: gl.constexpr):
    """acc^T [D, 8] of the codes' form (`_value_products`) -> the values' weighted sum: row m
    (group g = m // G_V) becomes acc * 2^(24 - k) + Z_g / 1024, k = code-in-byte * b_V of its
    channel (`code`, from `_value_channel`; rows stay in that order), where Z_g is the
    column `_column_sums` gave group g in acc_z, summed over both token halves (rows a and
    8 + a of head a). Once per program; the broadcast over each group's channels is a one-hot sum."""
    NVG: gl.constexpr = D // GV
    C: gl.constexpr = 16 // NVG
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 1], [4, 1, 8], [1, 1, 1], [2, 1, 0])  # [D, 8 columns, 8 heads]
    z_top, z_bottom = _row_halves(acc_z)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    g = c // GV
    own = (((g // 2) * C + (g % 2) * (C // 2))[:, None] == n[None, :])[:, :, None]  # [D, 8, 1]
    z_c = gl.sum(gl.where(own, gl.convert_layout(gl.permute(z_top + z_bottom, [1, 0]),
                                                 gl.SliceLayout(0, L3))[None, :, :], 0.0), axis=1)
    k = code * BV
    return acc * gl.exp2(24.0 - k.to(gl.float32))[:, None] + gl.convert_layout(z_c, MMA) * (1.0 / 1024.0)


@gluon.jit
def _fp16_tail(ops, b, h, t, n_tail, qk_scale, GQ: gl.constexpr, D: gl.constexpr,
               BLOCK_R: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
    """Tail program t of n_tail: its chunks of BLOCK_R tokens of the sinks and the residual, fp16
    MMAs on the raw tokens. Chunk j of the sinks goes to program j % n_tail, chunk j of the
    residual to program (j + 1) % n_tail (the sinks are usually one chunk: program 0 then
    gets the residual's last). Returns acc^T [D, 8], its rows' channels (in order) and the
    softmax max and sum per head (-inf and 0 for a program with no token)."""
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=ROW)
    l_i = gl.zeros([16], gl.float32, layout=ROW)
    acc = gl.zeros([D, 8], gl.float32, layout=MMA)
    # Padded query rows are zero, so their scores stay finite (never -inf - -inf).
    rows_a = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    cols_a = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
    q_base = ops.q_ptr + b.to(gl.int64) * ops.stride_qb + (h * GQ + rows_a) * ops.stride_qh
    q16 = (gl.load(q_base[:, None] + cols_a[None, :], mask=(rows_a < GQ)[:, None],
                   other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
    u0 = gl.convert_layout(q16, A_OP)  # the A operand holds the accumulator layout's 16-bit elements
    t_b = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, B_OP))  # key tokens (columns)
    c_b = gl.arange(0, D, layout=gl.SliceLayout(1, B_OP))
    t_a = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, A_OP))  # value tokens (columns of V^T)
    c_a = gl.arange(0, D, layout=gl.SliceLayout(1, A_OP))
    tcol = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, MMA))
    for region in gl.static_range(2):
        if region == 0:
            n_tok = gl.load(ops.sink_len_ptr + b)
            off = b.to(gl.int64) * ops.stride_sb + h * ops.stride_sh
            k_base = ops.ks_ptr + off
            v_base = ops.vs_ptr + off
            stride_t = ops.stride_st
        else:
            n_tok = gl.load(ops.res_len_ptr + b)
            off = b.to(gl.int64) * ops.stride_rb + h * ops.stride_rh
            k_base = ops.kr_ptr + off
            v_base = ops.vr_ptr + off
            stride_t = ops.stride_rt
        first = (t + region * (n_tail - 1)) % n_tail  # this program's first chunk of the region
        for t0 in range(first * BLOCK_R, n_tok, n_tail * BLOCK_R):
            # Through fp32 (exact from bf16, so the same rounding): Triton 3.9 turns a direct bf16 ->
            # fp16 cast into one cvt per element, and the block kernel then spills (255 registers).
            kt = gl.load(k_base + (t0 + t_b)[None, :] * stride_t + c_b[:, None],
                         mask=(t0 + t_b < n_tok)[None, :], other=0.0).to(gl.float32).to(gl.float16)
            # The values' load issued with the keys': one round trip to memory per chunk, not two.
            vt = gl.load(v_base + (t0 + t_a)[None, :] * stride_t + c_a[:, None],
                         mask=(t0 + t_a < n_tok)[None, :], other=0.0).to(gl.float32).to(gl.float16)
            scores = mma_v2(u0, kt, gl.zeros([16, BLOCK_R], gl.float32, layout=MMA))
            scores = gl.where((t0 + tcol < n_tok)[None, :], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = mma_v2(vt, _p_operand(p, BLOCK_R, B_OP), acc * _first_heads(alpha, HEADS)[None, :])
    c_r = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))  # rows are channels here
    return acc, c_r, _first_heads(m_i, HEADS), _first_heads(l_i, HEADS)


@gluon.jit
def _head_operands(ops, b, h):
    """The packed operands of sequence b's KV head h: the key scales' offset, the key planes, the
    value words, scales and zeros (`DecodeOperands`)."""
    ks_off = b.to(gl.int64) * ops.stride_ksb + h * ops.stride_ksh
    klo = ops.klo_ptr + b.to(gl.int64) * ops.stride_lob + h * ops.stride_loh
    khi = ops.khi_ptr + b.to(gl.int64) * ops.stride_hib + h * ops.stride_hih
    vp = ops.vp_ptr + b.to(gl.int64) * ops.stride_vpb + h * ops.stride_vph
    vsc = ops.vsc_ptr + b.to(gl.int64) * ops.stride_vsb + h * ops.stride_vsh
    vze = ops.vze_ptr + b.to(gl.int64) * ops.stride_vsb + h * ops.stride_vsh
    return ks_off, klo, khi, vp, vsc, vze


@gluon.jit
def _rescaled(acc, acc_z, l_t, alpha, ROW: gl.constexpr):
    """The running sums of the packed split (acc^T, the zeros' part acc_z, the softmax sums l_t) times
    alpha per head, when the running max moves; acc_z holds head a in rows a and 8 + a."""
    acc = acc * alpha[None, :]
    l_t = l_t * alpha[None, :]
    acc_z = acc_z * gl.convert_layout(gl.reshape(gl.permute(gl.join(alpha, alpha), [1, 0]), [16]), ROW)[:, None]
    return acc, acc_z, l_t


@gluon.jit
def _packed_partials(acc, acc_z, l_t, m_h, D: gl.constexpr, GV: gl.constexpr, BV: gl.constexpr, MMA: gl.constexpr):
    """A packed split's partials once its loop is done: the values' weighted sum acc^T [D, 8]
    (`_values_finished`), its rows' channels, and the softmax max and sum per head."""
    l_h = gl.sum(l_t, axis=0)
    c_r, code = _value_channel(gl.arange(0, D, layout=gl.SliceLayout(1, MMA)), GV, BV)  # row -> channel
    return _values_finished(acc, acc_z, code, D, GV, BV, MMA), c_r, m_h, l_h


@gluon.jit
def _packed_split(split, n_tail, tail_start):
    """Split `split`'s index among the packed region's splits, or -1 for one of the fp16 tail's
    n_tail splits, tail_start .. tail_start + n_tail - 1 (0: launched first; the packed split
    count: launched last, `tails_last`)."""
    after = split >= tail_start
    return gl.where(after & (split < tail_start + n_tail), -1, split - n_tail * after.to(gl.int32))


@gluon.jit
def _store_partials(pm_ptr, pl_ptr, pa_ptr, part, acc, c_r, m_fin, l_fin, GQ: gl.constexpr, D: gl.constexpr,
                    MMA: gl.constexpr):
    """A program's partials: acc^T [D, 8] (rows c_r), softmax max and sum per head. Rows past
    the GQ query heads are padding: not written (the combine step does not read them)."""
    h_c = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(pa_ptr + (part * 8 + h_c[None, :]) * D + c_r[:, None], acc, mask=(h_c < GQ)[None, :])
    gl.store(pm_ptr + part * 8 + h_c, m_fin, mask=h_c < GQ)
    gl.store(pl_ptr + part * 8 + h_c, l_fin, mask=h_c < GQ)
