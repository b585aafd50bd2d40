"""The cheap proxy for multi-fidelity search: attention KL on recorded Q/K traces.

Post-RoPE queries and keys (and values) of every layer are recorded once per model (a prompt plus
generated tokens; cached on disk). A config is scored by the attention KL(p || p_hat) its key
quantization causes for ~64 decode queries spread over the trace, each query seeing the cache as
it was when it ran: sinks exact, the packed region through the PN-Mix key format (salient pairs
chosen from the prefill), the residual buffer exact. Lower is better; it costs milliseconds per
layer, so it screens candidates before full inference.

KL sees keys only. To weigh keys against values (a KV budget whose layers each choose a value
format), both are measured in one unit instead: the relative attention-output error
sum ||o - o_hat||^2 / sum ||o||^2 over the same queries, with o = softmax(q k^T) v, once with the
keys quantized and the values exact (`proxy_kl_table(..., measure=ProxyMeasure.OUTPUT)`) and once the other
way round (`proxy_value_table`). The two errors are nearly independent and add. The serving
engines' formats are weighed in the same unit, keys and values apart (`proxy_format_table`).

Which tokens are quantized follows the cache exactly (`quantized_tokens`): sinks stay exact,
prefill tokens past the sinks go into whole groups, the remainder and the generated tokens fill
the residual buffer, which is quantized `residual_len` tokens at a time. The recent tokens that
decode queries lean on most are therefore exact, as in real generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from pnmix import packing
from pnmix.analysis import Trace, masked_kl, quantize_pnmix
from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig
from pnmix.kv_formats import KVFormat, calibrate, round_trip
from pnmix.layerwise import LayerwiseConfig, as_layerwise
from pnmix.saliency import Pairing, saliency_scores, select_salient_pairs


class ProxyMeasure(StrEnum):
    """What the proxy measures of a layer's approximate attention against the exact one."""

    KL = "kl"  # KL divergence of the attention probabilities
    OUTPUT = "output"  # relative error of the attention output (the unit value errors share)


def quantized_tokens(config: PNMixConfig, prefill: int, total: int) -> int:
    """Tokens in the packed region after a prefill of `prefill` tokens and decoding up to `total`."""
    sinks = min(config.n_sink, prefill)
    at_prefill = (prefill - sinks) // config.group_size * config.group_size
    residual = prefill - sinks - at_prefill + (total - prefill)
    if prefill < config.n_sink:  # generated tokens fill the sinks first
        residual = max(0, total - config.n_sink)
    return at_prefill + residual // config.residual_len * config.residual_len


Windows = Sequence[int | None]  # per layer of a trace: its sliding window, None for full attention


def proxy_kl(trace: Trace, config: PNMixConfig | LayerwiseConfig, pairing: Pairing, n_queries: int = 64,
             windows: Windows | None = None) -> float:
    """Mean attention KL over layers and ~n_queries decode queries spread over the trace (0 for fp16 keys).

    Each query sees the cache as it was when that query ran: the packed region then, exact
    sinks and residual buffer; in a sliding-window layer (`windows`), its last window positions.
    """
    per_layer = proxy_kl_by_layer(trace, config, pairing, n_queries, windows)
    return sum(per_layer) / len(per_layer)


def proxy_kl_by_layer(trace: Trace, config: PNMixConfig | LayerwiseConfig, pairing: Pairing,
                      n_queries: int = 64, windows: Windows | None = None) -> list[float]:
    """`proxy_kl` layer by layer, each layer under its own config (a layer-wise config's), from
    which the layer-sensitivity profile (`tuner/search/layers.py`) is read."""
    layers = as_layerwise(config).per_layer(len(trace.keys))
    return [row[0] for row in _rows(trace, [[c] for c in layers], pairing, n_queries, ProxyMeasure.KL, windows)]


def proxy_kl_table(trace: Trace, configs: list[PNMixConfig], pairing: Pairing,
                   n_queries: int = 64, measure: ProxyMeasure = ProxyMeasure.KL,
                   windows: Windows | None = None) -> list[list[float]]:
    """Each config's per-layer KL, `[config][layer]`, for configs that share G, sinks, residual,
    criterion and seed (the allocator's candidates): the exact attention and the saliency scores
    of a layer are computed once for all of them, so the table costs a fraction of one
    `proxy_kl_by_layer` pass per config, with the same figures. `measure=ProxyMeasure.OUTPUT`: the relative
    attention-output error instead of KL (the unit `proxy_value_table` shares). `windows`: each
    layer's sliding window (its queries see their last window positions), None for full attention."""
    if not configs:
        return []
    rows = _rows(trace, [list(configs)] * len(trace.keys), pairing, n_queries, measure, windows)
    return [[rows[layer][c] for layer in range(len(trace.keys))] for c in range(len(configs))]


def proxy_value_table(trace: Trace, formats: list[tuple[int, int]], shared: PNMixConfig,
                      n_queries: int = 64, windows: Windows | None = None) -> list[list[float]]:
    """Each value format's (bits, group size) relative attention-output error per layer,
    `[format][layer]`, with the keys exact and the values of the packed region (`shared`'s token
    schedule: sinks, G, residual) quantized per token as the cache stores them; a sliding-window
    layer (`windows`) attends over its window only."""
    at = _Schedule.of(trace, shared, n_queries)
    out: list[list[float]] = [[] for _ in formats]
    for li, (q, k, v) in enumerate(zip(trace.queries, trace.keys, _values(trace), strict=True)):
        group = q.shape[0] // k.shape[0]
        logits = torch.einsum("hqd,hsd->hqs", q[:, at.positions], k.repeat_interleave(group, 0)) * trace.scaling
        window = windows[li] if windows is not None else None
        seen = at.causal if window is None else at.causal & (
            torch.arange(k.shape[1], device=k.device)[None, :] > at.positions[:, None] - window)
        p = logits.masked_fill(~seen, float("-inf")).softmax(-1)  # [Hq, Q, T]
        v_rep = v.repeat_interleave(group, 0)
        o = p @ v_rep
        lo, hi = at.sinks, at.sinks + at.n_packed
        for f, (bits, size) in enumerate(formats):
            v_hat = v.clone()
            if hi > lo:
                packed = packing.quantize_values(v[:, lo:hi], bits, size)
                v_hat[:, lo:hi] = packing.dequantize_values(packed, bits, size)
            delta = (p * at.use_packed) @ (v_hat - v).repeat_interleave(group, 0)  # only packed tokens change
            out[f].append(_relative(delta, o))
    return out


def proxy_format_table(trace: Trace, formats: Sequence[KVFormat], plan: LayerPlan | None = None,
                       n_queries: int = 64) -> list[list[float]]:
    """The serving engines' formats on every layer (`pnmix.kv_formats`): rows `[side][format]` of
    the relative attention-output error per layer, side 0 the keys stored in the format (values
    exact), side 1 the values (keys exact). Every token is stored so, the prompt's included (an
    engine writes its cache before it attends), with the per-tensor scales calibrated on the
    prompt, as `pnmix.recipe_cache.RecipeCache` stores them. A sliding-window layer (`plan`)
    attends over its window only. The engine method's allocator adds a layer's two sides: the
    error of a (key, value) pair."""
    values = _values(trace)
    p = trace.prefill_len
    t = trace.keys[0].shape[1]
    stride = max(1, (t - p) // n_queries)
    dev = trace.keys[0].device
    positions = torch.arange(p, t, stride, device=dev)
    s_idx = torch.arange(t, device=dev)
    causal = s_idx[None, :] <= positions[:, None]
    kinds = plan.kinds if plan is not None else ("full",) * len(trace.keys)
    window = plan.window if plan is not None else None
    rows: list[list[list[float]]] = [[[] for _ in formats] for _ in range(2)]
    for li, (q, k, v) in enumerate(zip(trace.queries, trace.keys, values, strict=True)):
        qs = q[:, positions]
        seen = causal & (s_idx[None, :] > positions[:, None] - window) if kinds[li] != "full" and window else causal

        o = _attend(qs, k, v, seen, trace.scaling)
        for f, fmt in enumerate(formats):
            k_hat = round_trip(fmt, k, calibrate(fmt, k[:, :p]))
            v_hat = round_trip(fmt, v, calibrate(fmt, v[:, :p]))
            rows[0][f].append(_relative(_attend(qs, k_hat, v, seen, trace.scaling) - o, o))
            rows[1][f].append(_relative(_attend(qs, k, v_hat, seen, trace.scaling) - o, o))
    return [row for side in rows for row in side]


def _attend(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention output of queries [Hq, Q, d] over keys and values [Hkv, T, d] where `seen` [Q, T]."""
    group = qs.shape[0] // k.shape[0]
    logits = torch.einsum("hqd,hsd->hqs", qs, k.repeat_interleave(group, 0)) * scaling
    return logits.masked_fill(~seen, float("-inf")).softmax(-1) @ v.repeat_interleave(group, 0)


def _values(trace: Trace) -> list[torch.Tensor]:
    """The trace's values, which the output measure weighs."""
    if trace.values is None:
        raise ValueError("this trace holds no values (recorded before values were recorded)")
    return trace.values


def _relative(delta: torch.Tensor, o: torch.Tensor) -> float:
    """sum ||delta||^2 / sum ||o||^2: the relative output error of one layer."""
    return float(delta.square().sum() / o.square().sum().clamp_min(1e-30))


@dataclass(frozen=True)
class _Schedule:
    """Which tokens each proxy query sees packed (the cache's token schedule at its time)."""

    positions: torch.Tensor  # [Q] the decode queries' positions
    use_packed: torch.Tensor  # [Q, T] whether token s is in the packed region when query q runs
    causal: torch.Tensor  # [Q, T]
    sinks: int
    n_packed: int  # the packed region's largest extent, from the first token after the sinks

    @classmethod
    def of(cls, trace: Trace, shared: PNMixConfig, n_queries: int) -> _Schedule:
        p = trace.prefill_len
        t = trace.keys[0].shape[1]
        stride = max(1, (t - p) // n_queries)
        dev = trace.keys[0].device
        positions = torch.arange(p, t, stride)  # [Q]
        packed_upto = torch.tensor([quantized_tokens(shared, p, int(pos) + 1) for pos in positions], device=dev)
        positions = positions.to(dev)
        s_idx = torch.arange(t, device=dev)
        sinks = min(shared.n_sink, t)
        use_packed = (s_idx[None, :] >= sinks) & (s_idx[None, :] < sinks + packed_upto[:, None])
        causal = s_idx[None, :] <= positions[:, None]
        return cls(positions, use_packed, causal, sinks, int(packed_upto.max()))


def _rows(trace: Trace, per_layer: list[list[PNMixConfig]], pairing: Pairing, n_queries: int,
          measure: ProxyMeasure, windows: Windows | None = None) -> list[list[float]]:
    """For each layer, the KL (or, `measure=ProxyMeasure.OUTPUT`, the relative output error) of each of its
    configs (`per_layer[layer]`), which share the token-schedule fields (sinks, G, residual) and
    the saliency rule (criterion, seed)."""
    if measure not in tuple(ProxyMeasure):
        raise ValueError(f"unknown proxy measure {measure!r}: allowed {', '.join(ProxyMeasure)}")
    values = _values(trace) if measure == ProxyMeasure.OUTPUT else None
    at = _Schedule.of(trace, per_layer[0][0], n_queries)  # sinks, G, residual: alike in every layer and config
    p, sinks, n_q = trace.prefill_len, at.sinks, at.n_packed
    out: list[list[float]] = []
    for li, (q, k) in enumerate(zip(trace.queries, trace.keys, strict=True)):
        configs = per_layer[li]
        h_kv, t, d = k.shape
        group = q.shape[0] // h_kv
        qs = q[:, at.positions]  # [Hq, Q, d]
        exact = torch.einsum("hqd,hsd->hqs", qs, k.repeat_interleave(group, 0)) * trace.scaling
        seen = at.causal
        window = windows[li] if windows is not None else None
        if window is not None:
            seen = seen & (torch.arange(t, device=k.device)[None, :] > at.positions[:, None] - window)
        if values is not None:
            v_rep = values[li].repeat_interleave(group, 0)
            o = exact.masked_fill(~seen, float("-inf")).softmax(-1) @ v_rep
        prefill_mask = torch.ones((1, p), dtype=torch.bool, device=k.device)
        first = configs[0]
        scores = saliency_scores(first.criterion, q[None, :, :p], k[None, :, :p], prefill_mask, pairing,
                                 first.seed + li)[0]
        row: list[float] = []
        for cfg in configs:
            if not cfg.keys_quantized:
                row.append(0.0)
                continue
            pairs = select_salient_pairs(scores, cfg.salient_pairs(d))
            k_hat = k.clone()
            k_hat[:, sinks : sinks + n_q] = quantize_pnmix(k[:, sinks : sinks + n_q], pairs, cfg.b_high, cfg.b_low,
                                                           cfg.group_size, pairing)
            approx = torch.einsum("hqd,hsd->hqs", qs, k_hat.repeat_interleave(group, 0)) * trace.scaling
            mixed = torch.where(at.use_packed, approx, exact)
            if measure == ProxyMeasure.KL:
                row.append(float(masked_kl(exact, mixed, seen).mean()))
            else:
                o_hat = mixed.masked_fill(~seen, float("-inf")).softmax(-1) @ v_rep
                row.append(_relative(o_hat - o, o))
        out.append(row)
    return out
