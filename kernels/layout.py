"""Operand containers and small torch helpers for the kernels (no Triton import here).

The byte layout itself is defined in `pnmix/packing.py` (the one definition); these dataclasses
only name the tensors a kernel reads or writes, with their shapes in comments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class PackedKeyBytes:
    low: torch.Tensor  # uint8 [..., n_groups, b_low, d, G // 8]
    high: torch.Tensor  # uint8 [..., n_groups, b_high - b_low, n_sc, G // 8]
    scale: torch.Tensor  # fp16 [..., n_groups, d]
    zero: torch.Tensor  # fp16 [..., n_groups, d]


@dataclass
class PackedValueBytes:
    packed: torch.Tensor  # uint8 [..., T, d * b_V // 8]
    scale: torch.Tensor  # fp16 [..., T, d // G_V]
    zero: torch.Tensor  # fp16 [..., T, d // G_V]


def channel_order(salient_channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int32 [..., d]: the non-salient channels ascending, then the salient ones ascending.

    The decode kernel reads channels in this order so that a channel's high bit planes line up
    with it (high rows follow the salient channels in ascending order). Computed on the device,
    no host synchronisation.
    """
    lead = salient_channels.shape[:-1]
    is_salient = torch.zeros((*lead, head_dim), dtype=torch.int8, device=salient_channels.device)
    if salient_channels.shape[-1]:
        is_salient.scatter_(-1, salient_channels.long(), 1)
    return torch.sort(is_salient, dim=-1, stable=True).indices.to(torch.int32)


@dataclass
class DecodeCache:
    """One layer's PN-Mix cache as the fused decode kernel reads it.

    B sequences, H_kv KV heads, head dim d. Per sequence b, in token order:
    [k/v_sink[b, :, :sink_len[b]] | n_groups[b] packed groups of G tokens | k/v_res[b, :, :res_len[b]]].
    Inner dimensions must be contiguous; batch and head strides are free.
    """

    k_sink: torch.Tensor  # float [B, H_kv, S_cap, d]     (v_sink: same shape and strides)
    v_sink: torch.Tensor
    k_res: torch.Tensor  # float [B, H_kv, R_cap, d]      (v_res: same shape and strides)
    v_res: torch.Tensor
    k_low: torch.Tensor  # uint8 [B, H_kv, NG_cap, b_low, d, G // 8]            bits along tokens
    k_high: torch.Tensor  # uint8 [B, H_kv, NG_cap, b_high - b_low, n_sc, G // 8] salient rows only
    k_scale: torch.Tensor  # fp16 [B, H_kv, NG_cap, d]
    k_zero: torch.Tensor  # fp16 [B, H_kv, NG_cap, d]
    v_packed: torch.Tensor  # uint8 [B, H_kv, NG_cap * G, d * b_V // 8]      bits along channels
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
