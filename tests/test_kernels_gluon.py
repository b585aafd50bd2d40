"""The Gluon decode kernels without a GPU: `kernels.gluon.block`'s kernel (G a multiple of 128) and
`kernels.gluon.words`' (G 32 or 64), which `kernels.gluon.launch` picks.

1. Their source, run by the CPU emulator (`gluon_emu.py`), against dequantize-then-attend in fp32
   on the cases of `test_kernels_decode.py` that the kernels' limits admit (fresh random inputs, the
   output poisoned): the arithmetic and the indexing of the kernels are what it checks.
2. Garbage past each sequence's lengths does not change the output.
3. The kernel compiles for sm_90 (offline, no GPU needed) for configs covering every branch: the
   layouts it declares are the ones the tensor cores use (`assert_trivial` conversions would not
   compile otherwise) and its shared memory is what `ring_bytes` counts.
4. The emulator's models of the kernel's cross-lane inline PTX (prmt, movmatrix) agree with the
   instructions' documented semantics, computed lane by lane.
5. The launch plan's rules (splits over whole waves, tail programs, a shorter last split).
"""

from __future__ import annotations

import dataclasses
import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # the combine step is the Triton kernel, run by the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402
from gluon_emu import _byte_perm, _f16_pairs, _halves_f16, _transposed_blocks, run_split_kernel  # noqa: E402
from test_kernels_decode import CASES, Case, build, fresh_generator, garble_past_held_tokens, run_compiler  # noqa: E402

from pnmix.backend import decode_reference  # noqa: E402
from pnmix.kernels.gluon import block, launch  # noqa: E402
from pnmix.kernels.plan import length_bucket  # noqa: E402
from pnmix.models import model_names  # noqa: E402


def emulated(q: torch.Tensor, cache, scale: float, splits: int | None, n_tail: int | None = None,
             tail_last: bool = False, max_groups: int | None = None, value_slots: int = 2) -> torch.Tensor:
    """The kernel's output through the emulator, with the plan's tail programs set (n_tail None: as
    planned) and launched first or last."""
    plan = dataclasses.replace(launch.plan_launch(q, cache, splits, max_groups, value_slots=value_slots),
                               tail_last=tail_last,
                               **({"n_tail": n_tail} if n_tail else {}))
    split = launch.split_launch(q, cache, scale, plan)
    assert split.grid[1] == plan.n_parts == plan.num_splits + plan.n_tail
    assert split.args[-3] == plan.tail_start == (plan.num_splits if tail_last else 0)
    for t in (split.pm, split.pl, split.pa):
        t.fill_(float("nan"))  # poisoned: a partial the kernel does not write fails the check
    run_split_kernel(split)
    return split.combine(torch.full_like(q, float("nan")))


def admitted(case: Case) -> bool:
    q, cache = build(case, torch.Generator().manual_seed(0))
    return launch.shape_supported(cache, q)


MMA_CASES = [c for c in CASES if admitted(c)]
# One value group a head (ONE_SCALE): the kernels compute two halves of the head that share the
# token's one scale and zero; block and word kernels, head dims 64 and 128, value bits 1 to 8.
ONE_SCALE_CASES = [
    Case(b_low=1, b_high=3, group_size=128, head_dim=128, value_bits=2, value_group=128, gqa=4, splits=2),
    Case(b_low=2, b_high=2, group_size=256, head_dim=64, value_bits=8, value_group=64, gqa=3, splits=2),
    Case(b_low=2, b_high=4, group_size=64, head_dim=64, value_bits=1, value_group=64, gqa=2, splits=3),
    Case(b_low=1, b_high=2, group_size=32, head_dim=128, value_bits=4, value_group=128, gqa=1, splits=2),
]


def test_the_cases_cover_the_kernel_branches():
    # Value bits 1, 2, 4, 8; no salient channels, some, all; no high planes; head dims 64 and 128.
    assert {c.value_bits for c in MMA_CASES} == {1, 2, 4, 8}
    assert {c.ratio for c in MMA_CASES} == {0.0, 0.5, 1.0}
    assert any(c.b_low == c.b_high for c in MMA_CASES) and {c.head_dim for c in MMA_CASES} == {64, 128}
    assert {c.group_size for c in MMA_CASES} == {32, 64, 128} and {c.gqa for c in MMA_CASES} == {1, 3, 4}


def assert_emulated_matches_reference(q, cache, scale, splits, n_tail=None, tail_last=False, value_slots=2):
    """Runs the emulated kernel; asserts every output finite and within 1e-2 relative error of the
    fp32 dequantize-then-attend reference. Returns both outputs."""
    out = emulated(q, cache, scale, splits, n_tail, tail_last, value_slots=value_slots)
    assert torch.isfinite(out).all(), "unwritten or non-finite output elements"
    want = decode_reference(q, cache, scale)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"relative error {err:.3e}"
    return out, want


@pytest.mark.parametrize("case", MMA_CASES + ONE_SCALE_CASES, ids=lambda c: (
    f"b{c.b_low}{c.b_high}-G{c.group_size}-r{c.ratio}-s{c.n_sink}-{c.residual}-gqa{c.gqa}-d{c.head_dim}"
    f"-v{c.value_bits}g{c.value_group}-{str(c.dtype)[6:]}-sp{c.splits}"))
def test_emulated_kernel_matches_dequantize_then_attend(case):
    q, cache = build(case, fresh_generator())
    out, want = assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits or 3)
    per_seq = (out.float() - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))
    assert (per_seq <= 2e-2).all(), f"per-sequence relative errors {per_seq.tolist()}"


def test_emulated_kernel_with_eight_value_groups_per_head():
    # 16-channel value groups at d 128: `_value_products` splits groups three levels deep and
    # `_column_sums` gives each group one column (the shared CASES reach at most 4 groups).
    case = Case(b_low=2, b_high=3, group_size=64, head_dim=128, value_bits=4, value_group=16, gqa=2, splits=2)
    q, cache = build(case, fresh_generator())
    assert launch.shape_supported(cache, q) and cache.v_scale.shape[-1] == 8
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits)


def test_one_value_group_cases_reach_the_kernels_with_one_scale_a_token():
    for case in ONE_SCALE_CASES:
        q, cache = build(case, torch.Generator().manual_seed(0))
        assert launch.shape_supported(cache, q) and cache.v_scale.shape[-1] == 1


def test_emulated_block_kernel_with_eight_value_groups_per_head():
    # 16-channel value groups at d 128 in the block kernel (the shared CASES reach 4 groups there).
    case = Case(b_low=2, b_high=4, group_size=128, head_dim=128, value_bits=4, value_group=16, gqa=2, splits=2)
    q, cache = build(case, fresh_generator())
    assert launch.kernel_module(cache.group_size) is block and cache.v_zero.shape[-1] == 8
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits)


def test_emulated_kernel_with_at_most_16_salient_channels():
    # 16 salient channels are 8 high-plane channel pairs, one MMA tile, and a ring slot's rows too
    # short to swizzle (`slot_rows`); the shared CASES have 32 or more whenever there are high planes.
    case = Case(b_low=1, b_high=3, ratio=0.25, head_dim=64, gqa=4, splits=2)
    q, cache = build(case, fresh_generator())
    assert 0 < cache.n_salient_channels <= 16
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits)


@pytest.mark.parametrize("head_dim,n_salient", [(64, 6), (64, 8), (64, 12), (128, 40), (128, 126)])
def test_emulated_block_kernel_with_salient_counts_inside_their_class(head_dim, n_salient):
    # A count that does not fill its size class: the high-plane buffers hold the first and the last
    # half of the class (channels counted once: 12 of 16 hold 4 twice, 8 of 16 all of them) or, below
    # half the class (6 of 16), the count alone with masked copies; layer-wise configs run these.
    case = Case(b_low=1, b_high=3, group_size=128, ratio=n_salient / head_dim, head_dim=head_dim, gqa=3, splits=2)
    q, cache = build(case, fresh_generator())
    assert launch.kernel_module(cache.group_size) is block and cache.n_salient_channels == n_salient
    const = launch.kernel_constants(1, 3, head_dim, 128, 1, 3, n_salient, 2, 32)
    assert not const["FULL"] and const["FEW"] == (n_salient < const["NSC_P"] // 2)
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits)


def test_emulated_block_kernel_with_two_blocks_per_group():
    # G = 256: a group's plane words are two blocks (the second starts 8 halves into each channel's
    # words), and the key scales and query operands change every other block.
    case = Case(b_low=1, b_high=3, group_size=256, head_dim=64, gqa=3, splits=2)
    q, cache = build(case, fresh_generator())
    assert launch.kernel_module(cache.group_size) is block and cache.k_low.shape[2] >= 2
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits)


THREE_SLOT_CASES = [c for c in MMA_CASES if c.group_size % 128 == 0] + [
    Case(b_low=1, b_high=3, group_size=256, head_dim=64, gqa=3, splits=2),  # 6 blocks: the slots wrap around
    ONE_SCALE_CASES[0],
]


@pytest.mark.parametrize("case", THREE_SLOT_CASES, ids=lambda c: (
    f"b{c.b_low}{c.b_high}-G{c.group_size}-r{c.ratio}-d{c.head_dim}-v{c.value_bits}g{c.value_group}"))
@pytest.mark.parametrize("splits", [1, 4], ids=["one-split", "empty-splits"])
def test_emulated_block_kernel_with_three_value_slots(case, splits):
    # Value products one block behind the scores: the zeroed slot before block 0, the last block's
    # products after the loop, splits with no block (4 splits of at most 3 groups) and 6 blocks in
    # one split (G 256), where every slot is refilled.
    q, cache = build(case, fresh_generator())
    assert launch.kernel_module(cache.group_size) is block
    out, want = assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, splits, value_slots=3)
    assert torch.allclose(out, emulated(q, cache, case.head_dim**-0.5, splits), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("case,n_tail", [
    # sinks (one chunk, 7 tokens in sequence 2) and a full residual of two chunks: one chunk a program
    (Case(residual="full", gqa=3, splits=2), 3),
    # more programs than chunks (some hold no token) and uneven partial residuals (16, 1, 5 tokens)
    (Case(group_size=64, residual="partial", value_group=16, splits=1), 5),
    # the block kernel: 1 + 8 chunks over 4 programs (program 0: the sinks and the residual's last)
    (Case(b_low=1, b_high=3, group_size=128, residual="full", head_dim=128, dtype=torch.bfloat16, splits=2), 4),
    # one tail program (the plan while the wave has exactly one slot free per KV head)
    (Case(residual="partial", gqa=4, splits=2), 1),
    (Case(b_low=2, b_high=4, group_size=128, head_dim=64, residual="partial", splits=3), 1),
], ids=["words-3", "words-5-partial", "blocks-4", "words-1", "blocks-1"])
@pytest.mark.parametrize("tail_last", [False, True], ids=["tail-first", "tail-last"])
def test_emulated_kernel_with_the_tail_over_several_programs(case, n_tail, tail_last):
    q, cache = build(case, fresh_generator())
    assert launch.shape_supported(cache, q)
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, case.splits, n_tail, tail_last)


def test_tail_programs_one_a_chunk_within_two_waves_else_the_free_slots():
    # 132 SMs x 8 programs. Batch 1 at 32K (128 splits of 2 groups) and batch 8 / 16 at 8K (14 and
    # 8 splits): one program per chunk, the launch spans at most two waves. Batch 32 at 8K (4
    # splits, 2.2 waves): the free slots of one wave, none, so one; likewise many waves.
    assert launch.tail_programs(8, 128, 1056, 5) == 5
    assert launch.tail_programs(64, 14, 1056, 5) == 5
    assert launch.tail_programs(128, 8, 1056, 5) == 5
    assert launch.tail_programs(256, 4, 1056, 5) == 1
    assert launch.tail_programs(64, 10, 1056, 30) == 6  # 30 chunks, 2.4 waves: 16 slots - 10 splits
    assert launch.tail_programs(256, 16, 1056, 5) == 1
    assert launch.tail_programs(1, 1, 1, 5) == 1


def test_split_groups_shorten_the_last_split_by_the_tail_chunks():
    # 32 x 32K, 32 x 8K and 110 x 8K on an H200 (5 tail chunks): the measured best of each
    assert launch.split_groups(255, 4, 5) == 65  # last split 60
    assert launch.split_groups(63, 4, 5) == 17  # last split 12
    assert launch.split_groups(63, 7, 5) == 10  # last split 3
    assert launch.split_groups(8, 8, 5) == 1  # longer splits would be fewer: even
    assert launch.split_groups(0, 0, 5) == 0


def test_tail_programs_launch_last_where_only_they_overflow_the_wave():
    # H200, 1,056 programs at once: 32 x 32K and 32 x 8K (1,024 packed splits + 256 tail programs)
    # last; 110 x 8K (6,160 packed) and batch 1 (everything fits) first.
    assert launch.tails_last(256, 4, 1, 1056)
    assert not launch.tails_last(880, 7, 1, 1056)
    assert not launch.tails_last(8, 128, 4, 1056)


def test_emulated_kernel_with_a_shorter_last_split():
    # 20 groups of capacity in 4 splits whose programs do not all fit at once (the CPU plan counts 8
    # resident): `split_groups` makes them 6, 6, 6 and 2 groups (3 tail chunks). Sequence 0 holds
    # all 20 groups, sequence 1 ends inside the third split.
    case = Case(group_size=32, head_dim=64, gqa=4, residual="partial", splits=4)
    gen = fresh_generator()
    q, cache = build(case, gen)
    pad = 17
    grown = {}
    for name, per in (("k_low", 1), ("k_high", 1), ("k_scale", 1), ("k_zero", 1), ("v_packed", case.group_size),
                      ("v_scale", case.group_size), ("v_zero", case.group_size)):
        t = getattr(cache, name)
        shape = (*t.shape[:2], pad * per, *t.shape[3:])
        if t.dtype == torch.uint8:
            extra = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        elif name.endswith("scale"):
            extra = (torch.rand(shape, generator=gen) * 0.1 + 0.01).to(t.dtype)
        else:
            extra = (torch.randn(shape, generator=gen) * 0.1).to(t.dtype)
        grown[name] = torch.cat([t, extra], dim=2)
    cache = dataclasses.replace(cache, **grown, n_groups=torch.tensor([20, 13, 2], dtype=torch.int32))
    plan = launch.plan_launch(q, cache, 4)
    assert plan.tail_start == 0  # 12 programs: the packed splits do not fit at once either
    assert plan.groups_per_split == 6 and plan.num_splits == 4
    assert_emulated_matches_reference(q, cache, case.head_dim**-0.5, 4)


def test_emulated_kernel_planned_for_a_bound_on_the_groups_held():
    # Capacity 3 groups, every sequence holding at most 1: the plan for max_groups=1 covers one group
    # (the capacity's, 3), and the groups past the bound (NaN scales) are not read.
    q, cache = build(Case(value_group=32), fresh_generator())
    cache = dataclasses.replace(cache, n_groups=torch.tensor([1, 1, 0], dtype=torch.int32))
    whole = launch.plan_launch(q, cache)
    assert whole.num_splits * whole.groups_per_split == 3
    plan = launch.plan_launch(q, cache, max_groups=1)
    assert (plan.num_splits, plan.groups_per_split) == (1, 1)
    cache.k_scale[:, :, 1:] = float("nan")
    cache.v_scale[:, :, cache.group_size:] = float("nan")
    out = emulated(q, cache, 0.125, None, max_groups=1)
    assert torch.isfinite(out).all()
    want = decode_reference(q, cache, 0.125)
    assert ((out.float() - want).norm() / want.norm()).item() <= 1e-2


def test_emulated_kernel_reads_only_held_tokens():
    q, cache = build(Case(value_group=32), fresh_generator())
    before = emulated(q, cache, 0.125, 2)
    garble_past_held_tokens(cache)
    after = emulated(q, cache, 0.125, 2)
    assert torch.equal(before, after)


@pytest.mark.parametrize("value_group,head_dim,admitted_here", [
    (32, 64, True), (16, 128, True), (64, 128, True),  # 2 to 8 value groups of whole MMA tiles
    (64, 64, True), (128, 128, True),  # one group per head: computed as two halves sharing its scale
    (8, 64, False),  # a group smaller than an MMA tile
])
def test_value_group_limits_send_other_configs_to_the_triton_kernel(value_group, head_dim, admitted_here):
    q, cache = build(Case(value_group=value_group, head_dim=head_dim, value_bits=4), torch.Generator().manual_seed(0))
    assert launch.shape_supported(cache, q) is admitted_here


@pytest.mark.parametrize("model", model_names())
def test_every_searched_config_of_the_products_models_takes_the_gluon_kernels(model):
    # `PNMIX_DECODE_KERNEL=auto` falls back to the Triton kernel (below SDPA's speed) only where
    # `shape_supported` refuses: on these models no config the tuner searches (every G, every value
    # format the search space offers at the head dim; the bit pair changes no limit) is refused.
    from pnmix.config import GROUP_SIZES
    from pnmix.models import model_shape
    from pnmix.tuner.search.space import SearchSpace

    shape = model_shape(model)
    d, gqa = shape.head_dim, shape.num_heads // shape.num_kv_heads
    refused = []
    for g in GROUP_SIZES:
        for bits, group in SearchSpace().value_choices(d):
            case = Case(group_size=g, head_dim=d, gqa=gqa, value_bits=bits, value_group=group, ratio=0.25)
            q, cache = build(case, torch.Generator().manual_seed(0))
            if not launch.shape_supported(cache, q):
                refused.append((g, bits, group))
    assert not refused, f"{model} (d {d}, {gqa} query heads a KV head): G, value bits, value group {refused}"
    # the check itself: a shape past the kernels' limits is refused
    q, cache = build(Case(head_dim=d, gqa=9), torch.Generator().manual_seed(0))
    assert not launch.shape_supported(cache, q)


# (head_dim, G, b_low, b_high, salient channels, value bits, value group, GQA, activation pointer type,
#  the block kernel's value slots)
COMPILED = [
    (128, 128, 1, 3, 64, 2, 32, 4, "*bf16", 2),  # pnmix-paper on an 8B-shaped layer
    (64, 32, 2, 4, 64, 1, 32, 1, "*fp16", 2),  # every channel salient, 1-bit values
    (64, 64, 4, 4, 0, 8, 32, 3, "*fp32", 2),  # no high planes, 8-bit values
    (128, 32, 2, 3, 32, 4, 16, 2, "*fp16", 2),  # 8 value groups per head (the deepest group split)
    (64, 32, 1, 3, 16, 2, 32, 4, "*bf16", 2),  # 16 salient channels: one tile of high-plane pairs
    (64, 256, 2, 4, 16, 4, 16, 2, "*fp16", 2),  # two blocks per group, 16 salient channels
    (128, 128, 3, 3, 0, 1, 64, 8, "*bf16", 2),  # no high planes, 1-bit values, GQA 8
    (128, 128, 2, 4, 32, 4, 16, 2, "*fp16", 2),  # the block kernel with 8 value groups per head
    (128, 128, 1, 3, 64, 4, 128, 4, "*bf16", 2),  # one value group per head (ONE_SCALE), block kernel
    (64, 64, 2, 3, 32, 1, 64, 3, "*fp16", 2),  # one value group per head, word kernel, 1-bit values
    (128, 128, 1, 3, 64, 2, 32, 4, "*bf16", 3),  # pnmix-paper with 3 value slots
    (64, 256, 2, 3, 32, 4, 64, 2, "*fp16", 3),  # 3 value slots, one value group per head, two blocks per group
    (128, 128, 1, 3, 40, 2, 32, 4, "*bf16", 2),  # a layer-wise count inside its class (64): the halves' copies
    (64, 128, 1, 3, 6, 2, 32, 3, "*fp16", 2),  # fewer than half of the class (16): masked copies
]


@pytest.mark.parametrize("part", [0, 1, 2])
def test_kernel_compiles_for_sm90_with_its_shared_ring(part):
    """Every third config of COMPILED: three processes that a parallel run spreads over its workers.
    A fresh interpreter: TRITON_INTERPRET (set for the tests above) replaces the language's own
    functions, which a real compile must not see."""
    configs = COMPILED[part::3]
    code = (
        "import json, sys\n"
        "from pnmix.kernels.gluon.launch import compile_offline, offline_resources\n"
        "for config in json.loads(sys.argv[1]):\n"
        "    k = compile_offline(*config[:9], value_slots=config[9])\n"
        "    ptx = k.asm['ptx']\n"
        "    regs, stack = offline_resources(k)\n"
        "    mma, copies = 'mma.sync.aligned.m16n8k16' in ptx, 'cp.async' in ptx\n"
        "    print(json.dumps([k.metadata.shared, mma, copies, regs, stack]))\n"
    )
    done = run_compiler(code, configs)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == len(configs), done.stderr[-2000:]
    # d, G, b_low, b_high, salient channels, value bits, value group: the ring is all the shared memory
    want = [[launch.ring_bytes(c[0], c[2], c[3], c[4], c[5], c[6], c[1], c[9]), True, True] for c in configs]
    assert [r[:3] for r in rows] == want, (rows, done.stderr[-2000:])
    # No spills on this Triton (the stack holds nothing), and at least as many programs an SM by the
    # compiled registers (rounded up to the allocation unit of 8) as the launch plan counts with
    # REGISTERS: the plan never over-fills an SM.
    assert all(r[4] == 0 for r in rows), rows
    cpu = torch.device("cpu")
    assert all(launch.resident_programs(cpu, r[0], -(-r[3] // 8) * 8) >= launch.resident_programs(cpu, r[0])
               for r in rows), rows


@pytest.mark.parametrize("n_bh,ng_cap,resident,want", [
    (256, 63, 1056, 4),  # 32 x 8K on an H200: one wave of 16-group splits, not 4.1 waves of 4 groups
    (8, 255, 1056, 128),  # 1 x 32K: two groups per split fill one wave
    (880, 63, 1056, 6),  # 110 x 8K: 5 waves of 11 + 1 = 60, 7 splits 6 waves of 9 + 1 = 60: fewer
    (816, 66, 1056, 5),  # pnmix-paper at batch 102 (static path, 8K): 5 splits of 14, not 22 of 3
    (768, 66, 1056, 4),  # batch 96: 4 of 17 (measured fastest), not 11 of 6
    (4, 3, 1, 1),  # one program at a time: splitting only adds waves
])
def test_wave_splits_fill_whole_waves(n_bh, ng_cap, resident, want):
    assert launch.wave_splits(n_bh, ng_cap, resident) == want


@pytest.mark.parametrize("n,cap,want", [(0, 100, 0), (1, 100, 1), (3, 100, 4), (64, 100, 64), (65, 100, 100),
                                        (142, 8334, 256), (8193, 8334, 8334)])
def test_length_bucket_rounds_up_to_a_power_of_two_within_the_capacity(n, cap, want):
    assert length_bucket(n, cap) == want


def test_emulated_prmt_picks_the_documented_bytes():
    a = torch.tensor([0x33221100, -1, 0x0000FFFF], dtype=torch.int32)
    b = torch.tensor([0x77665544, 0, -65536], dtype=torch.int32)
    # Byte i of the result is byte nibble_i(sel) of {b, a}, a's bytes numbered 0-3 (PTX ISA, prmt).
    assert [hex(v & 0xFFFFFFFF) for v in _byte_perm(a, b, 0x5410).tolist()] == ["0x55441100", "0xffff", "0xffff"]
    assert [hex(v & 0xFFFFFFFF) for v in _byte_perm(a, b, 0x7632).tolist()] == ["0x77663322", "0xffff",
                                                                                 "0xffff0000"]


def test_emulated_movmatrix_is_the_lane_level_transpose():
    """movmatrix.trans, lane by lane: lane L holds row L // 4, columns 2 (L % 4) and + 1 of an 8 x 8
    fp16 block before, and the same positions of its transpose after. The register of lane L for
    block j sits at row 8j + L // 4, column pair L % 4 of the emulated [16, 4] tensor."""
    p = torch.randn(16, 8, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    got = _halves_f16(_transposed_blocks(_f16_pairs(p[:, 0::2], p[:, 1::2])))  # [16, 4, 2]
    for j in range(2):
        block = p[8 * j: 8 * j + 8]
        for lane in range(32):
            r, c = lane // 4, 2 * (lane % 4)
            want = block.T[r, c: c + 2]
            assert torch.equal(got[8 * j + r, lane % 4], want)
