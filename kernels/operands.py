"""The operands every PN-Mix decode kernel reads: one `DecodeOperands` tuple, spelled once here.

A kernel takes it as its first argument `ops` and reads `ops.klo_ptr`, `ops.stride_lob`, ...
(Triton and Gluon pass a NamedTuple's fields as separate kernel parameters: no cost). Strides are
in elements of the tensor passed; a kernel that reads packed bytes as int16 or int32 words is
handed those views (`decode_operands`), and its strides count halves or words.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pnmix.kernels.layout import DecodeCache


class DecodeOperands(NamedTuple):
    """Query and cache of one decode step; B sequences, H_kv KV heads of GQ query heads, head dim d.

    q          float [B, H_kv * GQ, d]                    the new token's query; channels contiguous
    k/v sinks  float [B, H_kv, S_cap, d]                  first tokens, unquantized (same strides)
    k/v res    float [B, H_kv, R_cap, d]                  newest tokens, unquantized (same strides)
    k_low      uint8 [B, H_kv, NG_cap, b_low, d, G // 8]  key bit planes packed along TOKENS: token t
                                                          of a group in byte t // 8, bit t % 8
    k_high     uint8 [B, H_kv, NG_cap, b_high - b_low, n_sc, G // 8]  the salient channels' upper planes
    k_scale, k_zero fp16 [B, H_kv, NG_cap, d]             per group and channel
    v_packed   uint8 [B, H_kv, NG_cap * G, d * b_V // 8]  value codes packed along CHANNELS, LSB first
    v_scale, v_zero fp16 [B, H_kv, NG_cap * G, d // G_V]  per token and group of G_V channels
    order      int32 [B, H_kv, d]                         non-salient channels, then salient (ascending)
    sink_len, n_groups, res_len int32 [B]                 what sequence b holds (<= the capacities)
    The inner dims of every tensor are contiguous; stride_xb, stride_xh are batch and head strides.
    """

    q_ptr: torch.Tensor
    stride_qb: int
    stride_qh: int
    ks_ptr: torch.Tensor
    vs_ptr: torch.Tensor
    stride_sb: int
    stride_sh: int
    stride_st: int
    kr_ptr: torch.Tensor
    vr_ptr: torch.Tensor
    stride_rb: int
    stride_rh: int
    stride_rt: int
    klo_ptr: torch.Tensor
    stride_lob: int
    stride_loh: int
    khi_ptr: torch.Tensor
    stride_hib: int
    stride_hih: int
    ksc_ptr: torch.Tensor
    kze_ptr: torch.Tensor
    stride_ksb: int
    stride_ksh: int
    vp_ptr: torch.Tensor
    stride_vpb: int
    stride_vph: int
    vsc_ptr: torch.Tensor
    vze_ptr: torch.Tensor
    stride_vsb: int
    stride_vsh: int
    order_ptr: torch.Tensor
    stride_ob: int
    stride_oh: int
    sink_len_ptr: torch.Tensor
    n_groups_ptr: torch.Tensor
    res_len_ptr: torch.Tensor


def decode_operands(q: torch.Tensor, cache: DecodeCache, k_low: torch.Tensor | None = None,
                    k_high: torch.Tensor | None = None, v_packed: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, v_zero: torch.Tensor | None = None) -> DecodeOperands:
    """The operands of `q` over `cache`; the packed tensors (and the value scales and zeros) may be
    replaced by other views of the same bytes, as the Gluon kernels read them."""
    k_low = cache.k_low if k_low is None else k_low
    k_high = cache.k_high if k_high is None else k_high
    v_packed = cache.v_packed if v_packed is None else v_packed
    v_scale = cache.v_scale if v_scale is None else v_scale
    v_zero = cache.v_zero if v_zero is None else v_zero
    return DecodeOperands(
        q, q.stride(0), q.stride(1),
        cache.k_sink, cache.v_sink, cache.k_sink.stride(0), cache.k_sink.stride(1), cache.k_sink.stride(2),
        cache.k_res, cache.v_res, cache.k_res.stride(0), cache.k_res.stride(1), cache.k_res.stride(2),
        k_low, k_low.stride(0), k_low.stride(1),
        k_high, k_high.stride(0), k_high.stride(1),
        cache.k_scale, cache.k_zero, cache.k_scale.stride(0), cache.k_scale.stride(1),
        v_packed, v_packed.stride(0), v_packed.stride(1),
        v_scale, v_zero, v_scale.stride(0), v_scale.stride(1),
        cache.channel_order, cache.channel_order.stride(0), cache.channel_order.stride(1),
        cache.sink_len, cache.n_groups, cache.res_len,
    )


def _check_inner_contiguous(name: str, t: torch.Tensor, n_inner: int) -> None:
    if t.numel() == 0:
        return
    expected = 1
    for size, stride in zip(reversed(t.shape[-n_inner:]), reversed(t.stride()[-n_inner:]), strict=True):
        if size > 1 and stride != expected:
            raise ValueError(f"{name}: inner {n_inner} dims must be contiguous, got strides {t.stride()}")
        expected *= size


def check_operands(q: torch.Tensor, cache: DecodeCache) -> None:
    """The shapes, value formats and strides every decode kernel assumes; a one-line ValueError otherwise."""
    bsz, hq, d = q.shape
    _, hkv, _, d_cache = cache.k_sink.shape
    if d_cache != d or hq % hkv or d & (d - 1) or d < 16:
        raise ValueError(f"unsupported decode shape q {tuple(q.shape)}, cache head_dim {d_cache}, H_kv {hkv}")
    if cache.value_group_size & (cache.value_group_size - 1) or d % cache.value_group_size:
        raise ValueError(f"value_group_size {cache.value_group_size} must be a power of two dividing {d}")
    if cache.value_bits not in (1, 2, 4, 8):
        raise ValueError(f"unsupported value bits {cache.value_bits}")
    for name, t, n in (("q", q, 1), ("k_sink", cache.k_sink, 1), ("v_sink", cache.v_sink, 1),
                       ("k_res", cache.k_res, 1), ("v_res", cache.v_res, 1), ("k_low", cache.k_low, 4),
                       ("k_high", cache.k_high, 4), ("k_scale", cache.k_scale, 2), ("k_zero", cache.k_zero, 2),
                       ("v_packed", cache.v_packed, 2), ("v_scale", cache.v_scale, 2), ("v_zero", cache.v_zero, 2),
                       ("channel_order", cache.channel_order, 1)):
        _check_inner_contiguous(name, t, n)
    if cache.k_sink.stride() != cache.v_sink.stride() or cache.k_res.stride() != cache.v_res.stride():
        raise ValueError("keys and values of the sinks and of the residual must share strides")
    if cache.k_scale.stride() != cache.k_zero.stride() or cache.v_scale.stride() != cache.v_zero.stride():
        raise ValueError("scales and zeros must share strides")


def offline_signature(fn: Any, const: dict[str, Any], operand_types: dict[str, str], activation: str,
                      scalars: dict[str, str]) -> tuple[dict[str, Any], dict[tuple[int, ...], list]]:
    """(signature, attrs) for compiling a decode kernel `fn` without a GPU (`triton.compile` of an
    AST source). `const`: its compile-time constants; `operand_types`: the `DecodeOperands` pointers'
    types by field (the others take `activation`, the query's and the sinks' type; strides are i32);
    `scalars`: the types of the kernel's own pointer and float arguments (the rest are i32).
    Pointers and strides are specialized as divisible by 16, as the JIT does for real caches."""
    ops = DecodeOperands._make(operand_types.get(f, activation) if f.endswith("_ptr") else "i32"
                               for f in DecodeOperands._fields)
    sig: dict[str, Any] = {n: "constexpr" if n in const else ops if n == "ops" else scalars.get(n, "i32")
                           for n in fn.arg_names}
    divisible = [["tt.divisibility", 16]]
    attrs: dict[tuple[int, ...], list] = {(fn.arg_names.index("ops"), i): divisible
                                          for i in range(len(DecodeOperands._fields))}
    attrs |= {(i,): divisible for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    return sig, attrs
