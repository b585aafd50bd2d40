"""The PN-Mix storage format: quantization rule and bit packing, with torch reference code.

This module is the one definition of the stored bytes. The Triton kernels (kernels/) must
produce and read exactly this layout; tests compare them bit for bit.

Quantizer (asymmetric, per group; docs/design.md, "The method"):
    z = fp16(min(x)),  s = fp16((max(x) - min(x)) / (2^b - 1))          over the group
    q = clamp(floor((x - z) / s + 0.5), 0, 2^b - 1)                       in fp32; s == 0 -> q = 0
    x^ = q * s + z                                                        in fp32
Halves round up (floor(v + 0.5)) rather than to even, so that a kernel can reproduce it exactly.

Keys, per (sequence, KV head), quantized per channel over groups of G consecutive tokens, stored
as bit planes packed along tokens. Token t of a group sits in byte t // 8, bit t % 8 (LSB first):
    low   uint8 [..., n_groups, b_low, d, G // 8]           bit p of q, every channel
    high  uint8 [..., n_groups, b_high - b_low, n_sc, G // 8]  bit b_low + p of q, salient channels
    scale fp16  [..., n_groups, d]      zero fp16 [..., n_groups, d]
A salient channel is quantized with 2^b_high - 1 levels, every other with 2^b_low - 1. `n_sc` is
twice the number of salient pairs; the rows of `high` follow `salient_channels` (ascending).
A channel group of G tokens is G/8 contiguous bytes per plane, so a decode kernel loads whole
groups with wide loads, and only salient channels pay for their upper bits.

Values, quantized per token over groups of `value_group_size` channels, packed along channels:
    packed uint8 [..., T, d * b_V // 8]   channel c in byte c // (8 // b_V), bits starting at
                                          (c % (8 // b_V)) * b_V (LSB first); b_V = 8 is one byte
    scale, zero fp16 [..., T, d // value_group_size]
The containers of these tensors, `PackedKeys` and `PackedValues`, are defined in kernels/layout.py
(torch only), so that the reference here and the pack kernels return the same types.
"""

from __future__ import annotations

import torch

from pnmix.kernels.layout import PackedKeys, PackedValues

TOKENS_PER_BYTE = 8


def quantize_groups(x: torch.Tensor, levels: torch.Tensor | int, dim: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric quantization of `x` with min/max taken along `dim` (kept as size 1).

    `levels` (2^b - 1) broadcasts against the reduced shape, so channels may differ in bits.
    Returns (q as uint8, scale fp16, zero fp16), scale and zero with `dim` kept.
    """
    x = x.float()
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    zero = lo.to(torch.float16)
    scale = ((hi - lo) / levels).to(torch.float16)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.floor((x - zero.float()) / safe + 0.5)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    q = torch.minimum(q.clamp_min(0), torch.as_tensor(levels, dtype=q.dtype, device=q.device))
    return q.to(torch.uint8), scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x^ = q * s + z in fp32 (scale and zero broadcast against q)."""
    return q.float() * scale.float() + zero.float()


# -- bit planes along tokens (keys) ------------------------------------------------------------


def pack_planes(q: torch.Tensor, first_bit: int, n_planes: int) -> torch.Tensor:
    """q uint8 [..., G, C] -> uint8 [..., n_planes, C, G // 8]: bits first_bit.. of q, 8 tokens a byte."""
    *lead, g, c = q.shape
    shifts = torch.arange(first_bit, first_bit + n_planes, device=q.device, dtype=torch.uint8)
    bits = (q.unsqueeze(-3) >> shifts.view(-1, 1, 1)) & 1  # [..., P, G, C]
    bits = bits.transpose(-1, -2).reshape(*lead, n_planes, c, g // TOKENS_PER_BYTE, TOKENS_PER_BYTE)
    weights = (1 << torch.arange(TOKENS_PER_BYTE, device=q.device)).to(torch.int32)
    return (bits.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_planes(planes: torch.Tensor, first_bit: int) -> torch.Tensor:
    """uint8 [..., P, C, G // 8] -> the planes' contribution to q, uint8 [..., G, C]."""
    *lead, p, c, gb = planes.shape
    shifts = torch.arange(TOKENS_PER_BYTE, device=planes.device, dtype=torch.uint8)
    bits = (planes.unsqueeze(-1) >> shifts) & 1  # [..., P, C, G // 8, 8]
    bits = bits.reshape(*lead, p, c, gb * TOKENS_PER_BYTE)
    weights = (1 << torch.arange(first_bit, first_bit + p, device=planes.device)).to(torch.int32)
    q = (bits.to(torch.int32) * weights.view(-1, 1, 1)).sum(-3)  # [..., C, G]
    return q.transpose(-1, -2).to(torch.uint8)


def channel_levels(
    head_dim: int, salient_channels: torch.Tensor, b_low: int, b_high: int, lead: tuple[int, ...]
) -> torch.Tensor:
    """Quantization levels (2^bits - 1) per channel, float [..., 1, d]; salient channels get b_high."""
    levels = torch.full((*lead, head_dim), float(2**b_low - 1), device=salient_channels.device)
    if salient_channels.shape[-1]:
        levels.scatter_(-1, salient_channels.long(), float(2**b_high - 1))
    return levels.unsqueeze(-2)


def quantize_keys(
    k: torch.Tensor, salient_channels: torch.Tensor, b_low: int, b_high: int, group_size: int
) -> PackedKeys:
    """k [..., n_groups * G, d] -> PackedKeys. salient_channels int [..., n_sc], ascending."""
    *lead, t, d = k.shape
    n_groups = t // group_size
    assert n_groups * group_size == t, "keys are quantized in whole groups"
    kg = k.reshape(*lead, n_groups, group_size, d)
    levels = channel_levels(d, salient_channels, b_low, b_high, tuple(lead)).unsqueeze(-3)  # [..., 1, 1, d]
    q, scale, zero = quantize_groups(kg, levels, dim=-2)  # q [..., n, G, d]
    low = pack_planes(q, 0, b_low)
    n_sc = salient_channels.shape[-1]
    if b_high > b_low and n_sc:
        idx = salient_channels.long()[..., None, None, :].expand(*lead, n_groups, group_size, n_sc)
        high = pack_planes(torch.gather(q, -1, idx), b_low, b_high - b_low)
    else:
        high = torch.zeros((*lead, n_groups, b_high - b_low, n_sc, group_size // 8), dtype=torch.uint8, device=k.device)
    return PackedKeys(low, high, scale.squeeze(-2), zero.squeeze(-2))


def fake_quantize_keys(
    k: torch.Tensor, salient_channels: torch.Tensor, b_low: int, b_high: int, group_size: int
) -> torch.Tensor:
    """What the stored keys decode to, without packing: equals dequantize_keys(quantize_keys(...)).

    Packing is lossless, so simulations (the tuner's proxy, `pnmix analyze`) skip the bit planes.
    """
    *lead, t, d = k.shape
    kg = k.reshape(*lead, t // group_size, group_size, d)
    levels = channel_levels(d, salient_channels, b_low, b_high, tuple(lead)).unsqueeze(-3)
    q, scale, zero = quantize_groups(kg, levels, dim=-2)
    return dequantize(q, scale, zero).reshape(*lead, t, d)


def dequantize_keys(packed: PackedKeys, salient_channels: torch.Tensor, b_low: int) -> torch.Tensor:
    """PackedKeys -> float32 [..., n_groups * G, d]."""
    q = unpack_keys(packed, salient_channels, b_low)  # [..., n, G, d]
    x = dequantize(q, packed.scale.unsqueeze(-2), packed.zero.unsqueeze(-2))
    *lead, n, g, d = x.shape
    return x.reshape(*lead, n * g, d)


def unpack_keys(packed: PackedKeys, salient_channels: torch.Tensor, b_low: int) -> torch.Tensor:
    """PackedKeys -> q uint8 [..., n_groups, G, d] (low planes plus salient channels' high planes)."""
    q = unpack_planes(packed.low, 0)
    if packed.high.shape[-3] and salient_channels.shape[-1]:
        high = unpack_planes(packed.high, b_low)  # [..., n, G, n_sc]
        *lead, n, g, n_sc = high.shape
        idx = salient_channels.long()[..., None, None, :].expand(*lead, n, g, n_sc)
        q = q.scatter_add(-1, idx, high)
    return q


# -- values along channels ---------------------------------------------------------------------


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> PackedValues:
    """v [..., T, d] -> PackedValues, per token, groups of `group_size` channels."""
    *lead, t, d = v.shape
    vg = v.reshape(*lead, t, d // group_size, group_size)
    q, scale, zero = quantize_groups(vg, 2**bits - 1, dim=-1)
    q = q.reshape(*lead, t, d)
    return PackedValues(pack_along_channels(q, bits), scale.squeeze(-1), zero.squeeze(-1))


def dequantize_values(packed: PackedValues, bits: int, group_size: int) -> torch.Tensor:
    """PackedValues -> float32 [..., T, d]."""
    q = unpack_along_channels(packed.packed, bits)
    *lead, t, d = q.shape
    qg = q.reshape(*lead, t, d // group_size, group_size)
    return dequantize(qg, packed.scale.unsqueeze(-1), packed.zero.unsqueeze(-1)).reshape(*lead, t, d)


def pack_along_channels(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q uint8 [..., d] -> uint8 [..., d * bits // 8]."""
    per_byte = 8 // bits
    *lead, d = q.shape
    shifts = (torch.arange(per_byte, device=q.device) * bits).to(torch.int32)
    return (q.reshape(*lead, d // per_byte, per_byte).to(torch.int32) << shifts).sum(-1).to(torch.uint8)


def unpack_along_channels(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., d * bits // 8] -> q uint8 [..., d]."""
    per_byte = 8 // bits
    *lead, n = packed.shape
    shifts = (torch.arange(per_byte, device=packed.device) * bits).to(torch.uint8)
    q = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return q.reshape(*lead, n * per_byte)
