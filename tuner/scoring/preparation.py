"""The fp16 runs a model's scores are measured against, prepared once and cached on disk.

For one (model, profile, seed, held-out share): the task items the unquantized model answers right
(candidates generated and filtered, `pool_factor` per kept item), and the fp16 trajectories for
long-output fidelity. Both are cached as text and token ids under the cache directory
(`cache_file`), taken from the package's shipped preparation where one fits (tuner/scoring/shipped.py),
else built here. `Preparation.load` gives a scoring engine holding them, every prompt prefilled once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pnmix import models
from pnmix.config import preset
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import fidelity
from pnmix.tuner.scoring import shipped as shipped_module
from pnmix.tuner.scoring import tasks as tasks_module
from pnmix.tuner.scoring.engine import ScoringEngine, Trajectory
from pnmix.tuner.scoring.holdout import total_for
from pnmix.tuner.scoring.parts import BUILT_IN
from pnmix.tuner.scoring.profiles import Profile

Progress = Callable[[str], None]

# Bump when task generation or filtering changes, so cached preparations are rebuilt.
PREPARATION_VERSION = 7
# A model that answers few candidates right (a base model: Gemma 3 270M answers about one in eight
# of the full profile's) gets up to this many more pools of candidates, each as large as the first,
# until the profile's counts are kept; a model that fills them from the first pool keeps its items.
EXTRA_POOLS = 5


def cache_name(profile: Profile, holdout: float, seed: int) -> str:
    """The preparation's file name: the profile's knobs and the held-out share are part of the key,
    so a changed profile never reads another's items."""
    knobs = hashlib.sha256(repr((asdict(profile), holdout)).encode()).hexdigest()[:10]
    return f"{profile.name}-{knobs}-seed{seed}-v{PREPARATION_VERSION}.json"


class Preparation:
    """The prepared fp16 runs of one loaded model under (profile, seed, held-out share)."""

    def __init__(self, loaded: models.LoadedModel, model_name: str, profile: Profile, seed: int, holdout: float,
                 progress: Progress) -> None:
        self.loaded, self.model_name, self.profile, self.seed, self.holdout = loaded, model_name, profile, seed, holdout
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.progress = progress
        self._shipped_looked = False  # tuner/scoring/shipped.py: looked up once
        self._shipped_found: shipped_module.Shipped | None = None

    def cache_file(self) -> Path:
        return models.cache_dir() / "eval" / self.model_name.replace("/", "_") / cache_name(
            self.profile, self.holdout, self.seed)

    def _read_cached(self, path: Path) -> dict[str, Any] | None:
        """The cached preparation, or None (with one line on stderr) when it is unreadable or malformed."""
        try:
            return self._read_dict(json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            print(f"warning: cached preparation {path} is unreadable ({type(exc).__name__}); rebuilding it",
                  file=sys.stderr, flush=True)
            return None

    @staticmethod
    def _read_dict(data: dict[str, Any]) -> dict[str, Any]:
        """A preparation as stored (JSON) -> items, trajectories (prompt ids, tokens) and the parts built."""
        items = {name: [tasks_module.Item(**it) for it in its] for name, its in data["items"].items()}
        trajectories = [(list(map(int, t["prompt_ids"])), list(map(int, t["tokens"]))) for t in data["trajectories"]]
        # A preparation stored before parts were built one at a time holds every built-in part.
        built = [str(name) for name in data.get("built", BUILT_IN)]
        return {"items": items, "trajectories": trajectories, "built": built, "grown": bool(data.get("grown"))}

    def _checked(self, shipped: shipped_module.Shipped,
                 wanted: list[str]) -> tuple[ScoringEngine, dict[str, Any]] | None:
        """The shipped preparation (as `_read_dict` gives it) and an engine holding its parts that this
        evaluator runs, once the unquantized model here answers every item right and agrees with the
        trajectories' tokens (tuner/scoring/shipped.py); None, with one line on stderr, when it does not."""
        data = self._read_dict(shipped.preparation)
        if any(name not in data["built"] for name in wanted):
            return None
        engine = self.new_engine()
        where = shipped_module.path_for(self.model_name, self.cache_file().name)
        if "fidelity" in wanted:
            self.progress("shipped preparation: fp16 reference distributions, checked against its tokens")
            refs = [fidelity.reference_logits(self.model, torch.tensor([prompt]), tokens)
                    for prompt, tokens in data["trajectories"]]
            worst = min((shipped_module.agreement(r, t) for r, (_, t) in zip(refs, data["trajectories"], strict=True)),
                        default=1.0)
            if worst < shipped_module.MIN_AGREEMENT:
                print(f"warning: shipped preparation {where}: the model here agrees with {worst:.1%} of a "
                      f"trajectory's tokens (at least {shipped_module.MIN_AGREEMENT:.0%} needed); building it here",
                      file=sys.stderr, flush=True)
                return None
            engine.add_trajectories([Trajectory(prompt, tokens, ref)
                                     for (prompt, tokens), ref in zip(data["trajectories"], refs, strict=True)])
        fp16 = preset("fp16")
        for name in wanted:
            if name == "fidelity":
                continue
            engine.add_items(name, data["items"][name])
            self.progress(f"shipped preparation: {name} items checked against fp16")
            if not all(engine.outcomes(fp16, name)):
                print(f"warning: shipped preparation {where}: the model here misses a shipped {name} item; "
                      "building it here", file=sys.stderr, flush=True)
                return None
        return engine, data

    def new_engine(self, quiet: bool = False) -> ScoringEngine:
        """An empty scoring engine on this model (quiet: without progress lines)."""
        progress = None if quiet else self.progress
        return ScoringEngine(self.model, self.tokenizer, progress=progress, plan=self.loaded.plan)

    def gguf_sha256(self) -> str | None:
        """SHA-256 of the embedded model's GGUF (what shipped preparations are keyed by); None otherwise."""
        source = self.loaded.source
        return models.gguf_digest(Path(source.location)) if source.kind == "embedded" else None

    def runs_as(self) -> str:
        """Where and in what precision the model runs ('cpu float32'): a shipped preparation's condition."""
        return f"{self.model.device.type} {str(self.model.dtype).removeprefix('torch.')}"

    def shipped(self) -> shipped_module.Shipped | None:
        if not self._shipped_looked:
            self._shipped_looked = True
            self._shipped_found = shipped_module.find(self.model_name, self.cache_file().name, self.gguf_sha256(),
                                                      self.runs_as())
        return self._shipped_found

    def load(self, tasks: tuple[str, ...]) -> tuple[ScoringEngine, dict[str, Any]]:
        """An engine holding the built-in parts of `tasks` (every prompt prefilled once), and the
        preparation (items, trajectories, the parts built): from disk if cached, else shipped with
        the package (tuner/scoring/shipped.py) once checked, else built here; written to the cache."""
        path = self.cache_file()
        data = self._read_cached(path) if path.is_file() else None
        if data is not None and not data["grown"]:
            # stored before candidates came from more than one pool: a part kept short is built again
            data["built"] = [name for name in data["built"]
                             if name == "fidelity" or len(data["items"].get(name, [])) >= self._wanted(name)]
        wanted = [name for name in BUILT_IN if name in tasks]
        engine = None
        if data is None and wanted and (shipped := self.shipped()) is not None:
            engine, data = self._checked(shipped, wanted) or (None, None)
        engine = engine or self.new_engine()
        data = data or {"items": {}, "trajectories": [], "built": [], "grown": True}
        # Only the built-in parts this evaluator runs are built; a later evaluator that runs more
        # builds what is missing into the same file (each part is built on its own, so the file
        # holds what one build of all parts would).
        missing = [name for name in wanted if name not in data["built"]]
        if missing:
            built = self._build(engine, missing)
            data["items"].update(built["items"])
            if "fidelity" in missing:
                data["trajectories"] = built["trajectories"]
            data["built"] = [name for name in BUILT_IN if name in data["built"] or name in missing]
        if missing or not path.is_file():
            self._write(path, data)
        for name, items in data["items"].items():
            if name in tasks and name not in engine.items:  # a build or a check added its own
                engine.add_items(name, items)
        if "fidelity" in tasks and "fidelity" not in engine.replays:
            self.progress("fp16 reference distributions")
            engine.add_trajectories([
                Trajectory(prompt, tokens, fidelity.reference_logits(self.model, torch.tensor([prompt]), tokens))
                for prompt, tokens in data["trajectories"]])
        return engine, data

    @staticmethod
    def _write(path: Path, data: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes preparing side by side write apart
        tmp.write_text(json.dumps({
            "items": {name: [it.to_dict() for it in its] for name, its in data["items"].items()},
            "trajectories": [{"prompt_ids": p, "tokens": t} for p, t in data["trajectories"]],
            "built": data["built"], "grown": True}))
        tmp.replace(path)

    def _build(self, engine: ScoringEngine, parts: list[str]) -> dict[str, Any]:
        """For the built-in `parts`: candidates answered by fp16 in the engine (kept: those it gets
        right), and fp16 trajectories."""
        p = self.profile
        pools: dict[str, Callable[[int], list[tasks_module.Item]]] = {  # candidates by pool number
            "passkey": lambda pool: tasks_module.passkey_items(
                p.pool_factor * total_for(p.passkey_items, self.holdout), self.seed, p.passkey_filler,
                p.passkey_digits, p.passkey_distractors, pool=pool),
            "kv_lookup": lambda pool: tasks_module.kv_lookup_items(
                p.pool_factor * total_for(p.kv_items, self.holdout), self.seed, p.kv_pairs, p.kv_digits,
                p.kv_near_miss, pool=pool),
        }
        kept = {name: self._filtered(engine, name, make_pool, self._wanted(name))
                for name, make_pool in pools.items() if name in parts}
        if "fidelity" not in parts:
            return {"items": kept, "trajectories": []}
        return {"items": kept, "trajectories": self._trajectories(engine)}

    def _wanted(self, name: str) -> int:
        """Items of a built-in part to keep: with a held-out share, the search keeps the profile's
        counts and the held-out units come on top."""
        p = self.profile
        return total_for(p.passkey_items if name == "passkey" else p.kv_items, self.holdout)

    def _filtered(self, engine: ScoringEngine, name: str, make_pool: Callable[[int], list[tasks_module.Item]],
                  wanted: int) -> list[tasks_module.Item]:
        """The first `wanted` candidates that the unquantized model answers right, so that a miss is
        the cache's fault: from the first pool, then from up to `EXTRA_POOLS` more while too few are
        kept. Candidates are prefilled and answered a batch at a time, until enough are kept."""
        fp16 = preset("fp16")
        right: list[int] = []
        tried, pools = 0, 1
        pool = make_pool(0)
        while len(right) < wanted:
            if tried == len(pool):
                if pools > EXTRA_POOLS:
                    break
                pool, pools = pool + make_pool(pools), pools + 1
            size = max(wanted - len(right), 4)
            if pools > 1:  # a model that answers few: a batch sized by the share it has answered so far
                size = max(size, min(512, -(-(wanted - len(right)) * tried // max(len(right), 1))))
            batch = pool[tried : tried + size]
            engine.add_items(name, batch)
            self.progress(f"filtering {name} against fp16: {len(right)} of {wanted} kept, {tried + len(batch)} tried"
                          + (f" from {pools} pools" if pools > 1 else ""))
            hits = engine.outcomes(fp16, name, start=tried)
            right += [tried + i for i, hit in enumerate(hits) if hit]
            tried += len(batch)
        engine.keep_items(name, right[:wanted])
        # Scored as one batch, an item can come out otherwise than in its filtering batch (bf16
        # sums depend on the batch): re-answer the kept set as scoring will, until fp16 passes all.
        for _ in range(3):
            hits = engine.outcomes(fp16, name)
            if all(hits):
                break
            engine.keep_items(name, [i for i, hit in enumerate(hits) if hit])
        return engine.items[name]

    def _trajectories(self, engine: ScoringEngine) -> list[tuple[list[int], list[int]]]:
        """The fp16 greedy continuations of the fidelity prompts: (prompt ids, tokens) each."""
        from pnmix.models import chat_ids

        p = self.profile
        n_prompts = total_for(p.fidelity_prompts, self.holdout)
        if n_prompts > len(fidelity.FIDELITY_PROMPTS):
            raise EvalError(f"profile {p.name} with a hold-out share of {self.holdout:g} needs {n_prompts} fidelity "
                            f"prompts; there are {len(fidelity.FIDELITY_PROMPTS)}: use a smaller share")
        prompts = [chat_ids(self.tokenizer, prompt)["input_ids"][0].tolist()
                   for prompt in fidelity.FIDELITY_PROMPTS[:n_prompts]]
        self.progress(f"generating {len(prompts)} fp16 trajectories")
        tokens = engine.continuations(prompts, p.fidelity_tokens) if prompts else []
        return list(zip(prompts, tokens, strict=True))
