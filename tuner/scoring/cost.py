"""The cost workload: the bytes a config's cache holds and its decode throughput, measured alike
for every config.

A prompt of COST_PROMPT_TOKENS random ids (seeded), then COST_NEW_TOKENS new tokens. `measure` runs
it on a PN-Mix config's cache built from the prompt's recorded prefill (the scoring engine keeps that
state: `ScoringEngine.measure_cost`); `live_cost` on a cache the model fills as it runs (a peer's
QuantizedCache). Both time decode steps the same way (`median_step_seconds`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pnmix.bits import LayerPlan, ModelShape, window_bytes
from pnmix.configs import Answer
from pnmix.generation import cache_kwargs
from pnmix.kv_formats import EFFECTIVE_BITS
from pnmix.layerwise import AnyConfig, as_layerwise
from pnmix.prefill import PrefillState, build_cache, build_layer
from pnmix.recipes import EngineRecipe
from pnmix.static import StaticGenerator, static_method

COST_PROMPT_TOKENS = 512  # the fixed workload of measured bytes and decode throughput
COST_NEW_TOKENS = 32
# Decode throughput: timed runs of a few steps each, the median run's step time. A CPU step of a small
# model takes tens of milliseconds, a GPU step (a replayed graph) about one.
COST_REPEATS = {"cpu": 3, "cuda": 5}
COST_STEPS = {"cpu": 3, "cuda": 8}


def prompt_ids(seed: int) -> torch.Tensor:
    """The workload's prompt: COST_PROMPT_TOKENS random ids of `seed`, [1, COST_PROMPT_TOKENS] on the host."""
    return torch.randint(100, 4000, (1, COST_PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))


def median_step_seconds(step: Callable[[], object], repeats: int, steps: int, cuda: bool) -> float:
    """Seconds per decode step: two untimed steps (compile, capture, first allocations), then the
    median over `repeats` timed runs of `steps` steps each, so one slow run cannot set the figure."""
    for _ in range(2):
        step()
    run_times: list[float] = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        run_times.append((time.perf_counter() - t0) / steps)
    return statistics.median(run_times)


@torch.inference_mode()
def live_cost(model: Any, make_cache: Callable[[], Any], held_bytes: Callable[[Any], int],
              seed: int = 0) -> tuple[int, float, int | None]:
    """(bytes the cache holds, decode tokens/s, peak device bytes) of the cost workload on a cache
    that the model fills as it runs (a peer's QuantizedCache, a hybrid model's PN-Mix cache): the
    prompt of COST_PROMPT_TOKENS random ids (`measure`'s, same seed) prefilled
    into `make_cache()`, then greedy decode steps. Bytes: `held_bytes(cache)` once COST_NEW_TOKENS - 1
    new tokens went in (the last is never fed back, as in `generate`). Tokens/s as the engine times
    PN-Mix (`median_step_seconds`); the steps it times count towards those new tokens. Peak (CUDA
    only): the weights plus what the workload allocates at its peak."""
    device = model.device
    cuda = device.type == "cuda"
    kind = "cuda" if cuda else "cpu"
    ids = prompt_ids(seed).to(device)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    cache = make_cache()
    kw = cache_kwargs(model, cache)
    nxt = model(input_ids=ids, use_cache=True, **kw).logits[:, -1].argmax(-1, keepdim=True)
    fed, kv_bytes = 0, 0

    def step() -> None:
        nonlocal nxt, fed, kv_bytes
        pos = torch.tensor([[COST_PROMPT_TOKENS + fed]], device=device)
        nxt = model(input_ids=nxt, position_ids=pos, use_cache=True, **kw).logits[:, -1].argmax(-1, keepdim=True)
        fed += 1
        if fed == COST_NEW_TOKENS - 1:
            kv_bytes = held_bytes(cache)

    step_seconds = median_step_seconds(step, COST_REPEATS[kind], COST_STEPS[kind], cuda)
    while fed < COST_NEW_TOKENS - 1:
        step()
    peak = None
    if cuda:
        weights = sum(q.nbytes for q in model.parameters())
        peak = weights + int(torch.cuda.max_memory_allocated(device)) - before
    return kv_bytes, 1.0 / step_seconds, peak


@torch.inference_mode()
def measure(model: Any, plan: LayerPlan, config: AnyConfig, state: PrefillState,
        last_only: dict[str, int]) -> tuple[int, float, int | None]:
    """(bytes the cache holds, decode tokens/s, peak device bytes) on the fixed workload: a
    prompt of COST_PROMPT_TOKENS random ids (prefilled once), then COST_NEW_TOKENS new tokens.

    Bytes: `cache.nbytes()` of the config's cache built from that prefill after the new tokens
    went through its own decode-time append, one at a time (the bytes depend on the token
    counts, not on their values, and are the same in every layer). Tokens/s: on CUDA the
    static CUDA-graph path started from that cache (what serving runs), else greedy decode on
    the dynamic cache; after two untimed steps (compile, capture, allocator warm-up), the
    steps run in COST_REPEATS timed runs of COST_STEPS steps each, and tokens/s is one over the
    median of the runs' step times: a run of several steps is long enough to time, and the
    median keeps one disturbed run (another process, a clock change) out of the figure. Peak
    (CUDA only): the model's weights plus what the workload allocates at its peak, so that the
    states this engine keeps do not count.
    """
    kv_bytes = held_bytes(model, plan, config, state)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
    head_dim = state.keys[0].shape[-1]
    method = static_path_of(model, plan, config, head_dim)
    first = state.logits.argmax(-1)[None]
    cache = build_cache(model, config, [state])
    repeats, steps = COST_REPEATS["cuda" if cuda else "cpu"], COST_STEPS["cuda" if cuda else "cpu"]
    if method is not None:
        static = StaticGenerator(model, method, max_len=COST_PROMPT_TOKENS + 4 + repeats * steps)
        static.start(cache, first)
        del cache
        step_seconds = median_step_seconds(static.step, repeats, steps, cuda)
    else:
        kw = cache_kwargs(model, cache)
        ids, pos = first[:, None], torch.tensor([[state.length]], device=model.device)

        def step() -> None:
            nonlocal ids, pos
            logits = model(input_ids=ids, position_ids=pos, use_cache=True, **last_only, **kw).logits
            ids, pos = logits[:, -1].argmax(-1, keepdim=True), pos + 1

        step_seconds = median_step_seconds(step, repeats, steps, cuda)
    peak = None
    if cuda:
        weights = sum(p.nbytes for p in model.parameters())
        peak = weights + int(torch.cuda.max_memory_allocated(model.device)) - before
    return kv_bytes, 1.0 / step_seconds, peak


def static_path_of(model: Any, plan: LayerPlan, config: Answer, head_dim: int) -> str | AnyConfig | None:
    """What the static path runs for `config` (`pnmix.static.static_method`); None on the CPU and
    for an engine recipe, which decode on the batched dynamic cache. A model with sliding-window
    layers takes the static path too (its windows as `pnmix.static.StaticWindowLayer` rings, or
    where the config quantizes them `quant_window_layer`'s bag or ring of packed groups)."""
    if model.device.type != "cuda" or isinstance(config, EngineRecipe):
        return None
    return static_method(config, model.device, head_dim)


def recipe_bytes(recipe: EngineRecipe, plan: LayerPlan, kv_heads: int, head_dim: int) -> int:
    """What an engine stores of the cost workload under `recipe`: each layer's keys and values at
    their formats' effective bits (the per-tensor scales left out), a sliding-window layer its last
    window - 1 tokens. An emulated recipe's decode speed is not the engine's: it is not measured
    (throughput 0 in its score)."""
    held = plan.held(COST_PROMPT_TOKENS + COST_NEW_TOKENS - 1)
    bits = sum(n * kv_heads * head_dim * (EFFECTIVE_BITS[f.key] + EFFECTIVE_BITS[f.value])
               for n, f in zip(held, recipe.layers, strict=True))
    return int(bits // 8)


def held_bytes(model: Any, plan: LayerPlan, config: AnyConfig, state: PrefillState) -> int:
    """The bytes `config`'s cache holds after the cost workload's new tokens. Every full-attention
    layer holds the same token counts, so one layer's appends give the bytes of every layer of its
    format (a layer-wise config: one layer per distinct format, times its count); a
    sliding-window layer holds its last window - 1 tokens of keys and values, in the model's dtype
    or, where the config quantizes that window, in its layer's format (`pnmix.bits.window_bytes`)."""
    per_layer = as_layerwise(config).per_layer(len(state.keys))
    stored = as_layerwise(config).held_configs(plan.kinds)
    full = plan.full_layers
    seen = state.length + COST_NEW_TOKENS - 1
    held = plan.held(seen)
    h, _, d = state.keys[0].shape
    kv_bytes = 0
    for i in (i for i in range(len(held)) if i not in full):
        c = stored[i]
        kv_bytes += 2 * h * held[i] * d * state.keys[0].dtype.itemsize if c is None else \
            window_bytes(c, ModelShape(1, h, h, d), 1, held[i], seen).total
    full_formats = [per_layer[i] for i in full]
    for fmt in dict.fromkeys(full_formats):
        layer = build_layer(model, fmt, [state], layer_idx=full[full_formats.index(fmt)])
        k, v = state.keys[0][None, :, -1:], state.values[0][None, :, -1:]
        for _ in range(COST_NEW_TOKENS - 1):  # the last new token is never fed back, as in `generate`
            layer.append(k, v)
        kv_bytes += full_formats.count(fmt) * sum(layer.nbytes().values())
        del layer
    return kv_bytes
