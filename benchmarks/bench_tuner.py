"""Searches replayed against a ground-truth sweep: how close to the true front, for how many seconds.

    python benchmarks/bench_tuner.py --out DIR                      # >= 20 seeds, every strategy
    python benchmarks/bench_tuner.py --seeds 2 --quick --out DIR    # the CI run

The evaluator looks every config's score up in the sweep (`pnmix sweep`, committed under
benchmarks/ground_truth/) and charges it the seconds that config took there, so a search of
hundreds of trials replays on the CPU in seconds. A config scored twice is charged once (the
campaign reuses scores; the single-study strategies look them up again). For every strategy and
seed it records, after each charged evaluation, the hypervolume of the front of what was scored
within each budget (reference point: the budget's bits and accuracy 0) as a fraction of the true
front's. Strategies:
- campaign: the product's campaign with its defaults (tuner.search.campaign.CampaignRunner on a real
  SQLite database: one TPE study per budget, budgets from the lowest up, every score shared with
  every budget it fits, warm starts including each bit pair's config that fills the budget, a
  neighbour of a re-proposed config scored in its place), 30 trials a budget as `pnmix tune`, without the proxy screen
  (a sweep holds no proxy values); campaign-N: N trials a budget; campaign+racing: with racing;
- random, tpe, nsga2, gp: one Optuna study over the whole space (accuracy up, key bits down);
  its front serves every budget;
- grid: the brute-force sweep in the space's enumeration order (bit pair, G, r, sinks);
- tpe+racing: tpe, each candidate raced (tuner/search/racing.py) against the front of the fully scored
  points of no more bits on a growing share of its items; a stopped candidate's partial accuracy
  is what the sampler is told.
A rung is charged its share of each part's units times that part's seconds in the sweep (items,
fidelity), so a race that stops early pays for what it scored; a per-evaluation fixed cost, if a
real rung has one, is not charged (this favours racing).
Writes bench_tuner.json and bench_tuner.png to --out and prints the tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna

from pnmix.bits import LayerPlan, key_bits
from pnmix.config import PNMixConfig
from pnmix.tuner.errors import EvalError
from pnmix.tuner.search import racing
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.sweep import config_key, front, hypervolume, read_sweep

DATASET = Path(__file__).parent / "ground_truth" / "smollm2-135m-pnmix-full-seed0.jsonl.gz"
BUDGETS = (3.0, 2.5, 2.25, 2.0, 1.5)
SHARES = (0.025, 0.05, 0.1, 0.2, 0.3)  # of the sweep's evaluation seconds, where the tables read
TARGET = 0.98
GP_TRIALS = 100
STRATEGIES = ("campaign", "campaign+racing", "random", "tpe", "nsga2", "gp", "grid", "tpe+racing")
CAMPAIGN_TRIALS = 30  # a budget: the default of `pnmix tune`


class Replay:
    """A lookup evaluator with a ledger: what was scored, in order, and what it cost."""

    def __init__(self, records: list[dict[str, Any]], head_dim: int, profile: str, seed: int) -> None:
        self.by_key = {config_key(r["config"]): r for r in records}
        self.head_dim, self.model_name, self.seed = head_dim, "replay", seed
        self.num_layers = 30  # the ground truth is of uniform configs: any layer count gives their bits
        self.plan = LayerPlan.full(30)
        self.profile = SimpleNamespace(name=profile)
        self.ledger: list[tuple[str, float, bool]] = []  # (config key, seconds charged, fully scored)
        self.full: set[str] = set()
        self.paid: dict[str, float] = {}  # seconds charged so far per config (rungs of a race add up)
        first = records[0]["units"]
        self.counts = {name: len(u) for name, u in first.items()}

    def record(self, config: PNMixConfig) -> dict[str, Any]:
        key = config_key(config)
        if key not in self.by_key:
            raise EvalError(f"config not in the sweep: {key}")
        return self.by_key[key]

    def charge(self, config: PNMixConfig, upto: dict[str, int] | None = None) -> dict[str, Any]:
        """Charges scoring `config` on the first `upto[part]` units of each part (None: all of them),
        less what its earlier rungs paid; a config fully scored before costs nothing."""
        r = self.record(config)
        key = config_key(config)
        if key in self.full:
            return r
        cost = self.cost(r, upto)
        self.ledger.append((key, max(0.0, cost - self.paid.get(key, 0.0)), upto is None))
        self.paid[key] = max(cost, self.paid.get(key, 0.0))
        if upto is None:
            self.full.add(key)
        return r

    def cost(self, r: dict[str, Any], upto: dict[str, int] | None) -> float:
        """The sweep's seconds of `r`, or of its first `upto` units: each part's seconds (items,
        fidelity; the rest spread over both) times the share of its units."""
        if upto is None:
            return float(r["seconds"])
        timings = r.get("timings") or {}
        parts = {"fidelity": ["fidelity"], "items": [n for n in self.counts if n != "fidelity"]}
        timed = {k: float(timings[k]) for k in parts if k in timings and parts[k]}
        if not timed:  # no timings: the share of all units
            return r["seconds"] * sum(upto.values()) / sum(self.counts.values())
        scale = r["seconds"] / sum(timed.values())  # overheads outside the parts, spread in proportion
        return sum(scale * secs * sum(upto[n] for n in parts[k]) / sum(self.counts[n] for n in parts[k])
                   for k, secs in timed.items())

    def unit_counts(self, which: str = "search") -> dict[str, int]:
        return dict(self.counts) if which == "search" else {}  # the recorded scores hold no held-out units

    def rung(self, config: PNMixConfig, upto: dict[str, int], have: Any = None) -> Any:
        from pnmix.tuner.scoring.score import Rung

        r = self.charge(config, upto)
        return Rung(units={name: list(r["units"][name][:n]) for name, n in upto.items()}, agreements=[],
                    seconds=self.cost(r, upto))

    def evaluate(self, config: PNMixConfig, measure: bool = True, have: Any = None) -> Any:
        from pnmix.tuner.scoring.score import Score

        r = self.charge(config)
        return Score(config=config.to_dict(), accuracy=r["accuracy"], parts=r["parts"],
                     fidelity_agreement=r["fidelity_agreement"], fidelity_kl=r["fidelity_kl"],
                     key_bits=r["key_bits"], kv_bytes=0, decode_tokens_per_s=0.0, peak_memory_bytes=None,
                     backend="replay", device="replay", versions={}, seconds=r["seconds"], profile="full",
                     accuracy_se=r["accuracy_se"], parts_se=r["parts_se"], units=r["units"], timings={})

    def proxy(self, config: PNMixConfig) -> float:
        raise EvalError("a sweep holds no proxy values: replay campaigns with multi_fidelity off")


def curve(replay: Replay, total_seconds: float) -> dict[str, Any]:
    """Hypervolume fraction at each budget after each fully scored evaluation, by seconds spent."""
    truth = {b: hypervolume([(r["key_bits"], r["accuracy"]) for r in front(replay.by_key.values(), b)], b)
             for b in BUDGETS}
    seconds, points = 0.0, []
    xs: list[float] = []
    ys: dict[float, list[float]] = {b: [] for b in BUDGETS}
    for key, s, full in replay.ledger:
        seconds += s
        if full:
            r = replay.by_key[key]
            points.append((r["key_bits"], r["accuracy"]))
        xs.append(seconds / total_seconds)
        for b in BUDGETS:
            ys[b].append(hypervolume(points, b) / truth[b])
    return {"share": xs, "fraction": {f"{b:g}": ys[b] for b in BUDGETS}, "evaluations": len(replay.full),
            "rungs": sum(1 for _, _, full in replay.ledger if not full)}


def at_share(c: dict[str, Any], budget: float, share: float) -> float:
    """The fraction reached once `share` of the sweep's seconds is spent (0 before the first)."""
    best = 0.0
    for x, y in zip(c["share"], c["fraction"][f"{budget:g}"], strict=True):
        if x > share + 1e-12:
            break
        best = y
    return best


def share_to_reach(c: dict[str, Any], target: float) -> float:
    """Share of the sweep's seconds after which every budget is at >= target (inf: never)."""
    for i, x in enumerate(c["share"]):
        if all(c["fraction"][f"{b:g}"][i] >= target for b in BUDGETS):
            return x
    return math.inf


# -- strategies ---------------------------------------------------------------------------------

def single_study(sampler: optuna.samplers.BaseSampler, space: SearchSpace, replay: Replay, n_trials: int,
                 race: bool = False) -> None:
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    scored: list[dict[str, Any]] = []  # fully scored records
    stopped: dict[str, float] = {}  # raced and stopped: the partial accuracy

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        cfg = space.suggest(trial)
        bits = key_bits(cfg, replay.head_dim).total
        if not race:
            r = replay.charge(cfg)
            return r["accuracy"], bits
        r = replay.record(cfg)
        key = config_key(cfg)
        if key in replay.full:  # seen before: no charge
            return r["accuracy"], bits
        if key in stopped:
            return stopped[key], bits
        for share in racing.RUNGS[:-1]:  # the last rung is the full score: nothing left to save
            verdict = racing.judge(r["units"], bits, [(p["key_bits"], p["units"]) for p in front(scored)], share)
            if verdict.stop:
                replay.charge(cfg, racing.rung_sizes(replay.counts, share))
                stopped[key] = verdict.accuracy
                return verdict.accuracy, bits  # the partial score (an estimate on fewer items)
        replay.charge(cfg)  # the rungs are nested: all of them cost one full score
        scored.append(r)
        return r["accuracy"], bits

    study.optimize(objective, n_trials=n_trials)


def run_campaign(space: SearchSpace, replay: Replay, seed: int, trials: int, race: bool = False) -> None:
    """The product's campaign over the replay evaluator, `trials` a budget."""
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.session import find_or_create_campaign, open_db
    from pnmix.tuner.search.spec import CampaignSpec

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        db = open_db(f"sqlite:///{tmp}/replay.db", upgrade=True)
        spec = CampaignSpec(model="smollm2-135m", budgets=BUDGETS, n_trials=trials, method=space.method,
                            profile="full", seed=seed, multi_fidelity=False, racing=race, space=space)
        cid = find_or_create_campaign(db, spec)
        runner = CampaignRunner(db, db.url, cid, spec, replay)
        runner.collect_garbage = False
        runner.run()
        db.engine.dispose()


def run(strategy: str, space: SearchSpace, replay: Replay, seed: int, n_trials: int) -> None:
    samplers: dict[str, Callable[[], optuna.samplers.BaseSampler]] = {
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=20),
        # r exists only when b_high > b_low: GP models the rest and samples r at random.
        "gp": lambda: optuna.samplers.GPSampler(seed=seed, n_startup_trials=10, warn_independent_sampling=False),
    }
    if strategy.startswith("campaign"):  # "campaign" (the default trial count), "campaign-N", "...+racing"
        name, race = strategy.removesuffix("+racing"), strategy.endswith("+racing")
        run_campaign(space, replay, seed, trials=int(name.partition("-")[2] or CAMPAIGN_TRIALS), race=race)
    elif strategy == "grid":
        for cfg in space.configs():
            replay.charge(cfg)
    elif strategy == "tpe+racing":
        single_study(samplers["tpe"](), space, replay, n_trials, race=True)
    else:
        # GP refits per trial (~0.5 s at 100 trials): 100 trials cover the 10% point of the sweep's seconds.
        single_study(samplers[strategy](), space, replay, n_trials if strategy != "gp" else min(n_trials, GP_TRIALS))


def head_dim_of(records: list[dict[str, Any]]) -> int:
    """The head dimension under which the recorded key bits follow from the formula."""
    r = records[0]
    for d in (32, 64, 80, 96, 128, 256):
        if math.isclose(key_bits(PNMixConfig.from_dict(r["config"]), d).total, r["key_bits"], rel_tol=1e-9):
            return d
    raise EvalError("no head dimension reproduces the sweep's key bits")


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(4 * len(BUDGETS), 3.6), sharey=True)
    grid = [i / 400 for i in range(1, 161)]  # 0.25% .. 40% of the sweep's seconds
    for ax, b in zip(axes, BUDGETS, strict=True):
        for i, (name, curves) in enumerate(results.items()):
            med = [statistics.median(at_share(c, b, x) for c in curves) for x in grid]
            ax.plot([100 * x for x in grid], med, label=name, color=f"C{i}")
        ax.axhline(TARGET, color="gray", linestyle=":", linewidth=1)
        ax.axvline(10, color="gray", linestyle=":", linewidth=1)
        ax.set_title(f"budget {b:g} bits", fontsize=10)
        ax.set_xlabel("% of the sweep's evaluation seconds")
        ax.set_ylim(0.5, 1.01)
    axes[0].set_ylabel("hypervolume / true front's (median)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(DATASET))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--trials", type=int, default=300, help="trials of the single-study strategies")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--quick", action="store_true", help="CI: fewer trials, no GP")
    ap.add_argument("--resume", action="store_true", help="keep the curves of strategies already run into --out")
    ap.add_argument("--out", default="out/bench_tuner")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep = read_sweep(args.dataset)
    records = sweep.records
    space = SearchSpace(method=sweep.header["method"])
    head_dim = head_dim_of(records)
    total = sum(r["seconds"] for r in records)
    strategies = [s for s in args.strategies.split(",") if s]
    trials = args.trials
    if args.quick:
        strategies = [s for s in strategies if s not in ("gp",)]
        trials = min(trials, 120)
    print(f"{sweep.header['model']}: {len(records)} configs, {total:.0f} evaluation seconds in the sweep; "
          f"{args.seeds} seeds, {trials} trials a single-study search")
    results: dict[str, list[dict[str, Any]]] = {}
    wall: dict[str, float] = {}
    for name in strategies:
        done = out / f"curves-{name}.json"  # kept per strategy, so a rerun with --resume skips it
        if args.resume and done.is_file():
            kept = json.loads(done.read_text())
            if kept["seeds"] == args.seeds and kept["trials"] == trials:
                results[name] = kept["curves"]
                print(f"  {name}: kept from {done}")
                continue
        if name == "gp" and importlib.util.find_spec("scipy") is None:
            print("  gp: skipped (Optuna's GPSampler needs scipy)")
            continue
        t0 = time.perf_counter()
        results[name] = []
        for seed in range(args.seeds if name != "grid" else 1):
            replay = Replay(records, head_dim, sweep.header["profile"], seed)
            run(name, space, replay, seed, trials)
            results[name].append(curve(replay, total))
        wall[name] = time.perf_counter() - t0
        done.write_text(json.dumps({"seeds": args.seeds, "trials": trials, "curves": results[name]}))
        print(f"  {name}: {wall[name]:.1f} s")
    summary: dict[str, Any] = {"dataset": Path(args.dataset).name, "configs": len(records), "sweep_seconds": total,
                               "seeds": args.seeds, "trials": trials, "strategies": {}}
    print(f"\nHypervolume fraction of the true front at 10% of the sweep's seconds ({0.1 * total:.0f} s): "
          "median [min, max] over seeds")
    print("| strategy | " + " | ".join(f"{b:g} bits" for b in BUDGETS) + f" | seconds to >= {TARGET} at every "
          "budget (median share of the sweep) | evaluations |")
    print("| --- " * (len(BUDGETS) + 3) + "|")
    for name, curves in results.items():
        cells, row = [], {"at_10pct": {}, "at_shares": {}}
        for b in BUDGETS:
            vals = [at_share(c, b, 0.1) for c in curves]
            cells.append(f"{statistics.median(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}]")
            row["at_10pct"][f"{b:g}"] = vals
            row["at_shares"][f"{b:g}"] = {f"{s:g}": statistics.median(at_share(c, b, s) for c in curves)
                                          for s in SHARES}
        reach = [share_to_reach(c, TARGET) for c in curves]
        med = statistics.median(reach)
        row["share_to_target"] = reach
        row["evaluations"] = statistics.median(c["evaluations"] for c in curves)
        row["final_share"] = [c["share"][-1] if c["share"] else 0.0 for c in curves]
        row["final"] = {f"{b:g}": [c["fraction"][f"{b:g}"][-1] if c["share"] else 0.0 for c in curves]
                        for b in BUDGETS}
        summary["strategies"][name] = row
        print(f"| {name} | " + " | ".join(cells) + f" | {'never' if math.isinf(med) else f'{100 * med:.1f}%'} | "
              f"{row['evaluations']:.0f} |")
    print("\nAt the end of each search: median share of the sweep's seconds spent, and median fraction")
    print("| strategy | seconds share | " + " | ".join(f"{b:g} bits" for b in BUDGETS) + " |")
    print("| --- " * (len(BUDGETS) + 2) + "|")
    for name, row in summary["strategies"].items():
        print(f"| {name} | {100 * statistics.median(row['final_share']):.1f}% | "
              + " | ".join(f"{statistics.median(row['final'][f'{b:g}']):.3f}" for b in BUDGETS) + " |")
    (out / "bench_tuner.json").write_text(json.dumps(summary, indent=1))
    plot(results, out / "bench_tuner.png")
    print(f"\nwrote {out / 'bench_tuner.json'} and {out / 'bench_tuner.png'}")


if __name__ == "__main__":
    main()
