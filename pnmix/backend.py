"""Which implementation runs the PN-Mix decode path: the torch reference or the Triton kernels.

    PNMIX_BACKEND=auto    (default) Triton kernels for CUDA tensors, torch everywhere else
    PNMIX_BACKEND=torch   always the torch reference (dequantized view + SDPA)
    PNMIX_BACKEND=triton  always the kernels; on the CPU this only works under TRITON_INTERPRET=1

`set_backend` overrides the environment (tests use it). The kernels package is imported lazily,
only when the Triton path is taken, so `pnmix` imports and runs without a Triton GPU backend.

Which fused decode kernel the Triton path runs:

    PNMIX_DECODE_KERNEL=auto    (default) the Gluon kernels (`kernels.gluon`: dequantization in the
                                tensor cores' operand registers, loads through a cp.async ring) on
                                CUDA where their limits admit the shape, else `kernels.decode`.
                                On an H200 they are 1.6-2.9x faster than bf16 SDPA and several
                                times faster than the Triton kernel (docs/kernels.md).
    PNMIX_DECODE_KERNEL=triton  always `kernels.decode` (Triton; what CI runs under the interpreter)
    PNMIX_DECODE_KERNEL=mma     always the Gluon kernels; a shape or device they cannot run is an error

This module also holds the torch reference of the fused decode kernel, `decode_reference`:
dequantize the stored bytes with `pnmix.packing`, then attend in fp32. Tests and the benchmark
compare the kernel with it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from pnmix import packing
from pnmix.layerwise import LayerwiseConfig
from pnmix.names import BACKENDS

if TYPE_CHECKING:
    from pnmix.kernels.layout import DecodeCache

DECODE_KERNELS = ("auto", "triton", "mma")
_override: str | None = None


def set_backend(name: str | None) -> None:
    """Forces a backend for this process (None: back to PNMIX_BACKEND / auto)."""
    global _override
    if name is not None and name not in BACKENDS:
        raise ValueError(f"invalid backend={name!r}: allowed one of {', '.join(BACKENDS)}")
    _override = name


def backend_name() -> str:
    name = _override or os.environ.get("PNMIX_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"invalid PNMIX_BACKEND={name!r}: allowed one of {', '.join(BACKENDS)}")
    return name


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernels take this head dim (a power of two, at least 16)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def kernels_support(config: Any, head_dim: int) -> bool:
    """Whether the kernels implement this PN-Mix config and head dim (else the torch path runs); a
    layer-wise config: every one of its layers' configs."""
    if isinstance(config, LayerwiseConfig):
        layers = [config.default] + [config.for_layer(r.first) for r in config.ranges]
        return all(kernels_support(c, head_dim) for c in layers)
    vg = config.value_group_size
    return (
        head_dim_supported(head_dim)
        and config.keys_quantized
        and config.values_quantized
        and not vg & (vg - 1)
        and head_dim % vg == 0
    )


def kernels_enabled(device: torch.device) -> bool:
    """Whether the backend switch sends attention on `device` to the Triton kernels (whatever the config)."""
    name = backend_name()
    if name == "torch":
        return False
    if name == "triton":
        return True
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device, config: Any, head_dim: int) -> bool:
    """True when the decode path of a layer on `device` should run the Triton kernels."""
    return kernels_enabled(device) and kernels_support(config, head_dim)


def quantizers(use_kernels: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(quantize_keys, quantize_values): the Triton pack on the kernel path, else the torch reference
    (`pnmix.packing`); both write the same bytes."""
    if use_kernels:
        return quantize_keys, quantize_values
    return packing.quantize_keys, packing.quantize_values


# -- torch reference of the fused decode kernel ---------------------------------------------------


def salient_channels_from_order(order: torch.Tensor, n_salient_channels: int) -> torch.Tensor:
    """`kernels.layout.channel_order` output [..., d] -> the salient channels, ascending [..., n_sc]."""
    d = order.shape[-1]
    return order[..., d - n_salient_channels :].long()


def dequantized_sequences(cache: DecodeCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence b, fp32 (k, v) [H_kv, L_b, d]: [sinks[:sink_len] | dequantized groups | residual[:res_len]]."""
    sal = salient_channels_from_order(cache.channel_order, cache.n_salient_channels)
    sink_len, n_groups, res_len = (t.tolist() for t in (cache.sink_len, cache.n_groups, cache.res_len))
    g = cache.group_size
    seqs = []
    for b in range(cache.k_sink.shape[0]):
        ng = n_groups[b]
        pk = packing.PackedKeys(cache.k_low[b, :, :ng], cache.k_high[b, :, :ng],
                                cache.k_scale[b, :, :ng], cache.k_zero[b, :, :ng])
        pv = packing.PackedValues(cache.v_packed[b, :, : ng * g], cache.v_scale[b, :, : ng * g],
                                  cache.v_zero[b, :, : ng * g])
        k = torch.cat([cache.k_sink[b, :, : sink_len[b]].float(),
                       packing.dequantize_keys(pk, sal[b], cache.b_low),
                       cache.k_res[b, :, : res_len[b]].float()], dim=-2)
        v = torch.cat([cache.v_sink[b, :, : sink_len[b]].float(),
                       packing.dequantize_values(pv, cache.value_bits, cache.value_group_size),
                       cache.v_res[b, :, : res_len[b]].float()], dim=-2)
        seqs.append((k, v))
    return seqs


def decode_reference(q: torch.Tensor, cache: DecodeCache, scale: float) -> torch.Tensor:
    """Dequantize-then-attend in fp32: q [B, H_q, d] -> [B, H_q, d] float32."""
    bsz, hq, d = q.shape
    hkv = cache.k_sink.shape[1]
    group = hq // hkv
    out = torch.empty((bsz, hq, d), dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(dequantized_sequences(cache)):
        qb = q[b].float().view(hkv, group, d)
        weights = torch.softmax(qb @ k.transpose(-1, -2) * scale, dim=-1)  # [H_kv, group, L]
        out[b] = (weights @ v).reshape(hq, d)
    return out


# -- the Triton path of a PNMixLayer (pnmix/cache.py calls these when `layer.use_kernels`) -------


def quantize_keys(k: torch.Tensor, salient_channels: torch.Tensor, b_low: int, b_high: int, group_size: int) -> Any:
    """`packing.quantize_keys` through the Triton kernel (same bytes; fields low, high, scale, zero)."""
    from pnmix.kernels.pack import quantize_pack_keys

    return quantize_pack_keys(k, salient_channels, b_low, b_high, group_size)


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> Any:
    """`packing.quantize_values` through the Triton kernel (same bytes; fields packed, scale, zero)."""
    from pnmix.kernels.pack import quantize_pack_values

    return quantize_pack_values(v, bits, group_size)


def channel_order(salient_channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    from pnmix.kernels.layout import channel_order as order

    return order(salient_channels, head_dim)


def _device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints -> int32 device tensor without a host synchronisation (pinned, non-blocking copy)."""
    t = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def decode_cache(layer: Any, packed: Mapping[str, torch.Tensor], sink_len: torch.Tensor, n_groups: torch.Tensor,
                 res_len: torch.Tensor) -> DecodeCache:
    """A layer's buffers as the decode kernels' operands (views, no copies): its sinks, residual,
    channel order and config, the packed tensors in `packed` (by `DecodeCache.PACKED` name; other
    entries are ignored) and the lengths, int32 [B] on the device. The dynamic (`layer_decode_cache`)
    and the static (`pnmix.static`) layers both build theirs here."""
    from pnmix.kernels.layout import DecodeCache

    cfg = layer.config
    return DecodeCache(
        k_sink=layer.k_sink, v_sink=layer.v_sink, k_res=layer.k_res, v_res=layer.v_res,
        **{name: packed[name] for name in DecodeCache.PACKED}, channel_order=layer.channel_order,
        sink_len=sink_len, n_groups=n_groups, res_len=res_len, b_low=cfg.b_low, b_high=cfg.b_high,
        group_size=cfg.group_size, value_bits=cfg.value_bits, value_group_size=cfg.value_group_size,
    )


def layer_decode_cache(layer: Any) -> DecodeCache:
    """A `PNMixLayer`'s state as the decode kernel's operands (views, no copies of the cache)."""
    cfg, p = layer.config, layer.packed
    if not p:  # nothing packed yet: zero-capacity operands of the right ranks
        b, h, d, g, dev = layer.batch, layer.kv_heads, layer.head_dim, cfg.group_size, layer.device
        u8, f16 = torch.uint8, torch.float16
        n_sc, vg = 2 * layer.n_salient, d // cfg.value_group_size
        p = {
            "k_low": torch.empty((b, h, 0, cfg.b_low, d, g // 8), dtype=u8, device=dev),
            "k_high": torch.empty((b, h, 0, cfg.high_planes, n_sc, g // 8), dtype=u8, device=dev),
            "k_scale": torch.empty((b, h, 0, d), dtype=f16, device=dev),
            "k_zero": torch.empty((b, h, 0, d), dtype=f16, device=dev),
            "v_packed": torch.empty((b, h, 0, d * cfg.value_bits // 8), dtype=u8, device=dev),
            "v_scale": torch.empty((b, h, 0, vg), dtype=f16, device=dev),
            "v_zero": torch.empty((b, h, 0, vg), dtype=f16, device=dev),
        }
    dev = layer.device
    return decode_cache(layer, p, _device_ints([min(cfg.n_sink, n) for n in layer.lengths], dev),
                        _device_ints(layer.n_groups, dev), _device_ints(layer.res_len, dev))


def decode_kernel_name() -> str:
    name = os.environ.get("PNMIX_DECODE_KERNEL", "auto")
    if name not in DECODE_KERNELS:
        raise ValueError(f"invalid PNMIX_DECODE_KERNEL={name!r}: allowed one of {', '.join(DECODE_KERNELS)}")
    return name


def fused_decode(query: torch.Tensor, cache: DecodeCache, scaling: float,
                 max_groups: int | None = None) -> torch.Tensor:
    """The fused decode kernel that PNMIX_DECODE_KERNEL picks: query [B, H_q, d] -> [B, H_q, d].
    max_groups: a bound on the packed groups any sequence holds, for the launch plan (default: the capacity)."""
    name = decode_kernel_name()
    if name != "triton":
        from pnmix.kernels import gluon

        if gluon.supports(cache, query):
            return gluon.decode_attention(query, cache, scaling, max_groups=max_groups)
        if name == "mma":
            raise ValueError("PNMIX_DECODE_KERNEL=mma: the Gluon decode kernel cannot run here (it needs CUDA with "
                             "compute capability >= 8.0, Triton with Gluon, G a multiple of 32, head dim a multiple "
                             "of 16, at most 8 query heads per KV head, value groups of >= 32 bits); allowed: auto, "
                             "which falls back to the Triton kernel")
    from pnmix.kernels.decode import decode_attention

    return decode_attention(query, cache, scaling, max_groups=max_groups)


def attend_kernels(layer: Any, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode attention of one new token per sequence: query [B, H_q, 1, d] -> [B, 1, H_q, d]."""
    b, hq, _, d = query.shape
    out = fused_decode(query[:, :, 0], layer_decode_cache(layer), scaling)
    return out.view(b, 1, hq, d)


def view_from_cache(cache: DecodeCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token-ordered k, v [B, H_kv, max length, d] in `dtype`, rebuilt from the stored bytes, and
    each sequence's length. The same values, in the same slots, as a `PNMixLayer`'s kept view."""
    seqs = dequantized_sequences(cache)
    lengths = [k.shape[-2] for k, _ in seqs]
    b, h, _, d = cache.k_sink.shape
    k_view = torch.zeros((b, h, max(lengths), d), dtype=dtype, device=cache.k_sink.device)
    v_view = torch.zeros_like(k_view)
    for i, (k, v) in enumerate(seqs):
        k_view[i, :, : k.shape[-2]] = k
        v_view[i, :, : v.shape[-2]] = v
    return k_view, v_view, lengths


def dequantized_view(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-ordered k, v [B, H_kv, max length, d] in the layer's dtype, rebuilt from the stored bytes.

    For the rare calls the kernel does not cover (several query tokens at once) when the layer
    keeps no dequantized view.
    """
    k_view, v_view, _ = view_from_cache(layer_decode_cache(layer), layer.dtype)
    return k_view, v_view
