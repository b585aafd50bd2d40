"""The parts a score is made of, and a task list read once into them.

Every part has one entry in `PARTS`: its weight in the combined accuracy, whether it is built in
(prepared from the profile), what argument names it in a task list (`items:PATH`,
`texts:PATH[@PREFIX+TOKENS]`, `lm_eval:TASK[@LIMIT]`) and whether it is scored by teacher forcing
rather than by answers. A task list, as the command line, a stored campaign or the service's request
gives it, is read once into a `Parts` (`Parts.parse`): the evaluator, the queue's checks, the CLI
and the REST route all take it from there.

Weights: passkey 0.25, kv_lookup 0.25, fidelity 0.5 (items 0.25 when an items file is given, texts
0.5 when a texts file is: the user's workload weighs as much as long-output fidelity; lm_eval 0.25
when an lm-evaluation-harness task is: tuner/scoring/harness.py). Long-output fidelity weighs most:
PN-Mix is for long generation, where the keys of generated tokens are themselves quantized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnmix.inputs import shorten
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import harness
from pnmix.tuner.scoring.texts import TextsTask


@dataclass(frozen=True)
class Part:
    name: str
    weight: float  # in the combined accuracy (tuner/scoring/stats.py)
    argument: str | None = None  # what follows `name:` in a task list; None: a built-in part
    replayed: bool = False  # scored by teacher forcing (the engine's `fidelity`), not by answers
    file: bool = False  # its argument is a file the worker reads at the same path


PARTS = {p.name: p for p in (
    Part("passkey", 0.25),
    Part("kv_lookup", 0.25),
    Part("fidelity", 0.5, replayed=True),
    Part("items", 0.25, argument="PATH", file=True),
    Part("texts", 0.5, argument="PATH[@PREFIX+TOKENS]", replayed=True, file=True),
    Part(harness.PART, 0.25, argument="TASK[@LIMIT]"),
)}
NAMES = tuple(PARTS)
BUILT_IN = tuple(n for n, p in PARTS.items() if p.argument is None)  # a profile's default parts
WITH_ARGUMENT = tuple(n for n, p in PARTS.items() if p.argument is not None)
FILES = tuple(n for n, p in PARTS.items() if p.file)
REPLAYED = tuple(n for n, p in PARTS.items() if p.replayed)
WEIGHTS = {n: p.weight for n, p in PARTS.items()}
# A task-list entry as the service's schema states it (`check_entries` is the check itself).
ENTRY_PATTERN = rf"^({'|'.join(BUILT_IN)}|({'|'.join(WITH_ARGUMENT)}):.*\S.*)$"


@dataclass(frozen=True)
class Parts:
    """The parts one evaluation runs, with the arguments of those that need one."""

    names: tuple[str, ...]
    items: str | None = None  # the items file (tuner/scoring/tasks.py)
    texts: TextsTask | None = None  # the texts file and its lengths (tuner/scoring/texts.py)
    lm_eval_task: str | None = None
    lm_eval_limit: int | None = None

    @classmethod
    def parse(cls, entries: Sequence[str] | None = None, items: str | Path | None = None,
              texts: TextsTask | None = None, lm_eval_task: str | None = None,
              lm_eval_limit: int | None = None) -> Parts:
        """The parts of a task list (default: the built-in parts, plus those the keywords give); an
        entry `name:ARGUMENT` names the part and its argument, as the keywords do. One line
        (EvalError) for an unknown part or one without its argument."""
        named: list[str] = []
        for entry in entries or ():
            name = entry.partition(":")[0]
            if entry.startswith(harness.PART + ":"):
                lm_eval_task, lm_eval_limit = harness.parse_entry(entry)
            elif entry.startswith("items:"):
                items = entry.partition(":")[2]
            elif entry.startswith("texts:"):
                texts = TextsTask.parse(entry)
            named.append(name)
        chosen = tuple(dict.fromkeys(named)) if named else (
            *BUILT_IN, *(("items",) if items else ()), *(("texts",) if texts else ()))
        if lm_eval_task and harness.PART not in chosen:
            chosen = (*chosen, harness.PART)
        for name in chosen:
            if name not in PARTS:
                raise EvalError(f"unknown task {name!r}: allowed {', '.join(NAMES)}")
        if "items" in chosen and not items:
            raise EvalError("task items needs a JSONL file (--items PATH)")
        if "texts" in chosen and not texts:
            raise EvalError("task texts needs a texts file (--texts PATH)")
        if harness.PART in chosen and not lm_eval_task:
            raise EvalError("task lm_eval needs an lm-eval task (--lm-eval-task TASK)")
        return cls(chosen, str(items) if items and "items" in chosen else None,
                   texts if "texts" in chosen else None,
                   lm_eval_task if harness.PART in chosen else None, lm_eval_limit)


def campaign_entries(named: Sequence[str] | None, items: str | None, texts: TextsTask | None) -> tuple[str, ...] | None:
    """The task list a campaign stores: the named parts (default: the built-in ones) and the user's
    files as entries items:PATH and texts:PATH[@PREFIX+TOKENS], which workers read at those paths."""
    files = (*((f"items:{Path(items).resolve()}",) if items else ()), *((texts.entry(),) if texts else ()))
    if not files:
        return tuple(named) if named else None
    return (*(t for t in named or BUILT_IN if t not in FILES), *files)


def check_entries(entries: Sequence[Any], files: bool = True) -> None:
    """The entries a campaign's task list may hold; with `files`, the files that items:PATH and
    texts:PATH name are read and checked too (`check_file_entry`)."""
    for entry in entries:
        name, colon, argument = entry.partition(":") if isinstance(entry, str) else ("", "", "")
        if entry in FILES:
            raise EvalError(f"task {entry} needs its file: --{entry} PATH (in a task list, {entry}:PATH)")
        if entry in BUILT_IN or (colon and argument.strip() and name in WITH_ARGUMENT):
            if files and name in FILES and colon:
                check_file_entry(entry)
            continue
        raise EvalError(f"invalid task {shorten(entry)} for a campaign: allowed {', '.join(BUILT_IN)} "
                        f"or {', '.join(n + ':ARGUMENT' for n in WITH_ARGUMENT)}")


def check_file_entry(entry: str) -> None:
    """An items:PATH or texts:PATH entry names a readable file of its kind (one line where not)."""
    from pnmix.tuner.scoring import tasks, texts

    if entry.startswith("items:"):
        tasks.items_file(entry.partition(":")[2])
    else:
        texts.documents(TextsTask.parse(entry).path)


def file_entries(entries: Sequence[str] | None) -> list[str]:
    """The entries of a task list that name a file."""
    return [e for e in entries or () if e.partition(":")[0] in FILES]
