"""Preparations shipped with the package: the embedded model's units for `make run`, ready to check.

On a CPU most of a first campaign's fixed cost is its preparation (tuner/scoring/evaluate.py): candidate
items answered by the unquantized model until enough are right (four candidates generated a kept
item), fp16 trajectories generated a token at a time, the proxy trace's greedy continuation, and
the allocator's sensitivity tables on that trace. For the embedded model and the campaign `make run`
starts, these are computed once by the project (`python -m pnmix.tuner.scoring.ship`, after a run that
filled the cache) and shipped in `tuner/scoring/prepared/<model>/`, one file per preparation, named as the
evaluator's cache file (profile, its knobs and held-out share, seed, preparation version) and
holding the SHA-256 of the GGUF it was computed from.

An evaluator whose cache lacks the preparation takes a shipped one only where the GGUF's SHA-256
matches and the model runs as it was computed (float32 on the CPU), and checks it before use, at
a fraction of the cost of building it:
- items: the unquantized model answers every shipped item right (one batched decode of the kept
  items instead of the filtering of their candidates);
- trajectories: the unquantized model's argmax agrees with at least `MIN_AGREEMENT` of the shipped
  tokens, on the teacher-forced pass the fidelity part needs anyway (no token-by-token generation);
- the proxy's trace: only its continuation tokens are shipped; the Q/K/V are recorded here, by one
  teacher-forced pass;
- sensitivity tables: the proxy's figures on that trace, taken as shipped (they steer the
  allocator's proposals; every proposal is then scored by real inference here).
A shipped preparation that fails its check is dropped with one line on stderr and built here as
without one. Once checked, it is written to the cache like a built one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).parent / "prepared"  # a data folder beside this module
FORMAT = 1
MIN_AGREEMENT = 0.99  # a CPU whose float sums differ may flip a near-tie; more than 1% flips is another model


@dataclass
class Shipped:
    """One shipped preparation (the cache file's contents), the trace's tokens and the tables."""

    preparation: dict[str, Any]  # as the evaluator's cache file holds it
    trace_tokens: dict[str, list[int]] = field(default_factory=dict)  # trace file name -> continuation
    tables: dict[str, list[list[float]]] = field(default_factory=dict)  # table file name -> rows


def path_for(model: str, cache_name: str) -> Path:
    return FOLDER / model.replace("/", "_") / cache_name


def find(model: str, cache_name: str, gguf_sha256: str | None, runs_as: str) -> Shipped | None:
    """The shipped preparation for this cache file name, where it was computed from this GGUF and
    the model runs as it was computed (`runs_as`, e.g. 'cpu float32'); else None."""
    path = path_for(model, cache_name)
    if gguf_sha256 is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("gguf_sha256") != gguf_sha256 or data.get("runs_as") != runs_as:
            return None
        return Shipped(data["preparation"], {str(k): [int(t) for t in v] for k, v in data["trace_tokens"].items()},
                       {str(k): [[float(x) for x in r] for r in rows] for k, rows in data["tables"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"warning: shipped preparation {path} is unreadable ({type(exc).__name__}); building it here",
              file=sys.stderr, flush=True)
        return None


def agreement(reference_logits: Any, tokens: list[int]) -> float:
    """Share of `tokens` that are the argmax of the reference logits predicting them."""
    import torch

    if not tokens:
        return 1.0
    return float((reference_logits.argmax(-1).cpu() == torch.tensor(tokens)).float().mean())


def write(model: str, cache_file: Path, gguf_sha256: str, runs_as: str) -> Path:
    """Packs what the evaluator's cache holds for `cache_file` (the preparation, the trace's tokens
    and the sensitivity tables beside it) into the shipped folder."""
    preparation = json.loads(cache_file.read_text())
    folder = cache_file.parent
    tokens = {p.name.removesuffix(".tokens.json"): json.loads(p.read_text())
              for p in sorted(folder.glob("trace-*.tokens.json"))}
    tables = {p.name: json.loads(p.read_text()) for p in sorted(folder.glob(f"sensitivity-{cache_file.stem}-*.json"))}
    out = path_for(model, cache_file.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"format": FORMAT, "gguf_sha256": gguf_sha256, "runs_as": runs_as,
                               "preparation": preparation, "trace_tokens": tokens, "tables": tables},
                              separators=(",", ":")))
    return out
