"""Saliency: which RoPE channel pairs of a KV head keep b_high bits (docs/design.md, "The method").

Scores are computed once, from the prefill's post-RoPE queries and keys, per (sequence, KV head):

    qk_pair_norm  sigma[h, i] = mean_{h' -> h, t} ||q[h', t, i]|| * mean_s ||k[h, s, i]||
    k_pair_norm   mean_s ||k[h, s, i]||
    k_magnitude   max over the pair's two channels of mean_s |k[h, s, c]|   (Kitty-like)
    k_range       max over the pair's two channels of (max_s k - min_s k)
    random        a seeded random score

Channel criteria are lifted to pairs by the max over the two channels, so the pair holding a
channel outlier is kept, as a channel-level selection would keep that channel.
Pad tokens (left padding) are excluded through `token_mask`.
"""

from __future__ import annotations

from typing import Literal

import torch

Pairing = Literal["rotate_half", "interleaved"]


def pair_channels(pairs: torch.Tensor, head_dim: int, pairing: Pairing) -> torch.Tensor:
    """Pair indices [..., n] (ascending) -> the channels they cover [..., 2n], ascending."""
    if pairing == "rotate_half":  # pair i = channels (i, i + d/2)
        return torch.cat([pairs, pairs + head_dim // 2], dim=-1)
    return torch.stack([2 * pairs, 2 * pairs + 1], dim=-1).flatten(-2)  # pair i = (2i, 2i + 1)


def to_pairs(x: torch.Tensor, pairing: Pairing) -> torch.Tensor:
    """[..., d] -> [..., d/2, 2]: the two channels of each pair side by side."""
    d = x.shape[-1]
    if pairing == "rotate_half":
        return torch.stack([x[..., : d // 2], x[..., d // 2 :]], dim=-1)
    return x.reshape(*x.shape[:-1], d // 2, 2)


def _masked_mean(x: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the token axis (-2) of x [B, H, T, C] where token_mask [B, T] is True."""
    m = token_mask[:, None, :, None].to(x.dtype)
    return (x * m).sum(-2) / m.sum(-2).clamp_min(1)


def saliency_scores(
    criterion: str,
    query: torch.Tensor,
    key: torch.Tensor,
    token_mask: torch.Tensor,
    pairing: Pairing,
    seed: int = 0,
) -> torch.Tensor:
    """query [B, Hq, T, d], key [B, Hkv, T, d], token_mask bool [B, T] -> scores [B, Hkv, d/2]."""
    b, h_kv, _, d = key.shape
    k = key.float()
    if criterion == "random":
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return torch.rand((b, h_kv, d // 2), generator=gen).to(key.device)
    if criterion in ("qk_pair_norm", "k_pair_norm"):
        k_norm = _masked_mean(to_pairs(k, pairing).norm(dim=-1), token_mask)  # [B, Hkv, d/2]
        if criterion == "k_pair_norm":
            return k_norm
        q = query.float()
        q_norm = _masked_mean(to_pairs(q, pairing).norm(dim=-1), token_mask)  # [B, Hq, d/2]
        group = q.shape[1] // h_kv  # query head h' reads KV head h' // group
        q_norm = q_norm.view(b, h_kv, group, d // 2).mean(2)
        return q_norm * k_norm
    if criterion == "k_magnitude":
        per_channel = _masked_mean(k.abs(), token_mask)
    elif criterion == "k_range":
        m = token_mask[:, None, :, None]
        per_channel = k.masked_fill(~m, float("-inf")).amax(-2) - k.masked_fill(~m, float("inf")).amin(-2)
    else:
        raise ValueError(f"unknown saliency criterion {criterion!r}")
    return to_pairs(per_channel, pairing).amax(-1)


def select_salient_pairs(scores: torch.Tensor, n_salient: int) -> torch.Tensor:
    """scores [..., d/2] -> indices of the top `n_salient` pairs, ascending, int64 [..., n_salient]."""
    if n_salient == 0:
        return torch.zeros((*scores.shape[:-1], 0), dtype=torch.long, device=scores.device)
    return scores.topk(n_salient, dim=-1).indices.sort(dim=-1).values
