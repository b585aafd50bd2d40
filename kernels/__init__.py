"""Triton kernels for PN-Mix: quantize + bit-pack, and fused dequantize-attention for decode.

    kernels.pack    quantize_pack_keys, quantize_pack_values   (bit-exact with pnmix.packing)
    kernels.decode  decode_attention                           (one query token per sequence)
    kernels.layout  DecodeCache, PackedKeyBytes, PackedValueBytes, channel_order  (torch only)

Importing this package imports nothing heavy: the names below resolve lazily, so a CPU-only
machine (or one without a Triton GPU backend) can import `kernels` and `pnmix` freely. The torch
references live with the format in `pnmix/packing.py` and `pnmix/backend.decode_reference`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DecodeCache",
    "PackedKeyBytes",
    "PackedValueBytes",
    "channel_order",
    "decode_attention",
    "quantize_pack_keys",
    "quantize_pack_values",
]

_HOME = {
    "DecodeCache": "kernels.layout",
    "PackedKeyBytes": "kernels.layout",
    "PackedValueBytes": "kernels.layout",
    "channel_order": "kernels.layout",
    "decode_attention": "kernels.decode",
    "quantize_pack_keys": "kernels.pack",
    "quantize_pack_values": "kernels.pack",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
