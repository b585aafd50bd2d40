"""Scoring one PN-Mix config on one model: accuracy parts with standard errors, bits, bytes, throughput.

`Evaluator` loads the model once and prepares, per (model, profile, seed), the task items the
unquantized model answers correctly and the fp16 trajectories for long-output fidelity; both are
cached on disk (as text and token ids) under the cache directory. The user's data joins as parts
of their own: an items file (tuner/tasks.py, `items_file`) and a texts file (tuner/texts.py).
With a held-out share (tuner/holdout.py), every part's units are split once: `evaluate` and
`rung` score the search units, `evaluate(..., which=Split.HOLDOUT)` the held-out ones. Scoring runs
through the batched engine (tuner/engine.py): every prompt is prefilled once per evaluator, and a trial
pays only for its config's decode. `evaluate_reference` scores the same items one at a time
through `generate`, the path the engine is tested and benchmarked against.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from pnmix import models
from pnmix.bits import weighted_key_bits
from pnmix.config import PNMixConfig, preset
from pnmix.families import plan_of_config, rope_pairing
from pnmix.layerwise import AnyConfig, LayerwiseConfig, as_layerwise
from pnmix.tuner import fidelity
from pnmix.tuner import shipped as shipped_module
from pnmix.tuner import tasks as tasks_module
from pnmix.tuner import texts as texts_module
from pnmix.tuner.engine import ScoringEngine, Trajectory
from pnmix.tuner.holdout import HOLDOUT, split, total_for
from pnmix.tuner.profiles import EvalError, Profile
from pnmix.tuner.proxy import ProxyMeasure
from pnmix.tuner.score import Rung, Score, Split, versions
from pnmix.tuner.texts import TextsTask

Progress = Callable[[str], None]


TASKS = ("passkey", "kv_lookup", "fidelity", "items", "texts", "lm_eval")
DEFAULT_TASKS = ("passkey", "kv_lookup", "fidelity")
REPLAYED = ("fidelity", "texts")  # parts scored by teacher forcing (the engine's `fidelity`), not by answers
# Bump when task generation or filtering changes, so cached preparations are rebuilt.
PREPARATION_VERSION = 7


def cache_name(profile: Profile, holdout: float, seed: int) -> str:
    """The preparation's file name: the profile's knobs and the held-out share are part of the key,
    so a changed profile never reads another's items."""
    import hashlib

    knobs = hashlib.sha256(repr((asdict(profile), holdout)).encode()).hexdigest()[:10]
    return f"{profile.name}-{knobs}-seed{seed}-v{PREPARATION_VERSION}.json"


class Evaluator:
    def __init__(self, model: str, profile: Profile, seed: int = 0, items: str | Path | None = None,
                 progress: Progress | None = None, tasks: tuple[str, ...] | None = None,
                 device: str = "cpu", lm_eval_task: str | None = None, lm_eval_limit: int | None = None,
                 texts: TextsTask | None = None, holdout: float = 0.0) -> None:
        from pnmix.tuner import harness

        # An lm-eval task (tuner/harness.py) comes as keywords or as a task-list entry lm_eval:TASK[@LIMIT];
        # the user's files as keywords or as entries items:PATH and texts:PATH[@PREFIX+TOKENS].
        named: list[str] = []
        for entry in tasks or ():
            name = entry.partition(":")[0] if ":" in entry else entry
            if entry.startswith(harness.PART + ":"):
                lm_eval_task, lm_eval_limit = harness.parse_entry(entry)
            elif entry.startswith("items:"):
                items = entry.partition(":")[2]
            elif entry.startswith("texts:"):
                texts = TextsTask.parse(entry)
            named.append(name)
        chosen = tuple(dict.fromkeys(named)) if named else (
            *DEFAULT_TASKS, *(("items",) if items else ()), *(("texts",) if texts else ()))
        if lm_eval_task and harness.PART not in chosen:
            chosen = (*chosen, harness.PART)
        for name in chosen:
            if name not in TASKS:
                raise EvalError(f"unknown task {name!r}: allowed {', '.join(TASKS)}")
        if "items" in chosen and not items:
            raise EvalError("task items needs a JSONL file (--items PATH)")
        if "texts" in chosen and not texts:
            raise EvalError("task texts needs a texts file (--texts PATH)")
        if harness.PART in chosen:
            if not lm_eval_task:
                raise EvalError("task lm_eval needs an lm-eval task (--lm-eval-task TASK)")
            harness.check_extra()  # a missing extra is one line, before the model loads
        self.tasks = chosen
        # The user's files are read and checked before the model loads.
        self._items = tasks_module.items_file(items) if items and "items" in chosen else None
        self.texts = texts if "texts" in chosen else None
        if self.texts is not None:
            texts_module.documents(self.texts.path)
        if not HOLDOUT.contains(holdout):
            raise EvalError(f"invalid holdout={holdout}: allowed {HOLDOUT.allowed}")
        self.holdout, self.model_name, self.profile, self.seed = holdout, model, profile, seed
        self._split: dict[str, tuple[list[int], list[int]]] = {}
        self.progress = progress or (lambda message: None)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.loaded = models.load(model, purpose="accuracy", dtype=dtype, device=device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.pairing = rope_pairing(self.model.config)
        # What each layer holds: the bit figures weigh the layers by it (pnmix.bits.weighted_key_bits).
        self.plan = plan_of_config(self.model.config)
        self.head_dim = self.loaded.shape.head_dim
        self.num_layers = self.loaded.shape.num_layers
        self.device = str(self.model.device)
        self.backend = self._backend_label()
        self._prepared: dict[str, Any] | None = None
        self.harness = (harness.HarnessPart(lm_eval_task, lm_eval_limit, self.model, self.tokenizer, model,
                                            progress=self.progress)
                        if harness.PART in chosen and lm_eval_task else None)
        self._engine: ScoringEngine | None = None
        self._trace: Any = None
        self._shipped_looked = False  # tuner/shipped.py: looked up once
        self._shipped_found: shipped_module.Shipped | None = None

    # -- preparation (fp16 runs, cached) ---------------------------------------------------------

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
        built = [str(name) for name in data.get("built", DEFAULT_TASKS)]
        return {"items": items, "trajectories": trajectories, "built": built}

    def _checked(self, shipped: shipped_module.Shipped,
                 wanted: list[str]) -> tuple[ScoringEngine, dict[str, Any]] | None:
        """The shipped preparation (as `_read_dict` gives it) and an engine holding its parts that this
        evaluator runs, once the unquantized model here answers every item right and agrees with the
        trajectories' tokens (tuner/shipped.py); None, with one line on stderr, when it does not."""
        data = self._read_dict(shipped.preparation)
        if any(name not in data["built"] for name in wanted):
            return None
        engine = self._new_engine()
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

    def _new_engine(self, quiet: bool = False) -> ScoringEngine:
        progress = None if quiet else self.progress
        return ScoringEngine(self.model, self.tokenizer, progress=progress)

    def gguf_sha256(self) -> str | None:
        """SHA-256 of the embedded model's GGUF (what shipped preparations are keyed by); None otherwise."""
        source = self.loaded.source
        return models.gguf_digest(Path(source.location)) if source.kind == "embedded" else None

    def runs_as(self) -> str:
        """Where and in what precision the model runs ('cpu float32'): a shipped preparation's condition."""
        return f"{self.model.device.type} {str(self.model.dtype).removeprefix('torch.')}"

    def _shipped(self) -> shipped_module.Shipped | None:
        if self._shipped_looked is False:
            self._shipped_looked = True
            self._shipped_found = shipped_module.find(self.model_name, self.cache_file().name, self.gguf_sha256(),
                                                      self.runs_as())
        return self._shipped_found

    def prepare(self) -> dict[str, Any]:
        """Filtered items and fp16 trajectories for this (model, profile, seed), from disk if cached
        (or shipped with the package: tuner/shipped.py); every prompt is prefilled once into the
        scoring engine."""
        if self._prepared is not None:
            return self._prepared
        path = self.cache_file()
        data = self._read_cached(path) if path.is_file() else None
        wanted = [name for name in DEFAULT_TASKS if name in self.tasks]
        engine = None
        if data is None and wanted and (shipped := self._shipped()) is not None:
            engine, data = self._checked(shipped, wanted) or (None, None)
        engine = engine or self._new_engine()
        data = data or {"items": {}, "trajectories": [], "built": []}
        # Only the built-in parts this evaluator runs are built; a later evaluator that runs more
        # builds what is missing into the same file (each part is built on its own, so the file
        # holds what one build of all parts would).
        missing = [name for name in wanted if name not in data["built"]]
        if missing:
            built = self._build(engine, missing)
            data["items"].update(built["items"])
            if "fidelity" in missing:
                data["trajectories"] = built["trajectories"]
            data["built"] = [name for name in DEFAULT_TASKS if name in data["built"] or name in missing]
        if missing or not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes preparing side by side write apart
            tmp.write_text(json.dumps({
                "items": {name: [it.to_dict() for it in its] for name, its in data["items"].items()},
                "trajectories": [{"prompt_ids": p, "tokens": t} for p, t in data["trajectories"]],
                "built": data["built"]}))
            tmp.replace(path)
        for name, items in data["items"].items():
            if name in self.tasks and name not in engine.items:  # a build or a check added its own
                engine.add_items(name, items)
        if "fidelity" in self.tasks and "fidelity" not in engine.replays:
            self.progress("fp16 reference distributions")
            engine.add_trajectories([
                Trajectory(prompt, tokens, fidelity.reference_logits(self.model, torch.tensor([prompt]), tokens))
                for prompt, tokens in data["trajectories"]])
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
        self._engine = engine
        self._prepared = data
        counts = self._all_counts()
        self._split = {name: split(n, self.holdout, self.seed, name) for name, n in counts.items()}
        return data

    @property
    def engine(self) -> ScoringEngine:
        self.prepare()
        assert self._engine is not None
        return self._engine

    def _build(self, engine: ScoringEngine, parts: list[str]) -> dict[str, Any]:
        """For the built-in `parts`: candidates answered by fp16 in the engine (kept: those it gets
        right), and fp16 trajectories."""
        p, fp16 = self.profile, preset("fp16")
        pools = {  # built when their part is
            "passkey": lambda: tasks_module.passkey_items(
                p.pool_factor * total_for(p.passkey_items, self.holdout), self.seed, p.passkey_filler,
                p.passkey_digits, p.passkey_distractors),
            "kv_lookup": lambda: tasks_module.kv_lookup_items(
                p.pool_factor * total_for(p.kv_items, self.holdout), self.seed, p.kv_pairs, p.kv_digits,
                p.kv_near_miss),
        }
        # With a held-out share, the search keeps the profile's counts and the held-out units come on top.
        wanted = {"passkey": total_for(p.passkey_items, self.holdout), "kv_lookup": total_for(p.kv_items, self.holdout)}
        kept: dict[str, list[tasks_module.Item]] = {}
        for name, make_pool in pools.items():
            if name not in parts:
                continue
            pool = make_pool()
            # Keep only items the unquantized model gets right, so a miss is the cache's fault.
            # Candidates are prefilled and answered a batch at a time, until enough are kept.
            right: list[int] = []
            tried = 0
            while len(right) < wanted[name] and tried < len(pool):
                batch = pool[tried : tried + max(wanted[name] - len(right), 4)]
                engine.add_items(name, batch)
                self.progress(f"filtering {name} against fp16: {len(right)} of {wanted[name]} kept, "
                              f"{tried + len(batch)} tried")
                hits = engine.outcomes(fp16, name, start=tried)
                right += [tried + i for i, hit in enumerate(hits) if hit]
                tried += len(batch)
            engine.keep_items(name, right[: wanted[name]])
            # Scored as one batch, an item can come out otherwise than in its filtering batch (bf16
            # sums depend on the batch): re-answer the kept set as scoring will, until fp16 passes all.
            for _ in range(3):
                hits = engine.outcomes(fp16, name)
                if all(hits):
                    break
                engine.keep_items(name, [i for i, hit in enumerate(hits) if hit])
            kept[name] = engine.items[name]
        if "fidelity" not in parts:
            return {"items": kept, "trajectories": []}
        from pnmix.models import chat_ids

        n_prompts = total_for(p.fidelity_prompts, self.holdout)
        if n_prompts > len(fidelity.FIDELITY_PROMPTS):
            raise EvalError(f"profile {p.name} with a hold-out share of {self.holdout:g} needs {n_prompts} fidelity "
                            f"prompts; there are {len(fidelity.FIDELITY_PROMPTS)}: use a smaller share")
        prompts = [chat_ids(self.tokenizer, prompt)["input_ids"][0].tolist()
                   for prompt in fidelity.FIDELITY_PROMPTS[:n_prompts]]
        self.progress(f"generating {len(prompts)} fp16 trajectories")
        tokens = engine.continuations(prompts, p.fidelity_tokens) if prompts else []
        return {"items": kept, "trajectories": list(zip(prompts, tokens, strict=True))}

    # -- the proxy -----------------------------------------------------------------------------

    def trace(self) -> Any:
        """The proxy's recorded Q/K/V trace of this model (recorded once, cached on disk)."""
        from pnmix.analysis import record_trace

        if self._trace is None:
            path = self.cache_file().with_name(f"trace-qkv-{self.profile.proxy_tokens}.pt")
            if path.is_file():
                self._trace = torch.load(path, weights_only=False)
            else:
                from pnmix.models import chat_ids

                ids = chat_ids(self.tokenizer, fidelity.FIDELITY_PROMPTS[-1])["input_ids"]
                # The continuation: shipped (tuner/shipped.py), or the fp16 greedy one on the engine's
                # decode (CUDA graphs on the GPU), as the trajectories are generated: `generate`
                # takes about a minute for it on an H200. Its tokens are kept beside the trace.
                shipped = self._shipped()
                tokens = shipped.trace_tokens.get(path.stem) if shipped is not None else None
                if tokens is None or len(tokens) != self.profile.proxy_tokens:
                    self.progress("recording the proxy's Q/K/V trace")
                    tokens = self._new_engine(quiet=True).continuations([ids[0].tolist()], self.profile.proxy_tokens)[0]
                self._trace = record_trace(self.model, ids, self.profile.proxy_tokens, continuation=tokens)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(self._trace, path)
                path.with_suffix(".tokens.json").write_text(json.dumps(tokens))
        return self._trace

    def _quantized_trace(self, config: AnyConfig) -> tuple[Any, AnyConfig]:
        """The trace and config the proxy weighs: on a model with sliding-window layers, only its
        full-attention layers (the windows stay unquantized: their attention is exact)."""
        trace = self.trace()
        if not self.plan.hybrid:
            return trace, config
        full = self.plan.full_layers
        kept = replace(trace, queries=[trace.queries[i] for i in full], keys=[trace.keys[i] for i in full],
                       values=None if trace.values is None else [trace.values[i] for i in full])
        per_layer = as_layerwise(config).per_layer(self.num_layers)
        return kept, (config if not isinstance(config, LayerwiseConfig)
                      else LayerwiseConfig.from_layers([per_layer[i] for i in full]))

    def proxy(self, config: AnyConfig) -> float:
        """Attention KL on recorded traces (tuner.proxy), milliseconds per layer (per quantized layer
        of a hybrid model)."""
        from pnmix.tuner.proxy import proxy_kl

        return proxy_kl(*self._quantized_trace(config), self.pairing)

    def proxy_by_layer(self, config: AnyConfig) -> list[float]:
        """The proxy's attention KL of each layer under its own config (tuner.layers reads it); for
        a model with sliding-window layers, of its full-attention layers."""
        from pnmix.tuner.proxy import proxy_kl_by_layer

        return proxy_kl_by_layer(*self._quantized_trace(config), self.pairing)

    def sensitivity(self, candidates: list[PNMixConfig],
                    measure: ProxyMeasure = ProxyMeasure.KL) -> dict[PNMixConfig, list[float]]:
        """The allocator's table: each candidate's proxy KL per layer (`tuner.proxy.proxy_kl_table`;
        the candidates share G, sinks, residual and criterion), or with `measure=ProxyMeasure.OUTPUT` its
        relative attention-output error, the unit `value_sensitivity` shares. Cached on disk beside
        the preparation, per model, profile, seed, measure and candidate set, so a campaign's later
        workers and later campaigns of the model read it instead of computing it again."""
        from pnmix.tuner.proxy import proxy_kl_table

        rows = self._cached_table(["keys", measure, [c.to_dict() for c in candidates]], len(candidates),
                                  lambda: proxy_kl_table(self.trace(), candidates, self.pairing, measure=measure))
        return dict(zip(candidates, rows, strict=True))

    def value_sensitivity(self, formats: list[tuple[int, int]],
                          shared: PNMixConfig) -> dict[tuple[int, int], list[float]]:
        """Each value format's (bits, group size) relative attention-output error per layer under
        `shared`'s token schedule (`tuner.proxy.proxy_value_table`), cached like `sensitivity`."""
        from pnmix.tuner.proxy import proxy_value_table

        schedule = {f: getattr(shared, f) for f in ("n_sink", "group_size", "residual_len")}
        rows = self._cached_table(["values", schedule, [list(f) for f in formats]], len(formats),
                                  lambda: proxy_value_table(self.trace(), formats, shared))
        return dict(zip(formats, rows, strict=True))

    def _cached_table(self, what: Any, n_rows: int, compute: Any) -> list[list[float]]:
        """A proxy table (`n_rows` rows of one figure per layer) read from the disk cache under the
        hash of `what`, or computed and written there."""
        import hashlib

        def fits(rows: Any) -> bool:
            return len(rows) == n_rows and all(len(r) == self.num_layers for r in rows)

        key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        path = self.cache_file().with_name(f"sensitivity-{self.cache_file().stem}-{key}.json")
        try:
            rows = json.loads(path.read_text())
            if fits(rows):
                return [[float(x) for x in r] for r in rows]
        except (OSError, ValueError, TypeError):
            pass  # absent or unreadable: shipped, or computed again, and rewritten
        shipped = self._shipped()
        rows = shipped.tables.get(path.name) if shipped is not None else None
        if rows is None or not fits(rows):
            rows = compute()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(path)
        except OSError as exc:  # a read-only or full cache folder costs the next run the seconds, nothing more
            print(f"warning: sensitivity table not cached at {path}: {exc.strerror or exc}", file=sys.stderr)
        return rows

    # -- full evaluation -----------------------------------------------------------------------

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
        """The units of `part` that `which` scores (tuner/holdout.py): all of them without a hold-out."""
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

    def _units(self, config: AnyConfig, reference: bool = False, have: Rung | None = None,
               upto: dict[str, int] | None = None, which: Split = Split.SEARCH) -> tuple[Rung, dict[str, float]]:
        """Per-unit outcomes of every part that runs (with the trajectories' agreements and the
        documents' KLs, as a Rung without seconds), and seconds by part.

        Positions count the units of `which` (their indices: `indices`). have/upto (engine only):
        the units already scored (a race's earlier rungs) and how many of each part to hold
        afterwards (default all); only the units in between are scored, and the outcomes returned
        are `have`'s followed by the new ones."""
        data, engine = self.prepare(), self.engine
        counts = self.unit_counts(which)
        upto = upto or counts
        held = {name: len(u) for name, u in (have.units if have else {}).items()}
        units: dict[str, list[float]] = {name: list(u) for name, u in (have.units if have else {}).items()}
        chosen = {name: self.indices(name, which)[held.get(name, 0):upto.get(name, n)] for name, n in counts.items()}
        timings: dict[str, float] = {}
        spans = {name: rows for name, rows in chosen.items() if name not in (*REPLAYED, "lm_eval")}
        if spans:
            self.progress("items: " + ", ".join(f"{len(rows)} {name}" for name, rows in spans.items()))
            t0 = time.perf_counter()
            if reference:
                for name, rows in spans.items():
                    units[name] = units.get(name, []) + [float(data["items"][name][i].is_correct(
                        tasks_module.answer(self.model, self.tokenizer, config, data["items"][name][i]))) for i in rows]
            else:  # every task's items in one batch
                for name, outcomes in engine.all_outcomes(config, spans).items():
                    units[name] = units.get(name, []) + outcomes
            timings["items"] = time.perf_counter() - t0
        if "lm_eval" in chosen and self.harness is not None:  # through the harness (tuner/harness.py)
            t0 = time.perf_counter()
            units["lm_eval"] = units.get("lm_eval", []) + self.harness.outcomes(config, chosen["lm_eval"])
            timings["lm_eval"] = time.perf_counter() - t0
        agreements: list[float] = list(have.agreements) if have else []
        text_kls: list[float] = list(have.text_kls) if have else []
        for part in REPLAYED:
            if part not in chosen:
                continue
            rows = chosen[part]
            self.progress(f"{part}: {len(rows)} teacher-forced sequences")
            t0 = time.perf_counter()
            if reference:
                seqs = engine.replays[part]
                fids = [fidelity.replay(self.model, torch.tensor([seqs[i].prompt_ids]), seqs[i].tokens.tolist(), config,
                                        seqs[i].ref_logp) for i in rows]
                pairs = [(f.agreement, f.mean_kl) for f in fids]
            else:
                pairs = engine.fidelity(config, rows=rows, part=part) if rows else []
            timings[part] = time.perf_counter() - t0
            if part == "fidelity":  # a trajectory's unit is its mean KL (tuner/stats.py)
                agreements += [a for a, _ in pairs]
                units[part] = units.get(part, []) + [kl for _, kl in pairs]
            else:  # a document's unit is its top-1 agreement; its KL is reported beside it
                text_kls += [kl for _, kl in pairs]
                units[part] = units.get(part, []) + [a for a, _ in pairs]
        return Rung(units, agreements, 0.0, text_kls), timings

    def rung(self, config: AnyConfig, upto: dict[str, int], have: Rung | None = None) -> Rung:
        """A race's next rung: `have` extended to the first `upto[part]` search units of every part."""
        config.check_head_dim(self.head_dim)
        start = time.perf_counter()
        got, _ = self._units(config, have=have, upto=upto)
        got.seconds = (have.seconds if have else 0.0) + time.perf_counter() - start
        return got

    def evaluate(self, config: AnyConfig, reference: bool = False, measure: bool = True,
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
            key_bits=weighted_key_bits(config, self.plan, self.head_dim),
            backend=self.backend,
            device=self._device_name(),
            versions=versions(),
            seconds=time.perf_counter() - start + (have.seconds if have else 0.0),
            profile=self.profile.name,
        )

    def measure_cost(self, config: AnyConfig) -> tuple[int, float, int | None]:
        """(bytes held, decode tokens/s, peak device bytes) on the fixed cost workload (tuner/engine.py)."""
        return self.engine.measure_cost(config, self.seed)

    def _backend_label(self) -> str:
        """What runs PN-Mix attention here: the kernels on CUDA unless the torch path is forced."""
        from pnmix.backend import backend_name

        if self.model.device.type == "cpu":
            return "torch-reference"
        return "torch-cuda" if backend_name() == "torch" else "triton"

    def _device_name(self) -> str:
        if self.model.device.type == "cuda":
            return torch.cuda.get_device_name(self.model.device)
        return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
