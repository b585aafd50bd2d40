"""The user's own texts as a task: real long text teacher-forced through the quantized cache.

A texts file is plain text, one document per blank-line-separated block, or JSONL with a "text"
field on every line (a file whose name ends in .jsonl, or whose first character is "{"). Each
document is tokenized as it is (no chat template) and cut into a prefix of `prefix` tokens and the
`tokens` that follow it; documents shorter than both together are left out. The prefix is
prefilled unquantized once, then quantized by each trial's config; the continuation is
teacher-forced through that cache exactly as the fidelity part replays fp16 trajectories
(tuner/scoring/engine.py), and compared with the unquantized model's next-token distribution along the
same text. A document is one unit: its top-1 agreement is the part's outcome (the part's score is
the mean agreement over documents), its mean KL(p_fp16 || p_quant) is reported beside it.

Unlike the fidelity part, the continuation is the user's text, not the model's own output: what
is measured is how the quantized cache changes the model's predictions on the workload served.

A campaign carries the task to its workers as the task-list entry `texts:PATH` or
`texts:PATH@PREFIX+TOKENS` (`TextsTask.entry`); the file must be readable where the worker runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.tasks import json_lines, read_user_file

PART = "texts"
# Default lengths, from the model's context: a prefix long enough that most of the cache is
# quantized history, and a continuation as long as the fidelity trajectories.
PREFIX_SHARE, MAX_PREFIX = 8, 1024  # prefix: context / 8, at most 1024 tokens
TOKENS_SHARE, MAX_TOKENS = 16, 512  # continuation: context / 16, at most 512 tokens
LENGTHS = re.compile(r"(\d+)\+(\d+)")
MIN_TOKENS = 2  # a continuation of one token would be predicted from the prefill alone


@dataclass(frozen=True)
class TextsTask:
    """A texts file and the lengths its documents are cut to (None: from the model's context)."""

    path: str
    prefix: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.prefix is None) != (self.tokens is None):
            raise EvalError("give --text-prefix and --text-tokens together (or neither: sized to the model's context)")
        for name, value, low in (("--text-prefix", self.prefix, 1), ("--text-tokens", self.tokens, MIN_TOKENS)):
            if value is not None and not low <= value <= 1 << 20:
                raise EvalError(f"invalid {name} {value}: allowed an integer in [{low}, {1 << 20}]")

    def entry(self) -> str:
        """The task-list entry a campaign stores (an absolute path: workers start elsewhere)."""
        path = str(Path(self.path).resolve())
        lengths = f"@{self.prefix}+{self.tokens}" if self.prefix is not None and self.tokens is not None else ""
        return f"{PART}:{path}{lengths}"

    @classmethod
    def parse(cls, entry: str) -> TextsTask:
        """The task of an entry `texts:PATH[@PREFIX+TOKENS]`."""
        body = entry.partition(":")[2]
        path, at, lengths = body.rpartition("@")
        found = LENGTHS.fullmatch(lengths) if at else None
        if found:
            return cls(path, int(found[1]), int(found[2]))
        return cls(body)

    def lengths(self, context: int | None) -> tuple[int, int]:
        """(prefix, continuation) tokens: as given, else sized to the model's context."""
        ctx = context or 8192
        prefix = self.prefix if self.prefix is not None else min(MAX_PREFIX, ctx // PREFIX_SHARE)
        tokens = self.tokens if self.tokens is not None else min(MAX_TOKENS, ctx // TOKENS_SHARE)
        if context is not None and prefix + tokens > context:
            raise EvalError(f"texts: a prefix of {prefix} and a continuation of {tokens} tokens exceed the model's "
                            f"context of {context}: give a shorter --text-prefix or --text-tokens")
        return prefix, tokens


def documents(path: str | Path) -> list[str]:
    """The documents of a texts file (see the module docstring); one line for a file without any."""
    text = read_user_file(path, "texts file")
    if str(path).endswith(".jsonl") or text.lstrip().startswith("{"):
        docs = []
        for lineno, row in json_lines(path, "texts file"):
            if not isinstance(row.get("text"), str):
                raise EvalError(f'{path}:{lineno}: needs a "text" field holding a string')
            docs.append(row["text"])
    else:
        docs = re.split(r"\n[ \t\r\f\v]*\n", text)
    docs = [d.strip() for d in docs if d.strip()]
    if not docs:
        raise EvalError(f"texts file {path} holds no documents")
    return docs


def cut(tokenizer: Any, path: str | Path, prefix: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prefix ids, continuation ids) of every document of `path` that holds prefix + tokens tokens."""
    out, longest = [], 0
    for doc in documents(path):
        ids = [int(t) for t in tokenizer(doc, add_special_tokens=False)["input_ids"]]
        longest = max(longest, len(ids))
        if len(ids) >= prefix + tokens:
            out.append((ids[:prefix], ids[prefix : prefix + tokens]))
    if not out:
        raise EvalError(f"texts file {path}: no document holds the {prefix + tokens} tokens a document needs "
                        f"(a prefix of {prefix} and {tokens} to predict); the longest holds {longest}: give longer "
                        "documents, or a shorter --text-prefix or --text-tokens")
    return out


def check_usable(model: str, task: TextsTask) -> int:
    """How many documents of `task` the model's tokenizer cuts (one line when none): what a campaign
    checks before it stores anything, so that a file without a usable document costs no campaign."""
    from pnmix import models

    tokenizer, context = models.load_tokenizer(model)
    return len(cut(tokenizer, task.path, *task.lengths(context)))
