"""The scoring engine's decode step on a hybrid model against a full-attention one.

Gemma 3 270M's shape (18 layers, 4 query heads, 1 KV head, head_dim 256, window 512; random bf16
weights: performance only) decodes a batch through `ScoringEngine.greedy`, against the same shape
with every layer full attention, which holds at least the hybrid's bytes; on two paths: the batched
dynamic cache (`pnmix.cache`'s `BatchWindowLayer` for each sliding layer) and the static CUDA-graph
path (`pnmix.static`'s `StaticWindowLayer` rings), what a trial on the GPU runs. The step is the
difference of two decodes of different lengths over the number of extra steps, so the prefill and
the cache's construction cancel. On the static path each graph key (`StaticGenerator.arm`: a flush,
a window start entering a group, the length bucket) costs one eager step and one capture in every
decode that meets it, so its two decodes are 145 and 273 steps: past the first 128, every row has
flushed its residual and every window start has entered a group, so the longer decode meets no
key the shorter one has not (unless a flush and an entry fall on one step only in it), and the 128
steps between them are replays: a whole residual cycle and a whole group of window starts.

    python -P benchmarks/hybrid_step.py --batch 32 --prompt 1024 [--config fp16] [--windows]

`--windows` quantizes the sliding layers' windows too, under the config (a layer-wise config's
`windows`: on the static path the decode kernels' bags of packed groups, `StaticQuantBagWindowLayer`).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from pnmix.config import preset
from pnmix.families import plan_of_config
from pnmix.layerwise import LayerwiseConfig
from pnmix.tuner.scoring import cost
from pnmix.tuner.scoring.engine import ScoringEngine

SHAPE = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
             sliding_window=512, tie_word_embeddings=True)


def model_of(hybrid: bool) -> Any:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    n = SHAPE["num_hidden_layers"]
    kinds = ["full_attention" if (i % 6 == 5 or not hybrid) else "sliding_attention" for i in range(n)]
    config = Gemma3TextConfig(**SHAPE, layer_types=kinds)
    config.use_sliding_window = hybrid  # the window stays set (Gemma 3 builds its sliding mask), unused
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()


def step_ms(model: Any, config_name: str, batch: int, prompt: int, short: int, long: int, windows: bool) -> float:
    engine = ScoringEngine(model, None)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (1, prompt - 8 * (i % 4)), generator=gen) for i in range(batch)]
    states = engine._prefill(prompts)
    config: Any = preset(config_name)
    sliding = plan_of_config(model.config).window_layers
    if windows and sliding:
        config = LayerwiseConfig(config, windows=sliding)
    engine.greedy(config, states, 4, stop=False)  # warm: allocator, kernels
    took = {}
    for n in (short, long):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.greedy(config, states, n, stop=False)
        torch.cuda.synchronize()
        took[n] = time.perf_counter() - t0
    return 1e3 * (took[long] - took[short]) / (long - short)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--config", default="fp16", help="a preset (fp16, pnmix-paper, kivi2, ...)")
    ap.add_argument("--windows", action="store_true", help="quantize the sliding layers' windows too")
    args = ap.parse_args()
    static_path_of = cost.static_path_of
    lengths = {"dynamic": (17, 81), "static": (145, 273)}
    ms: dict[tuple[str, bool], float] = {}
    for hybrid in (True, False):
        model = model_of(hybrid)
        for path in ("dynamic", "static"):
            cost.static_path_of = static_path_of if path == "static" else (lambda *a, **k: None)
            ms[path, hybrid] = step_ms(model, args.config, args.batch, args.prompt, *lengths[path], args.windows)
        del model
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.config}{', windows quantized' if args.windows else ''}")
    for path in ("dynamic", "static"):
        hyb, full = ms[path, True], ms[path, False]
        print(f"  {path}: hybrid {hyb:.1f} ms a step, all full attention {full:.1f} ms, ratio {hyb / full:.2f}")


if __name__ == "__main__":
    main()
