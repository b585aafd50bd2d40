"""An engine recipe as a `transformers` cache: every layer stores its keys and values as the engine would.

`RecipeCache(model.config, recipe)` holds, per layer, the keys and values round-tripped through
that layer's formats (`pnmix/kv_formats.py`), and attention reads them back dequantized, as the
engines' attention backends that dequantize before the products do. Every token is stored so,
the prompt's included, and attends on what is stored: a paged-attention engine writes the cache
before it attends. The per-tensor scales (FP8's `k_scale` / `v_scale`, NVFP4's tensor scale) are
calibrated on the prompt, each layer's keys and values apart, and kept for every later token
(which saturates where a later token exceeds them); `fp8_scale="one"` keeps FP8 at vLLM's default
scale of 1.0 instead. A sliding-window layer keeps its window as transformers' own does.

The scoring engine answers many prompts in one batch (`pnmix.prefill.build_recipe_cache`): each
prompt is prefilled alone into a `RecipeCache` (its prefill attends over what the recipe stores,
so the recorded exact prefill does not serve), and what each stored, with its scales, goes into
the PN-Mix cache's unpadded batch layers (`BatchFormatLayer`: `pnmix.cache.PNMixLayer` with the
fp16 config; `BatchFormatWindowLayer` for windows); every decoded token then enters
round-tripped with its sequence's scales.

    from pnmix.recipe_cache import RecipeCache

    cache = RecipeCache(model.config, recipe)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from pnmix.cache import BatchWindowLayer, PNMixLayer
from pnmix.config import preset
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
        if head_dim:
            recipe.check_head_dim(head_dim)
        self.recipe, self.plan = recipe, plan
        layers: list[Any] = [FormatLayer(f, fp8_scale) if kind == FULL else FormatWindowLayer(f, plan.window or 0,
                                                                                             fp8_scale)
                             for f, kind in zip(recipe.layers, plan.kinds, strict=True)]
        super().__init__(layers=layers)


class _RowScales:
    """What a batched layer stores: each sequence's new tokens round-tripped with that sequence's scales."""

    def _setup_rows(self, formats: LayerFormats, scales: list[tuple[float | None, float | None]],
                    device: torch.device) -> None:
        self.formats = formats
        self.row_scales = tuple(_column([s[side] for s in scales], device) for side in (0, 1))

    def rows(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [B, H_kv, n, d]: every sequence's new tokens round-tripped with its own scales."""
        return (_round_rows(self.formats.key, key, self.row_scales[0]),
                _round_rows(self.formats.value, value, self.row_scales[1]))


def _column(scales: list[float | None], device: torch.device) -> torch.Tensor | None:
    # float32, as a Python float scale is cast when it divides a float32 tensor: the same figures
    return None if scales[0] is None else torch.tensor(scales, dtype=torch.float32, device=device)


def _round_rows(fmt: KVFormat, x: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        return round_trip(fmt, x)
    # FP8 divides the elements by the scale; NVFP4 its blocks (one more dimension)
    extra = 1 if fmt == KVFormat.NVFP4 else 0
    return round_trip(fmt, x, scales.view(-1, *[1] * (x.dim() - 1 + extra)))


class BatchFormatLayer(_RowScales, PNMixLayer):
    """A full-attention layer of the scoring engine's batch: the fp16 PN-Mix layer (sequences of
    different lengths unpadded) holding each sequence's prompt as its `RecipeCache` stored it
    (`keys`, `values`, `scales`), fed every later token round-tripped through the layer's formats."""

    def __init__(self, formats: LayerFormats, pairing: Any, layer_idx: int, keys: list[torch.Tensor],
                 values: list[torch.Tensor], scales: list[tuple[float | None, float | None]]) -> None:
        PNMixLayer.__init__(self, preset("fp16"), pairing, layer_idx)
        self._setup_rows(formats, scales, keys[0].device)
        self.load_prefill(keys, values, None)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        super().append(*self.rows(key, value))


class BatchFormatWindowLayer(_RowScales, BatchWindowLayer):
    """A sliding-window layer of the scoring engine's batch, its windows stored in the layer's formats
    (`keys`, `values`: each sequence's positions, of which the window's last are the stored ones)."""

    def __init__(self, formats: LayerFormats, window: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                 scales: list[tuple[float | None, float | None]]) -> None:
        self._setup_rows(formats, scales, keys[0].device)
        BatchWindowLayer.__init__(self, window, keys, values)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        super().append(*self.rows(key, value))


class RecipeBatchCache(Cache):
    """An engine recipe's cache of a batch of prompts (`pnmix.prefill.build_recipe_cache`), with the
    first new token's logits of each prompt's own prefill through the recipe's cache."""

    def __init__(self, layers: list[Any], recipe: EngineRecipe, first_logits: torch.Tensor) -> None:
        self.recipe, self.first_logits = recipe, first_logits
        super().__init__(layers=layers)
