"""Which models PN-Mix supports, and how each pairs its RoPE channels.

Checked before any work starts, so that an unsupported model fails with one clear line instead
of crashing mid-generation.
"""

from __future__ import annotations

from typing import Any

from pnmix.bits import LayerPlan, ModelShape
from pnmix.config import ConfigError
from pnmix.errors import PNMixError
from pnmix.layerwise import AnyConfig, LayerwiseConfig
from pnmix.names import FULL, SLIDING
from pnmix.saliency import Pairing

# Hugging Face implementations of these families apply RoPE with `rotate_half` (channel i pairs
# with i + d/2) and go through the attention interface with a standard KV cache. Gemma 3's text
# decoder does too, after its QK-norm, with its own query scaling (`query_pre_attn_scalar`, passed
# to the attention function as `scaling`) and a RoPE base per layer kind: all of that happens before
# the cache sees a key, so PN-Mix needs nothing of it but the pairing.
ROTATE_HALF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

# The layer kinds PN-Mix serves. A full-attention layer holds every token: PN-Mix quantizes its keys.
# A sliding-window layer holds its window (`sliding_window` tokens) whatever the context: it keeps
# them in the model's dtype, exactly as transformers' own cache does (docs/design.md, "Layer kinds").
LAYER_KINDS = (FULL, SLIDING)


class UnsupportedModelError(PNMixError):
    pass


def text_config(model_config: Any) -> Any:
    return model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config


def layer_kinds(model_config: Any) -> list[str]:
    """Each layer's kind, FULL or SLIDING (a model without `layer_types` has full-attention layers only);
    raises for layer kinds PN-Mix cannot serve."""
    config = text_config(model_config)
    model_type = getattr(config, "model_type", "?")
    kinds = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
    other = sorted(set(kinds) - set(LAYER_KINDS))
    if other:
        raise UnsupportedModelError(
            f"model type {model_type!r} has {', '.join(other)} layers: PN-Mix supports full-attention layers, "
            "with sliding-window layers beside them (Gemma 3); linear-attention, cross-attention and other "
            "layer kinds are not")
    window = getattr(config, "sliding_window", None)
    if SLIDING not in kinds and window is not None and getattr(config, "use_sliding_window", True):
        kinds = [SLIDING] * len(kinds)  # a windowed model without layer_types (Mistral): every layer is one
    if FULL not in kinds:
        raise UnsupportedModelError(
            f"model type {model_type!r} uses sliding-window attention in every layer (sliding_window={window}): "
            "PN-Mix needs full-attention layers, alone or beside sliding-window ones")
    return kinds


def sliding_window(model_config: Any) -> int | None:
    """The window of the model's sliding-window layers (None: it has none)."""
    return getattr(text_config(model_config), "sliding_window", None) if SLIDING in layer_kinds(model_config) else None


def rope_pairing(model_config: Any) -> Pairing:
    """The model's RoPE channel pairing; raises for models PN-Mix cannot serve."""
    config = text_config(model_config)
    model_type = getattr(config, "model_type", "?")
    has_rope = getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_theta", None) is not None
    if not has_rope:
        raise UnsupportedModelError(
            f"model type {model_type!r} has no rotary position embedding; PN-Mix needs a RoPE decoder "
            f"({', '.join(ROTATE_HALF_FAMILIES)})"
        )
    layer_kinds(config)  # first: a hybrid of an unsupported kind is named as such, whatever its family
    if model_type not in ROTATE_HALF_FAMILIES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: allowed {', '.join(ROTATE_HALF_FAMILIES)}"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"model type {model_type!r} caps its attention logits (attn_logit_softcapping="
            f"{config.attn_logit_softcapping}): PN-Mix's attention does not; allowed models without it")
    return "rotate_half"


def plan_of_config(config: Any) -> LayerPlan:
    """Each layer's kind and the sliding window a transformers config gives its text decoder (what
    the bit figures weigh the layers by, `pnmix.bits.weighted_key_bits`)."""
    return LayerPlan(tuple(layer_kinds(config)), sliding_window(config))


def shape_of_config(config: Any) -> ModelShape:
    """The layer count, heads, KV heads and head dim a transformers config gives its text decoder."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(config.num_hidden_layers, heads, kv_heads, head_dim)


def check_model(model_config: Any, config: AnyConfig) -> tuple[Pairing, int]:
    """Validates a (model, PN-Mix config) pair, a layer-wise config's ranges against the model's
    layers too; returns (pairing, head_dim)."""
    pairing = rope_pairing(model_config)
    shape = shape_of_config(model_config)
    config.check_head_dim(shape.head_dim)
    if isinstance(config, LayerwiseConfig):
        config.per_layer(shape.num_layers)
        kinds = layer_kinds(model_config)
        sliding = [i for i, kind in enumerate(kinds) if kind == SLIDING]
        not_sliding = [i for i in config.windows if kinds[i] != SLIDING]
        if not_sliding:
            raise ConfigError("windows", ",".join(map(str, not_sliding)),
                              f"sliding-window layers ({_layers(sliding)})")
        unquantized = [i for i in config.named_layers(shape.num_layers)
                       if kinds[i] == SLIDING and i not in config.windows]
        if unquantized:
            full = [i for i, kind in enumerate(kinds) if kind == FULL]
            raise ConfigError("layers", ",".join(map(str, unquantized)),
                              f"full-attention layers ({_layers(full)}) or sliding-window layers that \"windows\" "
                              "lists: a window it does not list stays in the model's dtype")
    return pairing, shape.head_dim


def _layers(indices: list[int]) -> str:
    return ", ".join(map(str, indices)) if indices else "none"
