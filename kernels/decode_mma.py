"""Fused decode attention with the dequantization done in MMA operand registers (Gluon, CUDA only).

The same computation, partials and combine step as `kernels/decode.py` (read its docstring first),
written in Gluon so that the layouts are explicit. The Triton kernel expands the codes in a
blocked layout, and `tl.dot` then moves them to the tensor cores' operand layout through shared
memory; that round trip and the layout shuffles cost more than the bytes saved (it runs at
0.45-0.58x of bf16 SDPA; benchmarks/RESULTS.md, Kernels). Here every code is expanded by the
thread whose `mma.sync` fragment holds it:

- Codes are never shifted down to bit 0: masked where it lies, at bit k of a byte, a code q is
  read as an fp16 whose mantissa holds it, and the 2^k is taken out per row or per group, not
  per element.
- keys, A operand of S^T[t, h] = codes^T[t, c] @ U^T[c, h] (U = query x key scale, one per group,
  the first 8 heads as the B operand: N = 8, since GQ <= 8, where a [16 heads, tokens] product
  would pad 16 rows; the zero point is a per-head bias): a thread holds channel pairs (c, c+1) of
  its two token rows. The kernel walks blocks of 128 tokens: a channel's 16 bytes of a plane,
  eight 16-token runs of 16 bits. One ldmatrix.trans per 8 channels gives each row group of
  lanes one run of both channels of its pairs in one register (even channel in the low half,
  `_block_words`): every byte is read once, where words of 32 tokens were read by all 8 row
  groups (the L1 data pipe's limit; RESULTS.md). A tile's row r is a token of run r, row 8 + r
  the next one (`_token_of_row`): tile h of step s (8 tiles a block) takes bits 4 s + 2 h and the
  next of every run, one masking per row where the bit lies (bits 8-15 shifted down once per
  block), ORed into 1024 * 2^p (0x6400 for plane 0): 1024 * 2^p + 2^(p + k) * bit exactly.
  Every plane of a tile adds into one accumulator (one MMA per plane): the low planes of all
  channels against U, the salient channels' high planes against U[:, salient] * 2^b_low, since
  code = low + 2^b_low * high. The accumulator starts at minus the planes' constant part
  (-1024 (2^planes - 1) sum U per head, itself an MMA) and each row is scaled by 2^-k. No
  channel reordering, no gather of packed bytes. G must be a multiple of 128 (a tile's rows span
  the block, so its tokens must share a group's U); groups of 32 or 64 tokens run the word-step
  kernel of `decode_mma_words`, which shares everything below.
- values, A operand of acc^T[c, h] += V^T[c, t] @ (P^T x scale)[t, h]: a thread holds token pairs
  of one channel. One prmt puts its channel's byte of both tokens' words in the two halves, one
  `and` masks the code in place (bit k = (c % codes per byte) * b_V, a function of the register):
  with a zero exponent that is the subnormal fp16 2^(k - 24) q, exact, with no offset (an offset
  would grow in the accumulator, whose sums the tensor cores truncate). The scale varies along
  the MMA's K (tokens), so each value group gets its own B operand, P^T's fp16 pairs times that
  group's scale pairs (one HMUL2 per register), and its own MMA; the zeros' part, 1024 * sum_t
  P^T x zero per head and group, takes one MMA per pair of groups (`_value_products`). The
  2^(24 - k) and the zeros are applied once, at the program's end (`_values_finished`).
  Transposed so that the accumulator is [d, 8] (half the registers of [16, d]). P^T is the
  transpose of the score accumulator's 8-token blocks across lanes: one movmatrix.trans per
  block (`_pt_pairs`). Value words, scales and zeros reach shared memory already in row order.
  The product's rows are not channels in order: within a value group a row's bits are the
  channel's byte, word, code in the byte (`_value_channel`), so that the lanes of a row group read
  different words and each thread loads half the words it would otherwise; the partials are
  stored by channel.

One warp per program, program (b * H_kv + h, split): each warp owns a slice of the packed groups
and keeps its own online softmax. It walks its slice in blocks of 128 tokens. The bytes of a block
(plane words, value words, value scales and zeros, and at a group's first block the key scale and
zero rows and the words of the salient channels' scales) reach shared memory by asynchronous
copies (cp.async) issued a whole block ahead, so the warp never waits on global memory: the values
have two slots, the keys one (read into registers at the block's start, then refilled). The codes
go from shared memory straight into operand registers. A block computes its 8 tiles' scores (16
independent MMA chains), one online-softmax update for its 128 tokens, then its 4 steps' value
products. The kernel is bound by instruction issue and each warp's latency (ncu: 2 instructions a
cycle per SM of 4, the L1 data pipe at 60%, 8 warps per SM by registers, 2 a scheduler): fewer
bytes do not make it faster, and fewer instructions only partly (6.7% fewer bought 1.3% at 32 x
32K, RESULTS.md); more warps would need under 170 registers (and a smaller ring: shared memory
stops an SM at 9). n_tail splits of each (b, h_kv) handle the sinks and the residual (fp16 MMA
on the raw tokens, chunks of 32 tokens dealt out among them, `tail_programs`: one, or at batch 1
the slots the packed splits leave free in their wave); the splits of the packed region are sized
so that their programs fill whole waves of the GPU (`wave_splits`). Where the packed splits fit at
once but the tail programs do not, the tail programs launch last (`tails_last`); where the packed
splits take several waves, the tail programs launch first and the last split is the shorter
(`split_groups`). A packed split issues its first block's copies before it reads the lengths and
the query. Partials go to `decode.combine_partials`.

Limits (the caller falls back to the Triton kernel otherwise): CUDA with compute capability >= 8.0,
Triton with Gluon, group size G a multiple of 32 (128 for this module's kernel), head dim a
multiple of 16, at most 8 query heads per KV head, value groups spanning whole 32-bit words
(G_V * b_V >= 32), whole MMA tiles (G_V a multiple of 16) and 2 to 8 value groups per head (scales
are read as words of two groups; the zeros' sums have 8 columns).

CI runs this source through a CPU emulator (`tests/gluon_emu.py`) against the fp32 reference and
compiles it offline for sm_90 (`compile_offline`); `benchmarks/bench_decode.py` checks and times
it on the GPU. Figures (H200, SASS, registers): benchmarks/RESULTS.md, Kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.layout import DecodeCache, next_pow2

try:  # Gluon is Triton's explicit-layout dialect (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    # Names that changed after Triton 3.6 (the GPU image's): the barrier of a program's threads, and
    # the asynchronous global -> shared copy (same arguments).
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # `_reinterpret` in 3.6
except ImportError:  # pragma: no cover - older Triton
    gluon = None

LOG2E = 1.4426950408889634
# 1024.0 in both fp16 halves. Passed as a kernel argument, not written as a literal: the compiler
# then keeps it in a register, and "mask the bits, or in the exponent" is one LOP3 (two with an
# immediate), per pair of codes.
FP16_PAIR_1024 = 0x64006400
BLOCK_TOKENS = 128  # tokens of a key plane's 16 bytes per channel: the ring's unit; G must be a multiple
TAIL_TOKENS = 32  # sink and residual tokens per chunk of the fp16 tail (`_fp16_tail`)
MAX_GQA = 8  # query heads per KV head: the value product's N; partials hold this many rows


def available() -> bool:
    return gluon is not None and torch.cuda.is_available()


def shape_supported(cache: DecodeCache, q: torch.Tensor) -> bool:
    """Whether the kernel's limits (module docstring) admit this cache and query, on any device."""
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    return (d % 16 == 0 and d >= 32 and hq % hkv == 0 and hq // hkv <= MAX_GQA
            and cache.group_size % 32 == 0
            and cache.value_bits in (1, 2, 4, 8) and (d * cache.value_bits) % 32 == 0
            and cache.value_group_size * cache.value_bits >= 32 and d % cache.value_group_size == 0
            and cache.value_group_size % 16 == 0 and 2 <= d // cache.value_group_size <= 8
            and cache.k_low.shape[-1] % 4 == 0)


def supports(cache: DecodeCache, q: torch.Tensor) -> bool:
    """Whether `decode_attention_mma` can run here (else use `kernels.decode.decode_attention`)."""
    return (available() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8
            and shape_supported(cache, q))


@dataclass(frozen=True)
class _Layouts:
    mma: Any  # the mma.sync accumulator, one warp
    a_op: Any  # its A operand (keys [16 tokens, d], V^T [d, 16]) and B operand (u^T [d, 8], P^T [16, 8])
    b_op: Any
    # Values: the A operand's int32 pairs (channel c of tokens 2i, 2i + 1) viewed as [value groups,
    # words per group, bytes per word, codes per byte, 8 token pairs]; the words of each token pair
    # [groups, words, 8, 2] and the scales or zeros [groups, 8, 2] (even token first) load in the
    # layouts that split into that view's slices.
    v5: Any
    words_pairs: Any
    # Value scales and zeros: int32 words (two value groups each) of the even and odd token of each
    # pair, [2, 4, groups // 2, 2] (pair 4j + b, member last), and the fp16 pairs built from them,
    # [2, 8, 4, groups], in P^T's pair layout (`_pt_pairs`: token pair 4j + b of head a) with the
    # groups as registers (`_value_products`).
    scale_words: Any
    pairs4: Any
    # Keys: [d // 2 channel pairs, 8 runs], one int32 holding the even and the odd channel's 16 bits
    # of a run (16 consecutive tokens of a 128-token block, one per row group of lanes); each element
    # gives two A-operand registers (`_plane_pairs`: rows r and 8 + r, two tokens of run r).
    pairs_lo: Any
    pairs_hi: Any  # the same for the salient channels' high planes, [n_sc_p // 2, 8]
    # A plane's words of a block as int16 [channels, 8 runs] (a channel's 16 bytes), loaded so that a
    # thread gets its pairs' runs: ldmatrix.trans (`_block_words`).
    runs_lo: Any
    runs_hi: Any
    # Shared memory: rank 1 for buffers of [rows, row] indexed by row; rank 2 for the key planes
    # [planes, channels, 8 runs] and the value scales and zeros [slots, 8 tiles, row].
    smem1: Any
    smem2: Any
    # The asynchronous copies, 4 bytes a lane where the source is contiguous (a 4-byte copy costs
    # the L1 one wavefront per cache line it touches; ncu, RESULTS.md): a plane [channels, 8 runs]
    # 8 channels a copy; value words [16 tokens x words] (16-byte copies); a block's value scale or
    # zero words [8 tiles, row] in memory order (`_layouts`); a key scale or zero row [d].
    cp_keys: Any
    cp_v: Any
    cp_s: Any
    cp_k: Any
    cp_sal: Any  # the words of the salient channels' key scales [n_sc_p]

    def constexprs(self) -> dict:
        """The kernel's layout arguments."""
        return dict(MMA=self.mma, A_OP=self.a_op, B_OP=self.b_op, V5=self.v5, VWP_LOAD=self.words_pairs,
                    VS_WORDS=self.scale_words, PAIRS4=self.pairs4, PAIRS_LO=self.pairs_lo, PAIRS_HI=self.pairs_hi,
                    RUNS_LO=self.runs_lo, RUNS_HI=self.runs_hi, SMEM1=self.smem1, SMEM2=self.smem2,
                    CP_KEYS=self.cp_keys, CP_V=self.cp_v, CP_S=self.cp_s, CP_K=self.cp_k,
                    CP_SAL=self.cp_sal)


LAYOUT_ARGS = ("MMA", "A_OP", "B_OP", "V5", "VWP_LOAD", "VS_WORDS", "PAIRS4", "PAIRS_LO", "PAIRS_HI", "RUNS_LO",
               "RUNS_HI", "SMEM1", "SMEM2", "CP_KEYS", "CP_V", "CP_S", "CP_K", "CP_SAL")


@functools.cache
def _layouts(d: int, value_bits: int, value_group: int, n_sc_p: int) -> _Layouts:
    """Layouts for head dim d, values of b_V bits in groups of G_V channels (16 tokens a tile), and
    n_sc_p (padded) salient channels.

    Per warp, mma.sync m16n8k16 operands have (Gluon's `to_linear_layout`): A [M, K]: register
    bases k+1, m+8, k+8, then the M tiles; lane bases k+2, k+4, m+1, m+2, m+4. B [K, N]: register
    bases k+1, k+8, then the K tiles, then the N tiles; lane bases k+2, k+4, n+1, n+2, n+4.
    Values are the A operand of acc^T[c, h] += V^T[c, t] @ P^T[t, h] (M = d channels, K = 16 tokens);
    its first register basis (t+1) becomes the two halves of an int32, and splitting each channel
    basis c into (c // G_V, (c % G_V) // cpw, (c % cpw) // cpb, c % cpb) views those int32
    registers as [groups, words, bytes, codes in a byte, 8 token pairs], so the codes can be built
    there from one word per token and one scale/zero pair per (group, token pair), and reshaping
    back gives the A operand itself (the kernel asserts that the conversion is trivial). Row m is
    not channel m: `split5` orders a row's bits byte, word, code, group, so that the lanes of a
    row group differ in the byte or word they read (see there).
    The load layouts hold the same elements per thread with the pair member (even/odd token) as
    the first register, so that `split` gives each token's words and scales.
    For keys (A operand, M = 16 tokens, K = channels) the first register basis is c+1: a thread's
    register holds channels c and c+1 of one token. The pair layouts drop that basis and halve the
    channel bases, so one int32 element there is that register: both codes are built in its two
    halves at once, and splitting the halves (join + reshape + permute) gives the A operand with no
    data movement (only the register order differs).
    """
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    cpw = 32 // value_bits
    cpb = 8 // value_bits  # codes per byte

    def layout(reg: list[list[int]], lane: list[list[int]], shape: list[int]) -> Any:
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[], block_bases=[], shape=shape)

    # The values' A operand without its first register basis (t+1: the two fp16 halves of an int32),
    # tokens halved, rows m split into (group, word, byte, code in the byte): the row's channel
    # (`_value_channel`) has its byte in m's two lowest bits, then its word in the group, its code
    # in the byte, its group. So the row lanes m+1, m+2, m+4 pick different bytes and words, and
    # the codes of a byte sit in one thread's registers: a thread reads half or less of the words
    # the lanes m+1, m+2, m+4 as code bits made it read (each value word was loaded by 8 lanes).
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
    scale_words = layout([[0, 0, 0, 1]] + [[0, 0, g, 0] for g in group_bits[:-1]] + [[1, 0, 0, 0]],
                         [[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], [2, 4, nvg // 2, 2])
    pairs4 = layout([[0, 0, 0, g] for g in group_bits] + [[1, 0, 0, 0]],
                    [[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], [2, 8, 4, nvg])

    def pairs(channels: int) -> Any:
        k_regs = [[8, 0]] + [[16 << i, 0] for i in range((channels // 16).bit_length() - 1)]
        k_lanes = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
        return layout([[c // 2, t] for c, t in k_regs], [[c // 2, t] for c, t in k_lanes], [channels // 2, 8])

    def runs(channels: int) -> Any:
        """int16 [channels, 8 runs]: `pairs` with the channel's parity as the first register."""
        regs = [[1, 0]] + [[8 << i, 0] for i in range((channels // 8).bit_length() - 1)]
        return layout(regs, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [channels, 8])

    def flat(vec: int) -> Any:
        return gl.BlockedLayout([vec], [32], [1], [0])

    # A block's value scale (or zero) words [8 tiles, 8 token pairs x groups // 2 words x 2 members]
    # (`_value_scale_pairs`), copied so that the 32 lanes of a copy read 32 consecutive words: the
    # bits of a word's address in the block (`_issue_block`, `_token_of_row`), lowest first, are the
    # word in the token, then the token's: pair bit 2, tile bits 0-2, member, pair bits 0-1.
    wsb = nvg.bit_length() - 2  # word bits of a token's scales
    s_bits = ([[0, 2 << j] for j in range(wsb)] + [[0, 8 << wsb], [1, 0], [2, 0], [4, 0], [0, 1], [0, 2 << wsb],
                                                   [0, 4 << wsb]])
    cp_s = layout(s_bits[5:], s_bits[:5], [8, 8 * nvg])

    return _Layouts(mma, a_op, b_op, layout(v_regs, v_lanes, shape5), words_pairs, scale_words, pairs4,
                    pairs(d), pairs(n_sc_p), runs(d), runs(n_sc_p),
                    gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]),
                    gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
                    gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]), flat(4), cp_s, flat(8), flat(1))


if gluon is not None:

    @gluon.jit
    def _halves_f16(x):
        """int32 [R, T] holding two fp16 bit patterns -> fp16 [R, T, 2], the low half first."""
        lo = x.to(gl.int16).to(gl.float16, bitcast=True)
        hi = (x >> 16).to(gl.int16).to(gl.float16, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _low_half_f16(x):
        """int32 -> the fp16 whose bits are its low half."""
        return x.to(gl.int16).to(gl.float16, bitcast=True)

    @gluon.jit
    def _byte_perm(a, b, sel: gl.constexpr):
        """PTX prmt: bytes of {b, a} (a's are 0-3) picked by the nibbles of sel, one instruction
        (shifts and masks of the same take two)."""
        return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _token_of_row(m):
        """The token of row m of a tile's score and value products, from the tile's first token: row
        r < 8 is the tile's token in run r (tokens 16 r to 16 r + 15 of the block), row 8 + r the one
        after it, so that a thread's two rows are adjacent bits of the 16 it holds per channel
        (`_plane_pairs`). Tile h of step s starts at token 4 s + 2 h of the block."""
        return 16 * (m % 8) + m // 8

    @gluon.jit
    def _pack_halves(lo, hi):
        """int16 x 2 -> int32 (lo in the low half). Free where both already share a register (ldmatrix)."""
        return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=gl.int32, is_pure=True,
                                         pack=1)

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
    def _plane_operand(x, C: gl.constexpr, A_OP: gl.constexpr):
        """int32 pairs [C // 2, 16] -> the fp16 A operand [16 tokens, C] (the same registers)."""
        codes = gl.reshape(gl.permute(_halves_f16(x), [0, 2, 1]), [C, 16])
        return gl.convert_layout(gl.permute(codes, [1, 0]), A_OP, assert_trivial=True)

    @gluon.jit
    def _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, S: gl.constexpr, H: gl.constexpr, magic,
                     B_LOW: gl.constexpr, NH: gl.constexpr, NSC: gl.constexpr, D: gl.constexpr,
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
        bits); measured rel err 2.0-2.2e-3 against 1.8-1.9e-3 with per-element subtraction
        (benchmarks/RESULTS.md).
        """
        K: gl.constexpr = 4 * (S % 2) + 2 * H
        lw_s = lw[0] if S < 2 else lw[1]
        hw_s = hw[0] if S < 2 else hw[1]
        acc = c0
        for p in gl.static_range(B_LOW):
            x = _plane_pairs(lw_s[p], K, magic + p * 0x04000400)
            acc = mma_v2(_plane_operand(x, D, A_OP), u, acc)
        if NH > 0:
            if NSC > 0:
                for p in gl.static_range(NH):
                    x = _plane_pairs(hw_s[p], K, magic + p * 0x04000400)
                    acc = mma_v2(_plane_operand(x, NSC_P, A_OP), u_hi, acc)
        return acc * inv_pos[(S % 2) * 2 + H][:, None] + bias

    @gluon.jit
    def _issue_block(blk, valid, slot, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks, klo, khi, vp, vsc, vze,
                     ksc, kze, off_lo, off_hi, m_hi, off_v, off_s, off_k, G32: gl.constexpr,
                     B_LOW: gl.constexpr, D: gl.constexpr, NH: gl.constexpr, NSC: gl.constexpr, NW: gl.constexpr,
                     NVG: gl.constexpr, PL_P: gl.constexpr, PH_P: gl.constexpr):
        """Starts the asynchronous copies of block `blk` (128 tokens): into the one-slot key buffers
        its 16 bytes of every channel's (low) and salient channel's (high) plane words, and at a
        group's first block the group's key scale and zero rows; into value slot `slot` the value
        words of its 8 tiles and its value scales and zeros. `valid` False (past the split's end)
        copies nothing. klo and khi count int16 halves of the plane words. The caller commits."""
        GB: gl.constexpr = G32 // 4  # blocks per group
        g = blk // GB
        q8 = (blk % GB) * 8  # the block's first half-word in a channel's words of the group
        lo = klo + g * (B_LOW * D * G32 * 2) + q8
        for p in gl.static_range(B_LOW):
            _async_load(buf_lo.index(p), lo + p * (D * G32 * 2) + off_lo, mask=(off_lo >= 0) & valid)
        if NH > 0:
            if NSC > 0:
                hi = khi + g * (NH * NSC * G32 * 2) + q8
                for p in gl.static_range(NH):
                    _async_load(buf_hi.index(p), hi + p * (NSC * G32 * 2) + off_hi, mask=m_hi & valid)
        for tile in gl.static_range(8):
            _async_load(buf_v.index(slot * 8 + tile), vp + (blk * 128 + 2 * tile) * NW + off_v,
                        mask=(off_v >= 0) & valid)
        _async_load(buf_sc.index(slot), vsc + blk * (128 * (NVG // 2)) + off_s, mask=(off_s >= 0) & valid)
        _async_load(buf_ze.index(slot), vze + blk * (128 * (NVG // 2)) + off_s, mask=(off_s >= 0) & valid)
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
    def _run_offsets(C: gl.constexpr, G32: gl.constexpr, L: gl.constexpr):
        """[channel, half-word] -> its offset in a plane of a group (a channel's words are G32 words)."""
        c = gl.arange(0, C, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, 8, layout=gl.SliceLayout(0, L))
        return c[:, None] * (2 * G32) + j[None, :]

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
    def _f16_pairs(even, odd):
        """fp16 [..] x 2 -> int32 [..]: even in the low half, odd in the high half."""
        lo = even.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return lo | (odd.to(gl.int16, bitcast=True).to(gl.int32) << 16)

    @gluon.jit
    def _value_codes(buf_v, row, sel, mask, D: gl.constexpr, NVG: gl.constexpr, WPG: gl.constexpr,
                     A_OP: gl.constexpr, V5: gl.constexpr, VWP_LOAD: gl.constexpr):
        """V^T codes [D, 16] fp16 (A operand) of 16 tokens from row `row` of the value-word ring
        [2 pair members, 8 token pairs, NW words]: 2^(k - 24) q for the code q of channel c,
        k = (c % codes per byte) * b_V, in row order (row m holds channel `_value_channel`(m)).

        Member-major: the 4 lanes of a load that read different token pairs then read adjacent
        rows, in distinct banks (pair-major, rows 2i were 64 bytes apart at NW = 8: a 2-way bank
        conflict on every load, 64 extra shared-memory wavefronts a step, ncu).

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
    def _value_scale_pairs(buf, row, NVG: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr):
        """Scale (or zero) fp16 pairs [2, 1, 4, NVG] of 16 tokens for `_value_products`: element
        (j, 0, b, g) holds value group g of tokens 8j + 2b (low half) and 8j + 2b + 1.

        The ring row holds int32 words (two groups of one token) ordered (token pair, word, member),
        so one load gives a thread both members' words, and one prmt per pair takes a group's
        halves of both."""
        ev, od = gl.split(buf.index(row).reshape([2, 4, NVG // 2, 2]).load(VS_WORDS))
        x = gl.reshape(gl.join(_byte_perm(ev, od, 0x5410), _byte_perm(ev, od, 0x7632)), [2, 4, NVG])
        return gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, PAIRS4), assert_trivial=True), 1)

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
    def _value_products(codes, xs, xz, acc, acc_z, pair: gl.constexpr, NVG: gl.constexpr, MMA: gl.constexpr,
                        A_OP: gl.constexpr, B_OP: gl.constexpr):
        """acc^T += codes @ (P^T x scale), value group by value group, and the zeros' part
        acc_z += 1024 * sum_t P^T x zero per head and group (`_values_finished` reads it).

        codes [R, 16] (R: the channels of NG groups), acc [R, 8]; xs, xz [2, 8, 4, NG]: P^T's fp16
        pairs (`_pt_pairs`) times each group's scale and zero pairs. A group's scale varies along the
        tokens (the MMA's K), so it is folded into its own B operand: one MMA per group. (The codes
        carry no offset, `_value_pairs`: an offset such as the keys' 1024 would grow in acc with
        every step, and the tensor cores' accumulation truncates; 2e-2 relative error after 8K
        tokens on the H200, benchmarks/RESULTS.md.) Groups are split off two at a time (register
        renames; recursing on NG). For a pair, the zeros' sums take one MMA: both groups' registers
        as one A operand (`_pair_rows`) against `_column_sums`.
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
    def _p_operand(p, T: gl.constexpr, B_OP: gl.constexpr):
        """X [16 heads, T] in the accumulator layout -> X^T [T, 8] fp16 as a B operand, the first 8
        heads: P^T of the fp16 tail's value product, and u^T of the key product. Each thread
        already holds its operand elements (asserted)."""
        first, _ = gl.split(gl.permute(gl.reshape(p.to(gl.float16), [2, 8, T]), [1, 2, 0]))
        return gl.convert_layout(gl.permute(first, [1, 0]), B_OP, assert_trivial=True)

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
    def _pairs_operand(x, B_OP: gl.constexpr):
        """P^T-pairs [16, 4] (`_pt_pairs`, possibly scaled) -> the B operand [16 tokens, 8] fp16 (no data moves)."""
        y = gl.reshape(_halves_f16(gl.reshape(x, [16, 4])), [2, 8, 4, 2])  # (j, a, b, e) = P[8j + 2b + e, a]
        return gl.convert_layout(gl.reshape(gl.permute(y, [0, 2, 3, 1]), [16, 8]), B_OP, assert_trivial=True)

    @gluon.jit
    def _step_values(buf_v, buf_sc, buf_ze, row0, x0, x1, acc, acc_z, sel, mask, D: gl.constexpr, NVG: gl.constexpr,
                     WPG: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V5: gl.constexpr,
                     VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr):
        """The value product of a step: its two tiles, rows row0 and row0 + 1 of the ring's value
        buffers, with their P^T pairs x0, x1 (`_pt_pairs`)."""
        for half in gl.static_range(2):
            row = row0 + half
            x = x0 if half == 0 else x1
            x = gl.expand_dims(gl.convert_layout(gl.reshape(x, [2, 8, 4]), gl.SliceLayout(3, PAIRS4),
                                                 assert_trivial=True), 3)
            xs = _mul_pairs(x, _value_scale_pairs(buf_sc, row, NVG, VS_WORDS, PAIRS4))
            xz = _mul_pairs(x, _value_scale_pairs(buf_ze, row, NVG, VS_WORDS, PAIRS4))
            codes = _value_codes(buf_v, row, sel, mask, D, NVG, WPG, A_OP, V5, VWP_LOAD)
            acc, acc_z = _value_products(codes, xs, xz, acc, acc_z, 0, NVG, MMA, A_OP, B_OP)
        return acc, acc_z

    @gluon.jit
    def _softmax_values(s0, s1, m, row0, acc, acc_z, l_t, buf_v, buf_sc, buf_ze, sel, mask, D: gl.constexpr,
                        NVG: gl.constexpr, WPG: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr,
                        B_OP: gl.constexpr, V5: gl.constexpr, VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr,
                        PAIRS4: gl.constexpr):
        """A step's probabilities P = 2^(s - m) of its two tiles' scores s0, s1 (rows of the value
        buffers row0, row0 + 1), their value product into acc, acc_z, and their sums into l_t."""
        p0 = gl.exp2(s0 - m[None, :])
        p1 = gl.exp2(s1 - m[None, :])
        acc, acc_z = _step_values(buf_v, buf_sc, buf_ze, row0, _pt_pairs(p0), _pt_pairs(p1), acc, acc_z, sel, mask, D,
                                  NVG, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS, PAIRS4)
        return acc, acc_z, l_t + p0 + p1

    @gluon.jit
    def _value_channel(m, GV: gl.constexpr, BV: gl.constexpr):
        """The channel and the code-in-byte index of row m of the values' product (`split5` in
        `_layouts`): m = ((group * codes per byte + code) * words per group + word) * 4 + byte."""
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
    def _f16_pairs_rounded(even, odd):
        """fp32 x 2 -> int32 holding both rounded to fp16 (even low): one cvt.rn.f16x2.f32."""
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _first_heads(x, COLS: gl.constexpr):
        """[16] per-head values (rows of the score accumulator) -> the first 8, as [8] in COLS."""
        first, _ = gl.split(gl.permute(gl.reshape(x, [2, 8]), [1, 0]))
        return gl.convert_layout(first, COLS)

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
    def _fp16_tail(q_ptr, stride_qb, stride_qh, ks_ptr, vs_ptr, stride_sb, stride_sh, stride_st, kr_ptr, vr_ptr,
                   stride_rb, stride_rh, stride_rt, sink_len_ptr, res_len_ptr, b, h, t, n_tail, qk_scale,
                   GQ: gl.constexpr, D: gl.constexpr, BLOCK_R: gl.constexpr, MMA: gl.constexpr,
                   A_OP: gl.constexpr, B_OP: gl.constexpr):
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
        q_base = q_ptr + b.to(gl.int64) * stride_qb + (h * GQ + rows_a) * stride_qh
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
            first = (t + region * (n_tail - 1)) % n_tail  # this program's first chunk of the region
            for t0 in range(first * BLOCK_R, n_tok, n_tail * BLOCK_R):
                kt = gl.load(k_base + (t0 + t_b)[None, :] * stride_t + c_b[:, None],
                             mask=(t0 + t_b < n_tok)[None, :], other=0.0).to(gl.float16)
                # The values' load issued with the keys': one round trip to memory per chunk, not two.
                vt = gl.load(v_base + (t0 + t_a)[None, :] * stride_t + c_a[:, None],
                             mask=(t0 + t_a < n_tok)[None, :], other=0.0).to(gl.float16)
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
        pm_ptr, pl_ptr, pa_ptr, ksw_ptr,
        qk_scale, groups_per_split, n_parts, n_tail, tail_start, magic,
        HKV: gl.constexpr, GQ: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
        B_LOW: gl.constexpr, NH: gl.constexpr, NSC: gl.constexpr, NSC_P: gl.constexpr,
        BV: gl.constexpr, GV: gl.constexpr, BLOCK_R: gl.constexpr,
        MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, V5: gl.constexpr,
        VWP_LOAD: gl.constexpr, VS_WORDS: gl.constexpr, PAIRS4: gl.constexpr, PAIRS_LO: gl.constexpr,
        PAIRS_HI: gl.constexpr, RUNS_LO: gl.constexpr, RUNS_HI: gl.constexpr,
        PL_P: gl.constexpr, PH_P: gl.constexpr, SMEM1: gl.constexpr, SMEM2: gl.constexpr, CP_KEYS: gl.constexpr,
        CP_V: gl.constexpr, CP_S: gl.constexpr, CP_K: gl.constexpr, CP_SAL: gl.constexpr,
    ):
        """Operands as in `decode._decode_split_kernel`, except: klo and khi are int16 views of the
        packed bytes, vp, vsc and vze int32 views (strides in those units), and partials hold
        MAX_GQA = 8 rows."""
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        G32: gl.constexpr = G // 32  # words per channel and plane in a group
        CPW: gl.constexpr = 32 // BV  # value codes per word
        NW: gl.constexpr = D // CPW  # value words per token
        WPG: gl.constexpr = GV // CPW  # value words per value group
        NVG: gl.constexpr = D // GV
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        HEADS: gl.constexpr = gl.SliceLayout(0, MMA)  # the columns of acc^T
        part = bh.to(gl.int64) * n_parts + split
        acc = gl.zeros([D, 8], gl.float32, layout=MMA)  # acc^T: channels x the first 8 heads
        packed = _packed_split(split, n_tail, tail_start)
        if packed >= 0:  # else one of the fp16 tail's splits: short programs
            ks_off = b.to(gl.int64) * stride_ksb + h * stride_ksh
            klo = klo_ptr + b.to(gl.int64) * stride_lob + h * stride_loh
            khi = khi_ptr + b.to(gl.int64) * stride_hib + h * stride_hih
            vp = vp_ptr + b.to(gl.int64) * stride_vpb + h * stride_vph
            vsc = vsc_ptr + b.to(gl.int64) * stride_vsb + h * stride_vsh
            vze = vze_ptr + b.to(gl.int64) * stride_vsb + h * stride_vsh
            t_s = gl.arange(0, 16, layout=ROW)
            inv0 = gl.exp2(-(t_s // 8).to(gl.float32))  # 2^-k: the scores' per-row factor (`_plane_pairs`)
            inv_pos = (inv0, inv0 * 0.25, inv0 * 0.0625, inv0 * 0.015625)  # K = 0, 2, 4, 6
            v_sel, v_mask = _value_selectors(BV, V5)  # `_value_codes`
            # Shared memory for blocks of 128 tokens. Block i + 1's copies are issued at block i's
            # start, once its key words, key scale rows and salient scale words are in registers
            # (those buffers have one slot), and waited for at block i + 1's start: a whole block of
            # cover. The value buffers have two slots (block i's value products read one while the
            # copies fill the other). Buffers of rows are [slots x rows, row], indexed by one row.
            buf_lo = gl.allocate_shared_memory(gl.int16, [PL_P, D, 8], SMEM2)  # plane: [channel, run]
            buf_hi = gl.allocate_shared_memory(gl.int16, [PH_P, NSC_P, 8], SMEM2)
            buf_v = gl.allocate_shared_memory(gl.int32, [2 * 8, 16 * NW], SMEM1)  # (slot, tile): [member, pair, word]
            # value scales, zeros: int32 words (two groups of a token), [token pair, word, pair member] a
            # tile; copied a block at a time, read a tile (row) at a time
            buf_sc = gl.allocate_shared_memory(gl.int32, [2, 8, 8 * NVG], SMEM2)
            buf_ze = gl.allocate_shared_memory(gl.int32, [2, 8, 8 * NVG], SMEM2)
            sc_rows = _rows_view(buf_sc, [16, 8 * NVG], SMEM1)
            ze_rows = _rows_view(buf_ze, [16, 8 * NVG], SMEM1)
            buf_ks = gl.allocate_shared_memory(gl.float16, [2, D], SMEM1)  # key scale row, zero row
            buf_ss = gl.allocate_shared_memory(gl.int32, [1, NSC_P], SMEM1)  # the words of the salient scales
            # Element offsets of the copies, from the block's first word / token / row.
            off_lo = _run_offsets(D, G32, CP_KEYS)
            off_hi = _run_offsets(NSC_P, G32, CP_KEYS)
            m_hi = off_hi < NSC * G32 * 2
            # Value words, scales and zeros reach the ring in row order (`_token_of_row`), as the
            # scores' rows: P^T's token pairs are then the values' and the scales' as stored.
            n_v = gl.arange(0, 16 * NW, layout=CP_V)  # [member e, pair i, word] -> row 2 i + e (`_value_codes`)
            v_rows = 2 * ((n_v // NW) % 8) + n_v // (8 * NW)
            off_v = _token_of_row(v_rows) * NW + n_v % NW
            # [tile, (pair i, word w, member e)] -> word w of the tile's token 2 i + e (tile h of step s
            # starts at token 4 s + 2 h = 2 tile)
            tile_s = gl.arange(0, 8, layout=gl.SliceLayout(1, CP_S))
            n_s = gl.arange(0, 8 * NVG, layout=gl.SliceLayout(0, CP_S))
            off_s = ((2 * tile_s[:, None] + _token_of_row((n_s[None, :] // NVG) * 2 + n_s[None, :] % 2)) * (NVG // 2)
                     + (n_s[None, :] // 2) % (NVG // 2))
            off_k = gl.arange(0, D, layout=CP_K)
            # Block 0's copies first, before the lengths and the query are read: they overlap those
            # round trips to memory. Every split's first block lies within the capacity, so the copy
            # is safe before the length says whether the block is held (when not, the loop skips it).
            g_start = packed * groups_per_split
            b_start = g_start * (G32 // 4)
            _issue_block(b_start, b_start >= 0, 0, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks, klo, khi, vp,
                         vsc, vze, ksc_ptr + ks_off, kze_ptr + ks_off, off_lo, off_hi, m_hi, off_v, off_s, off_k,
                         G32, B_LOW, D, NH, NSC, NW, NVG, PL_P, PH_P)
            async_copy.commit_group()
            n_groups = gl.load(n_groups_ptr + b)
            g_end = gl.minimum(g_start + groups_per_split, n_groups)
            n_blk = gl.maximum(g_end - g_start, 0) * (G32 // 4)
            # The query as the key product's B operand, q^T [D, 8 heads] (padded heads zero), and its
            # salient channels' [NSC_P, 8]; kept in fp16 (half the registers of fp32): q * softmax
            # scale * log2 e is well inside its range.
            KCOL: gl.constexpr = gl.SliceLayout(1, B_OP)  # the channels (rows) of a B operand
            q_heads = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
            q_rows = q_ptr + b.to(gl.int64) * stride_qb + (h * GQ + q_heads) * stride_qh
            q_c = gl.arange(0, D, layout=KCOL)
            q_t = (gl.load(q_rows[None, :] + q_c[:, None], mask=(q_heads < GQ)[None, :],
                           other=0.0).to(gl.float32) * qk_scale).to(gl.float16)
            js = gl.arange(0, NSC_P, layout=KCOL)
            order = order_ptr + b.to(gl.int64) * stride_ob + h * stride_oh
            sal = gl.load(order + (D - NSC) + js, mask=js < NSC, other=0)
            q_sal = (gl.load(q_rows[None, :] + sal[:, None], mask=(q_heads < GQ)[None, :] & (js < NSC)[:, None],
                             other=0.0).to(gl.float32) * (qk_scale * (1 << B_LOW))).to(gl.float16)
            # In shared memory, not registers: they are read once per group, and the loop's registers
            # decide how many programs an SM holds.
            buf_q = gl.allocate_shared_memory(gl.float16, [D, 8], SMEM2, q_t)
            buf_qs = gl.allocate_shared_memory(gl.float16, [NSC_P, 8], SMEM2, q_sal)
            js_cp = gl.arange(0, NSC_P, layout=CP_SAL)
            off_ss = gl.load(order + (D - NSC) + js_cp, mask=js_cp < NSC, other=0) // 2
            off_ss = gl.where(js_cp < NSC, off_ss, -1)
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
            for i in range(0, n_blk):  # blocks: 128 tokens, 8 tiles of 16
                blk = b_start + i
                slot = i % 2
                async_copy.wait_group(0)  # this block's copies have landed ...
                _thread_barrier()  # ... for every lane, and every lane is done with the previous block's slot
                if blk % (G32 // 4) == 0:  # a new group: its scales fold into the query, its zeros into a bias
                    # u = q x key scale, exactly as before (one fp16 rounding of an exact product);
                    # the zero point's bias and the planes' constant part c0 as MMAs, sums over the
                    # channels in fp32 like the scores' own (every row of those tiles is the same).
                    q_t = buf_q.load(B_OP)
                    u = q_t * buf_ks.index(0).load(KCOL)[:, None]
                    z_a = gl.expand_dims(buf_ks.index(1).load(gl.SliceLayout(0, A_OP)), 0)
                    bias = mma_v2(z_a + gl.zeros([16, D], gl.float16, layout=A_OP), q_t,
                                  gl.zeros([16, 8], gl.float32, layout=MMA))  # zero: z @ q
                    # The salient channels' scales: each in the low or high half of its copied word.
                    s_word = buf_ss.index(0).load(KCOL)
                    s_sal = gl.where(js < NSC, _low_half_f16(s_word >> ((sal % 2) * 16)), 0.0)
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
                _issue_block(blk + 1, i + 1 < n_blk, 1 - slot, buf_lo, buf_hi, buf_v, buf_sc, buf_ze, buf_ks, klo,
                             khi, vp, vsc, vze, ksc_ptr + ks_off, kze_ptr + ks_off, off_lo, off_hi, m_hi, off_v,
                             off_s, off_k, G32, B_LOW, D, NH, NSC, NW, NVG, PL_P, PH_P)
                _issue_salient_scales(blk + 1, i + 1 < n_blk, buf_ss, ksw_ptr + ks_off // 2, off_ss, G32, D)
                async_copy.commit_group()
                # The block's 8 tiles of scores (16 independent MMA chains), one online-softmax update
                # for its 128 tokens, then the value products of its 4 steps.
                s00 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 0, 0, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s01 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 0, 1, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s10 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 1, 0, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s11 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 1, 1, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s20 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 2, 0, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s21 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 2, 1, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s30 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 3, 0, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s31 = _tile_scores(u, u_hi, c0, bias, lw, hw, inv_pos, 3, 1, magic, B_LOW, NH, NSC, D, NSC_P, MMA, A_OP)
                s_max = gl.maximum(gl.maximum(gl.maximum(s00, s01), gl.maximum(s10, s11)),
                                   gl.maximum(gl.maximum(s20, s21), gl.maximum(s30, s31)))
                m_new = gl.maximum(m_h, gl.max(s_max, axis=0))
                alpha = gl.exp2(m_h - m_new)
                acc = acc * alpha[None, :]
                l_t = l_t * alpha[None, :]
                # acc_z holds head a in rows a and 8 + a
                acc_z = acc_z * gl.convert_layout(gl.reshape(gl.permute(gl.join(alpha, alpha), [1, 0]), [16]),
                                                  ROW)[:, None]
                m_h = m_new
                acc, acc_z, l_t = _softmax_values(s00, s01, m_new, slot * 8, acc, acc_z, l_t, buf_v, sc_rows, ze_rows,
                                                  v_sel, v_mask, D, NVG, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD, VS_WORDS,
                                                  PAIRS4)
                acc, acc_z, l_t = _softmax_values(s10, s11, m_new, slot * 8 + 2, acc, acc_z, l_t, buf_v, sc_rows,
                                                  ze_rows, v_sel, v_mask, D, NVG, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD,
                                                  VS_WORDS, PAIRS4)
                acc, acc_z, l_t = _softmax_values(s20, s21, m_new, slot * 8 + 4, acc, acc_z, l_t, buf_v, sc_rows,
                                                  ze_rows, v_sel, v_mask, D, NVG, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD,
                                                  VS_WORDS, PAIRS4)
                acc, acc_z, l_t = _softmax_values(s30, s31, m_new, slot * 8 + 6, acc, acc_z, l_t, buf_v, sc_rows,
                                                  ze_rows, v_sel, v_mask, D, NVG, WPG, MMA, A_OP, B_OP, V5, VWP_LOAD,
                                                  VS_WORDS, PAIRS4)
            async_copy.wait_group(0)  # nothing may be left writing shared memory when the program ends
            l_h = gl.sum(l_t, axis=0)
            c_r, code = _value_channel(gl.arange(0, D, layout=gl.SliceLayout(1, MMA)), GV, BV)  # row -> channel
            acc = _values_finished(acc, acc_z, code, D, GV, BV, MMA)
            m_fin = m_h
            l_fin = l_h
        else:
            acc, c_r, m_fin, l_fin = _fp16_tail(q_ptr, stride_qb, stride_qh, ks_ptr, vs_ptr, stride_sb, stride_sh,
                                                stride_st, kr_ptr, vr_ptr, stride_rb, stride_rh, stride_rt,
                                                sink_len_ptr, res_len_ptr, b, h, split - tail_start, n_tail,
                                                qk_scale, GQ, D, BLOCK_R, MMA, A_OP, B_OP)
        _store_partials(pm_ptr, pl_ptr, pa_ptr, part, acc, c_r, m_fin, l_fin, GQ, D, MMA)


def _halfwords(t: torch.Tensor) -> torch.Tensor:
    """The int16 view of packed bytes (last dim even); strides then count halves."""
    return t.view(torch.int16) if t.numel() else torch.empty(t.shape[:-1] + (t.shape[-1] // 2,), dtype=torch.int16,
                                                             device=t.device)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The int32 view of packed bytes (last dim a multiple of 4); strides then count words."""
    return t.view(torch.int32) if t.numel() else torch.empty(t.shape[:-1] + (t.shape[-1] // 4,), dtype=torch.int32,
                                                             device=t.device)


@dataclass
class SplitLaunch:
    """Everything one launch of the split kernel needs; `decode_attention_mma` runs it, and the CPU
    tests run the same kernel source through an emulator (tests/gluon_emu.py)."""
    grid: tuple[int, int]
    kernel: Any  # `_mma_split_kernel`, or `decode_mma_words._mma_split_kernel` for G not a multiple of 128
    args: tuple
    constexprs: dict
    layouts: dict  # the kernel's layout arguments
    pm: torch.Tensor  # partials, as `decode._combine_kernel` reads them
    pl: torch.Tensor
    pa: torch.Tensor

    PLAN = ("groups_per_split", "n_parts", "n_tail", "tail_start")  # kernel arguments, in order, before `magic`

    @property
    def plan(self) -> dict:
        """The launch plan's kernel arguments by name (`PLAN`)."""
        return dict(zip(self.PLAN, self.args[-1 - len(self.PLAN):-1], strict=True))

    def with_plan(self, **changes: int) -> SplitLaunch:
        """The same launch with some plan arguments replaced (for experiments and tests)."""
        plan = {**self.plan, **changes}
        return dataclasses.replace(self, args=(*self.args[:-1 - len(self.PLAN)], *plan.values(), self.args[-1]))

    def run(self, max_registers: int | None = None) -> None:
        """Launches the split kernel (one warp a program); max_registers caps registers (ptxas maxnreg)."""
        self.kernel[self.grid](*self.args, **self.constexprs, **self.layouts, num_warps=1,
                               **({"maxnreg": max_registers} if max_registers else {}))


# Registers per thread the kernels take uncapped (213-217 for the block kernel, 227 for the word kernel,
# measured offline for sm_90 and by ncu on the H200), rounded up to the allocation unit of 8.
UNCAPPED_REGISTERS = 232


SHARED_PER_SM = 227 * 1024  # bytes of shared memory a Hopper SM gives its blocks


def uses_blocks(group_size: int) -> bool:
    """Whether this module's block kernel runs groups of this size (else `decode_mma_words`' kernel)."""
    return group_size % BLOCK_TOKENS == 0


def ring_bytes(d: int, b_low: int, b_high: int, n_salient: int, value_bits: int, value_group: int,
               group_size: int = BLOCK_TOKENS) -> int:
    """Shared memory of one program: its block buffers and the query (see the kernel's
    buffers), or the word kernel's ring (`decode_mma_words.ring_bytes`)."""
    if not uses_blocks(group_size):
        from kernels import decode_mma_words

        return decode_mma_words.ring_bytes(d, b_low, b_high, n_salient, value_bits, value_group)
    nsc_p = next_pow2(max(n_salient, 16))
    key_words = next_pow2(b_low) * d  # 16 bytes per (plane, channel); the high planes' only where used
    if b_high > b_low and n_salient:
        key_words += next_pow2(b_high - b_low) * nsc_p
    # Value words, scales and zeros: two slots. Key plane words, scale and zero rows and the words of
    # the salient channels' scales: one (read into registers at a block's start, then refilled).
    values = BLOCK_TOKENS * d * value_bits // 8 + 2 * 2 * BLOCK_TOKENS * (d // value_group)
    keys = 16 * key_words + 2 * 2 * d + 4 * nsc_p
    return 2 * values + keys + 2 * MAX_GQA * (d + nsc_p)  # + the query's channels and salient channels


def resident_programs(device: torch.device, max_registers: int | None, shared_bytes: int) -> int:
    """One-warp programs of this kernel that fit on the GPU at once: registers, shared memory and
    the 32-block limit of an SM decide. An SM's registers are four partitions of 16384, one per
    warp scheduler, and a warp's come from one of them: at 223 registers a thread that is 2 warps
    a partition, 8 an SM (ncu: "Block Limit Registers 8"), where 65536 / (32 x 224) would say 9."""
    from kernels.decode import _sm_count

    regs = -(-(max_registers or UNCAPPED_REGISTERS) // 8) * 8  # allocated in units of 8 per thread
    per_sm = max(1, min(32, 4 * (16384 // (32 * regs)), SHARED_PER_SM // max(shared_bytes, 1)))
    return per_sm * (_sm_count(device.index or 0) if device.type == "cuda" else 1)


# What a program costs besides its groups (reading the query, writing and merging its partials), in
# groups: an estimate. It only keeps `wave_splits` from one-group splits that save a fraction of a wave.
PROGRAM_OVERHEAD = 0.25


@functools.cache
def wave_splits(n_bh: int, ng_cap: int, resident: int) -> int:
    """Splits of the packed region per (b, h_kv) that make the launch shortest.

    Every split is one program and `resident` programs run at once, so a launch lasts about
    (waves) x (groups per split + PROGRAM_OVERHEAD). A plan with a nearly empty last wave wastes
    most of it: at 32 x 8K tokens, 17 splits (4.1 waves of 4 groups) take 5 waves where 4 splits
    (one wave of 16 groups) take one. Ties go to fewer splits: fewer partials to write and merge.
    """
    best_cost, best = float("inf"), 1
    for splits in range(1, ng_cap + 1):
        per = -(-ng_cap // splits)
        splits = -(-ng_cap // per)  # the same plan with no empty split
        cost = -(-(n_bh * splits) // resident) * (per + PROGRAM_OVERHEAD)
        if cost < best_cost:
            best_cost, best = cost, splits
    return best


def tail_programs(n_bh: int, num_splits: int, resident: int, n_chunks: int) -> int:
    """Programs per (b, h_kv) for the fp16 tail (sinks and residual, `n_chunks` chunks of
    TAIL_TOKENS tokens by capacity): as many as the slots the packed splits leave free in a single wave, at
    most one a chunk. One program reads its chunks one after another, a round trip to memory
    each: at batch 1 (a wave of 2-block splits) that program was the launch's long pole (19 of
    24 us with nothing else to do, RESULTS.md). When the packed splits fill a wave or more, the
    tail is short next to them and stays one program."""
    free = resident // max(n_bh, 1) - num_splits
    return max(1, min(n_chunks, free))


def split_groups(ng_cap: int, num_splits: int, n_chunks: int) -> int:
    """Groups per packed split when the launch has more programs than fit at once and the tail
    programs launch first (not `tails_last`: the packed splits take several waves): the splits get
    about n_chunks / num_splits more groups each, so that the last split, which the GPU launches
    last (grid order: split-major), holds about n_chunks fewer. Its programs start only when the
    tail programs (launched first) free their slots, which under load takes about a group's time
    per chunk of the tail: with even splits they finished that much after the rest. H200, same run
    (`probe_uneven_2026-12-01.log`): 327.3 -> 321.0 us at 32 x 32K (last split 60 groups of 65),
    102.4 -> 98.5 at 32 x 8K (12 of 17), 307.3 -> 299.5 at 110 x 8K (3 of 10); one group more or
    less was slower on each. The split count never changes: even splits where it would."""
    even = -(-ng_cap // max(num_splits, 1)) if ng_cap else 0
    longer = -(-(ng_cap + n_chunks) // max(num_splits, 1))
    return longer if ng_cap and -(-ng_cap // longer) == num_splits else even


def tails_last(n_bh: int, num_splits: int, n_tail: int, resident: int) -> bool:
    """Whether to launch the tail programs after the packed splits: where the packed splits fit on
    the GPU at once and the tail programs do not. Launched first, the tail programs would hold
    slots that packed splits then wait for; launched last, they run in the slots the packed splits
    leave free and in those of splits that finish. H200, same run (`probe_uneven_tail_last_2026-12-01.log`):
    32 x 32K 317.6 us against 322.1 first (with `split_groups`) and 325.9 first with even splits;
    32 x 8K 98.0 against 98.3. Where the packed splits take several waves (110 x 8K) the tail goes
    first: 321.8 us last against 306.8 first (even splits)."""
    return n_bh * num_splits <= resident < n_bh * (num_splits + n_tail)


def split_launch(q: torch.Tensor, cache: DecodeCache, scale: float, num_splits: int | None,
                 programs_per_sm: int | None = None, max_registers: int | None = None,
                 n_tail: int | None = None, tail_last: bool | None = None) -> SplitLaunch:
    """The split kernel's grid, arguments and compile-time constants.

    Splits: `num_splits` if given; else about `programs_per_sm` programs per SM
    (`decode.split_plan`) if given; else `wave_splits` for the programs that fit at once with
    `max_registers`. Programs (bh, 0 .. n_tail - 1) handle the sinks and the residual
    (`tail_programs` unless `n_tail` is given) and (bh, n_tail + i) split i; with tail_last
    (by default `tails_last`), (bh, i) split i and the tail programs after them (launched last).
    Where the programs do not all fit at once and the tail launches first, the last split is the
    shorter (`split_groups`).
    """
    from kernels.decode import cache_operands, check_operands, split_plan

    check_operands(q, cache)
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    n_sc = cache.n_salient_channels
    ng_cap = cache.k_low.shape[2]
    blocks = uses_blocks(cache.group_size)
    shared = ring_bytes(d, cache.b_low, cache.b_high, n_sc, cache.value_bits, cache.value_group_size,
                        cache.group_size)
    resident = resident_programs(q.device, max_registers, shared)
    if num_splits is None and programs_per_sm is None and ng_cap:
        num_splits = wave_splits(bsz * hkv, ng_cap, resident)
    groups_per_split, num_splits = split_plan(q, cache, num_splits, programs_per_sm or 16)
    chunks = -(-cache.k_sink.shape[2] // TAIL_TOKENS) + -(-cache.k_res.shape[2] // TAIL_TOKENS)
    if n_tail is None:
        n_tail = tail_programs(bsz * hkv, num_splits, resident, chunks)
    n_parts = num_splits + n_tail
    if tail_last is None:
        tail_last = tails_last(bsz * hkv, num_splits, n_tail, resident)
    if bsz * hkv * n_parts > resident and not tail_last:  # packed splits wait for the tail programs' slots
        groups_per_split = split_groups(ng_cap, num_splits, chunks)
    pm = torch.empty((bsz * hkv, n_parts, MAX_GQA), dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pa = torch.empty((bsz * hkv, n_parts, MAX_GQA, d), dtype=torch.float32, device=q.device)
    # Value scales and zeros as int32 words, two groups of a token each (`_value_scale_pairs`).
    scale_words = dataclasses.replace(cache, v_scale=_words(cache.v_scale.flatten(-2)),
                                      v_zero=_words(cache.v_zero.flatten(-2)))
    planes = _halfwords if blocks else _words  # the block kernel reads plane words as int16 runs
    args = (
        *cache_operands(q, scale_words, planes(cache.k_low), planes(cache.k_high), _words(cache.v_packed)),
        pm, pl, pa, _words(cache.k_scale),
        scale * LOG2E, groups_per_split, n_parts, n_tail, num_splits if tail_last else 0, FP16_PAIR_1024,
    )
    constexprs = kernel_constants(hkv, hq // hkv, d, cache.group_size, cache.b_low, cache.b_high, n_sc,
                                  cache.value_bits, cache.value_group_size)
    kernel, layouts = _kernel_and_layouts(d, cache.group_size, cache.value_bits, cache.value_group_size,
                                          constexprs["NSC_P"])
    return SplitLaunch((bsz * hkv, n_parts), kernel, args, constexprs, layouts, pm, pl, pa)


def kernel_constants(hkv: int, gqa: int, d: int, group_size: int, b_low: int, b_high: int, n_salient: int,
                     value_bits: int, value_group: int) -> dict:
    """The split kernel's compile-time constants (besides its layouts)."""
    out = dict(HKV=hkv, GQ=gqa, D=d, G=group_size, B_LOW=b_low, NH=b_high - b_low, NSC=n_salient,
               NSC_P=next_pow2(max(n_salient, 16)), BV=value_bits, GV=value_group, BLOCK_R=TAIL_TOKENS,
               PL_P=next_pow2(b_low), PH_P=next_pow2(max(b_high - b_low, 1)))
    if not uses_blocks(group_size):
        from kernels import decode_mma_words

        out["STAGES"] = decode_mma_words.STAGES
    return out


def _kernel_and_layouts(d: int, group_size: int, value_bits: int, value_group: int, nsc_p: int) -> tuple[Any, dict]:
    if uses_blocks(group_size):
        return _mma_split_kernel, _layouts(d, value_bits, value_group, nsc_p).constexprs()
    from kernels import decode_mma_words

    return decode_mma_words._mma_split_kernel, decode_mma_words.word_layouts(d, value_bits, value_group, nsc_p)


def combine(launch: SplitLaunch, out: torch.Tensor) -> torch.Tensor:
    """Merges the split partials into `out` [B, H_q, d] (`decode.combine_partials`)."""
    from kernels.decode import combine_partials

    return combine_partials(launch.pm, launch.pl, launch.pa, out, launch.constexprs["HKV"])


def decode_attention_mma(q: torch.Tensor, cache: DecodeCache, scale: float, num_splits: int | None = None,
                         programs_per_sm: int | None = None, max_registers: int | None = None,
                         out: torch.Tensor | None = None, n_tail: int | None = None,
                         tail_last: bool | None = None) -> torch.Tensor:
    """`kernels.decode.decode_attention` with this kernel; call only where `supports(cache, q)`.

    num_splits, programs_per_sm: splits of the packed region per (b, h_kv), as `split_launch`
    (by default balanced over whole waves). max_registers caps registers per thread (ptxas
    maxnreg; uncapped the kernel takes about 225, which allows 8 warps per SM). n_tail: programs
    per (b, h_kv) for the sinks and the residual (by default `tail_programs`).
    """
    from kernels.decode import output_for

    out = output_for(q, out)
    launch = split_launch(q, cache, scale, num_splits, programs_per_sm, max_registers, n_tail, tail_last)
    launch.run(max_registers)
    return combine(launch, out)


def compile_offline(d: int, group_size: int, b_low: int, b_high: int, n_salient: int, value_bits: int,
                    value_group: int, gqa: int, activation: str = "*bf16", arch: int = 90,
                    max_registers: int | None = None) -> Any:
    """Compiles the split kernel for an NVIDIA GPU of compute capability `arch` without one.

    For inspection and tests: the result's `asm` holds TTGIR, PTX and the cubin, `metadata.shared`
    the shared memory. Pointers and strides are specialized as divisible by 16, as the JIT does for
    real caches. Must run without TRITON_INTERPRET (it replaces the language's own functions).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    const = kernel_constants(8, gqa, d, group_size, b_low, b_high, n_salient, value_bits, value_group)
    fn, layouts = _kernel_and_layouts(d, group_size, value_bits, value_group, const["NSC_P"])
    const.update(layouts)
    halfwords = {"klo_ptr", "khi_ptr"} if uses_blocks(group_size) else set()
    words = {"ksw_ptr", "vp_ptr", "vsc_ptr", "vze_ptr", "order_ptr", "sink_len_ptr", "n_groups_ptr",
             "res_len_ptr"}
    halves = {"ksc_ptr", "kze_ptr"}

    def kind(name: str) -> str:
        if name in const:
            return "constexpr"
        if name.endswith("_ptr"):
            if name in ("pm_ptr", "pl_ptr", "pa_ptr"):
                return "*fp32"
            return "*i16" if name in halfwords else "*i32" if name in words | {"klo_ptr", "khi_ptr"} else (
                "*fp16" if name in halves else activation)
        return "fp32" if name == "qk_scale" else "i32"

    sig = {n: kind(n) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 1, **({"maxnreg": max_registers} if max_registers else {})})

