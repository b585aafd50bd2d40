"""Scoring study on the embedded model (CPU): discrimination table and the proxy's rank correlation.

Scores the presets and a spread of PN-Mix configs with the full profile, records each config's
proxy KL, and prints the Spearman correlation between proxy KL and full accuracy (a good proxy
ranks them inversely: correlation near -1). Writes JSON lines to out/scoring_study.jsonl.

    .venv/bin/python benchmarks/scoring_study.py [--profile full] [--configs 21]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pnmix.config import PNMixConfig, preset
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile


def study_configs() -> dict[str, PNMixConfig]:
    configs = {name: preset(name) for name in ("fp16", "kivi2", "kivi1", "pnmix-paper", "kitty")}
    grid = [
        (2, 1, 128, 0.25, 32), (2, 1, 64, 0.5, 16), (3, 1, 128, 0.25, 32), (3, 1, 32, 0.5, 8),
        (4, 1, 128, 0.25, 32), (4, 1, 64, 0.125, 0), (3, 2, 128, 0.5, 32), (4, 2, 128, 0.25, 32),
        (2, 2, 64, 0.0, 32), (2, 2, 128, 0.0, 32), (3, 3, 128, 0.0, 0), (1, 1, 32, 0.0, 32),
        (4, 3, 128, 0.5, 16), (3, 1, 128, 0.75, 64), (2, 1, 128, 0.9, 32), (4, 4, 128, 0.0, 0),
    ]
    for b_high, b_low, g, r, sinks in grid:
        configs[f"{b_high}/{b_low} G{g} r{r} s{sinks}"] = PNMixConfig(
            b_high=b_high, b_low=b_low, group_size=g, salient_ratio=r, n_sink=sinks, residual_len=128)
    return configs


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # average ranks over ties
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="full")
    parser.add_argument("--configs", type=int, default=21)
    parser.add_argument("--out", default="out/scoring_study.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ev = Evaluator("smollm2-135m", profile(args.profile), seed=0, progress=lambda m: None)
    ev.prepare()
    print(f"prepared in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for name, cfg in list(study_configs().items())[: args.configs]:
        t = time.perf_counter()
        proxy = ev.proxy(cfg)
        proxy_s = time.perf_counter() - t
        score = ev.evaluate(cfg)
        row = {"name": name, "proxy_kl": proxy, "proxy_s": proxy_s, **score.to_dict()}
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name:28s} bits {score.key_bits:6.3f} acc {score.accuracy:.3f} parts "
              + " ".join(f"{k}={v:.2f}" for k, v in score.parts.items())
              + f" fidKL {score.fidelity_kl:.4f} proxy {proxy:.4f} ({proxy_s:.2f}s) {score.seconds:.0f}s", flush=True)
    rho = spearman([r["proxy_kl"] for r in rows], [r["accuracy"] for r in rows])
    total = time.perf_counter() - start
    print(f"Spearman(proxy KL, accuracy) over {len(rows)} configs: {rho:.3f}; total {total:.0f} s")


if __name__ == "__main__":
    main()
