"""Fused decode attention vs dequantize-then-attend in fp32 (`pnmix.backend.decode_reference`).

Runs the Triton kernel under TRITON_INTERPRET=1 on small shapes. Relative error (Frobenius) must
stay <= 1e-2. Fresh random inputs per case; the output is poisoned (NaN) before every run, so an
unwritten element fails. The interpreter is slow, so the parametrization is a chosen subset rather
than the full product; every case has a batch of 3 sequences with unequal lengths (one of them
with an empty packed region), and between them the cases cover:
- bit pairs (1,3) (2,2) (1,4) (4,4) (1,1) (2,3) (3,4); G 32 / 64 / 128;
- salient ratios 0, 0.5, 1; sinks 0 and 32 (capacity; a short sequence holds fewer);
- residual empty / partial / full; GQA ratios 1, 3, 4; head_dim 64 and 128;
- value bits 1, 2, 4, 8 and value groups 16 / 32 / 64; fp32, bf16, fp16 activations;
- splits of the packed region 1, 2 and more splits than some sequences have groups.

On CUDA the kernel expands codes with inline PTX, which the interpreter cannot run: here that PTX
is emulated (numpy, instruction by instruction), alone and inside the kernel. What only the GPU
build shows is checked on the compiled kernel (for sm_90, no GPU needed): every MMA dot reduces over
at least 32 channels or tokens, the bound below which Triton 3.6 miscompiles dots of byte-expanded
operands (`pnmix.kernels.decode.key_tiles`).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # set before the kernels are decorated; only these tests use Triton

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pnmix import packing  # noqa: E402
from pnmix.backend import decode_reference  # noqa: E402
from pnmix.kernels import decode as decode_module  # noqa: E402
from pnmix.kernels.decode import MIN_KEY_CHANNELS, decode_attention, key_tiles  # noqa: E402
from pnmix.kernels.layout import DecodeCache, channel_order  # noqa: E402


@dataclass(frozen=True)
class Case:
    b_low: int = 1
    b_high: int = 3
    group_size: int = 32
    ratio: float = 0.5
    n_sink: int = 32
    residual: str = "partial"  # empty | partial | full
    gqa: int = 4
    head_dim: int = 64
    value_bits: int = 2
    value_group: int = 32
    dtype: torch.dtype = torch.float32
    splits: int | None = 2


CASES = [
    Case(),
    Case(b_low=2, b_high=2, ratio=0.0, residual="empty", gqa=1),
    Case(b_low=1, b_high=4, group_size=64, ratio=1.0, residual="full", gqa=3, value_bits=1, splits=1),
    Case(b_low=4, b_high=4, group_size=128, ratio=0.0, n_sink=0, value_bits=8, value_group=64, splits=7),
    Case(b_low=1, b_high=1, ratio=0.0, n_sink=0, residual="full", gqa=1, value_bits=4, dtype=torch.bfloat16),
    Case(b_low=2, b_high=3, group_size=64, ratio=0.5, residual="empty", gqa=3, value_group=16, dtype=torch.float16),
    Case(b_low=3, b_high=4, group_size=128, ratio=1.0, gqa=4, head_dim=128, splits=None),
    Case(b_low=1, b_high=3, group_size=128, ratio=0.5, gqa=4, head_dim=128, dtype=torch.bfloat16, splits=3),
    Case(b_low=1, b_high=3, group_size=32, ratio=0.5, n_sink=0, residual="empty", gqa=3, value_bits=8),
    Case(b_low=2, b_high=4, group_size=32, ratio=0.5, gqa=1, head_dim=128, value_bits=1, value_group=16,
         dtype=torch.float16, splits=5),
    Case(b_low=1, b_high=2, group_size=64, ratio=0.5, n_sink=0, residual="full", gqa=4, value_bits=4),
    Case(b_low=3, b_high=3, group_size=128, ratio=0.0, residual="empty", gqa=3, head_dim=128, value_group=64,
         dtype=torch.bfloat16),
    Case(b_low=1, b_high=3, group_size=64, ratio=1.0, n_sink=0, residual="partial", gqa=1, value_bits=2,
         value_group=16, splits=1),
    Case(b_low=2, b_high=3, group_size=128, ratio=0.5, residual="full", gqa=3, value_bits=8, dtype=torch.float16,
         splits=None),
    Case(b_low=1, b_high=4, group_size=32, ratio=0.5, residual="empty", gqa=4, head_dim=128, value_bits=4,
         value_group=32, splits=4),
    Case(b_low=1, b_high=3, group_size=32, ratio=0.0, n_sink=32, residual="full", gqa=4, value_bits=1,
         value_group=64, dtype=torch.bfloat16),
]


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def build(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, DecodeCache]:
    """Three sequences with unequal lengths: (groups, sinks held, residual held) differ per sequence."""
    bsz, hkv, d, g = 3, 2, case.head_dim, case.group_size
    ng_cap, res_cap = 3, 2 * g
    n_groups = [3, 1, 0]
    res_fill = {"empty": [0, 0, 0], "partial": [g // 2, 1, 5], "full": [res_cap, res_cap, res_cap]}[case.residual]
    sinks = [case.n_sink, case.n_sink, min(case.n_sink, 7)]  # the short sequence holds fewer sinks
    if case.residual == "empty" and case.n_sink == 0:
        n_groups[2] = 1  # every sequence holds at least one token
    n_pairs = round(case.ratio * d / 2) if case.b_high > case.b_low else 0

    k = torch.randn((bsz, hkv, ng_cap * g, d), generator=gen) * 2 + 0.3
    v = torch.randn((bsz, hkv, ng_cap * g, d), generator=gen)
    if n_pairs:
        pairs = torch.rand((bsz, hkv, d // 2), generator=gen).topk(n_pairs, dim=-1).indices.sort(-1).values
        salient = torch.cat([pairs, pairs + d // 2], dim=-1)
    else:
        salient = torch.zeros((bsz, hkv, 0), dtype=torch.long)
    pk = packing.quantize_keys(k, salient, case.b_low, case.b_high, g)
    pv = packing.quantize_values(v, case.value_bits, case.value_group)

    def fp(n: int) -> torch.Tensor:
        return (torch.randn((bsz, hkv, n, d), generator=gen) * 1.5).to(case.dtype)

    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    cache = DecodeCache(
        k_sink=fp(case.n_sink), v_sink=fp(case.n_sink), k_res=fp(res_cap), v_res=fp(res_cap),
        k_low=pk.low, k_high=pk.high, k_scale=pk.scale, k_zero=pk.zero,
        v_packed=pv.packed, v_scale=pv.scale, v_zero=pv.zero, channel_order=channel_order(salient, d),
        sink_len=as_i32(sinks), n_groups=as_i32(n_groups), res_len=as_i32(res_fill),
        b_low=case.b_low, b_high=case.b_high, group_size=g, value_bits=case.value_bits,
        value_group_size=case.value_group,
    )
    q = (torch.randn((bsz, hkv * case.gqa, d), generator=gen) * 1.5).to(case.dtype)
    return q, cache


@pytest.mark.parametrize("case", CASES, ids=lambda c: (
    f"b{c.b_low}{c.b_high}-G{c.group_size}-r{c.ratio}-s{c.n_sink}-{c.residual}-gqa{c.gqa}-d{c.head_dim}"
    f"-v{c.value_bits}g{c.value_group}-{str(c.dtype)[6:]}-sp{c.splits}"))
def test_decode_matches_dequantize_then_attend(case):
    check_decode(case)


def check_decode(case: Case) -> None:
    gen = fresh_generator()
    q, cache = build(case, gen)
    scale = case.head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, cache, scale, num_splits=case.splits, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == case.dtype
    assert torch.isfinite(out).all(), "unwritten or non-finite output elements"
    want = decode_reference(q, cache, scale)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"relative error {err:.3e}"
    per_seq = ((out.float() - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)))
    assert (per_seq <= 2e-2).all(), f"per-sequence relative errors {per_seq.tolist()}"


def garble_past_held_tokens(cache: DecodeCache) -> None:
    """Overwrites everything beyond what sequences 1 and 2 of `build`'s partial-residual cache hold
    (1 and 0 groups, residuals of 1 and 5 tokens, 7 sinks for sequence 2), packed bytes included."""
    cache.k_low[1:, :, 1:] = 0xFF
    cache.k_high[1:, :, 1:] = 0xFF
    cache.k_scale[1:, :, 1:] = 1e4
    cache.v_packed[1:, :, 32:] = 0xFF
    cache.v_scale[1:, :, 32:] = 1e4
    cache.k_res[1, :, 1:] = 1e4
    cache.k_res[2, :, 5:] = 1e4
    cache.k_sink[2, :, 7:] = 1e4


def test_decode_reads_only_held_tokens():
    """Bytes past each sequence's lengths are garbage; the output must not change."""
    gen = fresh_generator()
    q, cache = build(Case(residual="partial"), gen)
    scale = 0.125
    before = decode_attention(q, cache, scale, num_splits=2)
    garble_past_held_tokens(cache)
    after = decode_attention(q, cache, scale, num_splits=2)
    assert torch.equal(before, after)


def test_decode_plans_for_a_bound_on_the_groups_held():
    """max_groups: the splits cover that many packed groups, not the capacity (3 here). Where every
    sequence holds at most that many, one split reads what it read before (bit for bit), and the
    groups past the bound are never read."""
    q, cache = build(Case(residual="partial"), fresh_generator())
    cache = dataclasses.replace(cache, n_groups=torch.tensor([1, 1, 0], dtype=torch.int32))
    scale = 0.125
    whole = decode_attention(q, cache, scale, num_splits=1)
    for name in ("k_low", "k_high"):
        getattr(cache, name)[:, :, 1:] = 0xFF
    cache.k_scale[:, :, 1:] = float("nan")
    cache.v_scale[:, :, cache.group_size:] = float("nan")
    assert torch.equal(decode_attention(q, cache, scale, num_splits=1, max_groups=1), whole)
    assert torch.equal(decode_attention(q, cache, scale, max_groups=1), whole)  # planned: one split
    want = decode_reference(q, cache, scale)
    assert ((whole.float() - want).norm() / want.norm()).item() <= 1e-2


def test_decode_rejects_bad_shapes():
    q, cache = build(Case(), fresh_generator())
    with pytest.raises(ValueError, match="unsupported decode shape"):
        decode_attention(q[:, :, :32], cache, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        decode_attention(q, cache, 0.1, out=torch.empty(1))


# -- the inline PTX (CUDA) path, emulated; the compiled kernel's dots --------------------------------

ROOT = Path(__file__).resolve().parents[1]


def run_compiler(code: str, payload: object) -> subprocess.CompletedProcess:
    """`code` run in a fresh interpreter with `payload` as JSON in sys.argv[1], without
    TRITON_INTERPRET: the interpreter replaces the language's own functions, which a real compile
    (`compile_offline`, sm_90 on the CPU) must not see. Asserts that it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-P", "-c", code, json.dumps(payload)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# (bit planes, code width) of every expansion the kernel issues: key planes 1-4, value codes 1/2/4/8 bits
PTX_EXPANSIONS = [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (1, 4), (1, 8)]


def run_ptx(asm: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The instructions `_expand_asm` emits, on 32-bit registers (uint32 arrays, one element per call);
    anything else fails, so an expansion that grows an instruction grows its emulation first."""
    env = dict(regs)
    n = len(next(iter(regs.values())))

    def val(x: str) -> np.ndarray:
        if x in env:
            return env[x].astype(np.uint64)
        assert not re.fullmatch(r"\$\d+|[A-Za-z_]\w*", x), f"read of unset register {x}"
        return np.full(n, int(x, 0), dtype=np.uint64)

    for line in asm.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.rstrip(";").split(None, 1)
        d, *a = (x.strip() for x in rest.split(","))
        if op == "mov.b32":
            r = val(a[0])
        elif op == "prmt.b32":  # byte i: byte nibble_i(sel) of {b, a} (a's bytes 0-3), bit 3 replicates the sign
            src, sel, r = val(a[0]) | (val(a[1]) << np.uint64(32)), int(a[2], 0), np.zeros(n, np.uint64)
            for i in range(4):
                s = (sel >> (4 * i)) & 0xF
                byte = (src >> np.uint64(8 * (s & 7))) & np.uint64(0xFF)
                if s & 8:
                    byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                r |= byte << np.uint64(8 * i)
        elif op in ("shr.b32", "shl.b32", "and.b32", "or.b32"):
            x, y = val(a[0]), val(a[1])
            r = {"shr.b32": x >> y, "shl.b32": x << y, "and.b32": x & y, "or.b32": x | y}[op]
        elif op == "sub.rn.f16x2":
            r = (val(a[0]).astype(np.uint32).view(np.float16) - val(a[1]).astype(np.uint32).view(np.float16))
            r = r.view(np.uint32)
        else:
            raise NotImplementedError(f"PTX emulation: {op}")
        env[d] = (np.asarray(r).astype(np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return env


def emulate_inline_asm(asm: str, constraints: str, inputs: list[np.ndarray], out_dtypes: list[np.dtype],
                       pack: int) -> list[np.ndarray]:
    """tl.inline_asm_elementwise as Triton lowers it: `pack` consecutive elements a call, operands of
    less than 32 bits packed into 32-bit registers (element j in bits 8 * size * j up), the outputs'
    registers first ($0 ..), then the inputs' in order."""
    n_el = inputs[0].size
    n_call = -(-n_el // pack)
    regs: dict[str, np.ndarray] = {}
    outs: list[list[str]] = []
    i = 0
    for dt in out_dtypes:
        per = max(1, min(4 // np.dtype(dt).itemsize, pack))
        outs.append([f"${i + j}" for j in range(pack // per)])
        i += pack // per
    for x in inputs:
        size = x.dtype.itemsize
        per = max(1, min(4 // size, pack))
        flat = np.zeros(n_call * pack, dtype=x.dtype)
        flat[:n_el] = x.reshape(-1)
        lanes = flat.view(f"u{size}").astype(np.uint32).reshape(n_call, pack // per, per)
        words = sum(lanes[:, :, j] << np.uint32(8 * size * j) for j in range(per))
        for j in range(pack // per):
            regs[f"${i}"] = np.ascontiguousarray(words[:, j], dtype=np.uint32)
            i += 1
    assert i == len(constraints.split(",")), (i, constraints)
    env = run_ptx(asm, regs)
    result = []
    for dt, names in zip(out_dtypes, outs, strict=True):
        size = np.dtype(dt).itemsize
        per = max(1, min(4 // size, pack))
        words = np.stack([env[name] for name in names], axis=1)
        lanes = np.stack([(words >> np.uint32(8 * size * j)) & np.uint32((1 << (8 * size)) - 1)
                          for j in range(per)], axis=-1)
        result.append(lanes.reshape(-1)[:n_el].astype(f"u{size}").view(dt).reshape(inputs[0].shape))
    return result


@pytest.mark.parametrize("n_planes,width", PTX_EXPANSIONS)
def test_ptx_expansion_gives_each_bytes_codes_as_fp16(n_planes, width):
    """Register k of `_expand_asm` (two per code position: bytes 0-1, then 2-3 of the word) holds code
    k of each byte (LSB first), its bit p taken from plane p, as fp16; the constraints name as many
    output and input registers as it uses."""
    asm = decode_module._expand_asm(n_planes, width)
    n_out = 8 // width
    assert decode_module._expand_constraints(n_planes, width) == ",".join(["=r"] * 2 * n_out + ["r"] * n_planes)
    planes = np.random.default_rng().integers(0, 256, (n_planes, 4096, 4), dtype=np.uint8)
    words = {f"${2 * n_out + p}": planes[p].view(np.uint32).reshape(-1) for p in range(n_planes)}
    env = run_ptx(asm, words)
    for k in range(n_out):
        got = np.stack([env[f"${2 * k}"], env[f"${2 * k + 1}"]], axis=1).view(np.float16).reshape(-1, 4)
        want = sum(((planes[p].astype(np.int64) >> (k * width)) & ((1 << width) - 1)) << p for p in range(n_planes))
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"code {k}")


def test_the_kernel_issues_the_tested_expansions():
    for name, (n_planes, width) in {"P1": (1, 1), "P2": (2, 1), "P3": (3, 1), "P4": (4, 1), "W2": (1, 2),
                                    "W4": (1, 4), "W8": (1, 8)}.items():
        assert getattr(decode_module, f"_ASM_{name}").value == decode_module._expand_asm(n_planes, width)
        assert getattr(decode_module, f"_CON_{name}").value == decode_module._expand_constraints(n_planes, width)


@pytest.mark.parametrize("case", [
    # 16 salient channels at d 64: the config whose 16-channel key dot the GPU build got wrong
    Case(b_low=2, b_high=4, group_size=64, ratio=0.25, gqa=2, value_bits=1, value_group=64, dtype=torch.bfloat16),
    CASES[3],  # 4 low planes, 8-bit values
    CASES[4],  # 1 plane, 4-bit values
    Case(b_low=1, b_high=3, group_size=32, ratio=0.125, gqa=3, value_bits=2, value_group=16, splits=1),
], ids=lambda c: f"b{c.b_low}{c.b_high}-G{c.group_size}-r{c.ratio}-v{c.value_bits}")
def test_decode_ptx_path_matches_dequantize_then_attend(case, monkeypatch):
    """The CUDA path (inline PTX expansion, its outputs joined back into token order) under the
    interpreter, the assembly emulated."""
    from triton.runtime import interpreter

    class Call:
        def __init__(self, handles):
            self.handles = handles

        def get_result(self, i):
            return self.handles[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        elem = [getattr(t, "element_ty", t) for t in types]
        outs = emulate_inline_asm(asm, constraints, [v.data for v in values],
                                  [interpreter._get_np_dtype(t) for t in elem], pack)
        return Call([interpreter.TensorHandle(o, t) for o, t in zip(outs, elem, strict=True)])

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)
    monkeypatch.setattr(decode_module, "expand_with_ptx", lambda q: True)
    check_decode(case)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_key_dots_reduce_over_at_least_32_channels(d):
    """Every salient count's key tiles: powers of two that hold their channels and no fewer than 32."""
    assert MIN_KEY_CHANNELS >= 32
    for n_sc in range(0, d + 1, 2):
        for tile, n in zip(key_tiles(d, n_sc), (n_sc, d - n_sc), strict=True):
            assert tile >= max(n, 32) and tile & (tile - 1) == 0, (d, n_sc, tile)


# (head_dim, G, b_low, b_high, salient channels, value bits, value group, GQA, activation pointer type)
COMPILED = [
    (64, 64, 2, 4, 16, 1, 64, 2, "*bf16"),  # the GPU's failing config: 16 salient channels
    (64, 32, 1, 3, 8, 2, 32, 4, "*fp16"),  # 8 salient channels, G 32
    (64, 128, 1, 2, 56, 4, 16, 1, "*fp32"),  # 8 non-salient channels
]


def test_compiled_kernel_reduces_every_mma_dot_over_32_or_more():
    """The kernel compiled for sm_90 (no GPU needed): each MMA dot's reduction K is at least 32 and
    at least 4 x its operands' kWidth (4 threads across K, kWidth values each). Triton 3.6 packs
    byte-expanded operands with kWidth 8 also where K is 16, and the MMA then adds half the channels
    twice and skips the others. A fresh interpreter: TRITON_INTERPRET replaces the language's own
    functions, which a real compile must not see."""
    code = (
        "import json, sys\n"
        "from pnmix.kernels.decode import compile_offline\n"
        "for config in json.loads(sys.argv[1]):\n"
        "    print('TTGIR', json.dumps(compile_offline(*config).asm['ttgir']))\n"
    )
    done = run_compiler(code, COMPILED)
    ttgirs = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("TTGIR ")]
    assert len(ttgirs) == len(COMPILED)
    operand = re.compile(r"tt\.dot [^:]*: tensor<(\d+)x(\d+)x\w+, #ttg\.dot_op<\{opIdx = 0, parent = #mma[^,]*, "
                         r"kWidth = (\d+)\}>>")
    for config, ttgir in zip(COMPILED, ttgirs, strict=True):
        dots = [(int(m), int(k), int(w)) for m, k, w in operand.findall(ttgir)]
        assert len(dots) >= 3, (config, dots)  # the key dot(s) and the value dot at least
        assert all(k >= 32 and k >= 4 * w for _, k, w in dots), (config, dots)
