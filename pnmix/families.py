"""Which models PN-Mix supports, and how each pairs its RoPE channels.

Checked before any work starts, so that an unsupported model fails with one clear line instead
of crashing mid-generation.
"""

from __future__ import annotations

from typing import Any

from pnmix.errors import PNMixError
from pnmix.layerwise import AnyConfig, LayerwiseConfig
from pnmix.saliency import Pairing

# Hugging Face implementations of these families apply RoPE with `rotate_half` (channel i pairs
# with i + d/2) and go through the attention interface with a standard KV cache.
ROTATE_HALF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModelError(PNMixError):
    pass


def rope_pairing(model_config: Any) -> Pairing:
    """The model's RoPE channel pairing; raises for models PN-Mix cannot serve."""
    config = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    model_type = getattr(config, "model_type", "?")
    has_rope = getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_theta", None) is not None
    if not has_rope:
        raise UnsupportedModelError(
            f"model type {model_type!r} has no rotary position embedding; PN-Mix needs a RoPE decoder "
            f"({', '.join(ROTATE_HALF_FAMILIES)})"
        )
    if model_type not in ROTATE_HALF_FAMILIES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: allowed {', '.join(ROTATE_HALF_FAMILIES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"model type {model_type!r} uses {sorted(set(layer_types))} layers: PN-Mix supports full-attention "
            "layers only (sliding-window and linear-attention layers are not)"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise UnsupportedModelError(
            f"model type {model_type!r} uses sliding-window attention (sliding_window={window}); "
            "PN-Mix supports full attention only"
        )
    return "rotate_half"


def check_model(model_config: Any, config: AnyConfig) -> tuple[Pairing, int]:
    """Validates a (model, PN-Mix config) pair, a layer-wise config's ranges against the model's
    layers too; returns (pairing, head_dim)."""
    from pnmix.models import shape_of_config

    pairing = rope_pairing(model_config)
    shape = shape_of_config(model_config)
    config.check_head_dim(shape.head_dim)
    if isinstance(config, LayerwiseConfig):
        config.per_layer(shape.num_layers)
    return pairing, shape.head_dim
