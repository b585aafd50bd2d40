"""GPU pre-flight for a campaign: per-forward cost of the tuner's workloads on the embedded model's shape.

It needs no model weights, only the embedded model's tokenizer saved as a directory, so it can
check a GPU host and size a campaign before the model is installed there:
  1. writes a tiny random Llama with the embedded tokenizer (for a smoke campaign on CUDA), and
  2. times, on a random-weight model of SmolLM2-135M's exact shape (bf16, CUDA), the per-item
     workloads of the reference scoring path: a 32-token greedy generation after a 512-token
     prompt (one item's answer, the cost workload) and a 512-token teacher-forced replay in
     16-token chunks (one fidelity trajectory), for fp16 keys, pnmix-paper on the Triton kernels
     and pnmix-paper on the torch path.

    python benchmarks/gpu_probe.py --tokenizer DIR --tiny-out DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pnmix import backend
from pnmix.config import preset
from pnmix.generation import generate
from tuner import fidelity

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_theta=100000.0)


def write_tiny(tokenizer_dir: str, out: str) -> None:
    """The tests' tiny Llama (tests/tiny.py), written with the given tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import save_tiny_llama

    save_tiny_llama(out, AutoTokenizer.from_pretrained(tokenizer_dir))


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up: Triton compiles on first use
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def probe() -> list[dict[str, object]]:
    config = AutoConfig.for_model("llama", **SMOLLM2_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device="cuda", dtype=torch.bfloat16).eval()
    prompt = torch.randint(100, 4000, (1, 512), device="cuda")
    continuation = torch.randint(100, 4000, (512,)).tolist()
    reference = fidelity.reference_logits(model, prompt, continuation)
    rows = []
    for label, name, path in (("fp16", "fp16", "torch"), ("pnmix-paper", "pnmix-paper", "triton"),
                              ("pnmix-paper", "pnmix-paper", "torch")):
        backend.set_backend(path)
        cfg = preset(name)
        gen_s = timed(lambda cfg=cfg: generate(model, prompt, cfg, max_new_tokens=32, min_new_tokens=32))
        replay_s = timed(lambda cfg=cfg: fidelity.replay(model, prompt, continuation, cfg, reference))
        rows.append({"config": label, "backend": path, "generate_512+32_s": round(gen_s, 3),
                     "ms_per_decode_step": round(gen_s / 32 * 1000, 1), "replay_512_s": round(replay_s, 3)})
        print(json.dumps(rows[-1]), flush=True)
    backend.set_backend(None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--tiny-out", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    write_tiny(args.tokenizer, args.tiny_out)
    rows = probe()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
