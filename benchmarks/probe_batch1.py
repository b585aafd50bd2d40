"""Where the Gluon decode kernel's time goes at one shape (default batch 1, 32K tokens).

    python benchmarks/probe_batch1.py [--shape 1x32768] [--out DIR]

Times, as CUDA graph replays (do_bench median, L2 flushed; as `bench_decode.py`), on the
`pnmix-paper` cache of `bench_decode.build`:
- the whole call (split kernel + combine) for the default plan and for other split counts;
- the split kernel alone and the combine alone;
- the split kernel with parts of the work removed through the device lengths (same grid): no
  sinks and residual (the tail programs have nothing to do), no packed groups (only the tail
  programs work), neither (launch, prologue, the first block's copies and the partial stores);
- the call with 1, 2 and 5 tail programs, and a graph of one tiny kernel (the timing's floor);
- `kernels/decode_mma_prev.py` if present (an earlier version staged by hand, untracked): an A/B
  in one run.
The differences say which program is the long pole. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import D, build, log, time_us  # noqa: E402
from kernels import decode_mma  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x32768")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    bsz, ctx = (int(x) for x in args.shape.split("x"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    fh = open(Path(args.out) / f"probe_{bsz}x{ctx}.log", "w")
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache, q, _, _, info = build(bsz, ctx, gen)
    scale = D**-0.5
    out = torch.empty_like(q)
    default = decode_mma.split_launch(q, cache, scale, None)
    n_parts, n_tail = default.plan["n_parts"], default.plan["n_tail"]
    n_split = n_parts - n_tail
    log(f"[{bsz}x{ctx}] groups {info['n_groups']} residual {info['residual']} default grid {default.grid}, "
        f"{n_tail} tail programs per KV head ({decode_mma.resident_programs(q.device, None, 1)} resident)", fh)
    zero = torch.zeros_like(cache.sink_len)
    rows = {}

    def record(name: str, fn) -> None:
        t = time_us(fn)["graph"]
        rows[name] = t
        log(f"  {name:<40} {t:8.1f} us", fh)

    record("call, default plan", lambda: decode_mma.decode_attention_mma(q, cache, scale, out=out))
    try:  # an earlier version of the module, staged by hand as an untracked file for an A/B in one run
        from kernels import decode_mma_prev
    except ImportError:
        decode_mma_prev = None
    if decode_mma_prev is not None:
        record("call, previous module", lambda: decode_mma_prev.decode_attention_mma(q, cache, scale, out=out))
    for k in (1, 2, 5):
        record(f"call, {k} tail programs",
               lambda k=k: decode_mma.decode_attention_mma(q, cache, scale, out=out, n_tail=k))
        if decode_mma_prev is not None:
            record(f"call, {k} tail programs, previous module",
                   lambda k=k: decode_mma_prev.decode_attention_mma(q, cache, scale, out=out, n_tail=k))
    record("split kernel", lambda: default.run())
    record("combine", lambda: decode_mma.combine(default, out))
    for name, changes in (("split kernel, no sinks/residual", dict(sink_len=zero, res_len=zero)),
                          ("split kernel, no packed groups", dict(n_groups=zero)),
                          ("split kernel, nothing", dict(sink_len=zero, res_len=zero, n_groups=zero))):
        launch = decode_mma.split_launch(q, dataclasses.replace(cache, **changes), scale, n_split, n_tail=n_tail)
        record(name, lambda launch=launch: launch.run())
    for splits in (n_split // 4, n_split // 2, n_split * 3 // 4, n_split * 2):
        if splits >= 1:
            record(f"call, {splits} splits",
                   lambda s=splits: decode_mma.decode_attention_mma(q, cache, scale, num_splits=s, out=out))
    tiny = torch.zeros(1, device="cuda")
    record("graph of one one-element kernel (the floor)", lambda: tiny.add_(1.0))
    floor = do_bench(lambda: None, warmup=25, rep=200, return_mode="median") * 1e3
    log(f"  do_bench of a no-op (host floor, not graph): {floor:.1f} us", fh)
    line = json.dumps({"shape": [bsz, ctx], "grid": list(default.grid), "us": rows})
    log(line, fh)


if __name__ == "__main__":
    main()
