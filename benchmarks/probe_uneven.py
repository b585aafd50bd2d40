"""Packed splits of unequal size: the last split (launched last) with fewer groups (`split_groups`).

    python benchmarks/probe_uneven.py 32x32768 32x8192 110x8192

For each shape, the call (split kernel + combine, CUDA graph replay as `bench_decode.py`) with 1
and 2 tail programs launched first and the even split size plus 0-3 groups per split (the split
count kept), so the last split holds fewer; and with the planned tail programs launched last
(`tail_last`), even and +1. Writes $OUT/probe_uneven.log.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import D, build, log, time_us  # noqa: E402
from kernels import decode_mma  # noqa: E402


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    fh = open(out_dir / "probe_uneven.log", "w")
    rows = {}
    for shape in sys.argv[1:]:
        bsz, ctx = (int(x) for x in shape.split("x"))
        torch.cuda.empty_cache()
        cache, q, *_ = build(bsz, ctx, torch.Generator(device="cuda").manual_seed(7))
        out = torch.empty_like(q)
        base = decode_mma.split_launch(q, cache, D**-0.5, None)
        planned, n_parts, n_tail = (base.plan[k] for k in ("groups_per_split", "n_parts", "n_tail"))
        ng_cap = cache.k_low.shape[2]
        n_split = n_parts - n_tail
        gps = -(-ng_cap // n_split)  # even splits
        log(f"[{shape}] grid {base.grid} groups/split {planned} (even {gps}) splits {n_split} tail {n_tail} "
            f"ng_cap {ng_cap}", fh)
        variants = [(False, k, gps + e) for k in (1, 2) for e in (0, 1, 2, 3)]
        variants += [(True, n_tail, gps + e) for e in (0, 1)]
        for tail_last, k, g in variants:
            if -(-ng_cap // g) != n_split or (k != n_tail and bsz == 1):
                continue
            launch = decode_mma.split_launch(q, cache, D**-0.5, None, n_tail=k, tail_last=tail_last)
            launch = launch.with_plan(groups_per_split=g)

            def call(launch=launch, out=out):
                launch.run()
                decode_mma.combine(launch, out)

            t = time_us(call)["graph"]
            last = ng_cap - (n_split - 1) * g
            where = "last" if tail_last else "first"
            rows[f"{shape} tail {k} {where} gps {g}"] = t
            log(f"  tail programs {k} launched {where:<5} groups/split {g:3d} (last split {last:3d}): {t:7.1f} us", fh)
    log(json.dumps(rows), fh)


if __name__ == "__main__":
    main()
