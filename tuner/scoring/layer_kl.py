"""Model-Optimizer's ranking of layers for mixed KV formats: each layer's forward KL on calibration
text with that layer alone in a format, every other layer in bf16.

For a (key, value) format pair and a layer, KL(p_bf16 || p) of the next-token distributions, summed
over the text's positions' mean, averaged over the texts: what Model-Optimizer's mixed-precision KV
recipe ranks layers by before its knapsack. It costs one forward pass per text, layer and pair, so
the engine method computes it once per model and profile (cached on disk beside the proxy's
tables) and scores the knapsack's recipe over it as one warm start, beside its own proxy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pnmix.generation import cache_kwargs, new_cache
from pnmix.kv_formats import KVFormat
from pnmix.recipes import EngineRecipe, LayerFormats


@torch.no_grad()
def forward_kl_table(model: Any, texts: Sequence[torch.Tensor], num_layers: int,
                     pairs: Sequence[LayerFormats]) -> list[list[float]]:
    """Row per pair, one figure per layer: the mean over `texts` (token ids, shape [1, T]) of the
    mean forward KL over positions with only that layer in the pair (bf16 rows are zero)."""

    def logp(recipe: EngineRecipe) -> list[torch.Tensor]:
        out = []
        for ids in texts:
            cache = new_cache(model, recipe)
            logits = model(input_ids=ids.to(model.device), use_cache=True, **cache_kwargs(model, cache)).logits
            out.append(logits[0].float().log_softmax(-1))
        return out

    bf16 = EngineRecipe.uniform(num_layers, KVFormat.BF16)
    ref = logp(bf16)
    rows = []
    for pair in pairs:
        if pair == LayerFormats(KVFormat.BF16, KVFormat.BF16):
            rows.append([0.0] * num_layers)
            continue
        row = []
        for layer in range(num_layers):
            got = logp(bf16.with_layers({layer: (pair.key, pair.value)}))
            kl = sum(float((p.exp() * (p - q)).sum(-1).mean()) for p, q in zip(ref, got, strict=True))
            row.append(kl / len(ref))
        rows.append(row)
    return rows
