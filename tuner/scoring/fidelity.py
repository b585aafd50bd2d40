"""Long-output fidelity: teacher-forced replay of fp16 trajectories through a quantized cache.

A trajectory is the unquantized model's own greedy continuation of a prompt (cached per model).
Replaying it through a PN-Mix cache in chunks of tokens quantizes the keys of the generated
tokens exactly as long generation would (a multi-token step attends as that many single-token
steps do: `pnmix.cache.Flushed`), so the chunk size sets only the cost. At every position we
compare the quantized model's next-token distribution with the fp16 one: top-1 agreement and
KL(p_fp16 || p_quant).
`replay` does it for one trajectory through `model(...)` calls: the reference that the batched
replay of the scoring engine (tuner/scoring/engine.py) is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pnmix.configs import Answer
from pnmix.generation import cache_kwargs, new_cache

REPLAY_CHUNK = 16  # tokens fed per forward of the one-trajectory reference replay (any size is exact)

FIDELITY_PROMPTS = (
    "Write a long story about a cartographer who maps a city that keeps changing overnight.",
    "Explain in detail how a compiler turns source code into machine code, stage by stage.",
    "Describe a week in the life of a beekeeper in the mountains, day by day.",
    "Write a detailed travel guide to an imaginary island, with its history, food and festivals.",
    "Tell the story of a clockmaker's apprentice who discovers a clock that runs backwards.",
    "Explain how a city's water supply works, from the reservoir to the kitchen tap.",
    "Write a letter from a lighthouse keeper to her brother, describing a winter of storms.",
    "Describe, step by step, how to build a small wooden boat, and what can go wrong.",
    "Write a long fable about a fox, a crow and a river that changes its course.",
    "Explain the history of the printing press and how it changed the way people learned.",
    "Describe a day at a busy train station through the eyes of a ticket inspector.",
    "Write a detailed account of an expedition to the top of a glacier, day by day.",
)


@dataclass(frozen=True)
class Fidelity:
    agreement: float  # top-1 agreement with the fp16 next token, over all positions
    mean_kl: float  # mean KL(p_fp16 || p_quant) per token, nats
    tokens: int

    @property
    def score(self) -> float:
        return math.exp(-self.mean_kl)


@torch.inference_mode()
def trajectory(model: Any, prompt_ids: torch.Tensor, n_tokens: int) -> list[int]:
    """The unquantized model's greedy continuation of prompt_ids [1, P], exactly n_tokens long."""
    model.set_attn_implementation("sdpa")
    prompt_ids = prompt_ids.to(model.device)
    out = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                         max_new_tokens=n_tokens, min_new_tokens=n_tokens, pad_token_id=model.config.eos_token_id)
    return [int(t) for t in out[0, prompt_ids.shape[1]:]]


@torch.inference_mode()
def reference_logits(model: Any, prompt_ids: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """fp logits [n, vocab] predicting each continuation token, from one full forward pass."""
    model.set_attn_implementation("sdpa")
    prompt_ids = prompt_ids.to(model.device)
    full = torch.cat([prompt_ids, torch.tensor([continuation], device=model.device)], dim=1)
    logits = model(input_ids=full, use_cache=False).logits[0].float()
    p = prompt_ids.shape[1]
    return logits[p - 1 : p - 1 + len(continuation)]


@torch.inference_mode()
def replay(model: Any, prompt_ids: torch.Tensor, continuation: list[int], config: Answer,
           reference: torch.Tensor, chunk: int = REPLAY_CHUNK) -> Fidelity:
    """Teacher-forces `continuation` through a PN-Mix cache; compares with `reference` logits."""
    cache = new_cache(model, config)
    kw = cache_kwargs(model, cache)
    out = model(input_ids=prompt_ids.to(model.device), use_cache=True, **kw)
    pieces = [out.logits[0, -1:].float()]
    tokens = torch.tensor([continuation[:-1]], device=model.device)
    for start in range(0, tokens.shape[1], chunk):
        out = model(input_ids=tokens[:, start : start + chunk], use_cache=True, **kw)
        pieces.append(out.logits[0].float())
    logits = torch.cat(pieces)
    log_p = reference.log_softmax(-1)
    log_q = logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float()
    return Fidelity(agreement=float(agree.mean()), mean_kl=float(kl.mean()), tokens=len(continuation))
