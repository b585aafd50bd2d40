"""The tensors the kernels read and write, named (torch only: no Triton import here).

The stored format is defined in `pnmix/packing.py`, with its torch reference; these containers
hold it: `PackedKeys` and `PackedValues` what a pack writes (the kernels of `kernels.pack` and the
reference alike), `DecodeCache` one layer as the decode kernels read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class PackedKeys:
    """Keys quantized per channel over groups of G tokens, bit planes packed along tokens."""

    low: torch.Tensor  # uint8 [..., n_groups, b_low, d, G // 8]             bit p of every channel's codes
    high: torch.Tensor  # uint8 [..., n_groups, b_high - b_low, n_sc, G // 8]  bit b_low + p, salient channels
    scale: torch.Tensor  # fp16 [..., n_groups, d]
    zero: torch.Tensor  # fp16 [..., n_groups, d]


@dataclass
class PackedValues:
    """Values quantized per token over groups of G_V channels, codes packed along channels."""

    packed: torch.Tensor  # uint8 [..., T, d * b_V // 8]
    scale: torch.Tensor  # fp16 [..., T, d // G_V]
    zero: torch.Tensor  # fp16 [..., T, d // G_V]


def channel_order(salient_channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int32 [..., d]: the non-salient channels ascending, then the salient ones ascending.

    The decode kernels read the salient channels (the last n_sc entries) in this order, the order
    of their high bit-plane rows. Computed on the device, no host synchronisation.
    """
    lead = salient_channels.shape[:-1]
    is_salient = torch.zeros((*lead, head_dim), dtype=torch.int8, device=salient_channels.device)
    if salient_channels.shape[-1]:
        is_salient.scatter_(-1, salient_channels.long(), 1)
    return torch.sort(is_salient, dim=-1, stable=True).indices.to(torch.int32)


@dataclass(kw_only=True)
class DecodeCache:
    """One layer's PN-Mix cache as the decode kernels read it (built with keywords only).

    B sequences, H_kv KV heads, head dim d. Per sequence b, in token order:
    [k/v_sink[b, :, :sink_len[b]] | n_groups[b] packed groups of G tokens | k/v_res[b, :, :res_len[b]]].
    Inner dimensions must be contiguous; batch and head strides are free. Capacities (the tensors'
    shapes) shape a launch, lengths (device tensors) only what a program reads.
    """

    # The packed fields, named as `PackedKeys` / `PackedValues` with a k_ / v_ prefix.
    PACKED: ClassVar[tuple[str, ...]] = ("k_low", "k_high", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero")

    k_sink: torch.Tensor  # float [B, H_kv, S_cap, d]     (v_sink: same shape and strides)
    v_sink: torch.Tensor
    k_res: torch.Tensor  # float [B, H_kv, R_cap, d]      (v_res: same shape and strides)
    v_res: torch.Tensor
    k_low: torch.Tensor  # uint8 [B, H_kv, NG_cap, b_low, d, G // 8]             bits along tokens
    k_high: torch.Tensor  # uint8 [B, H_kv, NG_cap, b_high - b_low, n_sc, G // 8] salient rows only
    k_scale: torch.Tensor  # fp16 [B, H_kv, NG_cap, d]
    k_zero: torch.Tensor  # fp16 [B, H_kv, NG_cap, d]
    v_packed: torch.Tensor  # uint8 [B, H_kv, NG_cap * G, d * b_V // 8]      codes along channels
    v_scale: torch.Tensor  # fp16 [B, H_kv, NG_cap * G, d // G_V]
    v_zero: torch.Tensor  # fp16 [B, H_kv, NG_cap * G, d // G_V]
    channel_order: torch.Tensor  # int32 [B, H_kv, d], see `channel_order`
    sink_len: torch.Tensor  # int32 [B] sinks held (<= S_cap)
    n_groups: torch.Tensor  # int32 [B] packed groups held (<= NG_cap)
    res_len: torch.Tensor  # int32 [B] residual tokens held (<= R_cap)
    b_low: int
    b_high: int
    group_size: int
    value_bits: int
    value_group_size: int

    @property
    def n_salient_channels(self) -> int:
        return self.k_high.shape[-2]
