"""Accuracy tasks answered by real generation with a PN-Mix cache.

Every task yields `Item`s (a user prompt and the expected answer) deterministically from a seed,
with difficulty knobs that the profiles (tuner/scoring/profiles.py) set:
- passkey: a number of `digits` digits hidden at a random depth of varied natural filler, up to
  the model's useful context, optionally among near-miss "locker codes";
- kv_lookup: the number of one word among many "The <word> number is <n>." facts, some of them
  near misses of the asked number;
- items: the user's JSONL file (`items_file`), one item a line: {"question", "answer"} with a
  numeric answer (GSM8K's form; the last number in the model's output is its answer), or
  {"prompt", "answer"} with a string answer, matched after normalising whitespace and case, or
  as a regular expression where the line says `"match": "regex"`.
A built-in item is correct when its answer appears as a whole number in the greedy output.
`answer` and `accuracy` answer one item at a time through `generate`: the reference that the
batched scoring engine (tuner/scoring/engine.py) is tested against.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnmix.config import PNMixConfig
from pnmix.configs import Answer
from pnmix.models import chat_ids
from pnmix.tuner.errors import EvalError, MissingFile

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")

# Natural filler: every sentence is drawn from these parts, so a context of a few thousand tokens
# rarely repeats a sentence (20 * 20 * 20 * 20 combinations), unlike one repeated line, which a
# model can attend past.
_SUBJECTS = (
    "The old miller", "A young teacher", "The harbour master", "My neighbour", "The village baker", "A tired sailor",
    "The librarian", "An engineer from the north", "The shepherd", "Our guide", "The painter", "A quiet student",
    "The mayor", "The station clerk", "A travelling merchant", "The gardener", "The carpenter's daughter",
    "A retired pilot", "The choir leader", "The night watchman",
)
_VERBS = (
    "walked past", "wrote a letter about", "repaired", "painted", "talked for hours about", "carefully measured",
    "took a photograph of", "sold a map of", "forgot about", "cleaned", "sketched", "argued with the council over",
    "lost a glove near", "read a story about", "visited", "counted the windows of", "sang a song about",
    "planted flowers beside", "looked for", "complained about",
)
_OBJECTS = (
    "the stone bridge", "a wooden boat", "the clock tower", "the orchard", "an empty warehouse", "the ferry landing",
    "the market square", "a narrow staircase", "the old lighthouse", "the chapel roof", "a broken fence",
    "the railway depot", "the pottery shop", "a field of barley", "the town archive", "the river mill",
    "a row of cottages", "the bakery oven", "the school garden", "the copper fountain",
)
_TAILS = (
    "before the rain began.", "at the end of the summer.", "while the bells were ringing.", "early on Tuesday.",
    "without telling anyone.", "during the long winter.", "after the harvest festival.", "in the grey morning light.",
    "as the tide came in.", "for the third time that year.", "just before supper.", "on a windy afternoon.",
    "with a borrowed lantern.", "while the children watched.", "after the storm had passed.", "late in the evening.",
    "on the first day of spring.", "as the fog lifted.", "between two heavy showers.", "under a clear sky.",
)


def filler(rng: random.Random, n_sentences: int) -> list[str]:
    """n varied sentences of everyday prose (about 13 tokens each)."""
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
            for _ in range(n_sentences)]


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _near_miss(rng: random.Random, value: str) -> str:
    """value with one digit changed (never the leading digit to 0): a distractor one glance from the answer."""
    at = rng.randrange(len(value))
    choices = [c for c in "0123456789" if c != value[at] and not (at == 0 and c == "0")]
    return value[:at] + rng.choice(choices) + value[at + 1 :]


# How an item's answer is found in the model's output (`Item.match`).
MATCHES = ("whole_number", "last_number", "text", "regex")
STRING_MATCHES = ("text", "regex")  # what a {"prompt", "answer"} line may ask for
STRING_NEW_TOKENS = 32  # greedy tokens for a string answer unless the line says "max_new_tokens"
MAX_ITEM_NEW_TOKENS = 1024


@dataclass(frozen=True)
class Item:
    task: str
    prompt: str
    answer: str
    max_new_tokens: int = 16
    match: str = "whole_number"

    def is_correct(self, output: str) -> bool:
        if self.match == "last_number":
            found = NUMBER.findall(output)
            return bool(found) and _same_number(found[-1], self.answer)
        if self.match == "text":  # the answer as a whole phrase of the output, whitespace and case aside
            return re.search(rf"(?<!\w){re.escape(_normal(self.answer))}(?!\w)", _normal(output)) is not None
        if self.match == "regex":
            return re.search(self.answer, output) is not None
        # The answer as a whole number in the output: a longer number that contains it is a miss.
        return re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", output) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "prompt": self.prompt, "answer": self.answer, "max_new_tokens": self.max_new_tokens,
                "match": self.match}


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()


def passkey_items(n: int, seed: int, filler_sentences: tuple[int, int] = (40, 120), digits: int = 7,
                  distractors: int = 0, pool: int = 0) -> list[Item]:
    """n items: a pass key of `digits` digits at a random depth of natural filler.

    The filler length rises evenly over `filler_sentences` (about 13 tokens a sentence). With
    `distractors`, that many other codes ("the locker code is ...", one digit from the pass key)
    are scattered through the text, so reading a number near the question is not enough. `pool` > 0
    draws another pool of candidates at the same seed, disjoint from pool 0's draws.
    """
    rng = random.Random(f"passkey-{seed}" + (f"-pool{pool}" if pool else ""))
    lo, hi = filler_sentences
    items = []
    for i in range(n):
        n_fill = lo + (hi - lo) * i // max(n - 1, 1)
        key = _number(rng, digits)
        text = filler(rng, n_fill)
        for _ in range(distractors):
            text.insert(rng.randint(0, len(text)), f"The locker code is {_near_miss(rng, key)}.")
        text.insert(rng.randint(0, len(text)), f"The pass key is {key}. Remember it. {key} is the pass key.")
        prompt = ("There is a pass key hidden in the text below. Find it.\n\n" + " ".join(text)
                  + "\nWhat is the pass key?")
        items.append(Item("passkey", prompt, key, max_new_tokens=8 + digits))
    return items


KV_WORDS = (
    "apple river candle mountain pencil garden window rocket tiger violin castle forest bottle mirror island "
    "ladder market needle orange planet rabbit silver tunnel wagon anchor basket cactus dragon engine falcon "
    "glacier hammer igloo jacket kettle lemon magnet nickel oyster parrot quartz saddle teapot umbrella valley "
    "walrus yogurt zipper bridge cookie desert feather guitar helmet jungle kitten lantern meadow blanket canyon "
    "dolphin harbor lizard marble pepper pillow ribbon salmon spider thunder tomato trumpet turtle velvet whistle "
    "acorn barrel cherry copper donkey garlic hornet insect jigsaw koala lobster mango noodle pebble pirate "
    "radish scooter shovel spoon statue tulip waffle wizard"
).split()


def kv_lookup_items(n: int, seed: int, pairs: tuple[int, int] = (20, 60), digits: int = 7,
                    near_miss: int = 0, pool: int = 0) -> list[Item]:
    """n items: facts "The <word> number is <digits digits>." in a row, and the number of one word asked for.

    The fact count rises evenly over `pairs`. `near_miss` of the other facts carry numbers one
    digit away from the answer, so a cache that blurs the asked number lands on a neighbour.
    (A `key: value` list of random strings proved too hard for the embedded 135M model even in
    fp16; sentences with word keys it answers often enough, and filtering keeps those.)
    """
    rng = random.Random(f"kv-{seed}" + (f"-pool{pool}" if pool else ""))  # `pool`: as passkey_items
    lo, hi = pairs
    items = []
    for i in range(n):
        count = min(lo + (hi - lo) * i // max(n - 1, 1), len(KV_WORDS))
        keys = rng.sample(KV_WORDS, count)
        asked = rng.randrange(count)
        answer = _number(rng, digits)
        others = [j for j in range(count) if j != asked]
        near = set(rng.sample(others, min(near_miss, len(others))))
        values = [answer if j == asked else _near_miss(rng, answer) if j in near else _number(rng, digits)
                  for j in range(count)]
        facts = " ".join(f"The {k} number is {v}." for k, v in zip(keys, values, strict=True))
        prompt = f"Read the facts below.\n\n{facts}\n\nWhat is the {keys[asked]} number?"
        items.append(Item("kv_lookup", prompt, answer, max_new_tokens=10 + digits))
    return items



def read_user_file(path: str | Path, what: str) -> str:
    """The text of a user's data file; one line (EvalError) when it is missing, empty, binary or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"{what} {path} does not exist or is not a regular file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EvalError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if b"\x00" in data:
        raise EvalError(f"{what} {path} holds binary data (a NUL byte at offset {data.index(0)}): "
                        "give a UTF-8 text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EvalError(f"{what} {path} is not UTF-8 text (byte {exc.start}): give a UTF-8 text file") from None
    if not text.strip():
        raise EvalError(f"{what} {path} is empty")
    return text


def json_lines(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSONL file; one line for a line that is not
    a JSON object."""
    rows = []
    for lineno, line in enumerate(read_user_file(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise EvalError(f"{path}:{lineno}: not valid JSON") from None
        if not isinstance(row, dict):
            raise EvalError(f"{path}:{lineno}: each line must be a JSON object, not {type(row).__name__}")
        rows.append((lineno, row))
    return rows


def items_file(path: str | Path, n: int | None = None) -> list[Item]:
    """Items of the task `items` from a JSONL file, one object a line:
    {"question": str, "answer": number} (the output's last number must equal it; GSM8K's "#### 4"
    answers too) or {"prompt": str, "answer": str[, "match": "text" | "regex"][, "max_new_tokens": n]}."""
    items = []
    for lineno, row in json_lines(path, "items file"):
        has_prompt, has_question = isinstance(row.get("prompt"), str), isinstance(row.get("question"), str)
        if "answer" not in row or has_prompt == has_question:
            raise EvalError(f'{path}:{lineno}: needs "answer" and one of "prompt" (a string answer) or '
                            '"question" (a numeric answer), as strings')
        if has_question:
            answer = str(row["answer"]).split("####")[-1].strip()
            if not NUMBER.fullmatch(answer.replace(" ", "")):
                raise EvalError(f"{path}:{lineno}: answer {answer!r} of a \"question\" is not a number "
                                "(string answers go with \"prompt\")")
            prompt = str(row["question"]) + "\nSolve it step by step and end with the final number."
            items.append(Item("items", prompt, answer, max_new_tokens=256, match="last_number"))
            continue
        answer, match = row["answer"], row.get("match", "text")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
            raise EvalError(f"{path}:{lineno}: \"answer\" must be a non-empty string or a number")
        if match not in STRING_MATCHES:
            raise EvalError(f"{path}:{lineno}: invalid \"match\" {str(match)[:40]!r}: allowed "
                            f"{', '.join(STRING_MATCHES)}")
        if match == "regex":
            try:
                re.compile(str(answer))
            except re.error as exc:
                raise EvalError(f"{path}:{lineno}: \"answer\" is not a regular expression: {exc}") from None
        new = row.get("max_new_tokens", STRING_NEW_TOKENS)
        if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= MAX_ITEM_NEW_TOKENS:
            raise EvalError(f"{path}:{lineno}: invalid \"max_new_tokens\" {str(new)[:40]!r}: allowed an integer "
                            f"in [1, {MAX_ITEM_NEW_TOKENS}]")
        items.append(Item("items", row["prompt"], str(answer).strip(), max_new_tokens=new, match=match))
    if not items:
        raise EvalError(f"items file {path} holds no items")
    return items[:n] if n else items


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a.replace(",", "").rstrip(".")) == float(b.replace(",", "").rstrip("."))
    except ValueError:
        return False


def answer(model: Any, tokenizer: Any, config: Answer, item: Item) -> str:
    """Greedy answer of the model with a PN-Mix cache of `config`."""
    from pnmix.generation import generate

    ids = chat_ids(tokenizer, item.prompt)
    out, _ = generate(model, ids["input_ids"], config, ids["attention_mask"], max_new_tokens=item.max_new_tokens)
    return str(tokenizer.decode(out[0], skip_special_tokens=True))


def accuracy(model: Any, tokenizer: Any, config: PNMixConfig, items: list[Item],
             progress: Callable[[], None] | None = None) -> float:
    """Share of items answered correctly."""
    hits = 0
    for item in items:
        hits += item.is_correct(answer(model, tokenizer, config, item))
        if progress:
            progress()
    return hits / len(items) if items else 0.0
