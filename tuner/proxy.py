"""The cheap proxy for multi-fidelity search: attention KL on recorded Q/K traces.

Post-RoPE queries and keys of every layer are recorded once per model (a prompt plus generated
tokens; cached on disk). A config is scored by quantizing each layer's keys as the cache would
hold them at the end of the trace (first `n_sink` tokens exact, then whole groups of G tokens
through the PN-Mix key format with the salient pairs chosen from the prefill, the ragged tail
exact) and measuring KL(p || p_hat) of the last `n_queries` queries' attention. Lower is better.
It costs milliseconds per layer, so it screens candidates before full inference.
"""

from __future__ import annotations

import torch

from pnmix.analysis import Trace, attention_kl, quantize_pnmix
from pnmix.config import PNMixConfig
from pnmix.saliency import Pairing, saliency_scores, select_salient_pairs


def proxy_kl(trace: Trace, config: PNMixConfig, pairing: Pairing, n_queries: int = 64) -> float:
    """Mean attention KL over layers and the last n_queries queries of the trace (0 for fp16 keys)."""
    if not config.keys_quantized:
        return 0.0
    total = 0.0
    p = trace.prefill_len
    for li, (q, k) in enumerate(zip(trace.queries, trace.keys, strict=True)):
        t, d = k.shape[1], k.shape[2]
        first_query = max(p, t - n_queries)
        mask = torch.zeros((1, t), dtype=torch.bool)
        mask[0, :p] = True
        n_sal = config.salient_pairs(d)
        scores = saliency_scores(config.criterion, q[None, :, :p], k[None, :, :p], mask[:, :p], pairing,
                                 config.seed + li)[0]
        pairs = select_salient_pairs(scores, n_sal)
        k_hat = k.clone()
        sinks = min(config.n_sink, t)
        k_hat[:, sinks:] = quantize_pnmix(k[:, sinks:], pairs, config.b_high, config.b_low, config.group_size,
                                          pairing)
        total += attention_kl(q, k, k_hat, first_query, trace.scaling)
    return total / len(trace.keys)
