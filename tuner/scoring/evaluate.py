"""Scoring one config on one model: accuracy parts with standard errors, bits, bytes, throughput.

`Evaluator` loads the model once and reads its task list once (tuner/scoring/parts.py). Its
responsibilities are carved apart: the fp16 runs it measures against are its `Preparation`
(tuner/scoring/preparation.py: items the unquantized model answers right, fp16 trajectories,
cached on disk or shipped), the proxy's tables are its `ProxyTables` (tuner/scoring/tables.py),
and the scoring is its own: every prompt is prefilled once into the batched engine
(tuner/scoring/engine.py), and a trial pays only for its config's decode. The user's data joins as
parts of their own: an items file (tuner/scoring/tasks.py) and a texts file (tuner/scoring/texts.py).
With a held-out share (tuner/scoring/holdout.py), every part's units are split once: `evaluate` and
`rung` score the search units, `evaluate(..., which=Split.HOLDOUT)` the held-out ones.
`evaluate(..., reference=True)` scores the same units one at a time through `generate`, the path
the engine is tested and benchmarked against. The search wing sees it as a `Scorer`
(tuner/scoring/scorer.py).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pnmix import models
from pnmix.config import PNMixConfig
from pnmix.configs import Answer, key_bits
from pnmix.families import rope_pairing
from pnmix.kv_formats import KVFormat
from pnmix.layerwise import AnyConfig
from pnmix.recipes import EngineRecipe, LayerFormats
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import fidelity, harness
from pnmix.tuner.scoring import tasks as tasks_module
from pnmix.tuner.scoring import texts as texts_module
from pnmix.tuner.scoring.engine import ScoringEngine, Trajectory
from pnmix.tuner.scoring.holdout import HOLDOUT, split
from pnmix.tuner.scoring.parts import REPLAYED, Parts
from pnmix.tuner.scoring.preparation import Preparation
from pnmix.tuner.scoring.profiles import Profile
from pnmix.tuner.scoring.proxy import ProxyMeasure
from pnmix.tuner.scoring.score import Rung, Score, Split, versions
from pnmix.tuner.scoring.tables import ProxyTables
from pnmix.tuner.scoring.texts import TextsTask

Progress = Callable[[str], None]


class Evaluator:
    """Scores configs on one model's prepared parts (a `Scorer`)."""

    def __init__(self, model: str, profile: Profile, seed: int = 0, items: str | Path | None = None,
                 progress: Progress | None = None, tasks: tuple[str, ...] | None = None,
                 device: str = "cpu", lm_eval_task: str | None = None, lm_eval_limit: int | None = None,
                 texts: TextsTask | None = None, holdout: float = 0.0) -> None:
        # The task list, an lm-eval task and the user's files are read once, and the files checked,
        # before the model loads.
        self.parts = Parts.parse(tasks, items, texts, lm_eval_task, lm_eval_limit)
        if self.parts.lm_eval_task:
            harness.check_extra()  # a missing extra is one line, before the model loads
        self.tasks, self.texts = self.parts.names, self.parts.texts
        self._items = tasks_module.items_file(self.parts.items) if self.parts.items else None
        if self.texts is not None:
            texts_module.documents(self.texts.path)
        if not HOLDOUT.contains(holdout):
            raise EvalError(f"invalid holdout={holdout}: allowed {HOLDOUT.allowed}")
        self.holdout, self.model_name, self.profile, self.seed = holdout, model, profile, seed
        self.progress = progress or (lambda message: None)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.loaded = models.load(model, purpose="accuracy", dtype=dtype, device=device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        # What each layer holds: the bit figures weigh the layers by it (pnmix.bits.weighted_key_bits).
        self.plan = self.loaded.plan
        self.head_dim, self.num_layers = self.loaded.shape.head_dim, self.loaded.shape.num_layers
        self.device = str(self.model.device)
        self.backend = self._backend_label()
        self.preparation = Preparation(self.loaded, model, profile, seed, holdout, self.progress)
        self.tables = ProxyTables(self.preparation, self.plan, rope_pairing(self.model.config), self.num_layers)
        self.harness = (harness.HarnessPart(self.parts.lm_eval_task, self.parts.lm_eval_limit, self.model,
                                            self.tokenizer, model, progress=self.progress)
                        if self.parts.lm_eval_task else None)
        self._prepared: dict[str, Any] | None = None
        self._engine: ScoringEngine | None = None
        self._split: dict[str, tuple[list[int], list[int]]] = {}

    # -- the prepared parts -----------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """The prepared built-in parts (`Preparation.load`) and the user's, in one engine; every
        part's units split once into search and held-out units."""
        if self._prepared is not None:
            return self._prepared
        engine, data = self.preparation.load(self.tasks)
        if self._items is not None:
            data["items"]["items"] = self._items
            engine.add_items("items", self._items)
        if self.texts is not None:
            prefix, n = self.texts.lengths(engine.context)
            docs = texts_module.cut(self.tokenizer, self.texts.path, prefix, n)
            self.progress(f"texts: {len(docs)} documents, fp16 reference distributions")
            engine.add_trajectories([
                Trajectory(head, tail, fidelity.reference_logits(self.model, torch.tensor([head]), tail))
                for head, tail in docs], part="texts")
        self._engine, self._prepared = engine, data
        self._split = {name: split(n, self.holdout, self.seed, name) for name, n in self._all_counts().items()}
        return data

    @property
    def engine(self) -> ScoringEngine:
        self.prepare()
        assert self._engine is not None
        return self._engine

    def cache_file(self) -> Path:
        return self.preparation.cache_file()

    def gguf_sha256(self) -> str | None:
        return self.preparation.gguf_sha256()

    def runs_as(self) -> str:
        return self.preparation.runs_as()

    # -- the proxy (tuner/scoring/tables.py) --------------------------------------------------------

    def trace(self) -> Any:
        return self.tables.trace()

    def proxy(self, config: AnyConfig) -> float:
        """Attention KL on the recorded trace, milliseconds per layer (per quantized layer of a hybrid model)."""
        return self.tables.proxy(config)

    def proxy_by_layer(self, config: AnyConfig) -> list[float]:
        return self.tables.proxy_by_layer(config)

    def sensitivity(self, candidates: list[PNMixConfig],
                    measure: ProxyMeasure = ProxyMeasure.KL) -> dict[PNMixConfig, list[float]]:
        return self.tables.sensitivity(candidates, measure)

    def value_sensitivity(self, formats: list[tuple[int, int]],
                          shared: PNMixConfig) -> dict[tuple[int, int], list[float]]:
        return self.tables.value_sensitivity(formats, shared)

    def format_sensitivity(self, formats: list[KVFormat]) -> tuple[dict[KVFormat, list[float]],
                                                                    dict[KVFormat, list[float]]]:
        return self.tables.format_sensitivity(formats)

    def format_kl(self, pairs: list[LayerFormats]) -> dict[LayerFormats, list[float]]:
        """Each layer's forward KL with that layer alone in each (key, value) pair, on the first two
        fidelity trajectories (prompt and fp16 continuation) as calibration text
        (tuner/scoring/layer_kl.py); cached on disk beside the proxy's tables."""
        from pnmix.tuner.scoring.layer_kl import forward_kl_table

        data = self.prepare()
        texts = [torch.tensor([list(prompt) + list(tokens)]) for prompt, tokens in data["trajectories"][:2]]
        rows = self.tables.cached_table(["format-kl", [f"{p.key}/{p.value}" for p in pairs]], len(pairs),
                                        lambda: forward_kl_table(self.model, texts, self.num_layers, pairs))
        return dict(zip(pairs, rows, strict=True))

    # -- scoring ----------------------------------------------------------------------------------

    def _all_counts(self) -> dict[str, int]:
        """Units of every part that runs, held-out ones included: items per task, sequences for the
        replayed parts (fidelity trajectories, texts documents), kept lm-eval documents."""
        data, engine = self._prepared, self._engine
        assert data is not None and engine is not None
        counts = {name: len(items) for name, items in data["items"].items() if items and name in self.tasks}
        for part in REPLAYED:
            if part in self.tasks and engine.replays.get(part):
                counts[part] = len(engine.replays[part])
        if self.harness is not None and self.harness.kept():
            counts["lm_eval"] = len(self.harness.kept())
        return counts

    def indices(self, part: str, which: Split = Split.SEARCH) -> list[int]:
        """The units of `part` that `which` scores (tuner/scoring/holdout.py): all of them without a hold-out."""
        self.prepare()
        search, held = self._split[part]
        if which not in tuple(Split):
            raise ValueError(f"unknown split {which!r}")
        return search if which == Split.SEARCH else held

    def unit_counts(self, which: Split = Split.SEARCH) -> dict[str, int]:
        """Units of every part that `which` scores (a part with none is left out)."""
        self.prepare()
        counts = {name: len(self.indices(name, which)) for name in self._split}
        return {name: n for name, n in counts.items() if n}

    def _units(self, config: Answer, reference: bool = False, have: Rung | None = None,
               upto: dict[str, int] | None = None, which: Split = Split.SEARCH) -> tuple[Rung, dict[str, float]]:
        """Per-unit outcomes of every part that runs (with the trajectories' agreements and the
        documents' KLs, as a Rung without seconds), and seconds by part.

        Positions count the units of `which` (their indices: `indices`). have/upto (engine only):
        the units already scored (a race's earlier rungs) and how many of each part to hold
        afterwards (default all); only the units in between are scored, and the outcomes returned
        are `have`'s followed by the new ones."""
        counts = self.unit_counts(which)
        upto = upto or counts
        held = {name: len(u) for name, u in (have.units if have else {}).items()}
        got = Rung({name: list(u) for name, u in have.units.items()}, list(have.agreements), 0.0,
                   list(have.text_kls)) if have else Rung({}, [], 0.0, [])
        chosen = {name: self.indices(name, which)[held.get(name, 0):upto.get(name, n)] for name, n in counts.items()}
        timings: dict[str, float] = {}
        spans = {name: rows for name, rows in chosen.items() if name not in (*REPLAYED, "lm_eval")}
        if spans:
            self.progress("items: " + ", ".join(f"{len(rows)} {name}" for name, rows in spans.items()))
            t0 = time.perf_counter()
            for name, outcomes in self._answered(config, spans, reference).items():
                got.units[name] = got.units.get(name, []) + outcomes
            timings["items"] = time.perf_counter() - t0
        if "lm_eval" in chosen and self.harness is not None:  # through the harness (tuner/scoring/harness.py)
            t0 = time.perf_counter()
            got.units["lm_eval"] = got.units.get("lm_eval", []) + self._lm_eval(config, chosen["lm_eval"])
            timings["lm_eval"] = time.perf_counter() - t0
        for part in REPLAYED:
            if part in chosen:
                t0 = time.perf_counter()
                self._replayed(config, part, chosen[part], reference, got)
                timings[part] = time.perf_counter() - t0
        return got, timings

    def _lm_eval(self, config: Answer, rows: list[int]) -> list[float]:
        assert self.harness is not None
        if isinstance(config, EngineRecipe):  # the harness's model runs with the recipe's cache
            from pnmix.generation import new_cache

            return self.harness.outcomes(None, rows, make_cache=lambda: new_cache(self.model, config))
        return self.harness.outcomes(config, rows)

    def _answered(self, config: Answer, spans: dict[str, list[int]], reference: bool) -> dict[str, list[float]]:
        """Each item's 1/0 of the answered parts' `spans`: every task's items in one batch through
        the engine, or (reference) one at a time through `generate`."""
        if not reference:
            return self.engine.all_outcomes(config, spans)
        items = self.prepare()["items"]
        return {name: [float(items[name][i].is_correct(
            tasks_module.answer(self.model, self.tokenizer, config, items[name][i]))) for i in rows]
            for name, rows in spans.items()}

    def _replayed(self, config: Answer, part: str, rows: list[int], reference: bool, got: Rung) -> None:
        """A teacher-forced part's `rows` added to `got`: a trajectory's unit is its mean KL (its
        agreement kept beside it), a document's its top-1 agreement (its KL kept beside it)."""
        self.progress(f"{part}: {len(rows)} teacher-forced sequences")
        if reference:
            seqs = self.engine.replays[part]
            fids = [fidelity.replay(self.model, torch.tensor([seqs[i].prompt_ids]), seqs[i].tokens.tolist(), config,
                                    seqs[i].ref_logp) for i in rows]
            pairs = [(f.agreement, f.mean_kl) for f in fids]
        else:
            pairs = self.engine.fidelity(config, rows=rows, part=part) if rows else []
        if part == "fidelity":  # tuner/scoring/stats.py
            got.agreements += [a for a, _ in pairs]
            got.units[part] = got.units.get(part, []) + [kl for _, kl in pairs]
        else:
            got.text_kls += [kl for _, kl in pairs]
            got.units[part] = got.units.get(part, []) + [a for a, _ in pairs]

    def rung(self, config: Answer, upto: dict[str, int], have: Rung | None = None) -> Rung:
        """A race's next rung: `have` extended to the first `upto[part]` search units of every part."""
        config.check_head_dim(self.head_dim)
        start = time.perf_counter()
        got, _ = self._units(config, have=have, upto=upto)
        got.seconds = (have.seconds if have else 0.0) + time.perf_counter() - start
        return got

    def evaluate(self, config: Answer, reference: bool = False, measure: bool = True,
                 have: Rung | None = None, which: Split = Split.SEARCH) -> Score:
        """Scores `config` on the units of `which` through the engine (reference=True: item by item
        through `generate`, sequence by sequence through `model(...)`).

        measure=False skips the cost workload (bytes, tokens/s), e.g. for accuracy-only comparisons.
        have: the units a race already scored (`rung`); only the rest are scored now, and the
        score is the same as a full evaluation's (seconds: the rungs' and this call's).
        """
        from pnmix.kernels.compiles import watch

        config.check_head_dim(self.head_dim)
        start = time.perf_counter()
        log = watch() if self.model.device.type == "cuda" else None
        before = log.copy() if log else None
        got, timings = self._units(config, reference, have=have, which=which)
        cost: tuple[int, float, int | None] = (0, float("nan"), None)
        if measure and got.units:
            self.progress("measuring bytes and decode throughput")
            t0 = time.perf_counter()
            cost = self.measure_cost(config)
            timings["cost"] = time.perf_counter() - t0
        if log and before:  # the first use of a kernel specialisation compiles it, within the parts' seconds
            new = log.since(before)
            timings["kernel_compile"] = new.seconds
            timings["kernels_compiled"] = new.compiled
        return Score.from_units(
            got.units, got.agreements, timings, cost, text_kls=got.text_kls,
            config=config.to_dict(),
            key_bits=key_bits(config, self.plan, self.head_dim),
            backend=self.backend,
            device=self.device_name(),
            versions=versions(),
            seconds=time.perf_counter() - start + (have.seconds if have else 0.0),
            profile=self.profile.name,
        )

    def measure_cost(self, config: Answer) -> tuple[int, float, int | None]:
        """(bytes held, decode tokens/s, peak device bytes) on the fixed cost workload (tuner/scoring/engine.py)."""
        return self.engine.measure_cost(config, self.seed)

    def _backend_label(self) -> str:
        """What runs PN-Mix attention here: the kernels on CUDA unless the torch path is forced."""
        from pnmix.backend import backend_name

        if self.model.device.type == "cpu":
            return "torch-reference"
        return "torch-cuda" if backend_name() == "torch" else "triton"

    def device_name(self) -> str:
        if self.model.device.type == "cuda":
            return torch.cuda.get_device_name(self.model.device)
        return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
