"""GPU kernels for PN-Mix: quantize + bit-pack, and fused dequantize-attention for decode.

    kernels.layout       PackedKeys, PackedValues, DecodeCache, channel_order: the tensors, named (torch only)
    kernels.pack         quantize_pack_keys, quantize_pack_values (Triton; bit-exact with pnmix.packing)
    kernels.operands     DecodeOperands: the operand list every decode kernel takes, spelled once
    kernels.plan         host-side planning: SM count, splits of the packed region
    kernels.combine      the online-softmax step and the merge of split partials (Triton)
    kernels.gluon        the Gluon decode kernels, the default on CUDA (see its __init__)
    kernels.decode       decode_attention: the Triton decode kernel, the fallback (and CI's)
    kernels.decode_full  full_decode_attention: the unquantized baseline of the static path
    kernels.append       append_tokens: the static path's per-step cache append (Triton)
    kernels.compiles     watch(): how many kernel specialisations the process compiled, in what time

Importing this package imports nothing heavy: the names below resolve lazily, so a CPU-only
machine (or one without a Triton GPU backend) can import `kernels` and `pnmix` freely. The torch
references live with the format in `pnmix/packing.py` and `pnmix.backend.decode_reference`; the
design and its measured limits in docs/kernels.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DecodeCache",
    "PackedKeys",
    "PackedValues",
    "append_tokens",
    "channel_order",
    "decode_attention",
    "full_decode_attention",
    "quantize_pack_keys",
    "quantize_pack_values",
]

_HOME = {
    "append_tokens": "pnmix.kernels.append",
    "DecodeCache": "pnmix.kernels.layout",
    "PackedKeys": "pnmix.kernels.layout",
    "PackedValues": "pnmix.kernels.layout",
    "channel_order": "pnmix.kernels.layout",
    "decode_attention": "pnmix.kernels.decode",
    "full_decode_attention": "pnmix.kernels.decode_full",
    "quantize_pack_keys": "pnmix.kernels.pack",
    "quantize_pack_values": "pnmix.kernels.pack",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")

if __name__ == "kernels":  # the checkout root on sys.path: the installed `kernels` is meant (pnmix/shadow.py)
    from pnmix.shadow import stand_aside

    stand_aside(__name__, __file__)
