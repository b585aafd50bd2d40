"""The Gluon decode kernels' launch: which kernel, how the work is split, and the launcher.

`decode_attention` runs `block`'s kernel for key groups of a multiple of 128 tokens and `words`'
for 32 or 64; call it only where `supports(cache, q)` (else `kernels.decode.decode_attention`).
A launch is a plan (`LaunchPlan`: splits of the packed region and programs for the fp16 tail, from
capacities only) turned into a grid and arguments (`SplitLaunch`); the partials then go to
`kernels.combine.combine_partials`. The CPU tests run the same `SplitLaunch` through an emulator
(tests/gluon_emu.py) and compile the kernels offline for sm_90 (`compile_offline`).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pnmix.kernels.combine import combine_partials
from pnmix.kernels.gluon import block, words
from pnmix.kernels.gluon.common import FP16_PAIR_1024, MAX_GQA, TAIL_TOKENS
from pnmix.kernels.layout import DecodeCache, next_pow2
from pnmix.kernels.operands import check_operands, decode_operands, offline_signature
from pnmix.kernels.plan import LOG2E, output_for, planned_groups, sm_count, split_plan

# Registers per thread the kernels take (213-217 for the block kernel, 220 with 3 value slots, 227 for the
# word kernel, for sm_90 with Triton 3.6), rounded up to the allocation unit of 8.
REGISTERS = 232
SHARED_PER_SM = 228 * 1024  # bytes of shared memory of a Hopper SM ...
SHARED_RESERVED = 1024  # ... of which each resident block takes this much besides its own
# What a program costs besides its groups (starting, reading the lengths and the query, writing and
# merging its partials), in groups. On the H200 with static-path capacities (8K tokens, batch 8 to
# 104, both quantized presets) 1.0 picks the measured fastest split count at every batch; 0.25
# picked up to 4.4x as many splits, up to 28% slower at 8K tokens and 2.3x with a short cache.
PROGRAM_OVERHEAD = 1.0
# Tail programs (one per chunk) are worth their own programs while the whole launch spans at most
# this many waves; past that they are short next to the packed splits and take slots from them.
TAIL_SPREAD_WAVES = 2


def available() -> bool:
    return torch.cuda.is_available()


def shape_supported(cache: DecodeCache, q: torch.Tensor) -> bool:
    """Whether the kernels' limits admit this cache and query, on any device: G a multiple of 32,
    head dim a multiple of 16 (>= 32), at most 8 query heads per KV head, value groups (as the
    kernels compute them, `kernel_value_group`) of whole 32-bit words (G_V * b_V >= 32) and whole
    MMA tiles (G_V a multiple of 16), 1 to 8 value groups per head (the zeros' sums have 8 columns)."""
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    if d % 16 or d < 32 or cache.value_group_size <= 0 or d % cache.value_group_size:
        return False
    gv = kernel_value_group(d, cache.value_group_size)
    return (hq % hkv == 0 and hq // hkv <= MAX_GQA
            and cache.group_size % 32 == 0
            and cache.value_bits in (1, 2, 4, 8) and (d * cache.value_bits) % 32 == 0
            and gv * cache.value_bits >= 32 and gv % 16 == 0 and d // gv <= 8
            and cache.k_low.shape[-1] % 4 == 0)


def kernel_value_group(d: int, value_group: int) -> int:
    """The value group the kernels compute with: the stored one, or half the head where one group
    spans the head (`ONE_SCALE`). The kernels read a token's value scales as words of two groups and
    sum the zeros two groups at a time; with one group a head, the two halves of the head are those
    two groups, both given the token's one scale and zero, and the stored words (two tokens' scales)
    are split into them in registers (`common._value_scale_pairs`)."""
    return d // 2 if value_group == d else value_group


def supports(cache: DecodeCache, q: torch.Tensor) -> bool:
    """Whether `decode_attention` can run here: CUDA with compute capability >= 8.0 and `shape_supported`."""
    return (available() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8
            and shape_supported(cache, q))


def kernel_module(group_size: int) -> ModuleType:
    """The kernel for key groups of `group_size` tokens: `block` for a multiple of 128, else `words`."""
    return block if group_size % block.BLOCK_TOKENS == 0 else words


def ring_bytes(d: int, b_low: int, b_high: int, n_salient: int, value_bits: int, value_group: int,
               group_size: int, value_slots: int = block.VALUE_SLOTS) -> int:
    """Shared memory of one program of the kernel for `group_size` (`value_slots`: the block kernel's)."""
    kernel = kernel_module(group_size)
    if kernel is block:
        return block.ring_bytes(d, b_low, b_high, n_salient, value_bits, value_group, value_slots)
    return kernel.ring_bytes(d, b_low, b_high, n_salient, value_bits, value_group)


def resident_programs(device: torch.device, shared_bytes: int, registers: int = REGISTERS) -> int:
    """One-warp programs that fit on the GPU at once: registers (per thread), shared memory and the
    32-block limit of an SM decide. An SM's registers are four partitions of 16384, one per warp
    scheduler, and a warp's come from one of them: at 223 registers a thread that is 2 warps a
    partition, 8 an SM, where 65536 / (32 x 224) would say 9; 3 a partition takes <= 170. Off CUDA:
    one SM."""
    per_sm = max(1, min(32, 4 * (16384 // (32 * registers)), SHARED_PER_SM // (shared_bytes + SHARED_RESERVED)))
    return per_sm * (sm_count(device.index or 0) if device.type == "cuda" else 1)


@functools.cache
def wave_splits(n_bh: int, ng_cap: int, resident: int, overhead: float = PROGRAM_OVERHEAD) -> int:
    """Splits of the packed region per (b, h_kv) that make the launch shortest.

    Every split is one program and `resident` programs run at once, so a launch lasts about
    (waves) x (groups per split + `overhead`, a program's cost besides its groups, in groups). A
    plan with a nearly empty last wave wastes most of it: at 32 x 8K tokens, 17 splits (4.1 waves
    of 4 groups) take 5 waves where 4 splits (one wave of 16 groups) take one. Ties go to fewer
    splits: fewer partials to write and merge, and fewer programs to start where the cache is still
    short (a split's programs start whether or not its groups hold tokens yet).
    """
    best_cost, best = float("inf"), 1
    for splits in range(1, ng_cap + 1):
        per = -(-ng_cap // splits)
        splits = -(-ng_cap // per)  # the same plan with no empty split
        cost = -(-(n_bh * splits) // resident) * (per + overhead)
        if cost < best_cost:
            best_cost, best = cost, splits
    return best


def tail_programs(n_bh: int, num_splits: int, resident: int, n_chunks: int) -> int:
    """Programs per (b, h_kv) for the fp16 tail (sinks and residual, `n_chunks` chunks of TAIL_TOKENS
    tokens by capacity). One program reads its chunks one after another, a round trip to memory
    each, so a single tail program is a launch's long pole wherever the packed splits are short:
    at batch 1, and at any batch while the cache is short. So one program a chunk while the launch
    spans at most TAIL_SPREAD_WAVES waves; beyond, as many as the slots the packed splits leave free
    in a single wave (at least one). H200, static-path capacities, 32 sinks + full residual
    (5 chunks), batch 8 / 16 (14 / 8 splits): one a chunk took 20.5 / 23.2 us against 29.4 / 32.1
    with one tail program at 142 tokens, and was within 2% of it at 8K tokens."""
    if n_bh * (num_splits + n_chunks) <= TAIL_SPREAD_WAVES * resident:
        return n_chunks
    free = resident // max(n_bh, 1) - num_splits
    return max(1, min(n_chunks, free))


def split_groups(ng_cap: int, num_splits: int, n_chunks: int) -> int:
    """Groups per packed split when the launch has more programs than fit at once and the tail
    programs launch first (not `tails_last`): about n_chunks / num_splits more groups each, so that
    the last split, which the GPU launches last (grid order: split-major), holds about n_chunks
    fewer. Its programs start only when the tail programs free their slots, about a group's time
    per chunk of the tail; with even splits they finish that much after the rest. The split count
    never changes: even splits where it would."""
    even = -(-ng_cap // max(num_splits, 1)) if ng_cap else 0
    longer = -(-(ng_cap + n_chunks) // max(num_splits, 1))
    return longer if ng_cap and -(-ng_cap // longer) == num_splits else even


def tails_last(n_bh: int, num_splits: int, n_tail: int, resident: int) -> bool:
    """Whether to launch the tail programs after the packed splits: where the packed splits fit on
    the GPU at once and the tail programs do not. Launched first, they would hold slots that packed
    splits then wait for; launched last, they run in the slots the packed splits leave free and in
    those of splits that finish. Where the packed splits take several waves, the tail goes first."""
    return n_bh * num_splits <= resident < n_bh * (num_splits + n_tail)


@dataclass(frozen=True)
class LaunchPlan:
    """Per (b, h_kv): num_splits packed splits of groups_per_split groups and n_tail programs for the
    sinks and the residual, launched after the packed splits if tail_last, else before them;
    max_registers: the registers a thread may take (ptxas spills past it; None: as it allocates);
    value_slots: the block kernel's value slots (`block.VALUE_SLOTS`; 3 runs a block's value
    products beside the next block's scores)."""

    groups_per_split: int
    num_splits: int
    n_tail: int
    tail_last: bool
    max_registers: int | None = None
    value_slots: int = block.VALUE_SLOTS

    @property
    def n_parts(self) -> int:
        return self.num_splits + self.n_tail

    @property
    def tail_start(self) -> int:
        """The split index of the first tail program."""
        return self.num_splits if self.tail_last else 0


def plan_launch(q: torch.Tensor, cache: DecodeCache, num_splits: int | None = None,
                max_groups: int | None = None, max_registers: int | None = None,
                value_slots: int = block.VALUE_SLOTS) -> LaunchPlan:
    """The plan for `q` over `cache`: `num_splits` packed splits if given, else `wave_splits` for the
    programs that fit at once; `tail_programs`, `tails_last` and, where the programs do not all fit
    at once and the tail launches first, a shorter last split (`split_groups`). The packed region
    planned for is the capacity, or `max_groups` groups where given: a bound on the groups any
    sequence holds (groups past it are not read). `max_registers` caps the kernel's registers a
    thread (more programs fit at once; the compiler spills what does not fit); `value_slots` as in
    `LaunchPlan` (2 or 3)."""
    if value_slots not in (2, 3):
        raise ValueError(f"value_slots {value_slots}: allowed 2 or 3")
    check_operands(q, cache)
    bsz, _, d = q.shape
    n_bh = bsz * cache.k_sink.shape[1]
    ng_cap = planned_groups(cache.k_low.shape[2], max_groups)
    shared = ring_bytes(d, cache.b_low, cache.b_high, cache.n_salient_channels, cache.value_bits,
                        cache.value_group_size, cache.group_size, value_slots)
    resident = resident_programs(q.device, shared, max_registers or REGISTERS)
    if num_splits is None:
        num_splits = wave_splits(n_bh, ng_cap, resident) if ng_cap else 1
    groups_per_split, num_splits = split_plan(ng_cap, num_splits)
    chunks = -(-cache.k_sink.shape[2] // TAIL_TOKENS) + -(-cache.k_res.shape[2] // TAIL_TOKENS)
    n_tail = tail_programs(n_bh, num_splits, resident, chunks)
    tail_last = tails_last(n_bh, num_splits, n_tail, resident)
    if n_bh * (num_splits + n_tail) > resident and not tail_last:  # packed splits wait for the tail's slots
        groups_per_split = split_groups(ng_cap, num_splits, chunks)
    return LaunchPlan(groups_per_split, num_splits, n_tail, tail_last, max_registers, value_slots)


def kernel_constants(hkv: int, gqa: int, d: int, group_size: int, b_low: int, b_high: int, n_salient: int,
                     value_bits: int, value_group: int, value_slots: int = block.VALUE_SLOTS) -> dict:
    """The kernel's compile-time constants besides its layouts. The salient channel count is not
    one (it is the kernel's run-time `n_sc`): only its size class NSC_P, whether there are any (SAL)
    and whether they fill the class (FULL: then the count is NSC_P itself, and the kernel compiles
    as with the count a constant) are, and for `block` whether they fill less than half of it (FEW:
    only counts below 8, whose copies keep a mask; `block._salient_rows`). So configs that differ only
    in their salient ratio mostly share a compiled kernel. `value_slots`: the block kernel's VSLOTS (`LaunchPlan`)."""
    nsc_p = next_pow2(max(n_salient, 16))
    kernel = kernel_module(group_size)
    return dict(HKV=hkv, GQ=gqa, D=d, G=group_size, B_LOW=b_low, NH=b_high - b_low, SAL=n_salient > 0,
                FULL=n_salient == nsc_p, NSC_P=nsc_p, BV=value_bits, GV=kernel_value_group(d, value_group),
                ONE_SCALE=value_group == d, BLOCK_R=TAIL_TOKENS,
                PL_P=next_pow2(b_low), PH_P=next_pow2(max(b_high - b_low, 1)),
                **kernel.CONSTANTS,
                **({"VSLOTS": value_slots, "FEW": n_salient < nsc_p // 2} if kernel is block else {}))


def _view(t: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """`t`'s bytes as `dtype` elements (the last dim shrinks); strides then count those elements."""
    if t.numel():
        return t.view(dtype)
    return torch.empty((*t.shape[:-1], t.shape[-1] * t.element_size() // dtype.itemsize), dtype=dtype,
                       device=t.device)


@dataclass
class SplitLaunch:
    """One launch of a split kernel: `run` launches it, `combine` merges its partials; the CPU tests
    run the same kernel source and arguments through an emulator (tests/gluon_emu.py)."""

    grid: tuple[int, int]
    kernel: Any  # `block._block_kernel` or `words._words_kernel`
    # (DecodeOperands, pm, pl, pa, ksw, qk_scale, groups_per_split, n_parts, n_tail, tail_start, magic, n_sc)
    args: tuple
    constexprs: dict
    layouts: dict  # the kernel's layout arguments
    plan: LaunchPlan
    pm: torch.Tensor  # partials, as `kernels.combine.combine_partials` reads them
    pl: torch.Tensor
    pa: torch.Tensor

    def run(self) -> Any:
        """Launches the split kernel, one warp a program; returns the compiled kernel (its `n_regs`,
        `n_spills`)."""
        cap = {"maxnreg": self.plan.max_registers} if self.plan.max_registers else {}
        return self.kernel[self.grid](*self.args, **self.constexprs, **self.layouts, num_warps=1, **cap)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Merges the partials into `out` [B, H_q, d] and returns it."""
        return combine_partials(self.pm, self.pl, self.pa, out, self.constexprs["HKV"])


def split_launch(q: torch.Tensor, cache: DecodeCache, scale: float, plan: LaunchPlan) -> SplitLaunch:
    """The grid, arguments and compile-time constants of `plan`: programs (bh, tail_start ..
    tail_start + n_tail - 1) take the sinks and the residual, the others the packed splits in order."""
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    kernel = kernel_module(cache.group_size)
    pm = torch.empty((bsz * hkv, plan.n_parts, MAX_GQA), dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pa = torch.empty((bsz * hkv, plan.n_parts, MAX_GQA, d), dtype=torch.float32, device=q.device)
    # Value scales and zeros as int32 words, two groups of a token each (`common._value_scale_pairs`).
    ops = decode_operands(q, cache, _view(cache.k_low, kernel.PLANE_DTYPE), _view(cache.k_high, kernel.PLANE_DTYPE),
                          _view(cache.v_packed), _view(cache.v_scale.flatten(-2)), _view(cache.v_zero.flatten(-2)))
    args = (ops, pm, pl, pa, _view(cache.k_scale), scale * LOG2E, plan.groups_per_split, plan.n_parts, plan.n_tail,
            plan.tail_start, FP16_PAIR_1024, cache.n_salient_channels)
    constexprs = kernel_constants(hkv, hq // hkv, d, cache.group_size, cache.b_low, cache.b_high,
                                  cache.n_salient_channels, cache.value_bits, cache.value_group_size,
                                  plan.value_slots)
    layouts = kernel.layouts(d, cache.value_bits, constexprs["GV"], constexprs["NSC_P"], constexprs["ONE_SCALE"])
    return SplitLaunch((bsz * hkv, plan.n_parts), kernel.KERNEL, args, constexprs, layouts, plan, pm, pl, pa)


def decode_attention(q: torch.Tensor, cache: DecodeCache, scale: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None, max_groups: int | None = None,
                     max_registers: int | None = None, value_slots: int = block.VALUE_SLOTS) -> torch.Tensor:
    """`kernels.decode.decode_attention` with the Gluon kernels; call only where `supports(cache, q)`.

    q [B, H_q, d] -> [B, H_q, d] in q's dtype; num_splits: splits of the packed region per (b, h_kv)
    (by default balanced over whole waves of the GPU, `plan_launch`); `out`, `max_groups` as there;
    `max_registers`, `value_slots` as in `plan_launch`.
    """
    out = output_for(q, out)
    launch = split_launch(q, cache, scale, plan_launch(q, cache, num_splits, max_groups, max_registers, value_slots))
    launch.run()
    return launch.combine(out)


def compile_offline(d: int, group_size: int, b_low: int, b_high: int, n_salient: int, value_bits: int,
                    value_group: int, gqa: int, activation: str = "*bf16", arch: int = 90,
                    max_registers: int | None = None, value_slots: int = block.VALUE_SLOTS) -> Any:
    """Compiles the kernel for these shapes for an NVIDIA GPU of compute capability `arch`, without one.

    For inspection and tests: the result's `asm` holds TTGIR, PTX and the cubin, `metadata.shared`
    the shared memory. Pointers and strides are specialized as divisible by 16, as the JIT does for
    real caches; `max_registers`, `value_slots` as in `plan_launch`. Must run without TRITON_INTERPRET (it replaces
    the language's own functions).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = kernel_module(group_size)
    const = kernel_constants(8, gqa, d, group_size, b_low, b_high, n_salient, value_bits, value_group, value_slots)
    const.update(kernel.layouts(d, value_bits, const["GV"], const["NSC_P"], const["ONE_SCALE"]))
    planes = "*i16" if kernel.PLANE_DTYPE == torch.int16 else "*i32"
    operand_types = {"klo_ptr": planes, "khi_ptr": planes, "vp_ptr": "*i32", "vsc_ptr": "*i32",
                     "vze_ptr": "*i32", "order_ptr": "*i32", "sink_len_ptr": "*i32", "n_groups_ptr": "*i32",
                     "res_len_ptr": "*i32", "ksc_ptr": "*fp16", "kze_ptr": "*fp16"}
    scalars = {"pm_ptr": "*fp32", "pl_ptr": "*fp32", "pa_ptr": "*fp32", "ksw_ptr": "*i32", "qk_scale": "fp32"}
    fn = kernel.KERNEL
    sig, attrs = offline_signature(fn, const, operand_types, activation, scalars)
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 1, **({"maxnreg": max_registers} if max_registers else {})})


def offline_resources(compiled: Any) -> tuple[int, int]:
    """Registers a thread and stack bytes (spills) of a `compile_offline` result, read from its cubin
    by the cuobjdump that Triton ships beside its ptxas."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-500:]}")
    return int(m.group(1)), int(m.group(2))
