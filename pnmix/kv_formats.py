"""The KV-cache formats serving engines store, emulated exactly in torch.

Each function takes a key or value tensor `[..., head_dim]` and returns what the engine's
attention reads back: the tensor quantized as the engine stores it and dequantized again, in the
input's dtype. Attention then runs on those tensors, as the engines' attention backends that
dequantize before the products do; an FP8 attention that also quantizes the queries (FlashInfer's
or FlashAttention 3's FP8 path) is not modelled.

- `fp8`: FP8 E4M3 with one scale per tensor, vLLM's `k_scale` / `v_scale`: x / scale saturated to
  +-448 and rounded to nearest even by torch's `float8_e4m3fn` cast, times scale. The scale is 1.0
  (vLLM's default) or calibrated on the prefill as amax / 448 (`fp8_scale`).
- `nvfp4`: NVFP4 as Model-Optimizer defines it: E2M1 values (+-0, 0.5, 1, 1.5, 2, 3, 4, 6) in
  blocks of 16 along head_dim, an E4M3 scale per block and an fp32 scale per tensor; the tensor
  scale is amax / (6 * 448), a block's scale amax_block / 6 / tensor scale cast to E4M3, and a
  value rounds to the nearest E2M1 magnitude, ties to the even one (as the hardware's `cvt.rn`).
- `q8_0`, `q4_0`: llama.cpp's blocks of 32 along head_dim with an fp16 scale (ggml's reference
  quantizers `quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`): q8_0 stores round(x / d) with
  d = amax / 127, rounding half away from zero; q4_0 stores min(15, trunc(x / d + 8.5)) with
  d = max / -8, `max` the block's value of largest magnitude, and reads (q - 8) * d. Both quantize
  with the fp32 d and dequantize with its fp16 copy, as ggml does.
- `bf16`: the tensor in bfloat16.

`EFFECTIVE_BITS` is each format's bits per element with its scales, Model-Optimizer's
`kv_effective_bits` for the formats it names (bf16 16, FP8 8, NVFP4 4.5) and the block layout's for
llama.cpp's (q8_0: 34 bytes per 32 values, 8.5; q4_0: 18 bytes, 4.5).

torch is imported where the arithmetic runs, so that the formats' names and bits load without it
(the command line reads them at start-up).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class KVFormat(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"


EFFECTIVE_BITS = {KVFormat.BF16: 16.0, KVFormat.FP8: 8.0, KVFormat.NVFP4: 4.5, KVFormat.Q8_0: 8.5,
                  KVFormat.Q4_0: 4.5}
FP8_MAX = 448.0  # the largest finite E4M3 magnitude
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the E2M1 magnitudes, codes 0..7
NVFP4_BLOCK = 16
GGML_BLOCK = 32


def fp8_scale(x: torch.Tensor) -> float:
    """The per-tensor scale calibrated on `x` (the prefill's keys or values): amax / 448, 1.0 for an
    all-zero tensor."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / FP8_MAX if amax > 0 else 1.0


def fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """E4M3 with a per-tensor scale, saturating, round to nearest even; dequantized."""
    import torch

    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:

    if x.shape[-1] % size:
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of the format's block of {size}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // size, size)


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 value of each element of `x` (|x| <= 6 expected, larger saturate), ties to the
    value whose code is even."""
    import torch

    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    dist = (mag[..., None] - values).abs()
    best = dist.min(-1, keepdim=True).values
    # Among the nearest values (two at a tie), the even code: the lowest even index among them.
    codes = torch.arange(len(E2M1_VALUES), device=x.device)
    candidates = torch.where(dist == best, codes + (codes % 2) * len(E2M1_VALUES), 2 * len(E2M1_VALUES))
    chosen = values[candidates.argmin(-1)]
    return torch.copysign(chosen, x)


def nvfp4_scale(x: torch.Tensor) -> float:
    """NVFP4's per-tensor scale calibrated on `x`: amax / (6 * 448), 1.0 for an all-zero tensor."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / (E2M1_MAX * FP8_MAX) if amax > 0 else 1.0


def nvfp4(x: torch.Tensor, tensor_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 (blocks of 16, E4M3 block scales, fp32 tensor scale: `x`'s own, `nvfp4_scale`, unless
    given); dequantized. Given a smaller tensor scale than `x` needs, block scales saturate at 448."""
    import torch

    blocks = _blocks(x, NVFP4_BLOCK)
    scale = nvfp4_scale(blocks) if tensor_scale is None else tensor_scale
    block_amax = blocks.abs().amax(-1, keepdim=True)
    block_scale = (block_amax / E2M1_MAX / scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    q = torch.where(block_scale > 0, e2m1(blocks / safe), torch.zeros_like(blocks))
    return (q * block_scale).reshape(x.shape).to(x.dtype)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q8_0; dequantized."""
    import torch

    blocks = _blocks(x, GGML_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    v = blocks * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf: half away from zero
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def q4_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q4_0; dequantized."""
    import torch

    blocks = _blocks(x, GGML_BLOCK)
    where = blocks.abs().argmax(-1, keepdim=True)  # the first element of largest magnitude, as ggml's loop
    d = blocks.gather(-1, where) / -8.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.trunc(blocks * inv + 8.5).clamp(max=15)  # (int8_t) truncates toward zero; MIN(15, ...)
    return ((q - 8) * d.half().float()).reshape(x.shape).to(x.dtype)


def bf16(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x.to(torch.bfloat16).to(x.dtype)


def calibrate(fmt: KVFormat | str, x: torch.Tensor) -> float | None:
    """The per-tensor scale a format takes from the prefill's `x` (FP8's k_scale / v_scale, NVFP4's
    tensor scale); None for the formats that have none."""
    fmt = KVFormat(fmt)
    return fp8_scale(x) if fmt == KVFormat.FP8 else nvfp4_scale(x) if fmt == KVFormat.NVFP4 else None


def round_trip(fmt: KVFormat | str, x: torch.Tensor, scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """`x` stored in `fmt` and read back; `scale`: FP8's per-tensor scale (default 1.0) or NVFP4's
    (default `x`'s own)."""
    fmt = KVFormat(fmt)
    if fmt == KVFormat.FP8:
        return fp8(x, 1.0 if scale is None else scale)
    if fmt == KVFormat.NVFP4:
        return nvfp4(x, scale)
    return {KVFormat.BF16: bf16, KVFormat.Q8_0: q8_0, KVFormat.Q4_0: q4_0}[fmt](x)
