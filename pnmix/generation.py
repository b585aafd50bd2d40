"""Running `model.generate` with a PN-Mix cache, on any supported transformers 5.x."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from pnmix.attention import use_pnmix_attention
from pnmix.cache import PNMixCache
from pnmix.config import PNMixConfig
from pnmix.families import check_model
from pnmix.layerwise import LayerwiseConfig
from pnmix.recipes import EngineRecipe


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword under which this transformers version takes a cache (`cache` or `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def new_cache(model: Any, config: PNMixConfig | LayerwiseConfig | EngineRecipe) -> Any:
    """A fresh cache for one generation: a PN-Mix cache (one config for every layer, or
    layer-wise), or an engine recipe's `pnmix.recipe_cache.RecipeCache`; validates the (model,
    config) pair first."""
    if isinstance(config, EngineRecipe):
        from pnmix.recipe_cache import RecipeCache

        return RecipeCache(model.config, config)
    check_model(model.config, config)
    use_pnmix_attention(model)
    return PNMixCache(model.config, config)


@torch.inference_mode()
def generate(
    model: Any,
    input_ids: torch.Tensor,
    config: PNMixConfig | LayerwiseConfig | EngineRecipe,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    **generate_kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Greedy generation (unless told otherwise) with a PN-Mix cache (or an engine recipe's);
    returns (new tokens, cache)."""
    cache = new_cache(model, config)
    input_ids = input_ids.to(model.device)  # callers tokenize on the CPU; the model may sit on a GPU
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(model.device)
    generate_kwargs.setdefault("do_sample", False)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=generate_kwargs.pop("pad_token_id", model.config.eos_token_id),
        **cache_kwargs(model, cache),
        **generate_kwargs,
    )
    return out[:, input_ids.shape[1] :], cache
