"""Experiment (not wired into the tuner): a short teacher-forced replay as the multi-fidelity proxy.

Greedy fp16 trajectory of `total` tokens after the proxy's prompt; everything but the last `tail`
tokens is the prefill (quantized at once, as long contexts are), the tail is replayed through the
PN-Mix cache in 16-token chunks; proxy = mean KL(p_fp16 || p_quant) over the tail. Compared, by
Spearman correlation, with the full-profile accuracies of the scoring-study table in RESULTS.md.

    .venv/bin/python benchmarks/proxy_replay_experiment.py [tail=64] [total=448]
"""
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scoring_study import spearman, study_configs

from pnmix import models
from pnmix.cli import chat_ids
from tuner import fidelity

acc = {}
for line in open(Path(__file__).parent / "RESULTS.md"):
    m = re.match(r"\| ([^|]+?) \| (\d+\.\d+) \| (\d\.\d+) \|", line)
    if m:
        acc[m.group(1)] = float(m.group(3))
cfgs = study_configs()
loaded = models.load("smollm2-135m")
model, tok = loaded.model, loaded.tokenizer
torch.manual_seed(0)
ids = chat_ids(tok, fidelity.FIDELITY_PROMPTS[-1])["input_ids"]
tail = int(sys.argv[1]) if len(sys.argv) > 1 else 64
total = int(sys.argv[2]) if len(sys.argv) > 2 else 448
t0 = time.perf_counter()
cont = fidelity.trajectory(model, ids, total)
print("trajectory", round(time.perf_counter() - t0, 1), "s", flush=True)
prefix = torch.cat([ids, torch.tensor([cont[:-tail]])], dim=1)
last = cont[-tail:]
ref = fidelity.reference_logits(model, prefix, last)
rows = []
for name, cfg in cfgs.items():
    key = name if name in acc else None
    if key is None:
        alt = [k for k in acc if k.replace(" ", "") == name.replace(" ", "")]
        key = alt[0] if alt else None
    if key is None:
        print("skip", name)
        continue
    t = time.perf_counter()
    f = fidelity.replay(model, prefix, last, cfg, ref)
    rows.append((name, f.mean_kl, acc[key], time.perf_counter() - t))
    print(f"{name:24s} replayKL {f.mean_kl:.4f} acc {acc[key]:.3f} {rows[-1][3]:.2f}s", flush=True)
print("Spearman", round(spearman([r[1] for r in rows], [r[2] for r in rows]), 3), "n", len(rows))
