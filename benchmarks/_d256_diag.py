"""Where the time goes at head dim 256 (Gemma 3 shape 4/1 heads) vs 128, same shape otherwise.

Gluon: the split kernel alone and the combine alone, under the planned launch and with forced split
counts; the tail programs alone (packed groups set to 0). Triton: registers/spills of the compile
(Triton 3.6 on the GPU, via compile_offline + cuobjdump)."""
import dataclasses, functools, json, os, subprocess, sys, tempfile
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _d256_probe as P
from pnmix.kernels import decode
from pnmix.kernels.gluon import launch as GL

out_dir = os.environ.get("OUT", ".")
bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
res = {"regs": {}, "rows": []}

def cuobj(c):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    r = subprocess.run([f"{bindir}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
    return " ".join(l.strip() for l in r.stdout.splitlines() if "REG" in l) or (r.stdout + r.stderr)[-300:]

for d in (128, 256):
    for name, (bl, bh, ratio, g, ns, rc, vb, vg) in P.CONFIGS.items():
        nsal = 2 * round(ratio * d / 2) if bh > bl else 0
        for kind in ("triton", "gluon", "gluon-3slot"):
            try:
                c = (decode.compile_offline(d, g, bl, bh, nsal, vb, vg, 4, activation="*fp16") if kind == "triton" else
                     GL.compile_offline(d, g, bl, bh, nsal, vb, vg, 4, activation="*fp16", value_slots=3 if "3" in kind else 2))
                res["regs"][f"d{d} {name} {kind}"] = cuobj(c)
            except Exception as e:
                res["regs"][f"d{d} {name} {kind}"] = f"FAILED {type(e).__name__}: {str(e)[:500]}"
            print(f"regs d{d} {name} {kind}: {res['regs'][f'd{d} {name} {kind}']}", flush=True)

gen = torch.Generator(device="cuda").manual_seed(1)
t = P.time_events
for d in (128, 256):
    P.D = d
    for name in P.CONFIGS:
        cfg = P.CONFIGS[name]
        for bsz, ctx in ((1, 8192), (8, 32768)):
            cache, q, k, v, sal, ng, r = P.build(cfg, bsz, ctx, gen, "cuda")
            scale = d ** -0.5
            row = {"d": d, "config": name, "batch": bsz, "ctx": ctx}
            sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q.view(bsz, P.HQ, 1, d), k, v,
                                     scale=scale, enable_gqa=True)
            row["sdpa_us"] = t(sdpa)
            row["triton_us"] = t(functools.partial(decode.decode_attention, q, cache, scale))
            o = torch.empty_like(q)
            for label, splits in (("planned", None), ("s1", 1), ("s4", 4), ("s16", 16)):
                plan = GL.plan_launch(q, cache, splits)
                sl = GL.split_launch(q, cache, scale, plan)
                row[f"gluon_{label}"] = {"splits": plan.num_splits, "gps": plan.groups_per_split, "n_tail": plan.n_tail,
                                         "split_us": t(sl.run), "combine_us": t(functools.partial(sl.combine, o)),
                                         "total_us": t(functools.partial(GL.decode_attention, q, cache, scale, splits, out=o))}
            # tail only: no packed groups held
            empty = dataclasses.replace(cache, n_groups=torch.zeros_like(cache.n_groups))
            plan = GL.plan_launch(q, empty)
            sl = GL.split_launch(q, empty, scale, plan)
            row["gluon_tail_only_split_us"] = t(sl.run)
            # packed only: no sinks/residual held
            nofp = dataclasses.replace(cache, sink_len=torch.zeros_like(cache.sink_len), res_len=torch.zeros_like(cache.res_len))
            sl = GL.split_launch(q, nofp, scale, GL.plan_launch(q, nofp))
            row["gluon_packed_only_split_us"] = t(sl.run)
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            del cache, q, k, v
            torch.cuda.empty_cache()
json.dump(res, open(os.path.join(out_dir, "d256_diag.json"), "w"), indent=1)
