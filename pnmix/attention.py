"""The "pnmix" attention function, registered through `transformers.AttentionInterface`.

It receives the post-RoPE query and the `LayerStep` handles that `PNMixCache.update` returned.
Prefill: exact attention over the step's own keys and values (SDPA, the model's mask), then the
saliency choice and quantization. Later steps: append, then attend over the cache.
Called with plain tensors (no PN-Mix cache in use) it is SDPA, so a model switched to "pnmix"
still runs with any other cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pnmix.cache import LayerStep, StaticStep

ATTENTION_NAME = "pnmix"


def real_token_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device: torch.device,
                    sliding: bool = False) -> torch.Tensor:
    """bool [B, T]: the prefill columns that hold real tokens (padding is False).

    The last query row of a causal, padded prefill mask sees exactly the real tokens; under a
    sliding-window mask (`sliding`) it sees the last window only, so there a column is real where
    its own row sees it (the diagonal: a padding column is hidden from every row).
    """
    if attention_mask is None:
        return torch.ones((batch, length), dtype=torch.bool, device=device)
    if sliding:
        seen = torch.diagonal(attention_mask[:, 0, -length:, -length:], dim1=-2, dim2=-1)
    else:
        seen = attention_mask[:, 0, -1, -length:]
    if seen.dtype == torch.bool:
        return seen
    return seen == 0  # additive float mask: 0 where attended, -inf (or min) elsewhere


def pnmix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if isinstance(key, StaticStep):  # a static decode step (pnmix/static.py): append, then attend
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return key.layer.step(key.keys, key.values, query, scale), None
    if not isinstance(key, LayerStep):
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        return out, None
    layer = key.layer
    if not layer.prefilled:
        out, _ = sdpa_attention_forward(module, query, key.keys, key.values, attention_mask, dropout=0.0,
                                        scaling=scaling, **kwargs)
        b, _, t, _ = key.keys.shape
        sliding = kwargs.get("sliding_window") is not None  # a sliding-window layer of a hybrid model
        layer.prefill(query, key.keys, key.values, real_token_mask(attention_mask, b, t, query.device, sliding))
        return out, None
    layer.append(key.keys, key.values)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return layer.attend(query, scale), None


def register() -> None:
    """Registers the attention function and its mask function under "pnmix" (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, pnmix_attention)
    # A custom attention name needs a mask function too, or left-padded rows go wrong.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_pnmix_attention(model: Any) -> None:
    """Switches the model's attention to "pnmix" (SDPA when no PN-Mix cache is passed)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
