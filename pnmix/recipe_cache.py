"""An engine recipe as a `transformers` cache: every layer stores its keys and values as the engine would.

`RecipeCache(model.config, recipe)` holds, per layer, the keys and values round-tripped through
that layer's formats (`pnmix/kv_formats.py`), and attention reads them back dequantized, as the
engines' attention backends that dequantize before the products do. Every token is stored so,
the prompt's included, and attends on what is stored: a paged-attention engine writes the cache
before it attends. The per-tensor scales (FP8's `k_scale` / `v_scale`, NVFP4's tensor scale) are
calibrated on the prompt, each layer's keys and values apart, and kept for every later token
(which saturates where a later token exceeds them); `fp8_scale="one"` keeps FP8 at vLLM's default
scale of 1.0 instead. A sliding-window layer keeps its window as transformers' own does.

    from pnmix.recipe_cache import RecipeCache

    cache = RecipeCache(model.config, recipe)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from pnmix.families import FULL, plan_of_config
from pnmix.kv_formats import KVFormat, calibrate, round_trip
from pnmix.recipes import EngineRecipe, LayerFormats, RecipeError

Fp8Scale = Literal["calibrated", "one"]


class _Stored:
    """What a layer stores: its states round-tripped through its formats before they enter it."""

    def _setup(self, formats: LayerFormats, fp8_scale: Fp8Scale) -> None:
        self.formats, self.fp8_scale = formats, fp8_scale
        self.scales: tuple[float | None, float | None] | None = None  # (keys', values'), set by the prompt

    def _scale(self, fmt: KVFormat, states: torch.Tensor) -> float | None:
        return 1.0 if fmt == KVFormat.FP8 and self.fp8_scale == "one" else calibrate(fmt, states)

    def stored(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scales is None:
            self.scales = (self._scale(self.formats.key, key_states), self._scale(self.formats.value, value_states))
        return (round_trip(self.formats.key, key_states, self.scales[0]),
                round_trip(self.formats.value, value_states, self.scales[1]))


class FormatLayer(_Stored, DynamicLayer):
    """A full-attention layer whose keys and values are stored in the recipe's formats."""

    def __init__(self, formats: LayerFormats, fp8_scale: Fp8Scale = "calibrated") -> None:
        super().__init__()
        self._setup(formats, fp8_scale)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().update(*self.stored(key_states, value_states), *args, **kwargs)


class FormatWindowLayer(_Stored, DynamicSlidingWindowLayer):
    """A sliding-window layer whose window is stored in the recipe's formats."""

    def __init__(self, formats: LayerFormats, window: int, fp8_scale: Fp8Scale = "calibrated") -> None:
        super().__init__(sliding_window=window)
        self._setup(formats, fp8_scale)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().update(*self.stored(key_states, value_states), *args, **kwargs)


class RecipeCache(Cache):
    """A cache for `model_config`'s layers stored as `recipe` says (one LayerFormats a layer)."""

    def __init__(self, model_config: Any, recipe: EngineRecipe, fp8_scale: Fp8Scale = "calibrated") -> None:
        if fp8_scale not in ("calibrated", "one"):
            raise RecipeError(f"invalid fp8_scale {fp8_scale!r}: allowed calibrated, one")
        plan = plan_of_config(model_config)
        if len(recipe.layers) != len(plan.kinds):
            raise RecipeError(f"the recipe has {len(recipe.layers)} layers, the model {len(plan.kinds)}")
        head_dim = int(getattr(model_config.get_text_config(decoder=True), "head_dim", 0) or 0)
        for formats in recipe.layers:
            for fmt in (formats.key, formats.value):
                block = {KVFormat.NVFP4: 16, KVFormat.Q8_0: 32, KVFormat.Q4_0: 32}.get(fmt)
                if block and head_dim and head_dim % block:
                    raise RecipeError(f"{fmt} stores blocks of {block} along head_dim; this model's head_dim is "
                                      f"{head_dim}")
        self.recipe, self.plan = recipe, plan
        layers: list[Any] = [FormatLayer(f, fp8_scale) if kind == FULL else FormatWindowLayer(f, plan.window or 0,
                                                                                             fp8_scale)
                             for f, kind in zip(recipe.layers, plan.kinds, strict=True)]
        super().__init__(layers=layers)
