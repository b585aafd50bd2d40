"""Ground truth: every config of a search space scored with one profile, per-unit results kept.

A sweep file is JSON Lines (gzip-compressed when its name ends in .gz): a header line naming the
model, method, profile and seed, then one line per scored config with its score, standard errors,
per-unit outcomes (each item's 1/0, each trajectory's mean KL) and the seconds it took. Lines are
appended one write each, so a sweep stopped at any point (kill -9 included) resumes where it
stopped, and several processes (`--shard I/N`) may fill one file; a line cut short by a kill is
skipped on reading and its config scored again.

`front` gives the true Pareto front (accuracy up, key bits down) of a sweep within a budget:
what a search is measured against (benchmarks/bench_tuner.py).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnmix.config import PNMixConfig
from pnmix.inputs import InputError, shorten
from pnmix.layerwise import config_key
from pnmix.storage.vocabulary import Shard
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.search.space import SearchSpace

SWEEP_FORMAT = 1
SCORE_FIELDS = ("key_bits", "accuracy", "accuracy_se", "parts", "parts_se", "units", "fidelity_agreement",
                "fidelity_kl", "seconds", "timings", "kv_bytes", "decode_tokens_per_s")


@dataclass
class Sweep:
    header: dict[str, Any]
    records: list[dict[str, Any]]  # one per config (the last line wins where a config appears twice)
    skipped_lines: int = 0


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N), 0 <= I < N (the command line's `--shard` parser)."""
    try:
        return Shard().parse(text)
    except InputError as exc:
        raise EvalError(f"invalid shard {shorten(text)}: allowed {exc.allowed}") from None


def shard_configs(space: SearchSpace, shard: tuple[int, int]) -> list[PNMixConfig]:
    """The space's configs that shard I of N scores: whole kernel specialisations (configs that
    differ only in sinks) stay together, so each is compiled by one process."""
    i, n = shard
    groups: dict[tuple[Any, ...], list[PNMixConfig]] = {}
    for cfg in space.configs():
        groups.setdefault((cfg.b_high, cfg.b_low, cfg.group_size, cfg.salient_ratio), []).append(cfg)
    return [cfg for k, members in enumerate(groups.values()) if k % n == i for cfg in members]


def _open_text(path: Path, mode: str) -> Any:
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def read_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"no sweep file at {path}")
    header: dict[str, Any] | None = None
    by_key: dict[str, dict[str, Any]] = {}
    skipped = 0
    with _open_text(path, "r") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                skipped += 1
                continue
            if row.get("kind") == "header":
                header = header or row
            elif row.get("kind") == "score":
                by_key[config_key(row["config"])] = row
    if header is None:
        raise EvalError(f"{path} is not a sweep file (no header line)")
    return Sweep(header, list(by_key.values()), skipped)


def _append(path: Path, row: dict[str, Any]) -> None:
    """One os.write of one whole line: O_APPEND keeps concurrent writers' lines apart."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def start_file(path: Path, header: dict[str, Any]) -> Sweep:
    """Creates the sweep file with its header, or checks that an existing one is this sweep."""
    if path.suffix == ".gz":
        raise EvalError(f"{path}: a sweep is written uncompressed; compress it once it is complete")
    if path.is_dir():
        raise EvalError(f"{path} is a directory: --out takes a file, e.g. {path / 'sweep.jsonl'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        sweep = read_sweep(path)
        theirs = {k: sweep.header.get(k) for k in ("model", "method", "profile", "seed", "tasks", "space")}
        ours = {k: header.get(k) for k in theirs}
        if theirs != ours:
            diff = ", ".join(f"{k} {theirs[k]!r} (asked {ours[k]!r})" for k in theirs if theirs[k] != ours[k])
            raise EvalError(f"{path} holds another sweep: {diff}; use another --out") from None
        with path.open("rb+") as f:  # a line cut short by a kill: later lines start on their own
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        return sweep
    except OSError as exc:
        raise EvalError(f"cannot write the sweep file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(header) + "\n")
    return Sweep(header, [])


def sweep_header(model: str, space: SearchSpace, profile: str, seed: int, tasks: Iterable[str]) -> dict[str, Any]:
    return {"kind": "header", "format": SWEEP_FORMAT, "model": model, "method": space.method, "profile": profile,
            "seed": seed, "tasks": list(tasks), "space": space.to_dict()}


def run_sweep(evaluator: Scorer, space: SearchSpace, path: Path, shard: tuple[int, int] = (0, 1),
              limit: int | None = None, measure: bool = False,
              on_score: Callable[[int, int, PNMixConfig, dict[str, Any]], None] | None = None) -> int:
    """Scores this shard's configs of `space` not yet in `path`; returns how many it scored."""
    header = sweep_header(evaluator.model_name, space, evaluator.profile.name, evaluator.seed, evaluator.tasks)
    done = {config_key(r["config"]) for r in start_file(path, header).records}
    todo = [c for c in shard_configs(space, shard) if config_key(c) not in done]
    if limit is not None:
        todo = todo[:limit]
    if todo:
        evaluator.prepare()
    for k, cfg in enumerate(todo):
        score = evaluator.evaluate(cfg, measure=measure)
        row = {"kind": "score", "config": cfg.to_dict(), "shard": list(shard), "device": score.device,
               **{name: getattr(score, name) for name in SCORE_FIELDS}}
        _append(path, row)
        if on_score is not None:
            on_score(k + 1, len(todo), cfg, row)
    return len(todo)


def front(records: Iterable[dict[str, Any]], budget: float = float("inf")) -> list[dict[str, Any]]:
    """The Pareto front (accuracy up, key bits down) of the records within `budget` key bits,
    by increasing bits; of configs with equal (bits, accuracy) the first stays."""
    inside = sorted((r for r in records if r["key_bits"] <= budget + 1e-9),
                    key=lambda r: (r["key_bits"], -r["accuracy"]))
    out: list[dict[str, Any]] = []
    for r in inside:
        if not out or r["accuracy"] > out[-1]["accuracy"]:
            out.append(r)
    return out


def hypervolume(points: Iterable[tuple[float, float]], budget: float) -> float:
    """Area that (key bits, accuracy) points within `budget` bits dominate, above accuracy 0: the
    measure by which a front is compared with the true one."""
    from pnmix.tuner.search.fronts import hypervolume_2d

    return hypervolume_2d([(acc, bits) for bits, acc in points], budget + 1e-9)
