"""What the tuner answers with, of any method: a PN-Mix config (one for every layer, or layer-wise)
or an engine recipe (`pnmix.recipes.EngineRecipe`, each layer's key and value format in a serving
engine). One home for what differs between them: reading one back from its dict, its bit
figures, and its caches.

- Bits: key bits and KV bits per element, each layer weighted by the elements it holds on a
  hybrid model. A PN-Mix config's come from its formula (`pnmix.bits`, metadata included); an
  engine recipe's are Model-Optimizer's effective bits (bf16 16, FP8 8, NVFP4 4.5, q8_0 8.5, q4_0
  4.5), which count the block scales too, so both lie on one axis.
- Caches: `pnmix.generation.new_cache` gives either's cache for `generate`; `batch_cache` the
  scoring engine's, for a batch of recorded prefills (`pnmix.prefill.build_cache`,
  `pnmix.recipe_cache.build_recipe_cache`).
"""

from __future__ import annotations

import json
from typing import Any

from pnmix.bits import LayerPlan, weighted_key_bits, weighted_kv_bits
from pnmix.config import PNMixConfig
from pnmix.layerwise import LayerwiseConfig, config_from_dict, load_config
from pnmix.recipes import EngineRecipe

Answer = PNMixConfig | LayerwiseConfig | EngineRecipe


def is_recipe_dict(data: Any) -> bool:
    """Whether `data` is an engine recipe's dict ({"layers": [[KEY, VALUE], ...]}), not a config's."""
    return isinstance(data, dict) and "default" not in data and isinstance(data.get("layers"), list)


def answer_from_dict(data: Any) -> Answer:
    """Any answer from its `to_dict()`: an engine recipe, a layer-wise config or a single one."""
    return EngineRecipe.from_dict(data) if is_recipe_dict(data) else config_from_dict(data)


def load_answer(text: str | bytes) -> Answer:
    """Any answer from JSON: an engine recipe ({"layers": [[KEY, VALUE], ...]}), else a PN-Mix config
    (`pnmix.layerwise.load_config`, whose one-line errors a malformed file gets)."""
    try:
        data = json.loads(text)
    except (RecursionError, ValueError, TypeError):
        return load_config(text)
    return EngineRecipe.from_dict(data) if is_recipe_dict(data) else load_config(text)


def key_bits(config: Answer, plan: LayerPlan, head_dim: int) -> float:
    """Key bits per key element the model holds (weighted by what each layer holds)."""
    if isinstance(config, EngineRecipe):
        return config.key_bits(plan)
    return weighted_key_bits(config, plan, head_dim)


def kv_bits(config: Answer, plan: LayerPlan, head_dim: int) -> float:
    """KV bits per cached element (keys and values together), weighted as `key_bits`."""
    if isinstance(config, EngineRecipe):
        return config.effective_bits(plan)
    return weighted_kv_bits(config, plan, head_dim)


def batch_cache(model: Any, config: Answer, states: list[Any], multi_token: bool = False) -> Any:
    """`config`'s cache of a batch of recorded prefills, as if each had been prefilled alone."""
    from pnmix.prefill import build_cache, build_recipe_cache

    if isinstance(config, EngineRecipe):
        return build_recipe_cache(model, config, states, multi_token)
    return build_cache(model, config, states, multi_token)
