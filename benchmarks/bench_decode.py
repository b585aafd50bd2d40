"""PN-Mix decode kernels on the GPU: build, check against the torch reference, time, compare with SDPA.

    python benchmarks/bench_decode.py [--out DIR] [--shapes 1x32768,32x8192,...] [--kernels gluon,triton]
                                      [--heads 4/1/256]    # another head shape (default 32/8/128)
    python benchmarks/bench_decode.py --plans [--out DIR]   # the launch plan against its neighbours

For each (batch, context) shape, with 32 query / 8 KV heads, d = 128 and the `pnmix-paper` config
(3/1 bits, r = 0.5, G = 128, 32 sinks, residual 128, 2-bit values in groups of 32):
1. draws fresh random bf16 keys/values, packs them with the Triton quantize+pack kernels (checked
   bit for bit against `pnmix.packing` on a slice);
2. runs each fused decode kernel (`KERNELS`: the Gluon kernels of `kernels.gluon`, the default on
   CUDA, as planned, with registers capped at 168 a thread and with 3 value slots, and the Triton fallback of
   `kernels.decode`) and checks it against
   `pnmix.backend.decode_reference` (dequantize-then-attend in fp32) on a few sequences, output
   poisoned before the run;
3. times each kernel, and SDPA on bf16 K/V of the same shape in the same run. Every operation is
   timed as a CUDA graph replay (what a
   captured decode step runs; the static path of `pnmix` captures its steps) with
   triton.testing.do_bench (median; it flushes L2 before every call), and also eagerly, with the
   host time per eager call, since a launch that costs more host time than GPU time is
   host-bound when not captured;
4. reports time, bytes read, GB/s, share of the measured device copy bandwidth, speedup over SDPA.
Also the quantize+pack throughput of a 32K-token prefill (1 sequence, 8 KV heads), and first a
correctness sweep of both kernels over small configs that use every code-expansion path.
`--plans` instead times the Gluon split kernel and its combine under the launch plan
(`kernels.gluon.launch.plan_launch`) and its neighbours (other split counts, one tail program or
one a chunk, the tail launched first or last) and the plan for the cache's length bucket (what the
static path runs) on layers with the static path's capacities for 8K generated tokens, at a short
and a full cache, for `pnmix-paper` and KIVI-2, batch 1 to 104.
Imports only `kernels` and the torch-only `pnmix.packing` / `pnmix.backend` (no transformers).
Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from pnmix import packing
from pnmix.backend import decode_reference
from pnmix.kernels import gluon
from pnmix.kernels.decode import decode_attention
from pnmix.kernels.layout import DecodeCache, channel_order
from pnmix.kernels.pack import quantize_pack_keys, quantize_pack_values
from pnmix.kernels.plan import length_bucket, packed_groups_bound

HQ, HKV, D = 32, 8, 128
B_LOW, B_HIGH, G, N_SALIENT_PAIRS, N_SINK, RESIDUAL, V_BITS, V_GROUP = 1, 3, 128, 32, 32, 128, 2, 32
SHAPES = [(1, 32768), (32, 8192), (32, 32768), (110, 8192)]
# The decode kernels timed: the Gluon kernels (G a multiple of 128 runs `kernels.gluon.block`'s)
# and the Triton kernel, the fallback for shapes the Gluon kernels do not take.
# "gluon-168": the same kernel with its registers capped at 168 a thread (3 warps per scheduler,
# 12 an SM by registers, where the uncapped kernel's 213-217 allow 8), spilling the rest.
# "gluon-3slot": the block kernel with 3 value slots (a block's value products beside the next
# block's scores; `LaunchPlan.value_slots`).
GLUON_PLANS = {"gluon": {}, "gluon-168": {"max_registers": 168}, "gluon-3slot": {"value_slots": 3}}
KERNELS = {**{name: functools.partial(gluon.decode_attention, **options) for name, options in GLUON_PLANS.items()},
           "triton": decode_attention}


def attend(kernel: str, q: torch.Tensor, cache: DecodeCache, scale: float, out=None) -> torch.Tensor:
    """One decode attention with the kernel named `kernel` (a key of KERNELS)."""
    return KERNELS[kernel](q, cache, scale, out=out)


def graph_us(fn) -> float:
    """Median GPU time of `fn` replayed from a CUDA graph (us, L2 flushed before each replay)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def time_us(fn) -> dict:
    """GPU time of `fn` replayed from a CUDA graph and called eagerly (do_bench medians, L2 flushed
    before each call), and the host time of one eager call (us)."""
    out = {"graph": graph_us(fn), "eager": do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    out["host"] = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    return out


def log(msg: str, fh) -> None:
    print(msg, flush=True)
    fh.write(msg + "\n")
    fh.flush()


def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB, bytes read + written per second (GB/s)."""
    n = 4 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_()
    dst = torch.empty_like(src)
    ms = do_bench(functools.partial(dst.copy_, src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e9


def random_salient(bsz: int, gen: torch.Generator, n_pairs: int = N_SALIENT_PAIRS) -> torch.Tensor:
    """Ascending salient channels (rotate_half pairs) per (b, h), on gen's device: int64 [B, H_kv, 2 * n_pairs]."""
    scores = torch.rand((bsz, HKV, D // 2), generator=gen, device=gen.device)
    pairs = scores.topk(n_pairs, dim=-1).indices.sort(dim=-1).values
    return torch.cat([pairs, pairs + D // 2], dim=-1)


def build(bsz: int, ctx: int, gen: torch.Generator, n_pairs: int = N_SALIENT_PAIRS) -> tuple[
        DecodeCache, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """A layer holding `ctx` tokens per sequence, from fresh random bf16 K/V (also returned for SDPA),
    with `n_pairs` salient channel pairs."""
    n_groups = (ctx - N_SINK) // G
    res = ctx - N_SINK - n_groups * G
    assert 0 <= res <= RESIDUAL
    k = torch.randn((bsz, HKV, ctx, D), generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((bsz, HKV, ctx, D), generator=gen, device="cuda", dtype=torch.bfloat16)
    k.mul_(1.5).add_(0.25)  # not centred, not unit: scales and zeros both matter
    sal = random_salient(bsz, gen, n_pairs)
    region = slice(N_SINK, N_SINK + n_groups * G)
    pk = quantize_pack_keys(k[:, :, region], sal, B_LOW, B_HIGH, G)
    pv = quantize_pack_values(v[:, :, region], V_BITS, V_GROUP)
    k_res = torch.zeros((bsz, HKV, RESIDUAL, D), dtype=torch.bfloat16, device="cuda")
    v_res = torch.zeros_like(k_res)
    k_res[:, :, :res] = k[:, :, N_SINK + n_groups * G :]
    v_res[:, :, :res] = v[:, :, N_SINK + n_groups * G :]
    full = lambda n: torch.full((bsz,), n, dtype=torch.int32, device="cuda")  # noqa: E731
    cache = DecodeCache(
        k_sink=k[:, :, :N_SINK].contiguous(), v_sink=v[:, :, :N_SINK].contiguous(), k_res=k_res, v_res=v_res,
        k_low=pk.low, k_high=pk.high, k_scale=pk.scale, k_zero=pk.zero,
        v_packed=pv.packed, v_scale=pv.scale, v_zero=pv.zero, channel_order=channel_order(sal, D),
        sink_len=full(N_SINK), n_groups=full(n_groups), res_len=full(res),
        b_low=B_LOW, b_high=B_HIGH, group_size=G, value_bits=V_BITS, value_group_size=V_GROUP,
    )
    q = torch.randn((bsz, HQ, D), generator=gen, device="cuda", dtype=torch.bfloat16)
    info = {"n_groups": n_groups, "residual": res, "salient": sal}
    return cache, q, k, v, info


def cache_bytes_read(cache: DecodeCache, q: torch.Tensor, n_groups: int, res: int) -> int:
    """Bytes the decode kernel must read: every held byte of the layer once, plus q."""
    bsz = q.shape[0]
    per_group = sum(t[0, 0, 0].nbytes for t in (cache.k_low, cache.k_high, cache.k_scale, cache.k_zero))
    per_token = sum(t[0, 0, 0].nbytes for t in (cache.v_packed, cache.v_scale, cache.v_zero))
    fp_tokens = N_SINK + res
    return bsz * HKV * (n_groups * (per_group + G * per_token) + fp_tokens * 2 * D * 2 + D * 4) + q.nbytes


def check_pack(k: torch.Tensor, v: torch.Tensor, sal: torch.Tensor) -> bool:
    """Kernels vs pnmix.packing, bit for bit, on the first sequence's first (up to) 16 groups."""
    region = slice(N_SINK, N_SINK + min(16, (k.shape[2] - N_SINK) // G) * G)
    ks = k[:1, :, region].float()
    vs = v[:1, :, region]
    ref_k = packing.quantize_keys(ks, sal[:1], B_LOW, B_HIGH, G)
    out_k = quantize_pack_keys(k[:1, :, region], sal[:1], B_LOW, B_HIGH, G)
    ref_v = packing.quantize_values(vs, V_BITS, V_GROUP)
    out_v = quantize_pack_values(vs, V_BITS, V_GROUP)
    ok = all(torch.equal(getattr(ref_k, f), getattr(out_k, f)) for f in ("low", "high", "scale", "zero"))
    return ok and all(torch.equal(getattr(ref_v, f), getattr(out_v, f)) for f in ("packed", "scale", "zero"))


def poisoned_rel_err(run, q: torch.Tensor, ref: torch.Tensor) -> float:
    """`run(out=...)` into an output poisoned with NaN; its relative error against `ref`, or inf if
    an element is left unwritten or is not finite."""
    out = torch.full_like(q, float("nan"))
    run(out=out)
    if not torch.isfinite(out).all():
        return math.inf
    return float((out.float() - ref).norm() / ref.norm())


def check_decode(q: torch.Tensor, cache: DecodeCache, scale: float, kernel: str) -> float:
    """Relative error of the kernel against the fp32 reference on up to 4 sequences."""
    n = min(4, q.shape[0])
    sub = dataclasses.replace(cache, **{f.name: getattr(cache, f.name)[:n] for f in dataclasses.fields(cache)
                                        if isinstance(getattr(cache, f.name), torch.Tensor)})
    return poisoned_rel_err(functools.partial(attend, kernel, q[:n], sub, scale), q[:n],
                            decode_reference(q[:n], sub, scale))


# Small configs that between them use every code-expansion path of the kernel on the GPU:
# (b_low, b_high, G, salient ratio, value bits, value group, head_dim, GQA)
SWEEP = [
    (2, 4, 32, 0.5, 1, 16, 128, 1),
    (4, 4, 64, 0.0, 8, 64, 64, 3),
    (1, 2, 32, 1.0, 4, 32, 128, 4),
    (3, 3, 128, 0.0, 2, 32, 64, 4),
    (1, 1, 64, 0.0, 2, 16, 128, 3),
    (2, 3, 128, 0.5, 4, 32, 64, 1),
    (1, 3, 128, 0.5, 2, 128, 128, 4),  # one value group per head (the kernels' ONE_SCALE)
    (2, 4, 64, 0.25, 1, 64, 64, 2),
]


def sweep_correctness(gen: torch.Generator, fh) -> list[dict]:
    """The Triton kernel, and the Gluon kernels where their limits admit the config, vs the fp32
    reference on small caches with unequal lengths, per config."""
    results = []
    for b_low, b_high, g, ratio, vbits, vgroup, d, gqa in SWEEP:
        bsz, hkv, ng_cap = 3, 2, 5
        n_pairs = round(ratio * d / 2) if b_high > b_low else 0
        k = torch.randn((bsz, hkv, ng_cap * g, d), generator=gen, device="cuda") * 2 + 0.3
        v = torch.randn((bsz, hkv, ng_cap * g, d), generator=gen, device="cuda")
        pairs = torch.rand((bsz, hkv, d // 2), generator=gen, device="cuda").topk(n_pairs, -1).indices.sort(-1).values
        sal = torch.cat([pairs, pairs + d // 2], dim=-1)
        pk = quantize_pack_keys(k.to(torch.bfloat16), sal, b_low, b_high, g)
        pv = quantize_pack_values(v.to(torch.bfloat16), vbits, vgroup)
        fp = functools.partial(torch.randn, generator=gen, device="cuda", dtype=torch.bfloat16)
        ints = functools.partial(torch.tensor, dtype=torch.int32, device="cuda")
        sinks, res = (bsz, hkv, 8, d), (bsz, hkv, 2 * g, d)
        cache = DecodeCache(k_sink=fp(sinks), v_sink=fp(sinks), k_res=fp(res), v_res=fp(res), k_low=pk.low,
                            k_high=pk.high, k_scale=pk.scale, k_zero=pk.zero, v_packed=pv.packed, v_scale=pv.scale,
                            v_zero=pv.zero, channel_order=channel_order(sal, d), sink_len=ints([8, 8, 3]),
                            n_groups=ints([5, 2, 0]), res_len=ints([g // 2, 2 * g, 1]), b_low=b_low, b_high=b_high,
                            group_size=g, value_bits=vbits, value_group_size=vgroup)
        q = torch.randn((bsz, hkv * gqa, d), generator=gen, device="cuda", dtype=torch.bfloat16)
        ref = decode_reference(q, cache, d**-0.5)
        row = {"config": [b_low, b_high, g, ratio, vbits, vgroup, d, gqa]}
        row["triton"] = poisoned_rel_err(functools.partial(decode_attention, q, cache, d**-0.5, num_splits=2), q, ref)
        if not gluon.supports(cache, q):
            row["gluon"] = None  # outside the Gluon kernels' limits: the Triton kernel serves it
        else:
            for name, slots in (("gluon", 2), ("gluon-3slot", 3)):
                try:
                    run = functools.partial(gluon.decode_attention, q, cache, d**-0.5, num_splits=2,
                                            value_slots=slots)
                    row[name] = poisoned_rel_err(run, q, ref)
                except Exception as exc:  # reported, not fatal: the Triton kernel's figures still come back
                    row[name] = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"
        log(f"sweep {json.dumps(row)}", fh)
        results.append(row)
    return results


def bench_pack(gen: torch.Generator, fh) -> dict:
    """Quantize + pack throughput for a 32K-token prefill (one sequence, 8 KV heads), plus exactness."""
    kp = torch.randn((1, HKV, 32768, D), generator=gen, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn((1, HKV, 32768, D), generator=gen, device="cuda", dtype=torch.bfloat16)
    salp = random_salient(1, gen)
    pack_k = functools.partial(quantize_pack_keys, kp, salp, B_LOW, B_HIGH, G)
    pack_v = functools.partial(quantize_pack_values, vp, V_BITS, V_GROUP)
    pk_ms = do_bench(pack_k, warmup=25, rep=200, return_mode="median")
    pv_ms = do_bench(pack_v, warmup=25, rep=200, return_mode="median")
    pk_out, pv_out = pack_k(), pack_v()
    k_bytes = kp.nbytes + sum(t.nbytes for t in (pk_out.low, pk_out.high, pk_out.scale, pk_out.zero))
    v_bytes = vp.nbytes + sum(t.nbytes for t in (pv_out.packed, pv_out.scale, pv_out.zero))
    pack = {
        "tokens": 32768, "kv_heads": HKV,
        "keys_us": pk_ms * 1e3, "values_us": pv_ms * 1e3,
        "keys_GBps": k_bytes / (pk_ms * 1e-3) / 1e9, "values_GBps": v_bytes / (pv_ms * 1e-3) / 1e9,
        "tokens_per_s": 32768 / ((pk_ms + pv_ms) * 1e-3),
        "exact": check_pack(kp, vp, salp),
    }
    log(f"pack 32K prefill: {json.dumps(pack)}", fh)
    return pack


def bench_shape(bsz: int, ctx: int, gen: torch.Generator, kernels: list[str], copy_gbps: float, fh) -> dict:
    cache, q, k, v, info = build(bsz, ctx, gen)
    scale = D**-0.5
    exact = check_pack(k, v, info["salient"])
    nbytes = cache_bytes_read(cache, q, info["n_groups"], info["residual"])
    # SDPA baselines on bf16 K/V of the same shape: GQA flag, and the group folded into q_len.
    sdpa_gqa = functools.partial(F.scaled_dot_product_attention, q.view(bsz, HQ, 1, D), k, v, scale=scale,
                                 enable_gqa=True)
    sdpa_fold = functools.partial(F.scaled_dot_product_attention, q.view(bsz, HKV, HQ // HKV, D), k, v, scale=scale)
    ref_sdpa = sdpa_fold().reshape(bsz, HQ, D).float()
    sdpa_agree = float((sdpa_gqa().reshape(bsz, HQ, D).float() - ref_sdpa).norm() / ref_sdpa.norm())
    t_gqa = time_us(sdpa_gqa)
    t_fold = time_us(sdpa_fold)
    t_sdpa = min(t_gqa["graph"], t_fold["graph"])
    sdpa_bytes = k.nbytes + v.nbytes + 2 * q.nbytes
    log(f"[{bsz}x{ctx}] groups {info['n_groups']} residual {info['residual']} pack exact {exact} "
        f"bytes {nbytes / 1e6:.1f} MB (bf16 K/V {sdpa_bytes / 1e6:.1f} MB); SDPA us (graph / eager / host): "
        f"gqa {t_gqa['graph']:.1f} / {t_gqa['eager']:.1f} / {t_gqa['host']:.1f}, folded {t_fold['graph']:.1f} / "
        f"{t_fold['eager']:.1f} / {t_fold['host']:.1f} (agree {sdpa_agree:.1e})", fh)
    row: dict = {"batch": bsz, "ctx": ctx, "pack_exact": exact, "sdpa_us": t_sdpa, "sdpa_gqa": t_gqa,
                 "sdpa_folded": t_fold, "sdpa_GBps": sdpa_bytes / (t_sdpa * 1e-6) / 1e9, "bytes_read": nbytes,
                 "kernels": {}}
    for kernel in kernels:
        run = functools.partial(attend, kernel, q, cache, scale)
        try:
            err = check_decode(q, cache, scale, kernel)
            out = torch.full_like(q, float("nan"))  # poisoned; the whole batch must be written, finite
            run(out=out)
            t = time_us(run)
        except Exception as exc:  # a kernel that does not compile here is reported, not fatal
            log(f"  kernel {kernel}: FAILED {type(exc).__name__}: {str(exc)[:300]}", fh)
            continue
        us = t["graph"]
        finite = bool(torch.isfinite(out).all())
        gbps = nbytes / (us * 1e-6) / 1e9
        log(f"  kernel {kernel}: graph {us:.1f} us  eager {t['eager']:.1f} us  host {t['host']:.1f} us  "
            f"{gbps:.0f} GB/s  rel_err {err:.2e}  finite {finite}  speedup {t_sdpa / us:.2f}x", fh)
        row["kernels"][kernel] = {"us": us, "eager_us": t["eager"], "host_us": t["host"], "rel_err": err,
                                  "finite": finite, "passed": err <= 1e-2 and finite, "GBps": gbps,
                                  "copy_share": gbps / copy_gbps, "speedup": t_sdpa / us}
        if kernel in GLUON_PLANS:  # what the compiler gave the split kernel, and the plan's splits
            plan = gluon.launch.plan_launch(q, cache, **GLUON_PLANS[kernel])
            compiled = gluon.launch.split_launch(q, cache, scale, plan).run()
            row["kernels"][kernel] |= {"registers": compiled.n_regs, "spilled": compiled.n_spills,
                                       "splits": plan.num_splits, "tail_programs": plan.n_tail}
            log(f"    {compiled.n_regs} registers, {compiled.n_spills} spilled; {plan.num_splits} splits, "
                f"{plan.n_tail} tail programs", fh)
    return row


# The launch-plan comparison (`--plans`): layers as the static path allocates them for 8K generated
# tokens after a 141-token prompt (capacity 8333 tokens), at a short and a full fill, for the two
# quantized configs of the static study: (b_low, b_high, salient pairs, sinks).
PLAN_CONFIGS = {"pnmix-paper": (B_LOW, B_HIGH, N_SALIENT_PAIRS, N_SINK), "kivi2": (2, 2, 0, 0)}
PLAN_BATCHES = (1, 8, 16, 32, 64, 96, 102, 104)
PLAN_FILLS = (142, 8333)
PLAN_CAPACITY = 8333


def static_layer(bsz: int, config: tuple[int, int, int, int], fill: int, gen: torch.Generator) -> DecodeCache:
    """A layer with the static path's capacities (`pnmix.static.StaticQuantLayer`) for PLAN_CAPACITY
    tokens, holding `fill` tokens per sequence (sinks first, then whole groups, the rest in the
    residual), random contents on gen's device: timing only."""
    b_low, b_high, n_pairs, n_sink = config
    ng_cap = -(-(PLAN_CAPACITY - n_sink) // G) + RESIDUAL // G
    sinks = min(n_sink, fill)
    groups = min((fill - sinks) // G, ng_cap - RESIDUAL // G)
    res = min(fill - sinks - groups * G, RESIDUAL)
    device = gen.device
    u8 = functools.partial(torch.randint, 0, 256, dtype=torch.uint8, generator=gen, device=device)
    fp = functools.partial(torch.randn, generator=gen, device=device, dtype=torch.bfloat16)
    f16 = functools.partial(torch.rand, generator=gen, device=device, dtype=torch.float16)
    sal = random_salient(bsz, gen, n_pairs if b_high > b_low else 0)
    n_sc = sal.shape[-1]
    full = lambda n: torch.full((bsz,), n, dtype=torch.int32, device=device)  # noqa: E731
    return DecodeCache(
        k_sink=fp((bsz, HKV, n_sink, D)), v_sink=fp((bsz, HKV, n_sink, D)), k_res=fp((bsz, HKV, RESIDUAL, D)),
        v_res=fp((bsz, HKV, RESIDUAL, D)), k_low=u8((bsz, HKV, ng_cap, b_low, D, G // 8)),
        k_high=u8((bsz, HKV, ng_cap, b_high - b_low, n_sc, G // 8)), k_scale=f16((bsz, HKV, ng_cap, D)) * 0.1,
        k_zero=f16((bsz, HKV, ng_cap, D)) - 0.5, v_packed=u8((bsz, HKV, ng_cap * G, D * V_BITS // 8)),
        v_scale=f16((bsz, HKV, ng_cap * G, D // V_GROUP)) * 0.1, v_zero=f16((bsz, HKV, ng_cap * G, D // V_GROUP)) - 0.5,
        channel_order=channel_order(sal, D), sink_len=full(sinks), n_groups=full(groups), res_len=full(res),
        b_low=b_low, b_high=b_high, group_size=G, value_bits=V_BITS, value_group_size=V_GROUP)


def candidate_plans(q: torch.Tensor, cache: DecodeCache, fill: int) -> dict[str, gluon.launch.LaunchPlan]:
    """The planner's plan for the capacity and its neighbours: the splits `wave_splits` picks at
    other program overheads and the split count that fills one wave with the tail, each with one
    tail program or one a chunk, launched first or last; and "bucket", the plan the static path
    makes for a cache of `fill` tokens (its length bucket, `pnmix.static.StaticGenerator.arm`)."""
    launch = gluon.launch
    n_bh, ng_cap = q.shape[0] * HKV, cache.k_low.shape[2]
    shared = launch.ring_bytes(D, cache.b_low, cache.b_high, cache.n_salient_channels, V_BITS, V_GROUP, G)
    resident = launch.resident_programs(q.device, shared)
    chunks = -(-cache.k_sink.shape[2] // launch.TAIL_TOKENS) + -(-cache.k_res.shape[2] // launch.TAIL_TOKENS)
    splits = {launch.wave_splits(n_bh, ng_cap, resident, overhead) for overhead in (0.25, 1.0, 2.0, 4.0)}
    splits.add(max(1, resident // n_bh - chunks))
    bound = packed_groups_bound(length_bucket(fill, PLAN_CAPACITY), cache.k_sink.shape[2], G)
    plans = {"planned": launch.plan_launch(q, cache), "bucket": launch.plan_launch(q, cache, max_groups=bound)}
    for s in sorted(splits):
        base = launch.plan_launch(q, cache, s)
        for n_tail in sorted({1, chunks}):
            for last in (False, True):
                plans[f"{base.num_splits}x{base.groups_per_split} tail {n_tail} {'last' if last else 'first'}"] = (
                    dataclasses.replace(base, n_tail=n_tail, tail_last=last))
    return plans


def bench_plans(gen: torch.Generator, fh) -> list[dict]:
    """Split kernel + combine under each candidate plan (CUDA graph replays, L2 flushed), outputs
    checked against the planned plan's."""
    launch = gluon.launch
    rows = []
    for name, config in PLAN_CONFIGS.items():
        for bsz in PLAN_BATCHES:
            for fill in PLAN_FILLS:
                torch.cuda.empty_cache()
                cache = static_layer(bsz, config, fill, gen)
                q = torch.randn((bsz, HQ, D), generator=gen, device="cuda", dtype=torch.bfloat16)
                plans = candidate_plans(q, cache, fill)
                outs, times = {}, {}
                for label, plan in plans.items():
                    out = torch.empty_like(q)

                    def run(plan=plan, out=out, q=q, cache=cache):
                        split = launch.split_launch(q, cache, D**-0.5, plan)
                        split.run()
                        split.combine(out)

                    run()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    times[label] = do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3
                    outs[label] = out.float()
                ref = outs["planned"]
                worst = max(float((o - ref).norm() / ref.norm()) for o in outs.values())
                best = min(times, key=times.get)
                fields = {k: [p.num_splits, p.groups_per_split, p.n_tail, p.tail_last] for k, p in plans.items()}
                row = {"config": name, "batch": bsz, "fill": fill, "us": times, "plans": fields,
                       "max_rel_diff": worst, "best": best}
                log(f"plans {name} B={bsz} fill={fill}: planned {times['planned']:.1f} us {fields['planned']}, "
                    f"best {best} {times[best]:.1f} us (outputs agree to {worst:.1e})", fh)
                rows.append(row)
    return rows


# `--splits`: the split count of small batches, the split kernel and the combine timed apart.
SPLIT_SHAPES = [(1, 32768), (1, 8192), (4, 32768)]
SPLIT_COUNTS = (16, 32, 64, 96, 128, 192, 256)
# `--salient`: salient channel pairs of one size class (64 channels: 32 pairs fill it) at the large shapes.
SALIENT_PAIRS = (32, 20, 30)


def bench_splits(gen: torch.Generator, fh) -> list[dict]:
    """Split kernel + combine under the planned split count and its neighbours (SPLIT_COUNTS), each part
    also timed alone; outputs checked against the planned plan's."""
    launch = gluon.launch
    rows = []
    for bsz, ctx in SPLIT_SHAPES:
        torch.cuda.empty_cache()
        cache, q, *_ = build(bsz, ctx, gen)
        planned = launch.plan_launch(q, cache)
        ref = None
        for count in (None, *SPLIT_COUNTS):
            plan = planned if count is None else launch.plan_launch(q, cache, count)
            out = torch.empty_like(q)
            split = launch.split_launch(q, cache, D**-0.5, plan)
            row = {"batch": bsz, "ctx": ctx, "planned": count is None, "splits": plan.num_splits,
                   "groups_per_split": plan.groups_per_split, "tail_programs": plan.n_tail,
                   "both_us": graph_us(lambda split=split, out=out: (split.run(), split.combine(out))),
                   "kernel_us": graph_us(split.run),
                   "combine_us": graph_us(lambda split=split, out=out: split.combine(out))}
            ref = out.float() if ref is None else ref
            row["rel_diff"] = float((out.float() - ref).norm() / ref.norm())
            log(f"splits {json.dumps(row)}", fh)
            rows.append(row)
    return rows


def bench_salient(gen: torch.Generator, fh) -> list[dict]:
    """The block kernel with salient counts inside one size class against the count that fills it,
    at the large benchmark shapes, one after the other in one process."""
    rows = []
    for bsz, ctx in SHAPES[1:]:
        for pairs in SALIENT_PAIRS:
            torch.cuda.empty_cache()
            cache, q, *_ = build(bsz, ctx, gen, pairs)
            out = torch.empty_like(q)
            run = functools.partial(attend, "gluon", q, cache, D**-0.5, out=out)
            row = {"batch": bsz, "ctx": ctx, "salient": 2 * pairs, "us": graph_us(run)}
            log(f"salient {json.dumps(row)}", fh)
            rows.append(row)
    return rows


def check_wiring(fh, dtype: torch.dtype = torch.bfloat16, ref_device: str = "cuda") -> dict:
    """Generation through `pnmix` with PNMIX backend torch (on `ref_device`) vs triton (on CUDA).

    A random Llama-shaped model (4 layers, 8/2 heads, d = 128, `dtype`), a left-padded batch of two
    prompts with unequal lengths, greedy decoding of 48 tokens with the `pnmix-paper` config.
    Compares the stored bytes, the decode steps' logits and the tokens; times each generate call.
    Imports transformers (only this mode does).
    """
    import copy
    import time

    from transformers import AutoModelForCausalLM, LlamaConfig

    from pnmix import backend
    from pnmix.config import preset
    from pnmix.generation import cache_kwargs, new_cache

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, vocab_size=4096, max_position_embeddings=4096,
                      initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    models = {"triton": model.cuda(), "torch": copy.deepcopy(model).to(ref_device)}
    # In-situ check: every kernel call of the triton run is compared with the fp32 reference on the
    # same layer state (dequantize-then-attend), so the wiring is checked apart from bf16 noise.
    in_situ: list[float] = []
    attend_kernels = backend.attend_kernels

    def checked(layer, query, scaling):
        out = attend_kernels(layer, query, scaling)
        ref = decode_reference(query[:, :, 0], backend.layer_decode_cache(layer), scaling)
        in_situ.append(float((out[:, 0].float() - ref).norm() / ref.norm()))
        return out

    backend.attend_kernels = checked
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 4096, (2, 700), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :200], mask[1, :200] = 0, 0
    runs = {}
    for name in ("torch", "triton"):
        backend.set_backend(name)
        m = models[name]
        dev = next(m.parameters()).device
        cache = new_cache(m, preset("pnmix-paper"))
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = m.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=48,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             **cache_kwargs(m, cache))
        torch.cuda.synchronize()
        runs[name] = (out, cache, time.perf_counter() - start)
    backend.set_backend(None)
    backend.attend_kernels = attend_kernels
    (ref, ref_cache, t_torch), (got, cache, t_triton) = runs["torch"], runs["triton"]
    got.sequences, ref.sequences = got.sequences.cpu(), ref.sequences.cpu()
    got.logits, ref.logits = [x.cpu() for x in got.logits], [x.cpu() for x in ref.logits]
    layer, ref_layer = cache.layers[1], ref_cache.layers[1]
    same_bytes = all(torch.equal(layer.packed[k].cpu(), t.cpu()) for k, t in ref_layer.packed.items())
    # Groups packed at prefill come from identical inputs on both paths (later ones from diverged states).
    pre = [(int(row.sum()) - N_SINK) // G for row in mask]
    per_token = {"v_packed", "v_scale", "v_zero"}
    prefill_bytes = all(torch.equal(layer.packed[k][b, :, : pre[b] * (G if k in per_token else 1)].cpu(),
                                    t[b, :, : pre[b] * (G if k in per_token else 1)].cpu())
                        for k, t in ref_layer.packed.items() for b in range(2))
    logit_err = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got.logits, ref.logits,
                                                                                          strict=True)]
    agree = (got.sequences == ref.sequences).float().mean().item()
    first_diff = [int((got.sequences[i] != ref.sequences[i]).nonzero()[0]) if agree < 1 and
                  (got.sequences[i] != ref.sequences[i]).any() else None for i in range(2)]
    result = {
        "dtype": str(dtype), "reference_device": ref_device,
        "kernel_path": bool(layer.use_kernels and not layer.keep_view),
        "torch_path": not ref_layer.use_kernels, "prefill_bytes_equal": prefill_bytes, "packed_bytes_equal": same_bytes,
        "n_groups": layer.n_groups, "res_len": layer.res_len,
        "kernel_calls": len(in_situ), "kernel_vs_fp32_reference_max": max(in_situ),
        "logits_rel_err_first8": logit_err[:8], "logits_rel_err_max": max(logit_err),
        "token_agreement": agree, "first_divergence": first_diff,
        "generate_s_torch": t_torch, "generate_s_triton": t_triton,  # include Triton JIT compiles
        "nbytes_triton": cache.nbytes()["total"], "nbytes_torch": ref_cache.nbytes()["total"],
        "view_bytes_torch": sum(la.view_k.nbytes + la.view_v.nbytes for la in ref_cache.layers),
    }
    log(f"wiring {json.dumps(result)}", fh)
    return result


def main() -> None:
    global HQ, HKV, D
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES))
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"decode kernels to time, of {', '.join(KERNELS)}")
    ap.add_argument("--profile", metavar="BxCTX", help="only launch the kernel 3 times on that shape (for ncu)")
    ap.add_argument("--kernel", default="gluon", choices=list(KERNELS), help="for --profile: the kernel")
    ap.add_argument("--wiring", action="store_true", help="only the end-to-end generation check")
    ap.add_argument("--plans", action="store_true", help="only the launch-plan comparison")
    ap.add_argument("--splits", action="store_true",
                    help="only the split counts of small batches, split kernel and combine timed apart")
    ap.add_argument("--salient", action="store_true",
                    help="only salient counts inside one size class against the count that fills it")
    ap.add_argument("--heads", default=f"{HQ}/{HKV}/{D}", metavar="HQ/HKV/D",
                    help="query heads, KV heads and head dim of the timed shapes (Gemma 3 270M: 4/1/256)")
    args = ap.parse_args()
    HQ, HKV, D = (int(x) for x in args.heads.split("/"))
    for flag, name, bench in ((args.plans, "plans", bench_plans), (args.splits, "splits", bench_splits),
                              (args.salient, "salient", bench_salient)):
        if not flag:
            continue
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
               "python": platform.python_version()}
        with open(out_dir / f"{name}.log", "w") as fh:
            rows = bench(torch.Generator(device="cuda").manual_seed(0), fh)
        (out_dir / f"{name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        return
    if args.wiring:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "wiring.log", "w") as fh:
            # fp32: the torch path runs on the CPU (its CUDA fp32 attend fails on a .view; see RESULTS.md)
            check_wiring(fh, torch.float32, "cpu")
            check_wiring(fh, torch.bfloat16, "cuda")
        return
    if args.profile:
        bsz, ctx = (int(x) for x in args.profile.split("x"))
        cache, q, *_ = build(bsz, ctx, torch.Generator(device="cuda").manual_seed(0))
        for _ in range(3):
            attend(args.kernel, q, cache, D**-0.5)
        torch.cuda.synchronize()
        return
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - set(KERNELS):
        ap.error(f"unknown kernels {sorted(unknown)}: allowed {', '.join(KERNELS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fh = open(out_dir / "bench_decode.log", "w")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    env = {
        "date": datetime.date.today().isoformat(),
        "heads": args.heads,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    log(f"env {json.dumps(env)}", fh)
    copy_gbps = copy_bandwidth()
    log(f"device copy bandwidth (read + write, 4 GiB): {copy_gbps:.0f} GB/s", fh)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = []

    sweep = sweep_correctness(gen, fh)
    pack = bench_pack(gen, fh)
    for bsz, ctx in shapes:
        torch.cuda.empty_cache()
        rows.append(bench_shape(bsz, ctx, gen, kernels, copy_gbps, fh))

    log("", fh)
    log("times: CUDA graph replay, L2 flushed; 'eager' and 'host': the kernel called eagerly", fh)
    log(f"{'B x ctx':>10} | {'kernel':>6} | {'us':>7} | {'eager us':>8} | {'host us':>7} | {'MB read':>8} | "
        f"{'GB/s':>6} | {'of copy':>7} | {'SDPA us':>8} | {'SDPA GB/s':>9} | {'speedup':>7} | {'rel err':>8}", fh)
    for r in rows:
        for kernel, k in r["kernels"].items():
            log(f"{r['batch']:>4} x {r['ctx']:<5}| {kernel:>6} | {k['us']:7.1f} | {k['eager_us']:8.1f} | "
                f"{k['host_us']:7.1f} | {r['bytes_read'] / 1e6:8.1f} | {k['GBps']:6.0f} | {k['copy_share']:7.1%} | "
                f"{r['sdpa_us']:8.1f} | {r['sdpa_GBps']:9.0f} | {k['speedup']:6.2f}x | {k['rel_err']:8.1e}"
                + ("" if k["passed"] else "  FAILED the check"), fh)
    log(json.dumps({"env": env, "copy_GBps": copy_gbps, "sweep": sweep, "pack": pack, "decode": rows}), fh)


if __name__ == "__main__":
    main()
