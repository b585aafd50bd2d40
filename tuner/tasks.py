"""Accuracy tasks answered by real generation with a PN-Mix cache.

Every task yields `Item`s (a user prompt and the expected answer) deterministically from a seed.
- passkey: a 5-digit number hidden in long filler text;
- kv_lookup: the number of one word among many "The <word> number is <n>." facts;
- gsm8k: a JSONL file of {"question", "answer"} with numeric answers; the last number in the
  model's output is its answer.
An item is correct when the answer appears in the greedy output (gsm8k: equals its last number).
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
from tuner.profiles import EvalError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


@dataclass(frozen=True)
class Item:
    task: str
    prompt: str
    answer: str
    max_new_tokens: int = 16

    def is_correct(self, output: str) -> bool:
        if self.task == "gsm8k":
            found = NUMBER.findall(output)
            return bool(found) and _same_number(found[-1], self.answer)
        return self.answer in output

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "prompt": self.prompt, "answer": self.answer, "max_new_tokens": self.max_new_tokens}


def passkey_items(n: int, seed: int, filler: tuple[int, int] = (20, 47)) -> list[Item]:
    """n items whose filler count rises evenly over `filler` (20..47 sentences: ~560-1200 tokens)."""
    rng = random.Random(f"passkey-{seed}")
    lo, hi = filler
    items = []
    for i in range(n):
        n_fill = lo + (hi - lo) * i // max(n - 1, 1)
        key = rng.randint(10000, 99999)
        at = rng.randint(0, n_fill)
        text = FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. " + FILLER * (n_fill - at)
        prompt = "There is a pass key hidden in the text below. Find it.\n\n" + text + "\nWhat is the pass key?"
        items.append(Item("passkey", prompt, str(key), max_new_tokens=12))
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


def kv_lookup_items(n: int, seed: int, pairs: tuple[int, int] = (20, 60)) -> list[Item]:
    """n items: facts "The <word> number is <5 digits>." in a row, and the number of one word asked for.

    (A `key: value` list of random strings proved too hard for the embedded 135M model even in fp16;
    sentences with word keys it answers about half the time, and filtering keeps those.)
    """
    rng = random.Random(f"kv-{seed}")
    lo, hi = pairs
    items = []
    for i in range(n):
        count = min(lo + (hi - lo) * i // max(n - 1, 1), len(KV_WORDS))
        keys = rng.sample(KV_WORDS, count)
        values = [str(rng.randint(10000, 99999)) for _ in range(count)]
        asked = rng.randrange(count)
        facts = " ".join(f"The {k} number is {v}." for k, v in zip(keys, values, strict=True))
        prompt = f"Read the facts below.\n\n{facts}\n\nWhat is the {keys[asked]} number?"
        items.append(Item("kv_lookup", prompt, values[asked], max_new_tokens=16))
    return items


def gsm8k_items(path: str | Path, n: int | None = None) -> list[Item]:
    """Items from a JSONL file, one {"question": str, "answer": number or str} per line."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"gsm8k file {path} does not exist")
    items = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise EvalError(f"{path}:{lineno}: not valid JSON") from None
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise EvalError(f"{path}:{lineno}: needs the fields \"question\" and \"answer\"")
        answer = str(row["answer"]).split("####")[-1].strip()
        if not NUMBER.fullmatch(answer.replace(" ", "")):
            raise EvalError(f"{path}:{lineno}: answer {answer!r} is not a number")
        prompt = str(row["question"]) + "\nSolve it step by step and end with the final number."
        items.append(Item("gsm8k", prompt, answer, max_new_tokens=256))
    if not items:
        raise EvalError(f"gsm8k file {path} holds no items")
    return items[:n] if n else items


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a.replace(",", "").rstrip(".")) == float(b.replace(",", "").rstrip("."))
    except ValueError:
        return False


def answer(model: Any, tokenizer: Any, config: PNMixConfig, item: Item) -> str:
    """Greedy answer of the model with a PN-Mix cache of `config`."""
    from pnmix.cli import chat_ids
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
