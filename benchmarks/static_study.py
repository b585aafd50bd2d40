"""The memory/throughput study: fp16 vs KIVI-2 vs pnmix-paper on the static decode path.

On `qwen3-8b-shape` (random bf16 weights; performance only; `--model gemma3-12b-shape` for a hybrid
model, its sliding-window layers as the static path's rings in bf16), prompt 141 tokens, greedy, under a
40 GiB memory budget enforced in-process (`torch.cuda.set_per_process_memory_fraction`), with
every decode step replayed as a CUDA graph (pnmix/static.py):

  memory      (a) peak memory vs generated length 2K..32K at batch 32; (b) peak memory vs batch
              at 8K, and each method's largest feasible batch (a config is feasible when prefill,
              the static cache for prompt + N tokens, graph capture and decode steps at the full
              length all fit the budget).
  throughput  (c) decode throughput vs batch at 8K generated tokens, up to each method's largest
              feasible batch, beside its bytes bound (every step reading the weights and the cache
              it holds once at the copy bandwidth measured in the run: `bytes_bound_tok_s`).
  hf          HF `generate` at fp16's largest batch, with a bf16 DynamicCache and with transformers'
              own QuantizedCache (optimum-quanto, 2 and 4 bits): what users run without this tool.
  latency     (d) per-step latency along a 32K generation at batch 1; slope over 11K-31K.
  equality    greedy tokens of the static path (graphs, kernels, bf16) vs `generate` on the
              embedded model (needs the GGUF: --gguf), and the tuner's cost measurement there;
              `--equality-model gemma3-270m` on the hybrid (its windows wrap), where pnmix-paper
              also runs with every window quantized.
  fullkernel  the fp16 baseline's decode kernel (kernels/decode_full.py) vs SDPA without a mask.
  profile     where a batch-1 step's time goes at 8K tokens: kernels of one replay, busy vs idle
              time, and the same step without torch.compile.
  maxbatch    (b) alone, for fp16, pnmix-paper and each `--config NAME=FILE` (a config JSON, e.g. a
              KV-budget campaign's pick from budget_study.py) or `--windows NAME=PRESET` (a preset
              with every window of a hybrid --model quantized): the largest feasible batch at 8K
              generated tokens (`--generated N`: at N; throughput then generates N too).
  layerwise   each layer-wise `--config` (every layer its own kernel constants in one CUDA graph)
              against its uniform equivalent of the same mean key bits (`uniform_equivalent`):
              step times paired at batch 32 and 64 and three cache lengths. `throughput` also
              covers the `--config` ones whose largest batch `maxbatch` measured.

How time is measured: generating 8K tokens at batch 110 would take minutes per point, so the step
time t(L) is measured at several cache lengths L (cache lengths set directly on the device, so a
step reads exactly the bytes of a cache holding L tokens; medians of CUDA-graph replays), and the
decode time of an N-token generation is the integral of t over L = 141 .. 141 + N (trapezoids),
plus one flush step per `residual_len` steps for the quantized caches; where a quantized cache's
residual cycles, t(L) is the mean over the cycle (`RESIDUAL_POINTS`). A real generation of a few
hundred steps checks the estimate (`validate` in the JSON). Every static step runs through
torch.compile and replays as a CUDA graph (`StaticGenerator`'s defaults on CUDA).

    python benchmarks/static_study.py --part memory,throughput --out DIR   # GPU
    python benchmarks/static_study.py --part maxbatch --config kv=DIR/kv_config.json --out DIR
    python benchmarks/static_study.py --part maxbatch,throughput,layerwise \
        --config key-2.25=benchmarks/results/allocation/picks/key-2.25.json --out DIR
    python benchmarks/static_study.py --plot DIR/static_study.json        # anywhere: PNGs + table
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

PROMPT = 141
BUDGET_BYTES = 40 * 2**30
METHODS: tuple[str, ...] = ("fp16", "kivi2", "pnmix-paper")  # --methods: the presets measured
GEN_LENGTHS = (2048, 4096, 8192, 16384, 32768)
BATCHES = (1, 8, 16, 20, 24, 32, 48, 64, 80, 96, 110, 128, 160, 192)
THROUGHPUT_BATCHES: tuple[int, ...] = (1, 8, 16, 32, 64, 96, 128)  # --batches: below each method's largest


def log(msg: str) -> None:
    print(msg, flush=True)


EXTRA: dict[str, Any] = {}  # --config NAME=FILE: configs measured beside the presets
COMPILE = True  # --no-compile: static steps without torch.compile
RESULTS: Path | None = None  # the JSON the run writes: after each part, and after each throughput row
MODEL = "qwen3-8b-shape"  # --model: a shape model of pnmix.models.SHAPE_MODELS
GENERATED = 8192  # --generated: the tokens generated after the prompt in maxbatch and throughput


def quantized_layer(gen: Any) -> Any:
    """The generator's first PN-Mix layer (a hybrid model's first layers are windows)."""
    return next(layer for layer in gen.layers if hasattr(layer, "config"))


def kv_bytes(config: Any, batch: int, length: int) -> int:
    """`pnmix.bits.kv_cache_bytes` of MODEL (a hybrid's windows at 16 bits)."""
    from pnmix.bits import kv_cache_bytes
    from pnmix.models import layer_plan, model_shape

    return kv_cache_bytes(config, model_shape(MODEL), batch, length, layer_plan(MODEL)).total


def method_arg(name: str) -> Any:
    from pnmix.config import preset

    if name in EXTRA:
        return EXTRA[name]
    return "fp16" if name == "fp16" else preset(name)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# Where a quantized cache's residual stands at a step. Past its first `residual_len` tokens after
# the sinks, a sequence's residual cycles through 0 .. residual_len - 1 tokens (a flush empties it
# every residual_len steps) whatever its length, and the step's fp16 tail costs about one program
# round trip per chunk of 32 tokens it holds. A step at such a length is timed with the residual
# at the middle of each of its chunks (held tokens 1/8, 3/8, 5/8, 7/8 of residual_len), and the
# times are averaged: the cycle's mean, for every method alike. Pinned to one point, KIVI (no
# sinks) and PN-Mix (32) would sit at unlike points of the cycle at the same length.
RESIDUAL_POINTS = (1 / 8, 3 / 8, 5 / 8, 7 / 8)


def residual_points(gen: Any, length: int) -> list[int | None]:
    """The residual fills (tokens held after the step) a step at `length` is timed at: one per
    RESIDUAL_POINTS where the residual cycles there, else [None] (set by the length alone)."""
    if gen.config is None:
        return [None]
    cfg = quantized_layer(gen).config
    r = cfg.residual_len
    # Below two residuals past the sinks the cache is still near its prompt's layout (at most one
    # flush behind it): timed as it stands there.
    if length - min(cfg.n_sink, length) < 2 * r:
        return [None]
    return [max(1, round(f * r)) for f in RESIDUAL_POINTS]


def set_fill(gen: Any, length: int, held: int | None = None) -> int:
    """Makes every sequence's static cache hold `length` tokens after the step's append (contents
    as they are: timing only) and returns how many it holds: for a quantized cache with `held` of
    them in the residual if given, the whole groups that fit before it (the total is at most
    `length` and less than a group below it, so it stays in `length`'s plan bucket wherever
    `length` is not within a group above a power of two)."""
    total = length
    for layer in gen.layers:
        if hasattr(layer, "lengths"):  # fp16: a full layer or a window's ring
            layer.lengths.fill_(length - 1)  # the step appends the length-th token
        else:
            cfg = layer.config
            sinks = min(cfg.n_sink, length)
            # A quantized window takes any group count (a ring: group j in slot j mod its slots; a bag).
            cap = length if layer.is_sliding else layer.k_low.shape[2] - layer.groups_per_flush
            if held is None:
                groups = min((length - sinks) // cfg.group_size, cap)
                held = min(length - sinks - groups * cfg.group_size, cfg.residual_len - 1)
            else:
                groups = min((length - sinks - held) // cfg.group_size, cap)
            if hasattr(layer, "hold"):  # a quantized window's bag: its edge and bag follow the counters
                layer.hold(sinks, groups, max(0, held - 1))
            else:
                layer.sink_len.fill_(sinks)
                layer.n_groups.fill_(groups)
                layer.res_len.fill_(max(0, held - 1))
            total = sinks + groups * cfg.group_size + held
    return total


def graph_for(gen: Any, length: int, held: int | None = None, flush: bool = False) -> tuple[Any, int]:
    """The captured step for a cache filled by `set_fill(gen, length, held)` (captured on first use,
    after one eager warm-up that compiles its kernels) and the tokens it holds. The generator picks
    the graph as a real generation would (`StaticGenerator.arm`: flush or not, the plan bucket),
    with a quantized window's start entering a group in some sequence, as at nearly every step of a
    large batch of independent sequences (the upper bound at small batches)."""
    total = set_fill(gen, length, held)
    key = gen.arm(flush, total)
    if key not in gen._graphs:
        gen._step_body()
        set_fill(gen, length, held)
        gen.capture(key)
    return gen._graphs[key], total


def time_graph(gen: Any, length: int, flush: bool = False, reps: int = 12) -> tuple[float, float]:
    """Median ms of one decode step (a CUDA-graph replay) with every cache holding ~`length` tokens,
    and the tokens held; the means of both over the residual's cycle (`residual_points`) where it
    cycles. A flush step is timed with every residual one token short of full."""
    points = [quantized_layer(gen).config.residual_len] if flush else residual_points(gen, length)
    medians, totals = [], []
    for held in points:
        graph, total = graph_for(gen, length, held, flush)
        times = []
        for _ in range(reps if len(points) == 1 else max(5, reps // 2)):
            set_fill(gen, length, held)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        medians.append(sorted(times)[len(times) // 2])
        totals.append(total)
    return sum(medians) / len(medians), sum(totals) / len(totals)


def build(model: Any, method: str, batch: int, max_len: int, compile: bool | None = None) -> Any:
    """Prefill a batch of 141-token prompts into a static generator with room for max_len tokens."""
    from pnmix.static import StaticGenerator

    gen = StaticGenerator(model, method_arg(method), max_len=max_len, compile=COMPILE if compile is None else compile)
    ids = torch.randint(100, 50000, (batch, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    gen.prefill(ids)
    return gen


def try_config(model: Any, method: str, batch: int, n_new: int, fills: tuple[int, ...] = ()) -> dict:
    """Feasibility and peak memory of (method, batch, N new tokens); step times at `fills` if given."""
    free()
    row: dict[str, Any] = {"method": method, "batch": batch, "new_tokens": n_new}
    gen = None
    try:
        gen = build(model, method, batch, PROMPT + n_new)
        row["cache_bytes"] = gen.cache.nbytes()
        t_full, _ = time_graph(gen, PROMPT + n_new, reps=3)  # a step at the full length must fit too
        if gen.config is not None:
            time_graph(gen, PROMPT + n_new, flush=True, reps=2)
        row["feasible"] = True
        row["step_ms_full"] = t_full
        for fill in fills:
            ms, tokens = time_graph(gen, fill)
            row.setdefault("step_ms", {})[fill] = ms
            row.setdefault("step_tokens", {})[fill] = tokens
        if fills and gen.config is not None:
            row["flush_step_ms"] = time_graph(gen, fills[-1], flush=True)[0]
    except torch.OutOfMemoryError:
        row["feasible"] = False
    row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
    del gen
    free()
    return row


def bytes_bound_tok_s(method: str, batch: int, weight_bytes: int, gbps: float, n_new: int = 8192) -> float:
    """The throughput no implementation of `method` passes at `batch`: every step of an n_new-token
    generation reads the weights and the cache it holds (`pnmix.bits.kv_cache_bytes` at its length)
    once, at the copy bandwidth `gbps`, and does nothing else. Its ratio between two methods is
    what their memory footprints allow, whatever the kernels."""
    from pnmix.config import preset

    config = EXTRA[method] if method in EXTRA else preset(method)  # fp16 is a preset here (16-bit K/V)
    step_bytes = sum(weight_bytes + kv_bytes(config, batch, length) for length in range(PROMPT + 1, PROMPT + n_new + 1))
    return batch * n_new / (step_bytes / (gbps * 1e9))


def decode_seconds(row: dict, start: int, end: int, flushes: float = 0.0) -> float:
    """Decode time of the steps that take the cache from `start` to `end` tokens: the trapezoid
    integral of the measured step times (held constant outside the measured lengths), plus
    `flushes` flush steps at their extra cost over a plain step at the last measured length. A
    point lies at the tokens its caches held (`step_tokens`), which for a quantized cache is up to
    a group below the nominal fill."""
    held = row.get("step_tokens", {})
    pts = sorted((held.get(k, int(k)), v) for k, v in row["step_ms"].items())
    total = sum((l1 - l0) * (t0 + t1) / 2 for (l0, t0), (l1, t1) in zip(pts, pts[1:], strict=False))
    total += (pts[0][0] - start) * pts[0][1] + (end - pts[-1][0]) * pts[-1][1]
    if flushes:
        total += flushes * (row["flush_step_ms"] - pts[-1][1])
    return total / 1e3


def part_memory(model: Any, res: dict) -> None:
    res["memory_vs_length"] = []
    for method in METHODS:
        for n in GEN_LENGTHS:
            row = try_config(model, method, 32, n)
            log(f"[a] {method:12s} B=32 N={n:6d}: feasible {row['feasible']}  peak {row['peak_bytes'] / 2**30:.2f} GiB")
            res["memory_vs_length"].append(row)
    res["memory_vs_batch"], res["max_batch"] = [], {}
    for method in METHODS:
        largest_batch(model, method, BATCHES, res)


def largest_batch(model: Any, method: str, batches: tuple[int, ...], res: dict) -> int:
    """The largest batch of `method` feasible at GENERATED tokens: `batches` up to the first that
    fails, then bisection between the last that fit and it (rows into res["memory_vs_batch"])."""
    last_ok, first_bad = 0, None
    for b in batches:
        row = try_config(model, method, b, GENERATED)
        log(f"[b] {method:12s} B={b:4d} N={GENERATED}: feasible {row['feasible']}  "
            f"peak {row['peak_bytes'] / 2**30:.2f} GiB")
        res.setdefault("memory_vs_batch", []).append(row)
        if not row["feasible"]:
            first_bad = b
            break
        last_ok = b
    hi = first_bad if first_bad is not None else last_ok
    while first_bad is not None and hi - last_ok > 1:  # bisect the largest feasible batch
        mid = (last_ok + hi) // 2
        row = try_config(model, method, mid, GENERATED)
        res["memory_vs_batch"].append(row)
        last_ok, hi = (mid, hi) if row["feasible"] else (last_ok, mid)
    res.setdefault("max_batch", {})[method] = last_ok
    log(f"[b] {method}: largest feasible batch at {GENERATED} generated tokens = {last_ok}")
    return last_ok


def part_max_batch(model: Any, res: dict) -> None:
    """(b) alone, coarse steps then bisection: fp16, pnmix-paper and the --config ones, with the KV bytes
    a sequence holds at the end of the generation (formula) beside each."""
    res.setdefault("max_batch_configs", {})
    for method in ("fp16", "pnmix-paper", *EXTRA):
        arg = method_arg(method)
        if arg != "fp16":
            res["max_batch_configs"][method] = {"config": arg.to_dict(),
                                                "bytes_per_sequence": kv_bytes(arg, 1, PROMPT + GENERATED)}
        if method in res.get("max_batch", {}):  # measured by the run that --merge extends
            continue
        if method == "fp16":
            coarse: tuple[int, ...] = (8, 16, 24)
        elif method == "pnmix-paper" or "pnmix-paper" not in res.get("max_batch", {}):
            coarse = (64, 96, 112, 128, 144, 160, 192, 256)
        else:  # start near pnmix-paper's batch scaled by the bytes a sequence holds
            paper = res["max_batch_configs"]["pnmix-paper"]["bytes_per_sequence"]
            mine = res["max_batch_configs"][method]["bytes_per_sequence"]
            guess = int(res["max_batch"]["pnmix-paper"] * paper / mine)
            coarse = tuple(b for b in (guess - 8, guess + 4, guess + 32, guess + 128) if b > 0)
        largest_batch(model, method, coarse, res)
        if RESULTS:  # a cut run keeps the batches it measured
            RESULTS.write_text(json.dumps(res, indent=1))
    fp16 = res["max_batch"]["fp16"]
    for method in res["max_batch_configs"]:
        log(f"[b] {method}: {res['max_batch'][method]} = {res['max_batch'][method] / fp16:.2f}x fp16's {fp16}")


# The layer-wise comparison (`--part layerwise`): step times of each layer-wise --config and of its
# uniform equivalent (`uniform_equivalent`) at these batches and cache lengths, paired.
LAYERWISE_BATCHES = (32, 64)
LAYERWISE_FILLS = (PROMPT + 1, 4224, PROMPT + 8192)


def uniform_equivalent(config: Any, num_layers: int, head_dim: int) -> Any:
    """The uniform config a layer-wise one's speed is compared with: its default config (bit pair,
    G, sinks, values) with the salient ratio, in whole channel pairs, whose key bits come nearest
    the layer-wise config's mean (`pnmix.bits.mean_key_bits`); a default with b_low = b_high gets
    one more high bit so that the ratio can move its bits."""
    from pnmix.bits import key_bits, mean_key_bits

    target = mean_key_bits(config, num_layers, head_dim)
    base = config.default
    if base.b_high == base.b_low:
        base = base.with_(b_high=base.b_low + 1)
    candidates = [base.with_(salient_ratio=2 * n / head_dim) for n in range(head_dim // 2 + 1)]
    return min(candidates, key=lambda c: abs(key_bits(c, head_dim).total - target))


def part_layerwise(model: Any, res: dict) -> None:
    """Each layer-wise --config (every layer its own kernel constants, one CUDA graph a step)
    against its uniform equivalent: step times at the same batch and cache lengths, one after the
    other in one process; `ratio` is layer-wise over uniform per length."""
    from pnmix.bits import key_bits, mean_key_bits
    from pnmix.layerwise import LayerwiseConfig
    from pnmix.models import model_shape

    shape = model_shape(MODEL)
    rows = res.setdefault("layerwise", [])
    for name, config in list(EXTRA.items()):
        if not isinstance(config, LayerwiseConfig):
            continue
        twin = f"{name}-uniform"
        EXTRA[twin] = uniform = uniform_equivalent(config, shape.num_layers, shape.head_dim)
        for batch in LAYERWISE_BATCHES:
            layered = try_config(model, name, batch, 8192, LAYERWISE_FILLS)
            flat = try_config(model, twin, batch, 8192, LAYERWISE_FILLS)
            row = {"config": name, "batch": batch, "uniform": uniform.to_dict(),
                   "mean_key_bits": mean_key_bits(config, shape.num_layers, shape.head_dim),
                   "uniform_key_bits": key_bits(uniform, shape.head_dim).total,
                   "feasible": layered["feasible"] and flat["feasible"]}
            if row["feasible"]:
                row["layerwise_step_ms"], row["uniform_step_ms"] = layered["step_ms"], flat["step_ms"]
                row["ratio"] = {fill: layered["step_ms"][fill] / flat["step_ms"][fill] for fill in LAYERWISE_FILLS}
                log(f"[layerwise] {name} ({row['mean_key_bits']:.3f} key bits) vs uniform r = "
                    f"{uniform.salient_ratio:.3f} ({row['uniform_key_bits']:.3f}) B={batch}: step ratio "
                    + " ".join(f"{fill}: {r:.3f}" for fill, r in row["ratio"].items()))
            rows.append(row)
            if RESULTS is not None:
                RESULTS.write_text(json.dumps(res, indent=1))


def sibling(name: str) -> Any:
    """A module beside this script, loaded by its path: the GPU scripts run `python -P`, which puts
    no script folder on sys.path, so a bare `import bench_decode` would not find it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def part_throughput(model: Any, res: dict) -> None:
    from pnmix.layerwise import as_layerwise

    # A step's launch plans are made for its length rounded up to a power of two (pnmix/static.py),
    # so t(L) jumps where L passes one: each bucket is timed near both of its ends (a group past
    # its lower end: `set_fill` holds up to a group less than asked).
    fills = tuple(f for f in (PROMPT + 1, 384, 512, 640, 1024, 1152, 2048, 2176, 4096, 4224, 8192, 8320, 16384,
                              16512) if f < PROMPT + GENERATED) + (PROMPT + GENERATED,)
    res.setdefault("throughput", [])
    if "copy_gbps" not in res:  # the bytes bounds' memory speed, measured once per study
        res["copy_gbps"] = sibling("bench_decode").copy_bandwidth()
        free()
    fp16_top = res.get("max_batch", {}).get("fp16") or 20
    # --config ones where their largest batch is known (`--part maxbatch` in the same JSON)
    extra = [name for name in EXTRA if name in res.get("max_batch", {})]
    for method in (*METHODS, *extra):
        top = res.get("max_batch", {}).get(method) or {"fp16": 20, "kivi2": 104, "pnmix-paper": 102}[method]
        # every method also at fp16's largest batch, the equal-batch comparison
        batches = sorted({b for b in THROUGHPUT_BATCHES if b < top} | {top, min(top, fp16_top)})
        done = {r["batch"] for r in res["throughput"] if r["method"] == method}
        for b in batches:
            if b in done:  # measured by an earlier run (--merge)
                continue
            row = try_config(model, method, b, GENERATED, fills)
            if row["feasible"]:
                flushes = 0.0 if method == "fp16" else GENERATED / as_layerwise(method_arg(method)).default.residual_len
                secs = decode_seconds(row, PROMPT, PROMPT + GENERATED, flushes)
                row["decode_s"], row["tok_s"] = secs, b * GENERATED / secs
                row["bound_tok_s"] = bytes_bound_tok_s(method, b, res["weight_bytes"], res["copy_gbps"], GENERATED)
                log(f"[c] {method:12s} B={b:4d}: {row['tok_s']:8.1f} tok/s ({row['tok_s'] / row['bound_tok_s']:.0%} of "
                    f"the bytes bound {row['bound_tok_s']:.0f})  step ms at fills "
                    + " ".join(f"{v:.2f}" for v in row["step_ms"].values()))
            res["throughput"].append(row)
            if RESULTS is not None:  # a run cut short keeps its rows (--merge continues it)
                RESULTS.write_text(json.dumps(res, indent=1))
    if "validate" not in res:
        res["validate"] = validate(model)


def hf_generate(model: Any, batch: int, nbits: int | None = None) -> dict:
    """HF `generate` with SDPA: ms per decode step at ~1K, 4K and 8K tokens of context, with a
    bf16 DynamicCache (nbits None) or transformers' own QuantizedCache (optimum-quanto backend,
    `nbits` 2 or 4, its default groups and 128-token residual): what users run without this tool.

    Starts at `batch` and halves it until an 8K prompt's prefill fits too.
    """
    from transformers import DynamicCache, QuantizedCache

    def cache() -> Any:
        return DynamicCache() if nbits is None else QuantizedCache(backend="quanto", config=model.config, nbits=nbits)

    name = "bf16 DynamicCache" if nbits is None else f"QuantizedCache quanto {nbits}-bit"
    model.set_attn_implementation("sdpa")
    while batch >= 1:
        out: dict[str, Any] = {"batch": batch, "cache": name, "step_ms": {}}
        try:
            for ctx in (1024, 4096, PROMPT + 8192):
                free()
                ids = torch.randint(100, 50000, (batch, ctx), device="cuda")
                times = []
                if not out["step_ms"]:  # warm-up: the first generate calls pay one-off costs
                    for _ in range(2):
                        model.generate(input_ids=ids[:, :64], max_new_tokens=8, do_sample=False, pad_token_id=0,
                                       past_key_values=cache())
                for n in (2, 34):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, past_key_values=cache(), pad_token_id=0)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                out["step_ms"][str(ctx)] = (times[1] - times[0]) / 32 * 1e3
                out["peak_bytes"] = int(torch.cuda.max_memory_allocated())
                log(f"[hf] generate, {name}, B={batch} ctx={ctx}: {out['step_ms'][str(ctx)]:.1f} ms/step")
        except torch.OutOfMemoryError:
            log(f"[hf] generate, {name}, B={batch}: out of memory within the budget; halving")
            batch //= 2
            continue
        out["tok_s"] = batch * 8192 / decode_seconds(out, PROMPT, PROMPT + 8192)
        free()
        return out
    return {}


def part_profile(model: Any, res: dict) -> None:
    """Where a batch-1 step's time goes at 8K tokens: the kernels of one graph replay (CUDA profiler),
    their busy time against the replay's wall time, the idle time before each kernel kind, and the
    same step without torch.compile."""
    from torch.profiler import ProfilerActivity, profile

    res["profile"] = {}
    fill = PROMPT + 8192
    for method in METHODS:
        row: dict[str, Any] = {}
        for compiled in (False, True):
            free()
            gen = build(model, method, 1, fill + 1, compile=compiled)
            row["step_ms" if compiled else "step_ms_eager"] = time_graph(gen, fill)[0]
            if not compiled:
                continue
            graph, _ = graph_for(gen, fill)
            reps = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    graph.replay()
                torch.cuda.synchronize()
            kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                              if e.device_type.name == "CUDA"), key=lambda k: k[0])
            busy: dict[str, float] = {}
            idle: dict[str, float] = {}
            for i, (start, end, name) in enumerate(kernels):
                kind = name[:60]
                busy[kind] = busy.get(kind, 0.0) + (end - start) / reps / 1e3
                gap = start - kernels[i - 1][1] if i else -1
                if 0 <= gap < 100:  # within a replay (a gap of >= 100 us lies between two replays)
                    idle[kind] = idle.get(kind, 0.0) + gap / reps / 1e3
            row["kernels_per_step"] = len(kernels) / reps
            row["busy_ms"] = sum(busy.values())
            row["idle_ms"] = sum(idle.values())
            row["top_busy_ms"] = dict(sorted(busy.items(), key=lambda kv: -kv[1])[:12])
            row["top_idle_ms"] = dict(sorted(idle.items(), key=lambda kv: -kv[1])[:6])
            del gen
        res["profile"][method] = row
        log(f"[profile] {method} B=1 at {fill}: step {row['step_ms']:.2f} ms (without torch.compile "
            f"{row['step_ms_eager']:.2f}), {row['kernels_per_step']:.0f} kernels, busy {row['busy_ms']:.2f} ms, "
            f"idle {row['idle_ms']:.2f} ms; idle before: "
            + ", ".join(f"{k} {v:.3f}" for k, v in row["top_idle_ms"].items()))
        for k, v in row["top_busy_ms"].items():
            log(f"[profile]    {v:7.3f} ms  {k}")


def part_hf(model: Any, res: dict) -> None:
    """HF `generate` at fp16's largest static batch: bf16 DynamicCache, quanto 2-bit and 4-bit."""
    batch = res.get("max_batch", {}).get("fp16") or 20
    res["hf_generate"] = hf_generate(model, batch)
    res["hf_quanto"] = {str(n): hf_generate(model, batch, n) for n in (2, 4)}


def validate(model: Any) -> dict:
    """A real static generation vs the estimate for the same steps (the method of (c) and (d)).

    Steps 1-539 are untimed: they include every step that runs eagerly or is captured (the first
    two of each graph: plain and flush steps of each plan bucket). Steps 540-739 are timed: plain
    graph replays and one flush-graph replay (step 659), cache lengths 681-880, one plan bucket.
    """
    from pnmix.config import preset

    out = {}
    n, b, skip = 740, 32, 540
    for method in ("fp16", "pnmix-paper"):
        free()
        gen = build(model, method, b, PROMPT + n)
        for _ in range(skip - 1):  # the prefill gave token 1
            gen.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n - skip):
            gen.step()
        torch.cuda.synchronize()
        real_ms = (time.perf_counter() - t0) / (n - skip) * 1e3
        del gen
        lo, hi = PROMPT + skip, PROMPT + n
        row = try_config(model, method, b, n, (lo, (lo + hi) // 2, hi))
        flushes = 0 if method == "fp16" else (n - skip) // preset(method).residual_len  # one, at step 659
        est_ms = decode_seconds(row, lo, hi, flushes) * 1e3 / (hi - lo)
        out[method] = {"batch": b, "timed_steps": f"{skip}-{n - 1}", "real_ms_per_step": real_ms,
                       "estimated_ms_per_step": est_ms}
        log(f"[validate] {method}: real {real_ms:.2f} ms/step, estimated {est_ms:.2f} ms/step")
    return out


def part_latency(model: Any, res: dict) -> None:
    fills = (1024, 11264, 16384, 21504, 26624, 31744)
    res["latency"] = []
    for method in METHODS:
        row = try_config(model, method, 1, 32768, fills)
        if row["feasible"]:
            xs = [f for f in fills if f >= 11264]
            ys = [row["step_ms"][f] * 1e3 for f in xs]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            row["growth_us_11k_to_31k"] = ys[-1] - ys[0]
            row["slope_us_per_1k_steps"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
                (x - mx) ** 2 for x in xs) * 1000
            log(f"[d] {method:12s} B=1: step ms " + " ".join(f"{v:.3f}" for v in row["step_ms"].values())
                + f"; slope {row['slope_us_per_1k_steps']:.2f} us per 1K steps")
        res["latency"].append(row)


def part_fullkernel(res: dict) -> None:
    """The fp16 baseline's decode kernel vs SDPA (no mask) on bench_decode.py's shapes, bf16, 32/8 heads, d 128."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from pnmix.kernels.decode_full import full_decode_attention

    res["fullkernel"] = []
    for bsz, ctx in ((1, 32768), (32, 8192), (32, 32768), (110, 8192)):
        free()
        q = torch.randn((bsz, 32, 128), device="cuda", dtype=torch.bfloat16)
        k = torch.randn((bsz, 8, ctx, 128), device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.full((bsz,), ctx, dtype=torch.int32, device="cuda")
        out = full_decode_attention(q, k, v, lengths, 128**-0.5)
        ref = F.scaled_dot_product_attention(q.view(bsz, 32, 1, 128), k, v, enable_gqa=True).view(bsz, 32, 128)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        t_k = do_bench(functools.partial(full_decode_attention, q, k, v, lengths, 128**-0.5), return_mode="median")
        t_s = do_bench(functools.partial(F.scaled_dot_product_attention, q.view(bsz, 32, 1, 128), k, v,
                                         enable_gqa=True), return_mode="median")
        gbps = (k.nbytes + v.nbytes) / (t_k * 1e-3) / 1e9
        row = {"batch": bsz, "ctx": ctx, "kernel_us": t_k * 1e3, "sdpa_us": t_s * 1e3, "kernel_GBps": gbps,
               "rel_err": err}
        res["fullkernel"].append(row)
        log(f"[fullkernel] {bsz}x{ctx}: kernel {t_k * 1e3:.1f} us ({gbps:.0f} GB/s), SDPA {t_s * 1e3:.1f} us, "
            f"rel err {err:.1e}")


def part_tuner_cost(res: dict, model: Any) -> None:
    """The tuner's cost measurement on CUDA (static path) for the embedded model, as a trial runs it."""
    from pnmix.config import preset
    from pnmix.tuner.scoring.engine import ScoringEngine

    res["tuner_cost"] = {}
    engine = ScoringEngine(model, None)
    for name in METHODS:
        kv_bytes, tok_s, peak = engine.measure_cost(preset(name))
        res["tuner_cost"][name] = {"kv_bytes": kv_bytes, "tok_s": tok_s, "peak_bytes": peak}
        log(f"[tuner] {name}: kv {kv_bytes / 1024:.0f} KiB, {tok_s:.1f} tok/s, peak {(peak or 0) / 2**20:.0f} MiB")


def part_equality(res: dict, gguf: str, model_name: str) -> None:
    """Static path (CUDA graphs, kernels, bf16) vs `generate` on an embedded model (smollm2-135m,
    or the hybrid gemma3-270m, where pnmix-paper also runs with every window quantized)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from pnmix import models
    from pnmix.config import preset
    from pnmix.families import plan_of_config
    from pnmix.generation import generate, use_pnmix_attention
    from pnmix.layerwise import LayerwiseConfig
    from pnmix.static import StaticGenerator

    os.environ[models.EMBEDDED[model_name].env_var] = gguf
    loaded = models.load(model_name, dtype=torch.bfloat16, device="cuda")
    tok, model = loaded.tokenizer, loaded.model
    texts = ["Write a detailed essay about the history of the bicycle. " * 40,
             "Explain how photosynthesis works, step by step, for a student. " * 12]
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
    n = 160  # crosses at least one flush step for every row (residual 128)
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])

    def until_eos(tokens: torch.Tensor) -> list[list[int]]:
        return [row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in tokens.tolist()]

    class Margins(LogitsProcessor):
        """Records each step's margin between the two top logits, per row, as `generate` scores."""

        def __init__(self) -> None:
            self.steps: list[list[float]] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            top = scores.float().topk(2, dim=-1).values
            self.steps.append((top[:, 0] - top[:, 1]).tolist())
            return scores

    key = "equality" if COMPILE else "equality_eager"  # --no-compile keeps its own record beside the compiled one
    res[key] = {"model": model_name}
    methods = {m: method_arg(m) for m in METHODS}
    windows = plan_of_config(model.config).window_layers
    if windows:
        methods["pnmix-paper-windows"] = LayerwiseConfig(preset("pnmix-paper"), windows=windows)
    for name, method in methods.items():
        margins = Margins()
        kw = {"logits_processor": LogitsProcessorList([margins])}
        if method == "fp16":
            use_pnmix_attention(model)
            want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  pad_token_id=0, **kw)[:, width:]
        else:
            want = generate(model, ids, method, attention_mask=mask, max_new_tokens=n, **kw)[0]
        gen = StaticGenerator(model, method, max_len=width + n, compile=COMPILE)
        got = until_eos(gen.generate(ids, mask, max_new_tokens=n))
        ref = until_eos(want)
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b),
                           None if len(g) == len(r) else min(len(g), len(r))) for g, r in zip(got, ref, strict=True)]
        # `generate`'s top-2 logit margin at each row's first difference: near 0 is a near-tie
        margin = [None if i is None or i >= len(margins.steps) else margins.steps[i][row]
                  for row, i in enumerate(first_diff)]
        res[key][name] = {"tokens": [len(r) for r in ref], "equal": got == ref, "first_diff": first_diff,
                          "first_diff_margin": margin, "graphs": len(gen._graphs), "compiled": COMPILE}
        log(f"[{key}] {name}: equal {got == ref}, compared {[len(r) for r in ref]} tokens, first difference "
            f"per row {first_diff} (generate's top-2 logit margin there {margin}), graphs captured {len(gen._graphs)}")
    if COMPILE:  # the tuner measures its cost as it runs, whatever this run's --no-compile
        part_tuner_cost(res, model)


@torch.inference_mode()  # the static generator's buffers are inference tensors
def main() -> None:
    global COMPILE, RESULTS, MODEL, GENERATED, METHODS, THROUGHPUT_BATCHES
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="memory,throughput,latency")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--merge", help="an earlier static_study.json to extend")
    ap.add_argument("--gguf", help="the embedded model's GGUF (for --part equality)")
    ap.add_argument("--equality-model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"),
                    help="--part equality: the embedded model the GGUF holds")
    ap.add_argument("--plot", metavar="JSON", help="draw the PNGs and print the RESULTS table from a JSON")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FILE",
                    help="--part maxbatch, throughput, layerwise: a config JSON (single or layer-wise) to "
                         "measure beside the presets")
    ap.add_argument("--windows", action="append", default=[], metavar="NAME=PRESET",
                    help="like --config: a preset with every sliding-window layer of --model quantized under it")
    ap.add_argument("--no-compile", action="store_true", help="static steps without torch.compile")
    ap.add_argument("--generated", type=int, default=GENERATED,
                    help="--part maxbatch, throughput: tokens generated after the 141-token prompt (default 8192)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="the presets measured in memory and throughput, comma-separated (fp16 is the baseline)")
    ap.add_argument("--batches", default=",".join(map(str, THROUGHPUT_BATCHES)),
                    help="--part throughput: the batches timed below each method's largest (which, and fp16's "
                         "largest, are always timed)")
    ap.add_argument("--model", default="qwen3-8b-shape",
                    help="a shape model: qwen3-8b-shape, llama3-8b-shape, gemma3-12b-shape")
    args = ap.parse_args()
    from pnmix.config import preset
    from pnmix.layerwise import LayerwiseConfig, load_config
    from pnmix.models import layer_plan

    COMPILE = not args.no_compile
    MODEL, GENERATED = args.model, args.generated
    METHODS = tuple(m for m in args.methods.split(",") if m)
    THROUGHPUT_BATCHES = tuple(int(b) for b in args.batches.split(",") if b)
    for item in args.config:
        name, _, file = item.partition("=")
        EXTRA[name] = load_config(Path(file).read_text())
    for item in args.windows:
        name, _, base = item.partition("=")
        EXTRA[name] = LayerwiseConfig(preset(base), windows=layer_plan(MODEL).window_layers)
    if args.plot:
        plot(Path(args.plot))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    RESULTS = out / "static_study.json"
    res: dict[str, Any] = json.loads(Path(args.merge).read_text()) if args.merge else {}
    import transformers
    import triton

    res.setdefault("env", {})[args.part] = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
    }
    parts = args.part.split(",")
    if "equality" in parts:
        part_equality(res, args.gguf, args.equality_model)
    if "fullkernel" in parts:
        part_fullkernel(res)
    if set(parts) - {"equality", "fullkernel"}:
        from pnmix import models

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(BUDGET_BYTES / total)
        res["budget_bytes"], res["generated"] = BUDGET_BYTES, GENERATED
        model = models.load(MODEL, purpose="performance", dtype=torch.bfloat16, device="cuda").model
        res["model"], res["weight_bytes"] = MODEL, sum(p.nbytes for p in model.parameters())
        log(f"{MODEL} weights {res['weight_bytes'] / 2**30:.2f} GiB; budget {BUDGET_BYTES / 2**30:.0f} GiB")
        # maxbatch before throughput: the --config ones' throughput needs their largest batch
        for part, fn in (("memory", part_memory), ("maxbatch", part_max_batch), ("throughput", part_throughput),
                         ("latency", part_latency), ("hf", part_hf), ("profile", part_profile),
                         ("layerwise", part_layerwise)):
            if part in parts:
                t0 = time.time()
                fn(model, res)
                log(f"part {part}: {time.time() - t0:.0f} s")
                (out / "static_study.json").write_text(json.dumps(res, indent=1))
    (out / "static_study.json").write_text(json.dumps(res, indent=1))


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(path.read_text())
    gib = 2**30
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    if "memory_vs_length" in res:
        ax = axes[0]
        for m in METHODS:
            rows = [r for r in res["memory_vs_length"] if r["method"] == m and r["feasible"]]
            ax.plot([r["new_tokens"] for r in rows], [r["peak_bytes"] / gib for r in rows], "o-", label=m)
        ax.axhline(res["budget_bytes"] / gib, color="k", ls="--", lw=1, label="budget")
        ax.set(xscale="log", xlabel="generated tokens (batch 32)", ylabel="peak memory (GiB)", title="(a)")
        ax.legend()
    if "memory_vs_batch" in res:
        ax = axes[1]
        for m in METHODS:
            rows = sorted((r for r in res["memory_vs_batch"] if r["method"] == m and r["feasible"]),
                          key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in rows], [r["peak_bytes"] / gib for r in rows], "o-", label=m)
        ax.axhline(res["budget_bytes"] / gib, color="k", ls="--", lw=1)
        ax.set(xlabel="batch (8K generated)", ylabel="peak memory (GiB)", title="(b)")
        ax.legend()
    if "throughput" in res:
        ax = axes[2]
        for m in METHODS:
            rows = sorted((r for r in res["throughput"] if r["method"] == m and r.get("tok_s")),
                          key=lambda r: r["batch"])
            line, = ax.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], "o-", label=f"{m} (static, graphs)")
            bound = [r for r in rows if r.get("bound_tok_s")]
            if bound:
                ax.plot([r["batch"] for r in bound], [r["bound_tok_s"] for r in bound], "--", color=line.get_color(),
                        lw=1, label=f"{m}: bytes bound")
        hf = res.get("hf_generate", {})
        if hf.get("tok_s"):
            ax.plot([hf["batch"]], [hf["tok_s"]], "kx", ms=10, label="HF generate, bf16 DynamicCache")
        for (bits, row), mark in zip(res.get("hf_quanto", {}).items(), ("r+", "m+"), strict=False):
            if row.get("tok_s"):
                ax.plot([row["batch"]], [row["tok_s"]], mark, ms=10, label=f"HF generate, quanto {bits}-bit")
        ax.set(xlabel="batch (8K generated)", ylabel="decode tokens/s", title="(c)")
        ax.legend(loc="upper left", fontsize=7)
    if "latency" in res:
        ax = axes[3]
        for r in res["latency"]:
            if r.get("step_ms"):
                pts = sorted((int(k), v) for k, v in r["step_ms"].items())
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=r["method"])
        ax.set(xlabel="tokens in cache (batch 1)", ylabel="ms per decode step", title="(d)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
