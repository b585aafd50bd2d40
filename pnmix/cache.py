"""PNMixCache: a `transformers.Cache` holding keys and values in the PN-Mix storage format.

Per layer and sequence, in token order (docs/design.md, "Storage format"):
    [ n_sink fp sinks | packed region, whole groups of G tokens | fp residual buffer ]
The residual buffer is quantized into the packed region when it reaches `residual_len` tokens.
Sinks and residual stay in the model's dtype (fp16/bf16 on GPU; fp32 on the CPU reference).

Each sequence keeps only its real tokens: left-padding columns are dropped at prefill, so a
sequence in a batch gets the same sinks, groups and salient set as when generated alone.

`update` stores nothing by itself: it returns a `LayerStep` handle that the registered "pnmix"
attention function consumes, because the prefill's saliency needs the post-RoPE queries, which
only the attention function sees. The CPU reference path keeps a dequantized, token-ordered view
of each layer (`view_k`, `view_v`), written from the packed bytes when a group is quantized;
the GPU path (kernels/) reads the packed bytes directly instead.

A model with sliding-window layers beside its full-attention ones (Gemma 3) gets a `WindowLayer`
for each sliding one: transformers' own sliding-window layer, which keeps the last window of keys
and values in the model's dtype, so those layers attend exactly as with transformers' cache (the
"pnmix" attention function runs SDPA, with the model's sliding mask, on the plain tensors it
returns). PN-Mix quantizes the full-attention layers, where the long context and nearly all the
bytes sit. A cache built from recorded prefills (pnmix/prefill.py, the scoring engine's batches
of sequences of different lengths) holds `BatchWindowLayer`s instead: the same window, kept per
sequence, attended with the same sliding mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from pnmix import backend, packing
from pnmix.bits import ModelShape, window_bytes
from pnmix.config import ConfigError, PNMixConfig
from pnmix.families import FULL, check_model, plan_of_config
from pnmix.layerwise import LayerwiseConfig, as_layerwise
from pnmix.saliency import Pairing, pair_channels, saliency_scores, select_salient_pairs

REGIONS = ("packed_keys", "key_scales", "salient_sets", "packed_values", "value_scales", "sinks", "residual",
           "window")  # window: a sliding-window layer's keys and values, in the model's dtype


@dataclass
class LayerStep:
    """What `update` hands to the attention function: the layer and this step's new states."""

    layer: PNMixLayer
    keys: torch.Tensor  # [B, H_kv, q_len, d], post-RoPE
    values: torch.Tensor  # [B, H_kv, q_len, d]


@dataclass
class StaticStep:
    """The handle of a static layer (pnmix/static.py): one decode step, appended and attended there."""

    layer: Any  # StaticQuantLayer | StaticFullLayer
    keys: torch.Tensor  # [B, H_kv, 1, d], post-RoPE
    values: torch.Tensor


@dataclass
class Flushed:
    """A residual block that a multi-token step quantized: its unquantized tokens, and from which
    query position on the block is seen quantized.

    Token-by-token decode quantizes the block when its last token is appended, so every earlier
    query of the step saw it unquantized. Keeping that copy for them makes a step of n tokens
    attend exactly as n single-token steps do, whatever n is (teacher-forced replays).
    """

    row: int
    start: int  # position of the block's first token
    keys: torch.Tensor  # [H_kv, R, d], as they were in the residual buffer
    values: torch.Tensor

    @property
    def quantized_from(self) -> int:
        return self.start + self.keys.shape[-2] - 1


def attend_view(query: torch.Tensor, view_k: torch.Tensor, view_v: torch.Tensor, lengths: list[int],
                scaling: float, flushed: list[Flushed] | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of the newest q_len tokens of every sequence over a token-ordered view (causal).

    query [B, Hq, q_len, d]; view_k/view_v [B, H_kv, >= max(lengths), d], sequence b's tokens in
    its first lengths[b] slots -> [B, q_len, Hq, d]. The torch path of both the dynamic cache and
    the static one (pnmix/static.py) attend here, so given the same view they agree bit for bit.
    `flushed`: blocks this step quantized; queries before a block's flush see its unquantized
    copy (appended as extra key slots) instead of the view's quantized one. `window`: a query at
    position q sees positions > q - window only (transformers' sliding mask).
    """
    q_len = query.shape[2]
    length = int(max(lengths))
    k = view_k[:, :, :length]
    v = view_v[:, :, :length]
    dev = query.device
    lens = torch.tensor(lengths, device=dev)
    pos = torch.arange(length, device=dev)
    q_pos = (lens[:, None] - q_len + torch.arange(q_len, device=dev))  # [B, q_len]
    mask = pos[None, None, :] <= q_pos[:, :, None]  # [B, q_len, L]: causal, ends at each length
    if window is not None:
        mask = mask & (pos[None, None, :] > q_pos[:, :, None] - window)
    if flushed:
        k, v, mask = _with_flushed(k, v, mask, q_pos, flushed, window)
    return masked_attention(query, k, v, mask, scaling)


def masked_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """query [B, Hq, q_len, d] over k/v [B, H_kv, L, d] where mask [B, q_len, L] (bool) allows ->
    [B, q_len, Hq, d]. Query head h' reads KV head h' // group: the group is folded into the query
    axis, so one SDPA call serves grouped-query attention without repeating the keys."""
    b, hq, q_len, d = query.shape
    kv_heads = k.shape[1]
    group = hq // kv_heads
    q = query.reshape(b, kv_heads, group * q_len, d)
    mask = mask.repeat(1, group, 1)[:, None]  # [B, 1, group * q_len, L]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, q_len, d).transpose(1, 2).contiguous()


def _with_flushed(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, q_pos: torch.Tensor,
                  flushed: list[Flushed], window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The view's keys/values and mask [B, q_len, L] extended by the flushed blocks' copies.

    A query at position q sees a block's view slots (its quantized tokens) only from the block's
    `quantized_from` on, and its extra slots (the unquantized copy) only before it. Index lists are
    built on the host, so a step costs a few batched ops however many blocks it flushed.
    """
    b, h, length, d = k.shape
    dev = k.device
    n = flushed[0].keys.shape[-2]
    per_row = [0] * b  # blocks placed so far in each row's extra slots
    rows: list[int] = []
    slots: list[int] = []
    tokens: list[int] = []
    until: list[int] = []
    for f in flushed:
        rows += [f.row] * n
        slots += range(per_row[f.row] * n, (per_row[f.row] + 1) * n)
        tokens += range(f.start, f.start + n)
        until += [f.quantized_from] * n
        per_row[f.row] += 1
    width = max(per_row) * n
    row_t, slot_t, token_t, until_t = (torch.tensor(x, device=dev) for x in (rows, slots, tokens, until))
    copies_k = torch.stack([f.keys for f in flushed]).transpose(1, 2).reshape(-1, h, d)  # [blocks * n, H, d]
    copies_v = torch.stack([f.values for f in flushed]).transpose(1, 2).reshape(-1, h, d)
    ek = k.new_zeros((b, h, width, d))
    ev = v.new_zeros((b, h, width, d))
    ek[row_t, :, slot_t] = copies_k
    ev[row_t, :, slot_t] = copies_v
    never = torch.iinfo(torch.long).max
    # Per extra slot: its token's position and the first query that no longer sees the copy.
    slot_token = torch.full((b, width), never, dtype=torch.long, device=dev)
    slot_until = torch.zeros((b, width), dtype=torch.long, device=dev)
    slot_token[row_t, slot_t] = token_t
    slot_until[row_t, slot_t] = until_t
    q = q_pos[:, :, None]  # [B, q_len, 1]
    extra = (slot_token[:, None, :] <= q) & (q < slot_until[:, None, :])
    if window is not None:
        extra = extra & (slot_token[:, None, :] > q - window)
    # Per view slot: the first query that sees it (its block's flush; -1 for slots of no flushed block).
    view_from = torch.full((b, length), -1, dtype=torch.long, device=dev)
    view_from[row_t, token_t] = until_t  # every flushed token is held, so inside the view
    mask = mask & (q >= view_from[:, None, :])
    return torch.cat([k, ek], dim=2), torch.cat([v, ev], dim=2), torch.cat([mask, extra], dim=2)


def _scatter_tokens(buf: torch.Tensor, at: torch.Tensor, new: torch.Tensor) -> None:
    """buf[b, :, at[b, j]] = new[b, :, j] for buf [B, H, T, d], at [B, n], new [B, H, n, d]."""
    buf.scatter_(2, at[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]), new)


def _gather_tokens(buf: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """buf[b, :, at[b, j]] for buf [B, H, T, d], at [B, n] -> [B, H, n, d]."""
    return buf.gather(2, at[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))


class SeenTokensLayer(CacheLayerMixin):
    """transformers' layer protocol for layers whose masks count every token seen (`seen`)."""

    is_compileable = False
    is_sliding = False
    seen = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class PNMixLayer(SeenTokensLayer):
    is_croppable = False

    def __init__(self, config: PNMixConfig, pairing: Pairing, layer_idx: int, window: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.pairing = pairing
        self.layer_idx = layer_idx
        # A sliding-window layer whose window the config quantizes: every token is stored as a
        # full-attention layer stores it, and a query attends over the last `window` positions
        # only (transformers' sliding mask), so it sees exactly what a store that drops older
        # tokens, whole groups at a time, would still hold. `nbytes` counts what such a store holds.
        self.window = window
        self.seen = 0  # tokens processed, left padding included: what the model's masks count
        self.prefilled = False
        self.multi_token = False  # set by PNMixCache(multi_token=True)

    # -- transformers' layer protocol ------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self._allocate(b, h, d, key_states.dtype, key_states.device)

    def _allocate(self, b: int, h: int, d: int, dt: torch.dtype, dev: torch.device) -> None:
        cfg = self.config
        self.batch, self.kv_heads, self.head_dim, self.dtype, self.device = b, h, d, dt, dev
        self.n_salient = cfg.salient_pairs(d)
        self.flushes = cfg.keys_quantized or cfg.values_quantized
        self.lengths = [0] * b  # real tokens held per sequence
        self.n_groups = [0] * b  # groups in the packed region per sequence
        self.res_len = [0] * b  # tokens in the residual buffer per sequence
        self.k_sink = torch.zeros((b, h, cfg.n_sink, d), dtype=dt, device=dev)
        self.v_sink = torch.zeros_like(self.k_sink)
        res_cap = cfg.residual_len if self.flushes else 0
        self.k_res = torch.zeros((b, h, res_cap, d), dtype=dt, device=dev)
        self.v_res = torch.zeros_like(self.k_res)
        self.salient_pairs = torch.zeros((b, h, self.n_salient), dtype=torch.int16, device=dev)
        self.packed: dict[str, torch.Tensor] = {}  # packed region, grown a group at a time
        self.group_capacity = 0
        self.view_k = torch.zeros((b, h, 0, d), dtype=dt, device=dev)
        self.view_v = torch.zeros_like(self.view_k)
        self.flushed: list[Flushed] = []
        # [triton] Kernel path (pnmix/backend.py): pack and attend with kernels/, keep no dequantized view.
        self.use_kernels = self.window is None and backend.use_triton(dev, cfg, d)  # no window in the kernels
        # The kernel path keeps no view, unless the cache serves multi-token steps (teacher forcing).
        self.keep_view = not self.use_kernels or self.multi_token
        self.channel_order: torch.Tensor | None = None  # [triton] set at prefill, from the salient set
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        step = LayerStep(self, key_states, value_states)
        return step, step

    def reset(self) -> None:
        self.is_initialized = False
        self.prefilled = False
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PN-Mix cache does not support beam search")

    # -- storage ---------------------------------------------------------------------------------

    def salient_channels_all(self) -> torch.Tensor:
        """Channels of every sequence's salient pairs, [B, H_kv, 2 * n_salient], ascending."""
        return pair_channels(self.salient_pairs.long(), self.head_dim, self.pairing)

    def salient_channels(self, b: int) -> torch.Tensor:
        """Channels of sequence b's salient pairs, [H_kv, 2 * n_salient], ascending."""
        return pair_channels(self.salient_pairs[b].long(), self.head_dim, self.pairing)

    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, token_mask: torch.Tensor) -> None:
        """Chooses each sequence's salient pairs from the prefill and stores its real tokens."""
        cfg = self.config
        scores = None
        if self.n_salient:
            scores = saliency_scores(cfg.criterion, query, key, token_mask, self.pairing, cfg.seed + self.layer_idx)
        real = [token_mask[b].nonzero().squeeze(-1) for b in range(self.batch)]
        self._store_prefill(scores, [key[b][:, cols] for b, cols in enumerate(real)],
                            [value[b][:, cols] for b, cols in enumerate(real)])

    def load_prefill(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scores: torch.Tensor | None) -> None:
        """Builds the layer from recorded prefills (pnmix/prefill.py), one sequence each.

        keys/values [H_kv, T_b, d] post-RoPE; scores [B, H_kv, d/2]: each sequence's saliency
        scores under this config's criterion, as a prefill of that sequence alone computes them
        (None when no pair is salient). The cache equals the one live prefill builds, byte for
        byte; the tokens of all sequences are quantized in one call per layer.
        """
        h, _, d = keys[0].shape
        self._allocate(len(keys), h, d, keys[0].dtype, keys[0].device)
        self._choose_salient(scores if self.n_salient else None)
        self.seen = max(k.shape[1] for k in keys)
        self._store_batched(keys, values)

    def _store_batched(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """What `_append(b, ..., prefill=True)` does for every sequence b, with batched tensor ops:
        sinks, then whole groups (quantized together), then the rest into the residual buffer."""
        cfg, dev = self.config, self.device
        lengths = torch.tensor([k.shape[1] for k in keys], device=dev)
        # [B, H, T_max, d], sequence b's tokens in its first lengths[b] slots
        k_all = torch.nn.utils.rnn.pad_sequence([k.transpose(0, 1) for k in keys], batch_first=True).transpose(1, 2)
        v_all = torch.nn.utils.rnn.pad_sequence([v.transpose(0, 1) for v in values], batch_first=True).transpose(1, 2)
        t_max = k_all.shape[2]
        n_sink = min(cfg.n_sink, t_max)
        if n_sink:
            self.k_sink[:, :, :n_sink] = k_all[:, :, :n_sink]
            self.v_sink[:, :, :n_sink] = v_all[:, :, :n_sink]
        past_sinks = (lengths - cfg.n_sink).clamp_min(0)
        g = cfg.group_size
        n_groups = past_sinks // g if self.flushes else torch.zeros_like(past_sinks)
        most = int(n_groups.max())
        if most:
            region = slice(cfg.n_sink, cfg.n_sink + most * g)
            k_hat, v_hat = self._quantize_batched(k_all[:, :, region], v_all[:, :, region], n_groups, most)
        if self.keep_view:
            self._grow_view(t_max)
            self.view_k[:, :, :t_max] = k_all
            self.view_v[:, :, :t_max] = v_all
            if most:  # the groups' slots hold what their bytes decode to
                pos = cfg.n_sink + torch.arange(most * g, device=dev)
                packed = (pos[None, :] < (cfg.n_sink + n_groups * g)[:, None])[:, None, :, None]
                view = slice(cfg.n_sink, cfg.n_sink + most * g)
                self.view_k[:, :, view] = torch.where(packed, k_hat, self.view_k[:, :, view])
                self.view_v[:, :, view] = torch.where(packed, v_hat, self.view_v[:, :, view])
        res_len = past_sinks - n_groups * g
        most_res = int(res_len.max())
        if most_res:
            self._grow_residual(most_res)
            start = cfg.n_sink + n_groups * g  # [B]
            idx = (start[:, None] + torch.arange(most_res, device=dev)[None, :]).clamp_max(t_max - 1)
            held = (torch.arange(most_res, device=dev)[None, :] < res_len[:, None])[:, None, :, None]
            gather = idx[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
            zero = torch.zeros((), dtype=self.dtype, device=dev)
            self.k_res[:, :, :most_res] = torch.where(held, k_all.gather(2, gather), zero)
            self.v_res[:, :, :most_res] = torch.where(held, v_all.gather(2, gather), zero)
        self.lengths = lengths.tolist()
        self.n_groups = n_groups.tolist()
        self.res_len = res_len.tolist()

    def _quantize_batched(self, k: torch.Tensor, v: torch.Tensor, n_groups: torch.Tensor,
                          most: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantizes k/v [B, H_kv, most * G, d] into groups 0..most-1 of every sequence; groups past
        sequence b's n_groups[b] are left zero (their tokens belong to the residual or to nothing).
        Returns what the stored bytes decode to (k, v unchanged where the cache keeps no view)."""
        cfg, p, g = self.config, self.packed, self.config.group_size
        self._grow_packed(most)
        gmask = torch.arange(most, device=self.device)[None, :] < n_groups[:, None]  # [B, most]
        tmask = gmask.repeat_interleave(g, dim=1)  # [B, most * G]

        def put(name: str, new: torch.Tensor, mask: torch.Tensor) -> None:
            m = mask.view(*mask.shape, *([1] * (new.dim() - 3)))[:, None]  # [B, 1, n, 1...]
            p[name][:, :, : new.shape[2]] = torch.where(m, new, torch.zeros((), dtype=new.dtype, device=new.device))

        quantize_keys, quantize_values = backend.quantizers(self.use_kernels)
        if cfg.keys_quantized:
            channels = self.salient_channels_all()
            pk = quantize_keys(k, channels, cfg.b_low, cfg.b_high, g)
            for name, new in (("k_low", pk.low), ("k_high", pk.high), ("k_scale", pk.scale), ("k_zero", pk.zero)):
                put(name, new, gmask)
            if self.keep_view:
                k = packing.dequantize_keys(packing.PackedKeys(pk.low, pk.high, pk.scale, pk.zero), channels,
                                            cfg.b_low).to(self.dtype)
        else:
            put("k_raw", k, tmask)
        if cfg.values_quantized:
            pv = quantize_values(v, cfg.value_bits, cfg.value_group_size)
            for name, new in (("v_packed", pv.packed), ("v_scale", pv.scale), ("v_zero", pv.zero)):
                put(name, new, tmask)
            if self.keep_view:
                v = packing.dequantize_values(packing.PackedValues(pv.packed, pv.scale, pv.zero), cfg.value_bits,
                                              cfg.value_group_size).to(self.dtype)
        else:
            put("v_raw", v, tmask)
        return k, v

    def _store_prefill(self, scores: torch.Tensor | None, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Selects the salient pairs from `scores` [B, H_kv, d/2] and stores each sequence's tokens."""
        self._choose_salient(scores)
        for b, (k, v) in enumerate(zip(keys, values, strict=True)):
            self._append(b, k, v, prefill=True)

    def _choose_salient(self, scores: torch.Tensor | None) -> None:
        """The salient pairs from `scores` [B, H_kv, d/2] (None: none salient); the layer is prefilled after."""
        if scores is not None:
            self.salient_pairs = select_salient_pairs(scores, self.n_salient).to(torch.int16)
        if self.use_kernels:  # [triton] the kernel reads channels in an order that follows the salient set
            self.channel_order = backend.channel_order(self.salient_channels_all(), self.head_dim)
        self.prefilled = True

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Decode-time append: key/value [B, H_kv, n, d], every token real."""
        self.flushed = []  # what this step quantizes, if it has several tokens
        if self.flushes and min(self.lengths) >= self.config.n_sink:
            self._append_past_sinks(key, value)
            return
        for b in range(self.batch):
            self._append(b, key[b], value[b], keep_flushed=key.shape[-2] > 1)

    def _append_past_sinks(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """What `_append(b, ...)` does for every sequence b once all sinks are held, batched: the
        step's tokens go into the residual buffers, then every full residual block of every
        sequence is quantized in one call per layer (a replay step flushes several blocks a row;
        quantizing them one row and block at a time made it launch-bound)."""
        cfg, dev = self.config, self.device
        n, r = key.shape[-2], cfg.residual_len
        steps = torch.arange(n, device=dev)
        if self.keep_view:
            self._grow_view(max(self.lengths) + n)
            at = torch.tensor(self.lengths, device=dev)[:, None] + steps  # [B, n]
            _scatter_tokens(self.view_k, at, key)
            _scatter_tokens(self.view_v, at, value)
        self._grow_residual(max(self.res_len) + n)
        held = torch.tensor(self.res_len, device=dev)[:, None] + steps  # [B, n]
        _scatter_tokens(self.k_res, held, key)
        _scatter_tokens(self.v_res, held, value)
        totals = [h + n for h in self.res_len]
        blocks = [t // r for t in totals]  # full residual blocks to quantize, per sequence
        if max(blocks):
            self._flush_blocks(blocks, keep_flushed=n > 1)
            cap = self.k_res.shape[-2]
            shift = torch.tensor([f * r for f in blocks], device=dev)[:, None] + torch.arange(cap, device=dev)
            rest = shift.clamp_max(cap - 1)  # [B, cap]: each row's remaining tokens move to the front
            self.k_res.copy_(_gather_tokens(self.k_res, rest))
            self.v_res.copy_(_gather_tokens(self.v_res, rest))
        self.lengths = [length + n for length in self.lengths]
        self.res_len = [t - f * r for t, f in zip(totals, blocks, strict=True)]

    def _flush_blocks(self, blocks: list[int], keep_flushed: bool) -> None:
        """Quantizes the first blocks[b] residual blocks of every sequence b into its packed region,
        all sequences in one quantize call; the residual buffers are left as they were."""
        cfg, dev, p = self.config, self.device, self.packed
        g, r = cfg.group_size, cfg.residual_len
        most = max(blocks)
        k = self.k_res[:, :, : most * r].clone()  # [B, H_kv, most * R, d]; rows past their blocks unused
        v = self.v_res[:, :, : most * r].clone()
        if keep_flushed:
            for b, count in enumerate(blocks):
                for f in range(count):
                    start = cfg.n_sink + (self.n_groups[b] + f * r // g) * g
                    self.flushed.append(Flushed(b, start, k[b, :, f * r : (f + 1) * r], v[b, :, f * r : (f + 1) * r]))
        new_groups = [f * r // g for f in blocks]
        self._grow_packed(max(g0 + m for g0, m in zip(self.n_groups, new_groups, strict=True)))
        # (row, index in this flush) of every group and every token written, and where each lands
        g_row: list[int] = []
        g_src: list[int] = []
        g_dst: list[int] = []
        t_row: list[int] = []
        t_src: list[int] = []
        t_dst: list[int] = []
        for b, m in enumerate(new_groups):
            g_row += [b] * m
            g_src += range(m)
            g_dst += range(self.n_groups[b], self.n_groups[b] + m)
            t_row += [b] * (m * g)
            t_src += range(m * g)
            t_dst += range(self.n_groups[b] * g, (self.n_groups[b] + m) * g)
        gr, gs, gd, tr, ts, td = (torch.tensor(i, device=dev) for i in (g_row, g_src, g_dst, t_row, t_src, t_dst))
        quantize_keys, quantize_values = backend.quantizers(self.use_kernels)
        if cfg.keys_quantized:
            channels = self.salient_channels_all()
            pk = quantize_keys(k, channels, cfg.b_low, cfg.b_high, g)
            for name, new in (("k_low", pk.low), ("k_high", pk.high), ("k_scale", pk.scale), ("k_zero", pk.zero)):
                p[name][gr, :, gd] = new[gr, :, gs]
            if self.keep_view:
                k = packing.dequantize_keys(packing.PackedKeys(pk.low, pk.high, pk.scale, pk.zero), channels,
                                            cfg.b_low).to(self.dtype)
        else:
            p["k_raw"][tr, :, td] = k[tr, :, ts]
        if cfg.values_quantized:
            pv = quantize_values(v, cfg.value_bits, cfg.value_group_size)
            for name, new in (("v_packed", pv.packed), ("v_scale", pv.scale), ("v_zero", pv.zero)):
                p[name][tr, :, td] = new[tr, :, ts]
            if self.keep_view:
                v = packing.dequantize_values(packing.PackedValues(pv.packed, pv.scale, pv.zero), cfg.value_bits,
                                              cfg.value_group_size).to(self.dtype)
        else:
            p["v_raw"][tr, :, td] = v[tr, :, ts]
        if self.keep_view:  # the view's slots of these tokens hold what their bytes decode to
            self.view_k[tr, :, cfg.n_sink + td] = k[tr, :, ts]
            self.view_v[tr, :, cfg.n_sink + td] = v[tr, :, ts]
        self.n_groups = [g0 + m for g0, m in zip(self.n_groups, new_groups, strict=True)]

    def _append(self, b: int, k: torch.Tensor, v: torch.Tensor, prefill: bool = False,
                keep_flushed: bool = False) -> None:
        """Adds tokens k/v [H_kv, n, d] to sequence b: sinks first, then the residual buffer."""
        cfg = self.config
        start = self.lengths[b]
        end = start + k.shape[-2]
        if self.keep_view:  # [triton] the kernel path keeps no view
            self._grow_view(end)
            self.view_k[b, :, start:end] = k
            self.view_v[b, :, start:end] = v
        n_sink_new = max(0, min(cfg.n_sink, end) - start)
        if n_sink_new:
            self.k_sink[b, :, start : start + n_sink_new] = k[:, :n_sink_new]
            self.v_sink[b, :, start : start + n_sink_new] = v[:, :n_sink_new]
        self.lengths[b] = end
        k, v = k[:, n_sink_new:], v[:, n_sink_new:]
        if prefill and self.flushes:  # prefill tokens past the sinks go straight into whole groups
            whole = k.shape[-2] // cfg.group_size * cfg.group_size
            self._quantize(b, k[:, :whole], v[:, :whole])
            k, v = k[:, whole:], v[:, whole:]
        if k.shape[-2] == 0:
            return
        self._grow_residual(self.res_len[b] + k.shape[-2])
        r = self.res_len[b]
        self.k_res[b, :, r : r + k.shape[-2]] = k
        self.v_res[b, :, r : r + v.shape[-2]] = v
        self.res_len[b] = r + k.shape[-2]
        if not self.flushes:  # unquantized: the residual buffer simply holds everything
            return
        while self.res_len[b] >= cfg.residual_len:
            n = cfg.residual_len
            if keep_flushed:
                start = cfg.n_sink + self.n_groups[b] * cfg.group_size
                self.flushed.append(Flushed(b, start, self.k_res[b, :, :n].clone(), self.v_res[b, :, :n].clone()))
            self._quantize(b, self.k_res[b, :, :n], self.v_res[b, :, :n])
            rest = self.res_len[b] - n
            self.k_res[b, :, :rest] = self.k_res[b, :, n : n + rest].clone()
            self.v_res[b, :, :rest] = self.v_res[b, :, n : n + rest].clone()
            self.res_len[b] = rest

    def _quantize(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends tokens k/v [H_kv, n * G, d] of sequence b to its packed region, in whole groups."""
        n_tokens = k.shape[-2]
        if n_tokens == 0:
            return
        cfg = self.config
        g0 = self.n_groups[b]
        n_new = n_tokens // cfg.group_size
        self._grow_packed(g0 + n_new)
        p = self.packed
        channels = self.salient_channels(b)
        gs = slice(g0, g0 + n_new)
        ts = slice(g0 * cfg.group_size, (g0 + n_new) * cfg.group_size)
        # [triton] Same bytes from the kernels on the kernel path.
        quantize_keys, quantize_values = backend.quantizers(self.use_kernels)
        if cfg.keys_quantized:
            pk = quantize_keys(k, channels, cfg.b_low, cfg.b_high, cfg.group_size)
            p["k_low"][b, :, gs], p["k_high"][b, :, gs] = pk.low, pk.high
            p["k_scale"][b, :, gs], p["k_zero"][b, :, gs] = pk.scale, pk.zero
            if self.keep_view:
                stored = packing.PackedKeys(p["k_low"][b, :, gs], p["k_high"][b, :, gs],
                                            p["k_scale"][b, :, gs], p["k_zero"][b, :, gs])
                k_hat = packing.dequantize_keys(stored, channels, cfg.b_low).to(self.dtype)
        else:
            p["k_raw"][b, :, ts] = k
            k_hat = k
        if cfg.values_quantized:
            pv = quantize_values(v, cfg.value_bits, cfg.value_group_size)
            p["v_packed"][b, :, ts], p["v_scale"][b, :, ts], p["v_zero"][b, :, ts] = pv.packed, pv.scale, pv.zero
            if self.keep_view:
                stored_v = packing.PackedValues(p["v_packed"][b, :, ts], p["v_scale"][b, :, ts],
                                                p["v_zero"][b, :, ts])
                v_hat = packing.dequantize_values(stored_v, cfg.value_bits, cfg.value_group_size).to(self.dtype)
        else:
            p["v_raw"][b, :, ts] = v
            v_hat = v
        if self.keep_view:  # the reference view now holds what the packed bytes decode to
            pos = cfg.n_sink + g0 * cfg.group_size
            self.view_k[b, :, pos : pos + n_tokens] = k_hat
            self.view_v[b, :, pos : pos + n_tokens] = v_hat
        self.n_groups[b] = g0 + n_new

    def _grow_view(self, length: int) -> None:
        have = self.view_k.shape[-2]
        if length <= have:
            return
        extra = max(length - have, have // 2, 64)  # amortised growth
        pad = torch.zeros((self.batch, self.kv_heads, extra, self.head_dim), dtype=self.dtype, device=self.device)
        self.view_k = torch.cat([self.view_k, pad], dim=-2)
        self.view_v = torch.cat([self.view_v, pad], dim=-2)

    def _grow_residual(self, length: int) -> None:
        have = self.k_res.shape[-2]
        if length <= have:
            return
        # Unquantized caches keep every token here: grow them geometrically (a copy per step would
        # cost O(length) each step); quantized ones only ever need a chunk past residual_len.
        extra = length - have if self.flushes else max(length - have, have // 2, 64)
        pad = torch.zeros((self.batch, self.kv_heads, extra, self.head_dim), dtype=self.dtype,
                          device=self.device)
        self.k_res = torch.cat([self.k_res, pad], dim=-2)
        self.v_res = torch.cat([self.v_res, pad], dim=-2)

    def _grow_packed(self, n_groups: int) -> None:
        """Grows the packed region to exactly n_groups groups, so its bytes are the bytes held."""
        cfg, d = self.config, self.head_dim
        lead = (self.batch, self.kv_heads)
        have = self.group_capacity
        if n_groups <= have:
            return
        self.group_capacity = n_groups
        n, g, n_sc = n_groups - have, cfg.group_size, 2 * self.n_salient
        u8, f16, dev = torch.uint8, torch.float16, self.device
        new: dict[str, torch.Tensor] = {}
        if cfg.keys_quantized:
            new["k_low"] = torch.zeros((*lead, n, cfg.b_low, d, g // 8), dtype=u8, device=dev)
            new["k_high"] = torch.zeros((*lead, n, cfg.high_planes, n_sc, g // 8), dtype=u8, device=dev)
            new["k_scale"] = torch.zeros((*lead, n, d), dtype=f16, device=dev)
            new["k_zero"] = torch.zeros((*lead, n, d), dtype=f16, device=dev)
        else:
            new["k_raw"] = torch.zeros((*lead, n * g, d), dtype=self.dtype, device=dev)
        if cfg.values_quantized:
            vg = d // cfg.value_group_size
            new["v_packed"] = torch.zeros((*lead, n * g, d * cfg.value_bits // 8), dtype=u8, device=dev)
            new["v_scale"] = torch.zeros((*lead, n * g, vg), dtype=f16, device=dev)
            new["v_zero"] = torch.zeros((*lead, n * g, vg), dtype=f16, device=dev)
        else:
            new["v_raw"] = torch.zeros((*lead, n * g, d), dtype=self.dtype, device=dev)
        for name, t in new.items():
            self.packed[name] = torch.cat([self.packed[name], t], dim=2) if name in self.packed else t

    # -- reference attention -----------------------------------------------------------------------

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the newest q_len tokens of every sequence over its cache (causal).

        query [B, Hq, q_len, d] -> [B, q_len, Hq, d]. Reads the dequantized view: sinks and
        residual exact, packed groups as their stored bytes decode.
        """
        if self.use_kernels and query.shape[2] == 1:  # [triton] fused kernel over the stored bytes
            return backend.attend_kernels(self, query, scaling)
        # [triton] Without a kept view (kernel path, several query tokens), rebuild it from the bytes.
        view_k, view_v = (self.view_k, self.view_v) if self.keep_view else backend.dequantized_view(self)
        flushed, self.flushed = self.flushed, []
        return attend_view(query, view_k, view_v, self.lengths, scaling, flushed, self.window)

    # -- accounting --------------------------------------------------------------------------------

    def nbytes(self) -> dict[str, int]:
        """Bytes of every tensor this layer holds in the storage format, by region."""
        if not self.is_initialized:
            return dict.fromkeys(REGIONS, 0)
        if self.window is not None:
            return self._window_bytes()
        p = self.packed

        def size(*names: str) -> int:
            return sum(p[n].nbytes for n in names if n in p)

        return {
            "packed_keys": size("k_low", "k_high", "k_raw"),
            "key_scales": size("k_scale", "k_zero"),
            "salient_sets": self.salient_pairs.nbytes,
            "packed_values": size("v_packed", "v_raw"),
            "value_scales": size("v_scale", "v_zero"),
            "sinks": self.k_sink.nbytes + self.v_sink.nbytes,
            "residual": self._residual_bytes(),
            "window": 0,  # a full-attention layer: every token held, none dropped by a window
        }

    def _window_bytes(self) -> dict[str, int]:
        """What a store of each sequence's last window - 1 tokens holds (`pnmix.bits.window_config`:
        sinks while held, groups as after a prefill of those tokens), by region."""
        one = ModelShape(1, self.kv_heads, self.kv_heads, self.head_dim)
        out = dict.fromkeys(REGIONS, 0)
        for n in self.lengths:
            held = min(n, self.window - 1)  # type: ignore[operator]
            if held:
                regions = window_bytes(self.config, one, 1, held, n).as_dict()
                for r in REGIONS:
                    out[r] += regions.get(r, 0)
        return out

    def _residual_bytes(self) -> int:
        if self.flushes:  # a fixed buffer of residual_len tokens (a chunk more after a multi-token step)
            return self.k_res.nbytes + self.v_res.nbytes
        # Unquantized: the tokens held, not the spare capacity of the geometric growth.
        return 2 * self.batch * self.kv_heads * max(self.res_len, default=0) * self.head_dim * self.dtype.itemsize


class PNMixCache(Cache):
    """A PN-Mix KV cache for one `generate` call (or one forward sequence).

    Pass it to `generate` with `pnmix.generation.cache_kwargs`, and select the "pnmix" attention
    implementation (`pnmix.attention.use_pnmix_attention`). `multi_token=True` is for caches fed
    several tokens a step after prefill (teacher forcing): on the kernel path they keep a
    dequantized view, updated as groups are packed, instead of rebuilding it from the bytes each step.
    """

    def __init__(self, model_config: Any, config: PNMixConfig | LayerwiseConfig, multi_token: bool = False) -> None:
        if not isinstance(config, PNMixConfig | LayerwiseConfig):  # e.g. a dict or JSON text read from a file
            raise ConfigError("config", type(config).__name__,
                              "a PNMixConfig or LayerwiseConfig (load JSON with pnmix.layerwise.load_config)")
        pairing, _ = check_model(model_config, config)
        layerwise = as_layerwise(config)
        # The shared fields (G, residual, sinks, values) are the default's: the static path reads them here.
        self.pnmix_config = layerwise.default
        self.layerwise = layerwise
        self.plan = plan_of_config(model_config)  # what each layer holds: read once, here
        held = layerwise.held_configs(self.plan.kinds)  # None: a window in the model's dtype
        layers: list[Any] = [
            WindowLayer(self.plan.window or 0) if cfg is None
            else PNMixLayer(cfg, pairing, i, None if kind == FULL else self.plan.window)
            for i, (cfg, kind) in enumerate(zip(held, self.plan.kinds, strict=True))]
        for layer in layers:
            layer.multi_token = multi_token
        super().__init__(layers=layers)

    def nbytes(self) -> dict[str, Any]:
        """{"layers": [per-layer region bytes, every layer], "regions": summed by region, "total": all bytes}."""
        per_layer = [layer.nbytes() for layer in self.layers
                     if isinstance(layer, PNMixLayer | WindowLayer | BatchWindowLayer)]
        regions = {r: sum(layer[r] for layer in per_layer) for r in REGIONS}
        return {"layers": per_layer, "regions": regions, "total": sum(regions.values())}


class BatchWindowLayer(SeenTokensLayer):
    """A sliding-window layer of a batch of recorded prefills (`pnmix.prefill.build_cache`): every
    sequence keeps its own last `window - 1` tokens in the model's dtype, as transformers' sliding
    layer does for one sequence, and the newest tokens attend causally over the last `window`
    positions (transformers' sliding mask: key position > query position - window). Sequences of
    different lengths sit in one batch without padding; `update` hands the attention function a
    `LayerStep`, which appends and attends here, as a `PNMixLayer` does.

    A decode step costs no host-to-device copy and no per-sequence loop: each sequence's counters
    (slots in use, position of slot 0, positions seen) live on the device beside their host copies
    (the host ones size the buffers), and the buffer holds `SPARE` free slots a sequence, so that it
    is compacted (one gather of every sequence's last window - 1 tokens) once in `SPARE` steps."""

    is_croppable = False
    SPARE = 64  # decode steps between two compactions

    def __init__(self, window: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        super().__init__()
        self.window = window
        self.prefilled, self.multi_token = True, False
        self.lengths = [int(k.shape[1]) for k in keys]  # positions seen per sequence
        keep = [min(n, window - 1) for n in self.lengths]
        self.start = [n - k for n, k in zip(self.lengths, keep, strict=True)]  # position of slot 0
        self.count = keep  # slots in use per sequence
        h, _, d = keys[0].shape
        self.k = keys[0].new_zeros((len(keys), h, max(keep) + self.SPARE, d))
        self.v = torch.zeros_like(self.k)
        for b, n in enumerate(keep):
            if n:
                self.k[b, :, :n] = keys[b][:, -n:]
                self.v[b, :, :n] = values[b][:, -n:]
        self._to_device()
        self.seen = max(self.lengths)
        self.is_initialized = True

    def _to_device(self) -> None:
        dev = self.k.device
        self.count_t = torch.tensor(self.count, device=dev)
        self.start_t = torch.tensor(self.start, device=dev)
        self.lengths_t = torch.tensor(self.lengths, device=dev)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a BatchWindowLayer is built from recorded prefills")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen += key_states.shape[-2]
        step = LayerStep(self, key_states, value_states)  # type: ignore[arg-type]
        return step, step

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [B, H_kv, n, d]: every sequence's next n tokens."""
        n = key.shape[2]
        if max(self.count) + n > self.k.shape[2]:
            self._compact(n)
        at = self.count_t[:, None] + torch.arange(n, device=key.device)
        _scatter_tokens(self.k, at, key.to(self.k.dtype))
        _scatter_tokens(self.v, at, value.to(self.v.dtype))
        self.count = [c + n for c in self.count]
        self.lengths = [m + n for m in self.lengths]
        self.count_t += n
        self.lengths_t += n

    def _compact(self, n: int) -> None:
        """Room for n more tokens a sequence: each keeps only its last window - 1 (what the next
        query can still see), moved to the front of a buffer sized for them, the n and the spare."""
        keep = [min(c, self.window - 1) for c in self.count]
        b, h, _, d = self.k.shape
        dropped = self.count_t - self.count_t.clamp_max(self.window - 1)
        src = (dropped[:, None] + torch.arange(max(keep), device=self.k.device)).clamp_max(self.k.shape[2] - 1)
        k = self.k.new_zeros((b, h, max(keep) + n + self.SPARE, d))
        v = torch.zeros_like(k)
        k[:, :, : max(keep)] = _gather_tokens(self.k, src)  # a row's slots past its own keep are never held
        v[:, :, : max(keep)] = _gather_tokens(self.v, src)
        self.start = [s + c - m for s, c, m in zip(self.start, self.count, keep, strict=True)]
        self.k, self.v, self.count = k, v, keep
        self.start_t += dropped
        self.count_t -= dropped

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [B, Hq, q_len, d] of the newest q_len tokens -> [B, q_len, Hq, d]."""
        q_len = query.shape[2]
        dev = query.device
        width = max(self.count)
        slot = torch.arange(width, device=dev)
        pos = self.start_t[:, None] + slot  # [B, W]: each slot's position
        held = slot[None] < self.count_t[:, None]
        q_pos = self.lengths_t[:, None] - q_len + torch.arange(q_len, device=dev)
        p, qp = pos[:, None, :], q_pos[:, :, None]
        mask = held[:, None, :] & (p <= qp) & (p > qp - self.window)  # [B, q_len, W]
        return masked_attention(query, self.k[:, :, :width], self.v[:, :, :width], mask, scaling)

    def nbytes(self) -> dict[str, int]:
        """The window each sequence holds, as transformers' sliding layer keeps it (window - 1 tokens)."""
        per_token = 2 * self.k.shape[1] * self.k.shape[3] * self.k.dtype.itemsize
        held = sum(min(c, self.window - 1) for c in self.count)
        return {**dict.fromkeys(REGIONS, 0), "window": held * per_token}


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer of a hybrid model: transformers' own, its window in the model's dtype."""

    multi_token = False

    def nbytes(self) -> dict[str, int]:
        held = sum(t.nbytes for t in (self.keys, self.values) if t is not None)
        return {**dict.fromkeys(REGIONS, 0), "window": held}
