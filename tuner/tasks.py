"""Accuracy tasks answered by real generation with a PN-Mix cache.

Every task yields `Item`s (a user prompt and the expected answer) deterministically from a seed,
with difficulty knobs that the profiles (tuner/profiles.py) set:
- passkey: a number of `digits` digits hidden at a random depth of varied natural filler, up to
  the model's useful context, optionally among near-miss "locker codes";
- kv_lookup: the number of one word among many "The <word> number is <n>." facts, some of them
  near misses of the asked number;
- gsm8k: a JSONL file of {"question", "answer"} with numeric answers; the last number in the
  model's output is its answer.
An item is correct when the answer appears as a whole number in the greedy output (gsm8k: equals
its last number). `answer` and `accuracy` answer one item at a time through `generate`: the
reference that the batched scoring engine (tuner/engine.py) is tested against.
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
from pnmix.layerwise import AnyConfig
from pnmix.models import chat_ids
from pnmix.tuner.profiles import EvalError

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
        # The answer as a whole number in the output: a longer number that contains it is a miss.
        return re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", output) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "prompt": self.prompt, "answer": self.answer, "max_new_tokens": self.max_new_tokens}


def passkey_items(n: int, seed: int, filler_sentences: tuple[int, int] = (40, 120), digits: int = 7,
                  distractors: int = 0) -> list[Item]:
    """n items: a pass key of `digits` digits at a random depth of natural filler.

    The filler length rises evenly over `filler_sentences` (about 13 tokens a sentence). With
    `distractors`, that many other codes ("the locker code is ...", one digit from the pass key)
    are scattered through the text, so reading a number near the question is not enough.
    """
    rng = random.Random(f"passkey-{seed}")
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
                    near_miss: int = 0) -> list[Item]:
    """n items: facts "The <word> number is <digits digits>." in a row, and the number of one word asked for.

    The fact count rises evenly over `pairs`. `near_miss` of the other facts carry numbers one
    digit away from the answer, so a cache that blurs the asked number lands on a neighbour.
    (A `key: value` list of random strings proved too hard for the embedded 135M model even in
    fp16; sentences with word keys it answers often enough, and filtering keeps those.)
    """
    rng = random.Random(f"kv-{seed}")
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


def answer(model: Any, tokenizer: Any, config: AnyConfig, item: Item) -> str:
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
