"""`pnmix analyze`: the paper's saliency simulation on real post-RoPE traces of a model.

1. Trace: greedy fp generation of >= 512 tokens after a prompt, then one forward pass over the
   whole sequence with a recording attention function: post-RoPE Q [L, Hq, T, d], K [L, Hkv, T, d].
2. For each key quantizer at the same average key bits (2 bits per channel):
   - PN-Mix 3/1 at r = 0.5 under every saliency criterion, with the salient set chosen from the
     prefill tokens only and from the full sequence;
   - uniform 2-bit (KIVI-2);
   - a polar-coordinate uniform quantizer (each pair as radius and angle, 2 bits each);
   measure key MSE and the attention KL(p || p_hat) of the decode queries (values exact).
   Keys are quantized per channel in groups of G tokens with `pnmix.packing` (no sinks, no
   residual: the simulation isolates the key quantizer); KIVI-2 and PN-Mix (qk_pair_norm) are
   also reported with the first `n_sink` tokens exact, as the cache runs them.
3. Decode-time importance of pair i: mean over decode queries t and keys s <= t of
   |q[t, i] . k[s, i]|, the pair's contribution to the logits (which the query-key pair-norm
   product bounds). The Jaccard overlap of each criterion's prefill top-r pairs with the decode
   top-r pairs (r = 10%, 50%), and the share of total importance in the top 10/30/50% of pairs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pnmix import packing
from pnmix.saliency import Pairing, pair_channels, saliency_scores, select_salient_pairs, to_pairs

CRITERIA = ("qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range", "random")
TRACE_ATTENTION = "pnmix_trace"


@dataclass
class Trace:
    queries: list[torch.Tensor]  # per layer [Hq, T, d], post-RoPE
    keys: list[torch.Tensor]  # per layer [Hkv, T, d], post-RoPE
    prefill_len: int
    scaling: float
    values: list[torch.Tensor] | None = None  # per layer [Hkv, T, d]; what the value proxy weighs


class _Counter:
    """A `generate` streamer that reports how many tokens are done, at most every `every_s` seconds."""

    def __init__(self, total: int, progress: Callable[[str], None], every_s: float = 5.0) -> None:
        import time

        self.total, self.progress, self.every_s = total, progress, every_s
        self.done, self._clock, self._last = -1, time.monotonic, time.monotonic()  # the first put is the prompt

    def put(self, value: Any) -> None:
        self.done += 1
        now = self._clock()
        if self.done > 0 and now - self._last >= self.every_s:
            self._last = now
            self.progress(f"generated {self.done}/{self.total} tokens")

    def end(self) -> None:
        pass


@torch.inference_mode()
def record_trace(model: Any, input_ids: torch.Tensor, new_tokens: int,
                 progress: Callable[[str], None] | None = None, continuation: list[int] | None = None) -> Trace:
    """Greedy-generates `new_tokens` after `input_ids` [1, P] (or takes `continuation`, those tokens
    generated elsewhere, e.g. on a faster path), then records post-RoPE Q/K (and V) of all of it.
    `progress` hears how far the generation is, every few seconds."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    prefill = input_ids.shape[1]
    input_ids = input_ids.to(model.device)
    if continuation is not None:
        if len(continuation) != new_tokens:
            raise ValueError(f"a continuation of {len(continuation)} tokens: allowed exactly new_tokens={new_tokens}")
        full = torch.cat([input_ids, torch.tensor([continuation], device=input_ids.device)], dim=1)
    else:
        streamer = _Counter(new_tokens, progress) if progress else None
        full = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=model.config.eos_token_id, streamer=streamer)
    queries: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    scale: list[float] = []

    def recording(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                  **kwargs: Any) -> Any:
        queries[module.layer_idx] = query[0].float().clone()
        keys[module.layer_idx] = key[0].float().clone()
        values[module.layer_idx] = value[0].float().clone()
        scale.append(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(TRACE_ATTENTION, recording)
    AttentionMaskInterface.register(TRACE_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(TRACE_ATTENTION)
    try:
        model(input_ids=full, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    n = len(queries)
    return Trace([queries[i] for i in range(n)], [keys[i] for i in range(n)], prefill, scale[0],
                 [values[i] for i in range(n)])


def _importance(q: torch.Tensor, k: torch.Tensor, prefill: int, pairing: Pairing) -> torch.Tensor:
    """Decode-time importance [Hkv, d/2]: mean over decode queries t, keys s <= t of |q_i . k_i|."""
    h_kv, t, d = k.shape
    group = q.shape[0] // h_kv
    qp = to_pairs(q[:, prefill:], pairing)  # [Hq, Td, d/2, 2]
    kp = to_pairs(k, pairing)  # [Hkv, T, d/2, 2]
    kp = kp.repeat_interleave(group, dim=0)
    # [Hq, d/2, Td, T]: per pair, the dot product of each decode query with each key.
    dots = torch.einsum("htpc,hspc->hpts", qp, kp).abs()
    causal = torch.arange(t)[None, :] <= torch.arange(prefill, t)[:, None]  # [Td, T]
    per_query = (dots * causal).sum(-1) / causal.sum(-1)  # [Hq, d/2, Td]
    return per_query.mean(-1).view(h_kv, group, d // 2).mean(1)


def _jaccard(a: torch.Tensor, b: torch.Tensor, d_half: int) -> float:
    """Mean Jaccard overlap of index sets a, b [H, n] (per head)."""
    total = 0.0
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        sx, sy = set(x), set(y)
        total += len(sx & sy) / max(len(sx | sy), 1)
    return total / a.shape[0]


def quantize_pnmix(k: torch.Tensor, pairs: torch.Tensor, b_high: int, b_low: int, group: int,
                   pairing: Pairing) -> torch.Tensor:
    """Keys [H, T, d] through the PN-Mix key format (whole groups; the tail stays exact)."""
    h, t, d = k.shape
    whole = t // group * group
    channels = pair_channels(pairs, d, pairing)
    out = k.clone()
    out[:, :whole] = packing.fake_quantize_keys(k[:, :whole], channels, b_low, b_high, group)
    return out


def quantize_polar(k: torch.Tensor, bits: int, group: int, pairing: Pairing) -> torch.Tensor:
    """Each pair as (radius, angle): radius per-group asymmetric, angle uniform on [-pi, pi)."""
    h, t, d = k.shape
    whole = t // group * group
    pairs = to_pairs(k[:, :whole], pairing)  # [H, T, d/2, 2]
    radius = pairs.norm(dim=-1)
    angle = torch.atan2(pairs[..., 1], pairs[..., 0])
    rg = radius.view(h, whole // group, group, d // 2)
    q, s, z = packing.quantize_groups(rg, 2**bits - 1, dim=-2)
    r_hat = packing.dequantize(q, s, z).view(h, whole, d // 2)
    step = 2 * math.pi / 2**bits
    a_hat = (torch.floor((angle + math.pi) / step + 0.5) % 2**bits) * step - math.pi
    rebuilt = torch.stack([r_hat * torch.cos(a_hat), r_hat * torch.sin(a_hat)], dim=-1)
    if pairing == "rotate_half":
        flat = torch.cat([rebuilt[..., 0], rebuilt[..., 1]], dim=-1)
    else:
        flat = rebuilt.flatten(-2)
    out = k.clone()
    out[:, :whole] = flat
    return out


def attention_kl(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, prefill: int, scaling: float) -> float:
    """Mean KL(p || p_hat) over decode queries and query heads, causal attention."""
    h_kv, t, _ = k.shape
    group = q.shape[0] // h_kv
    qd = q[:, prefill:]
    causal = torch.arange(t)[None, :] <= torch.arange(prefill, t)[:, None]
    logits = torch.einsum("htd,hsd->hts", qd, k.repeat_interleave(group, 0)) * scaling
    logits_hat = torch.einsum("htd,hsd->hts", qd, k_hat.repeat_interleave(group, 0)) * scaling
    return float(masked_kl(logits, logits_hat, causal).mean())


def masked_kl(logits: torch.Tensor, logits_hat: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """KL(softmax(logits) || softmax(logits_hat)) per row, over the keys `visible` (bool, broadcasts)."""
    lp = logits.masked_fill(~visible, float("-inf")).log_softmax(-1)
    lp_hat = logits_hat.masked_fill(~visible, float("-inf")).log_softmax(-1)
    return (lp.exp() * (lp - lp_hat)).masked_fill(~visible, 0).sum(-1)


class _Tally:
    """What `analyze` sums over layers, each layer's share (1 / layers) at a time: per quantizer its key
    MSE and attention KL, per criterion the Jaccard overlaps, and the importance shares."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.rows: dict[str, dict[str, float]] = {}
        self.jaccard = {c: {"r=0.1": 0.0, "r=0.5": 0.0} for c in CRITERIA}
        self.shares = {"top10": 0.0, "top30": 0.0, "top50": 0.0}

    def add(self, name: str, q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, prefill: int,
            scaling: float) -> None:
        """Adds the key MSE and attention KL of the quantized keys `k_hat` to quantizer `name`'s row."""
        mse, kl = float(((k_hat - k) ** 2).mean()), attention_kl(q, k, k_hat, prefill, scaling)
        row = self.rows.setdefault(name, {"key_mse": 0.0, "attention_kl": 0.0})
        row["key_mse"] += mse / self.layers
        row["attention_kl"] += kl / self.layers


def _top_pairs(frac: float, d: int) -> int:
    """The number of a head's d/2 pairs that a fraction `frac` of them makes (at least one)."""
    return max(1, math.floor(frac * d / 2 + 0.5))


def _prefix_mask(t: int, upto: int) -> torch.Tensor:
    """A [1, t] mask of the first `upto` tokens: the tokens a salient set is chosen from."""
    mask = torch.zeros((1, t), dtype=torch.bool)
    mask[0, :upto] = True
    return mask


def analyze(trace: Trace, pairing: Pairing, group: int = 64, ratio: float = 0.5, n_sink: int = 32,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The saliency simulation of the module's docstring over every layer of `trace`: per key quantizer
    its key MSE and attention KL, each criterion's Jaccard overlap with the decode-time top pairs, and
    the share of importance the top pairs hold (each a mean over layers)."""
    layers = len(trace.keys)
    d = trace.keys[0].shape[-1]
    n_sal = math.floor(ratio * d / 2 + 0.5)
    tally = _Tally(layers)
    for li in range(layers):
        if progress:
            progress(f"quantizing and scoring layer {li + 1}/{layers}")
        q, k = trace.queries[li], trace.keys[li]
        imp = _importance(q, k, trace.prefill_len, pairing)  # [Hkv, d/2]
        _tally_shares(tally, imp, d)
        _tally_criteria(tally, trace, li, imp, d, pairing, group, n_sal)
        _tally_baselines(tally, trace, li, pairing, group, n_sal, n_sink)
    return {
        "prefill_tokens": trace.prefill_len,
        "total_tokens": int(trace.keys[0].shape[1]),
        "layers": layers,
        "head_dim": d,
        "group_size": group,
        "salient_ratio": ratio,
        "n_sink": n_sink,
        "quantizers": tally.rows,
        "jaccard_prefill_vs_decode": tally.jaccard,
        "importance_share": tally.shares,
    }


def _tally_shares(tally: _Tally, imp: torch.Tensor, d: int) -> None:
    """Adds one layer's share of total importance held by its top 10/30/50% pairs."""
    sorted_imp = imp.sort(-1, descending=True).values
    total = sorted_imp.sum(-1)
    for key, frac in (("top10", 0.1), ("top30", 0.3), ("top50", 0.5)):
        n = _top_pairs(frac, d)
        tally.shares[key] += float((sorted_imp[:, :n].sum(-1) / total).mean()) / tally.layers


def _tally_criteria(tally: _Tally, trace: Trace, li: int, imp: torch.Tensor, d: int, pairing: Pairing,
                    group: int, n_sal: int) -> None:
    """Layer `li` under PN-Mix 3/1 with each criterion's salient pairs, chosen from the prefill and from
    the full sequence; and the Jaccard overlap of the prefill choice with the decode-time top pairs."""
    q, k, p = trace.queries[li], trace.keys[li], trace.prefill_len
    t = k.shape[1]
    for crit in CRITERIA:
        for scope, upto in (("prefill", p), ("full", t)):
            scores = saliency_scores(crit, q[None], k[None], _prefix_mask(t, upto), pairing, seed=li)[0]
            pairs = select_salient_pairs(scores, n_sal)
            k_hat = quantize_pnmix(k, pairs, 3, 1, group, pairing)
            tally.add(f"pnmix-3/1 {crit} ({scope})", q, k, k_hat, p, trace.scaling)
            if scope == "prefill":
                for label, frac in (("r=0.1", 0.1), ("r=0.5", 0.5)):
                    n = _top_pairs(frac, d)
                    chosen = select_salient_pairs(scores, n)
                    truth = select_salient_pairs(imp, n)
                    tally.jaccard[crit][label] += _jaccard(chosen, truth, d // 2) / tally.layers


def _tally_baselines(tally: _Tally, trace: Trace, li: int, pairing: Pairing, group: int, n_sal: int,
                     n_sink: int) -> None:
    """Layer `li` under uniform 2-bit (KIVI-2) and the polar quantizer; and, as the cache runs them with
    the first `n_sink` tokens exact (attention sinks), KIVI-2 and PN-Mix 3/1 (qk_pair_norm)."""
    q, k, p = trace.queries[li], trace.keys[li], trace.prefill_len
    none = torch.zeros((k.shape[0], 0), dtype=torch.long)
    tally.add("kivi-2 uniform", q, k, quantize_pnmix(k, none, 2, 2, group, pairing), p, trace.scaling)
    mask = _prefix_mask(k.shape[1], p)
    qk_pairs = select_salient_pairs(saliency_scores("qk_pair_norm", q[None], k[None], mask, pairing)[0], n_sal)
    for name, b_high, b_low, pairs in (("kivi-2 uniform", 2, 2, none),
                                       ("pnmix-3/1 qk_pair_norm (prefill)", 3, 1, qk_pairs)):
        k_hat = k.clone()
        k_hat[:, n_sink:] = quantize_pnmix(k[:, n_sink:], pairs, b_high, b_low, group, pairing)
        tally.add(f"{name} + {n_sink} fp sinks", q, k, k_hat, p, trace.scaling)
    tally.add("polar 2+2 bits per pair", q, k, quantize_polar(k, 2, group, pairing), p, trace.scaling)


def write_report(result: dict[str, Any], out_dir: Path, model: str) -> list[Path]:
    """JSON + Markdown + one PNG (attention KL per quantizer); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"model": model, **result}
    json_path = out_dir / "analysis.json"
    json_path.write_text(json.dumps(result, indent=2))
    rows = sorted(result["quantizers"].items(), key=lambda kv: kv[1]["attention_kl"])
    lines = [
        f"# PN-Mix saliency analysis: {model}",
        "",
        f"{result['prefill_tokens']} prefill tokens + {result['total_tokens'] - result['prefill_tokens']} generated, "
        f"{result['layers']} layers, d = {result['head_dim']}, key groups of {result['group_size']} tokens, "
        "all quantizers at 2 key bits per channel (before scales). Values exact.",
        "",
        "| key quantizer | attention KL | key MSE |",
        "| --- | --- | --- |",
        *[f"| {name} | {row['attention_kl']:.5f} | {row['key_mse']:.5f} |" for name, row in rows],
        "",
        "Jaccard overlap of the prefill selection with the decode-time top-r pairs:",
        "",
        "| criterion | r = 10% | r = 50% |",
        "| --- | --- | --- |",
        *[f"| {c} | {j['r=0.1']:.3f} | {j['r=0.5']:.3f} |" for c, j in result["jaccard_prefill_vs_decode"].items()],
        "",
        "Share of total decode-time importance held by the top pairs: "
        + ", ".join(f"{k} {v:.1%}" for k, v in result["importance_share"].items()),
        "",
    ]
    md_path = out_dir / "analysis.md"
    md_path.write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.barh([name for name, _ in rows], [row["attention_kl"] for _, row in rows])
    ax.set_xscale("log")
    ax.set_xlabel("attention KL(p || p_hat), decode queries (log scale)")
    ax.set_title(f"{model}: key quantizers at 2 bits per channel")
    fig.tight_layout()
    png_path = out_dir / "attention_kl.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return [json_path, md_path, png_path]
