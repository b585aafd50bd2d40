"""Head dim 256 probe (Gemma 3 shape: 4 query heads, 1 KV head, d = 256) for the PN-Mix kernels.

    python d256.py --out DIR                       # GPU: batches 1, 8; contexts 8K, 32K
    TRITON_INTERPRET=1 python d256.py --cpu        # CPU: tiny context, Triton interpreter + Gluon emulator

Per config (pnmix-paper, kivi2) x batch x context:
1. fresh random keys/values, packed by the Triton quantize+pack kernels; bytes compared with the torch
   reference `pnmix.packing` on a slice (bit for bit);
2. the Triton decode kernel (`kernels.decode`), the Gluon kernel (2 and 3 value slots) where
   `gluon.supports` admits the shape, each against `pnmix.backend.decode_reference` (fp32) on up
   to 4 sequences, output poisoned with NaN before the run;
3. times each kernel and torch SDPA on fp16 K/V of the same shape (CUDA events around each call,
   L2 flushed before each call, median of 50 after 10 warm-up calls).
Prints one line per result and a table; writes d256.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from pnmix import packing
from pnmix.backend import decode_reference
from pnmix.kernels import gluon
from pnmix.kernels.gluon import launch as gluon_launch
from pnmix.kernels.decode import decode_attention
from pnmix.kernels.layout import DecodeCache, channel_order
from pnmix.kernels.pack import quantize_pack_keys, quantize_pack_values

HQ, HKV, D = 4, 1, 256
# name: (b_low, b_high, salient_ratio, G, sinks, residual capacity, value bits, value group): PNMixConfig presets
CONFIGS = {"pnmix-paper": (1, 3, 0.5, 128, 32, 128, 2, 32), "kivi2": (2, 2, 0.0, 128, 0, 128, 2, 32)}
DTYPE = torch.float16


def build(cfg, bsz: int, ctx: int, gen: torch.Generator, dev: str):
    b_low, b_high, ratio, g, n_sink, res_cap, vbits, vgroup = cfg
    n_groups = (ctx - n_sink) // g
    res = ctx - n_sink - n_groups * g
    assert 0 <= res <= res_cap
    k = torch.randn((bsz, HKV, ctx, D), generator=gen, device=dev).mul_(1.5).add_(0.25).to(DTYPE)
    v = torch.randn((bsz, HKV, ctx, D), generator=gen, device=dev).to(DTYPE)
    n_pairs = round(ratio * D / 2) if b_high > b_low else 0
    pairs = torch.rand((bsz, HKV, D // 2), generator=gen, device=dev).topk(n_pairs, dim=-1).indices.sort(-1).values
    sal = torch.cat([pairs, pairs + D // 2], dim=-1)
    region = slice(n_sink, n_sink + n_groups * g)
    pk = quantize_pack_keys(k[:, :, region], sal, b_low, b_high, g)
    pv = quantize_pack_values(v[:, :, region], vbits, vgroup)
    k_res = torch.zeros((bsz, HKV, res_cap, D), dtype=DTYPE, device=dev)
    v_res = torch.zeros_like(k_res)
    k_res[:, :, :res] = k[:, :, n_sink + n_groups * g:]
    v_res[:, :, :res] = v[:, :, n_sink + n_groups * g:]
    full = lambda n: torch.full((bsz,), n, dtype=torch.int32, device=dev)  # noqa: E731
    cache = DecodeCache(
        k_sink=k[:, :, :n_sink].contiguous(), v_sink=v[:, :, :n_sink].contiguous(), k_res=k_res, v_res=v_res,
        k_low=pk.low, k_high=pk.high, k_scale=pk.scale, k_zero=pk.zero,
        v_packed=pv.packed, v_scale=pv.scale, v_zero=pv.zero, channel_order=channel_order(sal, D),
        sink_len=full(n_sink), n_groups=full(n_groups), res_len=full(res),
        b_low=b_low, b_high=b_high, group_size=g, value_bits=vbits, value_group_size=vgroup)
    q = torch.randn((bsz, HQ, D), generator=gen, device=dev).to(DTYPE)
    return cache, q, k, v, sal, n_groups, res


def check_pack(cfg, k, v, sal) -> bool:
    """Triton pack kernels vs pnmix.packing, bit for bit, on sequence 0's first (up to) 8 groups."""
    b_low, b_high, _, g, n_sink, _, vbits, vgroup = cfg
    n = min(8, (k.shape[2] - n_sink) // g)
    region = slice(n_sink, n_sink + n * g)
    ref_k = packing.quantize_keys(k[:1, :, region].float(), sal[:1], b_low, b_high, g)
    out_k = quantize_pack_keys(k[:1, :, region], sal[:1], b_low, b_high, g)
    ref_v = packing.quantize_values(v[:1, :, region], vbits, vgroup)
    out_v = quantize_pack_values(v[:1, :, region], vbits, vgroup)
    ok = all(torch.equal(getattr(ref_k, f), getattr(out_k, f)) for f in ("low", "high", "scale", "zero"))
    return ok and all(torch.equal(getattr(ref_v, f), getattr(out_v, f)) for f in ("packed", "scale", "zero"))


def sub_cache(cache: DecodeCache, n: int) -> DecodeCache:
    return dataclasses.replace(cache, **{f.name: getattr(cache, f.name)[:n] for f in dataclasses.fields(cache)
                                         if isinstance(getattr(cache, f.name), torch.Tensor)})


def rel_err(run, q, ref) -> float:
    out = torch.full_like(q, float("nan"))
    run(out=out)
    if not torch.isfinite(out).all():
        return math.inf
    return float((out.float() - ref).norm() / ref.norm())


def emulated_gluon(q, cache, scale, out=None, value_slots=2):
    """CPU: the Gluon kernel's source through the tests' emulator (tests/gluon_emu.py)."""
    from gluon_emu import run_split_kernel
    split = gluon_launch.split_launch(q, cache, scale, gluon_launch.plan_launch(q, cache, 2, value_slots=value_slots))
    for t in (split.pm, split.pl, split.pa):
        t.fill_(float("nan"))
    run_split_kernel(split)
    return split.combine(out if out is not None else torch.empty_like(q))


_flush = None


def time_events(fn, warmup=10, reps=50) -> float:
    """Median us of `fn` by CUDA events around each call, L2 flushed (256 MB written) before each."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return t[len(t) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="tiny context on the CPU (TRITON_INTERPRET=1 + emulator)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default=None)
    ap.add_argument("--ctxs", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    dev = "cpu" if args.cpu else "cuda"
    batches = [int(x) for x in (args.batches or ("1,2" if args.cpu else "1,8")).split(",")]
    ctxs = [int(x) for x in (args.ctxs or ("416" if args.cpu else "8192,32768")).split(",")]
    env = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    import triton
    env["triton"] = triton.__version__
    print("env", json.dumps(env), flush=True)
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    scale = D**-0.5
    kernels = {"triton": decode_attention}
    if dev == "cuda":
        kernels["gluon"] = gluon.decode_attention
        kernels["gluon-3slot"] = functools.partial(gluon.decode_attention, value_slots=3)
    else:
        kernels["triton"] = functools.partial(decode_attention, num_splits=2)
        kernels["gluon(emu)"] = emulated_gluon
        kernels["gluon-3slot(emu)"] = functools.partial(emulated_gluon, value_slots=3)
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        for bsz in batches:
            for ctx in ctxs:
                if dev == "cuda":
                    torch.cuda.empty_cache()
                row = {"config": name, "batch": bsz, "ctx": ctx, "kernels": {}}
                try:
                    cache, q, k, v, sal, n_groups, res = build(cfg, bsz, ctx, gen, dev)
                    row["pack_exact"] = check_pack(cfg, k, v, sal)
                except Exception as exc:
                    row["pack_error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                    print(f"[{name} {bsz}x{ctx}] PACK FAILED {row['pack_error']}", flush=True)
                    traceback.print_exc()
                    rows.append(row)
                    continue
                row["gluon_supports"] = (gluon.supports(cache, q) if dev == "cuda"
                                         else gluon_launch.shape_supported(cache, q))
                n = min(4, bsz)
                sub, qs = sub_cache(cache, n), q[:n]
                ref = decode_reference(qs, sub, scale)
                if dev == "cuda":
                    kv = k.nbytes + v.nbytes
                    sdpa_gqa = functools.partial(F.scaled_dot_product_attention, q.view(bsz, HQ, 1, D), k, v,
                                                 scale=scale, enable_gqa=True)
                    sdpa_fold = functools.partial(F.scaled_dot_product_attention, q.view(bsz, HKV, HQ // HKV, D), k, v,
                                                  scale=scale)
                    fold = sdpa_fold().reshape(bsz, HQ, D)[:n].float()
                    # SDPA's own error against the fp32 attention of the unquantized K/V (context for the kernels')
                    kf, vf = k[:n].float(), v[:n].float()
                    exact = torch.softmax(qs.float().view(n, HKV, HQ // HKV, D) @ kf.transpose(-1, -2) * scale, -1) @ vf
                    row["sdpa_rel_err_vs_fp32"] = float((fold - exact.reshape(n, HQ, D)).norm() / exact.norm())
                    del kf, vf, exact
                    row["sdpa_gqa_us"] = time_events(sdpa_gqa)
                    row["sdpa_fold_us"] = time_events(sdpa_fold)
                    row["sdpa_us"] = min(row["sdpa_gqa_us"], row["sdpa_fold_us"])
                    row["sdpa_GBps"] = kv / (row["sdpa_us"] * 1e-6) / 1e9
                for kname, fn in kernels.items():
                    kr: dict = {}
                    t0 = time.perf_counter()
                    try:
                        kr["rel_err"] = rel_err(functools.partial(fn, qs, sub, scale), qs, ref)
                        kr["first_call_s"] = time.perf_counter() - t0
                        if dev == "cuda":
                            out = torch.full_like(q, float("nan"))
                            fn(q, cache, scale, out=out)
                            kr["full_batch_finite"] = bool(torch.isfinite(out).all())
                            kr["us"] = time_events(functools.partial(fn, q, cache, scale, out=out))
                            kr["speedup_vs_sdpa"] = row["sdpa_us"] / kr["us"]
                            if kname.startswith("gluon"):
                                plan = gluon_launch.plan_launch(q, cache, value_slots=3 if "3slot" in kname else 2)
                                c = gluon_launch.split_launch(q, cache, scale, plan).run()
                                kr |= {"registers": c.n_regs, "spilled": c.n_spills, "shared": c.metadata.shared,
                                       "splits": plan.num_splits, "tail_programs": plan.n_tail}
                    except Exception as exc:
                        kr["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
                        traceback.print_exc()
                    row["kernels"][kname] = kr
                    print(f"[{name} {bsz}x{ctx}] {kname}: {json.dumps(kr)}", flush=True)
                print(f"[{name} {bsz}x{ctx}] " + json.dumps({k: v for k, v in row.items() if k != "kernels"}),
                      flush=True)
                rows.append(row)
                del cache, q, k, v
    print()
    print(f"{'config':>12} | {'B x ctx':>9} | {'kernel':>16} | {'rel err':>8} | {'us':>8} | {'SDPA us':>8} | "
          f"{'vs SDPA':>7} | regs/spill")
    for r in rows:
        for kname, kr in r["kernels"].items():
            if "error" in kr:
                desc = f"ERROR {kr['error'][:80]}"
                print(f"{r['config']:>12} | {r['batch']:>3}x{r['ctx']:<5} | {kname:>16} | {desc}")
                continue
            us = f"{kr['us']:8.1f}" if "us" in kr else "       -"
            sd = f"{r['sdpa_us']:8.1f}" if "sdpa_us" in r else "       -"
            sp = f"{kr['speedup_vs_sdpa']:6.2f}x" if "speedup_vs_sdpa" in kr else "      -"
            rg = f"{kr.get('registers', '-')}/{kr.get('spilled', '-')}"
            print(f"{r['config']:>12} | {r['batch']:>3}x{r['ctx']:<5} | {kname:>16} | {kr['rel_err']:8.2e} | {us} | "
                  f"{sd} | {sp} | {rg}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "d256.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
