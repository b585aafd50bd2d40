"""Passkey retrieval: a number hidden in long filler text, asked for at the end.

Items are deterministic in (seed, index); the context length grows with the filler count.
On the embedded model (CPU, fp32) the unquantized cache retrieves 10/10 at 560-1200 tokens of
context, so failures of a quantized cache are the cache's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class PasskeyItem:
    prompt: str
    answer: str


def passkey_items(n: int, seed: int = 0, min_filler: int = 20, max_filler: int = 47) -> list[PasskeyItem]:
    """n items whose filler count rises evenly from min_filler to max_filler (~560 to ~1200 tokens)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        n_fill = min_filler + (max_filler - min_filler) * i // max(n - 1, 1)
        key = rng.randint(10000, 99999)
        at = rng.randint(0, n_fill)
        text = FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. " + FILLER * (n_fill - at)
        prompt = "There is a pass key hidden in the text below. Find it.\n\n" + text + "\nWhat is the pass key?"
        items.append(PasskeyItem(prompt, str(key)))
    return items


def passkey_accuracy(model: Any, tokenizer: Any, config: Any, items: list[PasskeyItem]) -> float:
    """Share of items whose greedy answer (12 new tokens) contains the pass key."""
    from pnmix.cli import chat_ids
    from pnmix.generation import generate

    hits = 0
    for item in items:
        ids = chat_ids(tokenizer, item.prompt)
        out, _ = generate(model, ids["input_ids"], config, ids["attention_mask"], max_new_tokens=12)
        hits += item.answer in tokenizer.decode(out[0])
    return hits / len(items)


def prompt_tokens(tokenizer: Any, item: PasskeyItem) -> int:
    from pnmix.cli import chat_ids

    ids: torch.Tensor = chat_ids(tokenizer, item.prompt)["input_ids"]
    return int(ids.shape[1])
