"""An lm-evaluation-harness generation task as an accuracy part (`lm_eval`), through `pnmix.lm_eval`.

`pnmix eval --lm-eval-task TASK` and `pnmix tune --lm-eval-task TASK [--lm-eval-limit N]` add the
part. TASK is a task the harness knows (e.g. `gsm8k`; its data set comes from the hub or the local
hub cache) or the path of a task YAML file, whose folder is then included. Every unit is a
document of the task, its outcome the task's first metric under its first filter (a share: 0/1
for `exact_match`), answered through the harness's own prompts, stop sequences and filters by
`pnmix.lm_eval.PNMixLM` with the config's cache, batched.

As with our own item tasks, the documents the unquantized model (`fp16`) gets wrong are dropped
first, so a miss is the cache's fault: the first `limit` documents (default all) are answered by
fp16, and those it answers are kept, re-answered as one scoring run until fp16 passes all of them
(a batch changes float sums). The kept document ids are cached per model, task and limit under
`PNMIX_CACHE_DIR/eval/`. The part weighs 0.25, like items (tuner/scoring/profiles.py).

In a campaign's task list the part is one entry, `lm_eval:TASK` or `lm_eval:TASK@LIMIT`
(`spec_entry`), so workers and resumed campaigns score the same documents.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pnmix import models
from pnmix.config import preset
from pnmix.layerwise import AnyConfig
from pnmix.tuner.errors import EvalError

PART = "lm_eval"
BATCH_SIZE = 16
FILTER_ROUNDS = 3


def check_extra() -> None:
    """One line naming the pip command when the harness is not installed (before any model loads)."""
    import pnmix.lm_eval  # noqa: F401  (raises pnmix.lm_eval.ExtraMissing, a PNMixError)


def spec_entry(task: str, limit: int | None) -> str:
    """The task-list entry of a campaign: `lm_eval:TASK[@LIMIT]` (a YAML path made absolute)."""
    if limit is not None and limit < 1:
        raise EvalError(f"invalid --lm-eval-limit {limit}: allowed an integer >= 1")
    if task.endswith((".yaml", ".yml")):
        path = Path(task)
        if not path.is_file():
            raise EvalError(f"lm-eval task file {task} does not exist")
        task = str(path.resolve())
    if not task or "@" in task:
        raise EvalError(f"invalid lm-eval task {task!r}")
    return f"{PART}:{task}" + (f"@{limit}" if limit else "")


def parse_entry(entry: str) -> tuple[str, int | None]:
    """(task, limit) of a task-list entry `lm_eval:TASK[@LIMIT]`."""
    body = entry.split(":", 1)[1]
    task, _, limit = body.partition("@")
    if not task:
        raise EvalError(f"invalid lm-eval task entry {entry!r}: expected lm_eval:TASK[@LIMIT]")
    try:
        return task, int(limit) if limit else None
    except ValueError:
        raise EvalError(f"invalid lm-eval limit in {entry!r}: allowed an integer >= 1") from None


class HarnessPart:
    """The `lm_eval` part of one evaluator: kept documents, and their outcomes under a config."""

    def __init__(self, task: str, limit: int | None, model: Any, tokenizer: Any, model_name: str,
                 progress: Callable[[str], None] | None = None) -> None:
        check_extra()
        self.task_arg, self.limit = task, limit
        self.include: str | None = None
        self.task = task
        if task.endswith((".yaml", ".yml")):
            path = Path(task)
            if not path.is_file():
                raise EvalError(f"lm-eval task file {task} does not exist")
            found = re.search(r"^task:\s*['\"]?([^'\"\s]+)", path.read_text(encoding="utf-8"), re.M)
            if found is None:
                raise EvalError(f"lm-eval task file {task} names no task (a line `task: NAME`)")
            self.task, self.include = found.group(1), str(path.resolve().parent)
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.progress = progress or (lambda message: None)
        self._lm: Any = None
        self._manager: Any = None
        self._kept: list[int] | None = None

    # -- the harness ---------------------------------------------------------------------------

    def _harness(self) -> tuple[Any, Any]:
        if self._lm is None:
            import logging

            from lm_eval.tasks import TaskManager

            from pnmix.lm_eval import PNMixLM

            # The harness logs every run at INFO; its warnings (and ours) still show.
            logging.getLogger("lm_eval").setLevel(logging.WARNING)
            self._lm = PNMixLM(pretrained=self.model, tokenizer=self.tokenizer, config=preset("fp16"),
                               batch_size=BATCH_SIZE)
            self._manager = TaskManager(include_path=self.include)
            if self.task not in self._manager.all_tasks:
                raise EvalError(f"lm-eval task {self.task!r} is unknown to the harness"
                                + (f" (looked in {self.include} too)" if self.include else ""))
        return self._lm, self._manager

    def _run(self, config: AnyConfig | None, docs: Sequence[int] | None, make_cache: Any = None) -> dict[int, float]:
        """{doc id: outcome} of the documents `docs` (None: the first `limit`) under `config`
        (or a peer's cache factory)."""
        import lm_eval

        lm, manager = self._harness()
        lm.pnmix_config = config or preset("fp16")
        lm.make_cache = make_cache
        kwargs: dict[str, Any] = {"samples": {self.task: list(docs)}} if docs is not None else {"limit": self.limit}
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=[self.task], task_manager=manager, log_samples=True,
                                          bootstrap_iters=0, verbosity="ERROR", **kwargs)
        finally:
            lm.make_cache = None
        if out is None or self.task not in out.get("samples", {}):
            raise EvalError(f"lm-eval task {self.task!r} returned no samples")
        return self._outcomes(out["samples"][self.task])

    def _outcomes(self, samples: list[dict[str, Any]]) -> dict[int, float]:
        """Each document's value of the first metric under the first filter (checked to be a share)."""
        if not samples:
            return {}
        first_filter = samples[0].get("filter")
        metric = next((k for k in samples[0].get("metrics", []) if k in samples[0]), None)
        if metric is None:  # older sample records: the first numeric field after the known ones
            known = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                     "doc_hash", "prompt_hash", "target_hash"}
            metric = next((k for k, v in samples[0].items() if k not in known and isinstance(v, int | float)), None)
        if metric is None:
            raise EvalError(f"lm-eval task {self.task!r}: no per-document metric in its samples")
        out: dict[int, float] = {}
        for s in samples:
            if s.get("filter") != first_filter:
                continue
            value = float(s[metric])
            if not 0.0 <= value <= 1.0:
                raise EvalError(f"lm-eval task {self.task!r}: metric {metric} is {value} for document "
                                f"{s['doc_id']}, not a share in [0, 1]; use a task scored by exact match")
            out[int(s["doc_id"])] = value
        return out

    # -- preparation ---------------------------------------------------------------------------

    def _cache_file(self) -> Path:
        ident = self.task_arg
        if self.include is not None:  # a local task: its file's content is part of the key
            ident += hashlib.sha256(Path(self.task_arg).read_bytes()).hexdigest()
        key = hashlib.sha256(ident.encode()).hexdigest()[:10]
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.task)
        return (models.cache_dir() / "eval" / self.model_name.replace("/", "_")
                / f"lm_eval-{safe}-{key}-limit{self.limit or 'all'}.json")

    def kept(self) -> list[int]:
        """Ids of the documents the unquantized model answers (cached on disk)."""
        if self._kept is not None:
            return self._kept
        path = self._cache_file()
        if path.is_file():
            try:
                self._kept = [int(i) for i in json.loads(path.read_text())["kept"]]
                return self._kept
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"warning: cached lm-eval preparation {path} is unreadable ({type(exc).__name__}); "
                      "rebuilding it", file=sys.stderr, flush=True)
        self.progress(f"filtering lm-eval {self.task} against fp16")
        outcomes = self._run(preset("fp16"), None)
        kept = sorted(i for i, v in outcomes.items() if v == 1.0)
        for _ in range(FILTER_ROUNDS):  # re-answered as scoring runs them, until fp16 passes all
            if not kept:
                break
            again = self._run(preset("fp16"), kept)
            if all(again[i] == 1.0 for i in kept):
                break
            kept = [i for i in kept if again[i] == 1.0]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"task": self.task, "limit": self.limit, "tried": len(outcomes), "kept": kept}))
        tmp.replace(path)
        self._kept = kept
        return kept

    # -- scoring -------------------------------------------------------------------------------

    def outcomes(self, config: AnyConfig | None, span: Sequence[int], make_cache: Any = None) -> list[float]:
        """Outcomes of the kept documents in `span` (their positions among the kept), in that order."""
        docs = [self.kept()[i] for i in span]
        if not docs:
            return []
        self.progress(f"lm-eval {self.task}: {len(docs)} documents")
        got = self._run(config, docs, make_cache)
        return [got[i] for i in docs]
