"""Writes the shipped preparation of the embedded model (tuner/scoring/shipped.py says what it is).

    python -m pnmix.tuner.scoring.ship --model smollm2-135m --profile quick

Run it after a campaign that filled the cache: it reads (or builds) the evaluator's preparation and
trace, and writes them, with the GGUF's SHA-256, into tuner/scoring/prepared/<model>/.
"""

from __future__ import annotations

import argparse

from pnmix.tuner.scoring import shipped
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile


def main(argv: list[str] | None = None) -> None:
    """Ships the cached preparation of (model, profile, seed, held-out share): run the campaign first."""
    parser = argparse.ArgumentParser(prog="python -m pnmix.tuner.scoring.ship", description=main.__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--holdout", type=float, default=0.25)
    args = parser.parse_args(argv)
    ev = Evaluator(args.model, profile(args.profile), seed=args.seed, holdout=args.holdout)
    ev.prepare()
    ev.trace()
    digest = ev.gguf_sha256()
    if digest is None:
        raise SystemExit(f"error: {args.model} is not an embedded GGUF model: nothing to ship")
    out = shipped.write(args.model, ev.cache_file(), digest, ev.runs_as())
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
