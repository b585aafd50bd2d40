"""The cheap proxy for multi-fidelity search: attention KL on recorded Q/K traces.

Post-RoPE queries and keys of every layer are recorded once per model (a prompt plus generated
tokens; cached on disk). A config is scored by the attention KL(p || p_hat) its key quantization
causes for ~64 decode queries spread over the trace, each query seeing the cache as it was when
it ran: sinks exact, the packed region through the PN-Mix key format (salient pairs chosen from
the prefill), the residual buffer exact. Values are not involved. Lower is better; it costs
milliseconds per layer, so it screens candidates before full inference.

Which tokens are quantized follows the cache exactly (`quantized_tokens`): sinks stay exact,
prefill tokens past the sinks go into whole groups, the remainder and the generated tokens fill
the residual buffer, which is quantized `residual_len` tokens at a time. The recent tokens that
decode queries lean on most are therefore exact, as in real generation.
"""

from __future__ import annotations

import torch

from pnmix.analysis import Trace, masked_kl, quantize_pnmix
from pnmix.config import PNMixConfig
from pnmix.layerwise import LayerwiseConfig, as_layerwise
from pnmix.saliency import Pairing, saliency_scores, select_salient_pairs


def quantized_tokens(config: PNMixConfig, prefill: int, total: int) -> int:
    """Tokens in the packed region after a prefill of `prefill` tokens and decoding up to `total`."""
    sinks = min(config.n_sink, prefill)
    at_prefill = (prefill - sinks) // config.group_size * config.group_size
    residual = prefill - sinks - at_prefill + (total - prefill)
    if prefill < config.n_sink:  # generated tokens fill the sinks first
        residual = max(0, total - config.n_sink)
    return at_prefill + residual // config.residual_len * config.residual_len


def proxy_kl(trace: Trace, config: PNMixConfig | LayerwiseConfig, pairing: Pairing, n_queries: int = 64) -> float:
    """Mean attention KL over layers and ~n_queries decode queries spread over the trace (0 for fp16 keys).

    Each query sees the cache as it was when that query ran: the packed region then, exact
    sinks and residual buffer.
    """
    per_layer = proxy_kl_by_layer(trace, config, pairing, n_queries)
    return sum(per_layer) / len(per_layer)


def proxy_kl_by_layer(trace: Trace, config: PNMixConfig | LayerwiseConfig, pairing: Pairing,
                      n_queries: int = 64) -> list[float]:
    """`proxy_kl` layer by layer, each layer under its own config (a layer-wise config's), from
    which the layer-sensitivity profile (`tuner/layers.py`) is read."""
    layers = as_layerwise(config).per_layer(len(trace.keys))
    return [row[0] for row in _kl_rows(trace, [[c] for c in layers], pairing, n_queries)]


def proxy_kl_table(trace: Trace, configs: list[PNMixConfig], pairing: Pairing,
                   n_queries: int = 64) -> list[list[float]]:
    """Each config's per-layer KL, `[config][layer]`, for configs that share G, sinks, residual,
    criterion and seed (the allocator's candidates): the exact attention and the saliency scores
    of a layer are computed once for all of them, so the table costs a fraction of one
    `proxy_kl_by_layer` pass per config, with the same figures."""
    if not configs:
        return []
    rows = _kl_rows(trace, [list(configs)] * len(trace.keys), pairing, n_queries)
    return [[rows[layer][c] for layer in range(len(trace.keys))] for c in range(len(configs))]


def _kl_rows(trace: Trace, per_layer: list[list[PNMixConfig]], pairing: Pairing, n_queries: int) -> list[list[float]]:
    """For each layer, the KL of each of its configs (`per_layer[layer]`), which share the
    token-schedule fields (sinks, G, residual) and the saliency rule (criterion, seed)."""
    shared = per_layer[0][0]  # sinks, G and residual: the same in every layer and config
    p = trace.prefill_len
    t = trace.keys[0].shape[1]
    stride = max(1, (t - p) // n_queries)
    dev = trace.keys[0].device
    positions = torch.arange(p, t, stride)  # [Q]
    packed_upto = torch.tensor([quantized_tokens(shared, p, int(pos) + 1) for pos in positions], device=dev)
    positions = positions.to(dev)
    s_idx = torch.arange(t, device=dev)
    sinks = min(shared.n_sink, t)
    use_packed = (s_idx[None, :] >= sinks) & (s_idx[None, :] < sinks + packed_upto[:, None])  # [Q, T]
    causal = s_idx[None, :] <= positions[:, None]
    n_q = int(packed_upto.max())
    out: list[list[float]] = []
    for li, (q, k) in enumerate(zip(trace.queries, trace.keys, strict=True)):
        configs = per_layer[li]
        h_kv, _, d = k.shape
        group = q.shape[0] // h_kv
        qs = q[:, positions]  # [Hq, Q, d]
        exact = torch.einsum("hqd,hsd->hqs", qs, k.repeat_interleave(group, 0)) * trace.scaling
        prefill_mask = torch.ones((1, p), dtype=torch.bool, device=dev)
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
            mixed = torch.where(use_packed, approx, exact)
            row.append(float(masked_kl(exact, mixed, causal).mean()))
        out.append(row)
    return out
