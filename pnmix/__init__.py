"""PN-Mix: mixed-precision KV-cache quantization for Hugging Face `transformers` models.

    from pnmix import generate, load_model, preset

    lm = load_model("smollm2-135m")
    ids = lm.tokenizer("The history of the printing press", return_tensors="pt")
    new_tokens, cache = generate(lm.model, ids["input_ids"], preset("pnmix-paper"), ids["attention_mask"], 64)

A layer-wise config (`LayerwiseConfig`, docs/layerwise.md) goes wherever a `PNMixConfig` goes;
`load_config(text)` reads either from JSON (what `pnmix export` writes).

`import pnmix` stays light: the names whose modules import torch and transformers (the cache,
`generate`, the static path, the model loader) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pnmix.config import PNMixConfig, preset
from pnmix.errors import PNMixError
from pnmix.layerwise import LayerwiseConfig, load_config

if TYPE_CHECKING:
    from pnmix.cache import PNMixCache
    from pnmix.generation import generate
    from pnmix.models import load as load_model
    from pnmix.static import StaticGenerator

# Public name -> (module, attribute), imported when first asked for.
_LAZY = {
    "PNMixCache": ("pnmix.cache", "PNMixCache"),
    "StaticGenerator": ("pnmix.static", "StaticGenerator"),
    "generate": ("pnmix.generation", "generate"),
    "load_model": ("pnmix.models", "load"),
}

__all__ = ["LayerwiseConfig", "PNMixCache", "PNMixConfig", "PNMixError", "StaticGenerator", "generate", "load_config",
           "load_model", "preset"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
