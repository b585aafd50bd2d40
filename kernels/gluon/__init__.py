"""The Gluon decode kernels (CUDA, compute capability >= 8.0): dequantization in the tensor cores'
operand registers, the packed cache streamed through shared memory by asynchronous copies.

    kernels.gluon.common   what both kernels share: layouts, value product, fp16 tail, partials
    kernels.gluon.block    the kernel for key groups of a multiple of 128 tokens (the default)
    kernels.gluon.words    the kernel for key groups of 32 or 64 tokens
    kernels.gluon.launch   supports, decode_attention: which kernel, its launch plan, the launcher

The names below resolve lazily (importing this package imports no Triton).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["decode_attention", "shape_supported", "supports"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("pnmix.kernels.gluon.launch"), name)
    raise AttributeError(f"module 'pnmix.kernels.gluon' has no attribute {name!r}")
