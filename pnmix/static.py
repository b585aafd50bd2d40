"""Static-shape decoding: a preallocated cache and one decode step replayed as a CUDA graph.

`generate` with a dynamic cache spends most of a decode step on host work (tens of ms for an 8B
shape on an H200). Here every buffer is allocated once to `max_len` tokens,
every length lives in a device tensor, and the whole step (embedding, the model's own decoder
layers, cache append, attention, final norm, LM head, greedy argmax) is captured once in a CUDA
graph and replayed. Prefill runs eagerly through the ordinary path (`PNMixCache` and the "pnmix"
attention, or a DynamicCache for fp16), and its state is then copied into the static buffers, so
the static path stores exactly what `generate` would.

Five cache kinds, same driver:
- `StaticQuantLayer`: PN-Mix and KIVI (keys and values quantized). Buffers are the decode kernel's
  operands (`kernels.layout.DecodeCache`) at full capacity. A step appends the new token (to the
  sinks while a sequence holds fewer than `n_sink`, else to the residual buffer) with predicated
  device writes. When a sequence's residual buffer becomes full, the same step quantizes it into
  the packed region before attending, as `PNMixCache` does. The host knows from its own counters
  which steps those are (no device read), so it replays a flush graph only then; that graph
  quantizes every sequence's residual and commits it only where the residual is full.
  The counters also give the longest sequence after each step: the kernels' launch plans are made
  for it rounded up to a power of two, one graph per (flush, bucket) (`StaticGenerator.arm`).
- `StaticFullLayer`: the fp16 baseline, [B, H_kv, max_len, d] keys and values, attended by a
  flash-decoding kernel over each sequence's length (kernels/decode_full.py), the same scheme as
  the PN-Mix kernel, so that a comparison isolates the cache format.
- `StaticWindowLayer`: a sliding-window layer of a hybrid model (Gemma 3), in the model's dtype:
  a ring of `window` slots per sequence, position p in slot p mod window, so that after a step's
  append it holds exactly the last `window` positions the model's sliding mask lets the new token
  see; attended over the slots filled by the full layers' decode kernel (SDPA with a mask off
  CUDA). The step computes one RoPE table per layer kind.
- `StaticQuantBagWindowLayer`: a sliding-window layer whose window the config quantizes, window
  >= residual_len + G: the groups the window admits whole as an unordered bag of packed groups
  and the group its start is in as an fp16 edge, which the decode kernels read as groups and
  sinks, with no mask.
- `StaticQuantWindowLayer`: a shorter quantized window: the quantized layer's store with a ring
  of packed groups (as many as a window of positions overlaps), attended by masked SDPA over its
  decoded groups, sinks and residual.

Off CUDA (tests, CPU) the same step runs eagerly: attention is the fp32 dequantize-then-attend
reference for quantized layers and masked SDPA for full ones (PNMIX_BACKEND=triton runs the
kernels there too, in Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from pnmix import backend, packing
from pnmix.cache import PNMixLayer, StaticStep, attend_view, masked_attention
from pnmix.config import ConfigError, PNMixConfig
from pnmix.families import FULL, layer_kinds, sliding_window
from pnmix.generation import cache_kwargs, new_cache, use_pnmix_attention
from pnmix.kernels.layout import DecodeCache
from pnmix.kernels.plan import length_bucket, packed_groups_bound
from pnmix.layerwise import AnyConfig, LayerwiseConfig, as_layerwise
from pnmix.projections import fuse_siblings, swapped, with_merged_linears

# The packed fields indexed by group (keys) and by token (values).
KEY_FIELDS, VALUE_FIELDS = DecodeCache.PACKED[:4], DecodeCache.PACKED[4:]


def put_slots(t: torch.Tensor, at: torch.Tensor, value: torch.Tensor, where: torch.Tensor) -> None:
    """t[b, :, at[b, i]] = value[b, :, i] where where[b], else unchanged; no host sync.

    t [B, H, N, ...], at int [B, n] (device), value [B, H, n, ...], where bool [B].
    """
    b = torch.arange(t.shape[0], device=t.device)[:, None]
    old = t[b, :, at]  # [B, n, H, ...]
    keep = where.view(-1, *([1] * (old.dim() - 1)))
    t[b, :, at] = torch.where(keep, value.transpose(1, 2).to(t.dtype), old)


def put_block(t: torch.Tensor, start: torch.Tensor, value: torch.Tensor, where: torch.Tensor) -> None:
    """t[b, :, start[b] : start[b] + n] = value[b] where where[b], else unchanged; no host sync.

    t [B, H, N, ...], start int [B] (device), value [B, H, n, ...], where bool [B].
    """
    put_slots(t, start.long()[:, None] + torch.arange(value.shape[2], device=t.device), value, where)


def append_reference(key: torch.Tensor, value: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                     dst_len: torch.Tensor, k_sink: torch.Tensor | None = None, v_sink: torch.Tensor | None = None,
                     sink_len: torch.Tensor | None = None) -> None:
    """`kernels.append.append_tokens` in torch (no host sync): key/value [B, H, 1, d] to the sink
    slot sink_len[b] while it is below the sink count, else to the destination slot dst_len[b];
    the length used grows by one. The CPU path and the kernel's test oracle."""
    n_sink = 0 if k_sink is None else k_sink.shape[2]
    if n_sink:
        assert k_sink is not None and v_sink is not None and sink_len is not None
        in_sink = sink_len < n_sink
        at = sink_len.clamp(max=n_sink - 1)
        put_block(k_sink, at, key, in_sink)
        put_block(v_sink, at, value, in_sink)
        sink_len += in_sink.to(sink_len.dtype)
    else:
        in_sink = torch.zeros_like(dst_len, dtype=torch.bool)
    at = dst_len.clamp(max=k_dst.shape[2] - 1)
    put_block(k_dst, at, key, ~in_sink)
    put_block(v_dst, at, value, ~in_sink)
    dst_len += (~in_sink).to(dst_len.dtype)


def _appender(use_kernels: bool) -> Any:
    if use_kernels:
        from pnmix.kernels.append import append_tokens

        return append_tokens
    return append_reference


class _StaticLayer(CacheLayerMixin):
    """transformers' layer protocol for the static layers: `update` only hands the new states to
    the attention function (as a `StaticStep`), which appends and attends in the layer's `step`
    (through the `pnmix::static_attend` operator, into `append_attend`)."""

    is_compileable = True
    is_sliding = False
    layer_idx: int
    # Set by the driver for each step (and graph): a bound on the tokens any sequence holds after
    # the step, which the kernels' launch plans are made for; None plans for the full capacity.
    plan_tokens: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        step = StaticStep(self, key_states, value_states)
        return step, step

    def step(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Append one token per sequence (key/value [B, H_kv, 1, d]) and attend: [B, 1, H_q, d].

        Through the `pnmix::static_attend` operator, which torch.compile leaves opaque."""
        return torch.ops.pnmix.static_attend(query, key, value, self.layer_idx, scaling)

    def get_seq_length(self) -> int:
        return 0  # never asked during a static step; lengths are per sequence, on the device

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a static layer is built from a prefilled cache, never lazily")


class StaticQuantLayer(_StaticLayer):
    """One layer's PN-Mix/KIVI cache at full capacity, in the decode kernel's layout."""

    def __init__(self, dyn: PNMixLayer, max_len: int) -> None:
        """Copies a prefilled `PNMixLayer` into buffers that hold `max_len` tokens per sequence."""
        super().__init__()
        cfg = dyn.config
        self.config, self.layer_idx = cfg, dyn.layer_idx
        b, h, d, dev, dt = dyn.batch, dyn.kv_heads, dyn.head_dim, dyn.device, dyn.dtype
        g, r = cfg.group_size, cfg.residual_len
        self.groups_per_flush = r // g
        ng_cap = self._group_slots(max_len)
        if max(dyn.n_groups, default=0) > ng_cap and not dyn.window:
            raise ValueError(f"prefill already holds more than max_len={max_len} tokens")
        src = backend.layer_decode_cache(dyn)
        n_sc, vg = src.n_salient_channels, d // cfg.value_group_size
        n_groups = src.n_groups.tolist()

        def buf(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor, n_held: int) -> torch.Tensor:
            out = torch.zeros(shape, dtype=dtype, device=dev)
            out[:, :, :n_held] = like[:, :, :n_held]
            return out

        def groups(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor, per_group: int) -> torch.Tensor:
            out = torch.zeros(shape, dtype=dtype, device=dev)
            self._copy_groups(out, like, n_groups, per_group)
            return out

        u8, f16 = torch.uint8, torch.float16
        self.k_sink = buf(src.k_sink.shape, dt, src.k_sink, cfg.n_sink)
        self.v_sink = buf(src.v_sink.shape, dt, src.v_sink, cfg.n_sink)
        self.k_res = buf((b, h, r, d), dt, src.k_res, min(r, src.k_res.shape[2]))
        self.v_res = buf((b, h, r, d), dt, src.v_res, min(r, src.v_res.shape[2]))
        self.k_low = groups((b, h, ng_cap, cfg.b_low, d, g // 8), u8, src.k_low, 1)
        self.k_high = groups((b, h, ng_cap, cfg.high_planes, n_sc, g // 8), u8, src.k_high, 1)
        self.k_scale = groups((b, h, ng_cap, d), f16, src.k_scale, 1)
        self.k_zero = groups((b, h, ng_cap, d), f16, src.k_zero, 1)
        self.v_packed = groups((b, h, ng_cap * g, d * cfg.value_bits // 8), u8, src.v_packed, g)
        self.v_scale = groups((b, h, ng_cap * g, vg), f16, src.v_scale, g)
        self.v_zero = groups((b, h, ng_cap * g, vg), f16, src.v_zero, g)
        order = src.channel_order if src.channel_order is not None else backend.channel_order(
            dyn.salient_channels_all(), d)
        self.channel_order = order.to(torch.int32).contiguous()
        self.salient_channels = backend.salient_channels_from_order(self.channel_order, n_sc)
        self.sink_len = src.sink_len.clone()
        self.n_groups = src.n_groups.clone()
        self.res_len = src.res_len.clone()
        self.use_kernels = backend.use_triton(dev, cfg, d)
        self.flush_now = False  # set by the driver for the step that fills some residual buffer
        self.is_initialized = True

    def _group_slots(self, max_len: int) -> int:
        """Packed groups a sequence has room for: every group of max_len tokens, and one flush's
        worth more (a flush step writes every sequence's slots past its last group and commits
        only the full ones)."""
        cfg = self.config
        return math.ceil(max(0, max_len - cfg.n_sink) / cfg.group_size) + self.groups_per_flush

    def _copy_groups(self, out: torch.Tensor, like: torch.Tensor, n_groups: list[int], per_group: int) -> None:
        """The prefill's packed groups (`per_group` slots each along dim 2) into their slots."""
        held = like.shape[2]
        out[:, :, :held] = like

    def decode_cache(self) -> Any:
        # The packed buffers are attributes named as the kernels' fields (k_low, ..., v_zero).
        return backend.decode_cache(self, vars(self), self.sink_len, self.n_groups, self.res_len)

    def append_attend(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
                      scaling: float) -> torch.Tensor:
        """Append one token per sequence (key/value [B, H_kv, 1, d]), flush if due, attend.

        query [B, H_q, 1, d] -> [B, 1, H_q, d]. Device work only (graph-capturable).
        """
        self._append(key, value)
        return self.attend(query, scaling)

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append one token per sequence; quantize the residual buffers if the driver says it is due."""
        _appender(self.use_kernels)(key, value, self.k_res, self.v_res, self.res_len, self.k_sink, self.v_sink,
                                    self.sink_len)
        if self.flush_now:
            self._flush()

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The newest token's attention over the cache as it stands: [B, 1, H_q, d]."""
        if self.use_kernels:
            return backend.fused_decode(query[:, :, 0], self.decode_cache(), scaling, self.groups_bound()).unsqueeze(1)
        # The torch path (eager only: it reads lengths on the host) attends exactly as the dynamic
        # cache's torch path does, so the two agree bit for bit and a flush quantizes equal inputs.
        k_view, v_view, lengths = backend.view_from_cache(self.decode_cache(), query.dtype)
        return attend_view(query, k_view, v_view, lengths, scaling)

    def groups_bound(self) -> int | None:
        """The most packed groups a sequence holds after this step (from `plan_tokens`), or None."""
        if self.plan_tokens is None:
            return None
        return packed_groups_bound(self.plan_tokens, self.config.n_sink, self.config.group_size)

    def _flush(self) -> None:
        """Quantizes every residual buffer into the groups past its sequence's packed region and
        commits the result (groups count up, residual empties) only where the buffer is full."""
        cfg = self.config
        g, n = cfg.group_size, self.groups_per_flush
        full = self.res_len == cfg.residual_len
        quantize_keys, quantize_values = backend.quantizers(self.use_kernels)
        pk = quantize_keys(self.k_res, self.salient_channels, cfg.b_low, cfg.b_high, g)
        pv = quantize_values(self.v_res, cfg.value_bits, cfg.value_group_size)
        slot = self._slots(self.n_groups[:, None].long() + torch.arange(n, device=full.device))  # [B, n]
        for name, new in (("k_low", pk.low), ("k_high", pk.high), ("k_scale", pk.scale), ("k_zero", pk.zero)):
            put_slots(getattr(self, name), slot, new, full)
        tokens = self._token_slots(slot)
        for name, new in (("v_packed", pv.packed), ("v_scale", pv.scale), ("v_zero", pv.zero)):
            put_slots(getattr(self, name), tokens, new, full)
        self.n_groups += full.to(torch.int32) * n
        self.res_len.masked_fill_(full, 0)

    def _slots(self, groups: torch.Tensor) -> torch.Tensor:
        """The slots of these groups' (their indices') packed bytes: group j in slot j."""
        return groups

    def _token_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The per-token slots (of the value fields) of group slots [B, n]: [B, n * G]."""
        g = self.config.group_size
        return (slots[:, :, None] * g + torch.arange(g, device=slots.device)).flatten(1)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k_sink, self.v_sink, self.k_res, self.v_res, self.k_low, self.k_high,
                                      self.k_scale, self.k_zero, self.v_packed, self.v_scale, self.v_zero))


class StaticQuantWindowLayer(StaticQuantLayer):
    """A sliding-window layer whose window is quantized (a layer-wise config's `windows`): PN-Mix's
    store (fp16 sinks, packed groups, fp16 residual) with a ring of packed groups instead of a
    capacity of max_len: group j in slot j mod `slots`, enough slots for every group a window of
    positions overlaps. A query attends over the positions its sliding mask admits (> its own -
    window), sinks, groups and residual alike, so it sees what the dynamic cache's windowed
    `PNMixLayer` shows it: the window's last window - 1 tokens as their stored bytes decode, and
    its own. Attention is dequantize-then-attend (masked SDPA, device work only), every packed group
    decoded every step: the form for windows shorter than residual_len + G, which the kernels'
    bag (`StaticQuantBagWindowLayer`) cannot hold."""

    def __init__(self, dyn: PNMixLayer, window: int) -> None:
        self.window = window
        super().__init__(dyn, max_len=0)
        self.is_sliding = True

    def _group_slots(self, max_len: int) -> int:
        # The groups that positions p - window + 1 .. p overlap: at most ceil(window / G) + 1.
        self.slots = math.ceil(self.window / self.config.group_size) + 1
        return self.slots

    def _copy_groups(self, out: torch.Tensor, like: torch.Tensor, n_groups: list[int], per_group: int) -> None:
        for b, ng in enumerate(n_groups):  # each sequence's newest groups, group j in slot j mod slots
            for j in range(max(0, ng - self.slots), ng):
                at = (j % self.slots) * per_group
                out[b, :, at : at + per_group] = like[b, :, j * per_group : (j + 1) * per_group]

    def _slots(self, groups: torch.Tensor) -> torch.Tensor:
        return groups.remainder(self.slots)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The newest token's attention over the window: [B, 1, H_q, d]."""
        k, v, admitted = self.window_view(query.dtype)
        return masked_attention(query, k, v, admitted[:, None], scaling)

    def window_view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [B, H_kv, n_sink + slots * G + R, d] in `dtype`, in position order (sinks, the
        ring's groups oldest first, residual), and which slots the newest query sees [B, L]."""
        cfg = self.config
        g, s, dev = cfg.group_size, self.slots, self.n_groups.device
        n_groups = self.n_groups.long()
        seen = self.sink_len.long() + n_groups * g + self.res_len.long()  # positions, the new token's included
        first = seen - self.window  # the oldest position the newest query sees (its own is seen - 1)
        j = n_groups[:, None] - s + torch.arange(s, device=dev)  # [B, s]: the groups the ring may hold, in order
        order = j.remainder(s)
        keys = packing.dequantize_keys(packing.PackedKeys(self.k_low, self.k_high, self.k_scale, self.k_zero),
                                       self.salient_channels, cfg.b_low)
        values = packing.dequantize_values(packing.PackedValues(self.v_packed, self.v_scale, self.v_zero),
                                           cfg.value_bits, cfg.value_group_size)
        b, h, _, d = keys.shape
        at = order[:, None, :, None, None].expand(b, h, s, g, d)
        keys = keys.view(b, h, s, g, d).gather(2, at).view(b, h, s * g, d)
        values = values.view(b, h, s, g, d).gather(2, at).view(b, h, s * g, d)
        t = torch.arange(g, device=dev)
        sink_pos = torch.arange(cfg.n_sink, device=dev).expand(b, -1)
        group_pos = (cfg.n_sink + j[:, :, None] * g + t).flatten(1)
        res_pos = cfg.n_sink + n_groups[:, None] * g + torch.arange(cfg.residual_len, device=dev)
        held = torch.cat([sink_pos < self.sink_len[:, None], (j >= 0).repeat_interleave(g, dim=1),
                          res_pos < seen[:, None]], dim=1)
        pos = torch.cat([sink_pos, group_pos, res_pos], dim=1)
        k = torch.cat([self.k_sink.to(dtype), keys.to(dtype), self.k_res.to(dtype)], dim=2)
        v = torch.cat([self.v_sink.to(dtype), values.to(dtype), self.v_res.to(dtype)], dim=2)
        return k, v, held & (pos >= first[:, None])


class StaticQuantBagWindowLayer(StaticQuantLayer):
    """A quantized sliding window that the decode kernels attend: what the window admits, kept so
    that the kernels read it without a mask. Attention does not depend on the order of the tokens
    (RoPE is in the keys), so the layer keeps two regions the kernels read from their start:

    - a bag of packed group slots (the kernels' groups, `bag_len` of them): every group the
      window admits whole, in any order. A flush appends its groups; when the window's start
      enters a group, that group leaves the bag (the bag's last slot moves into its place);
    - an edge of fp16 tokens (the kernels' sinks, `edge_len` of them), newest first: the group
      the window's start is in, decoded when the start enters it, or while the start is before
      the first group, the sinks. Newest first, the tokens the window still admits are its first
      `edge_len`, which shrinks by one a step.

    The residual is admitted whole. This holds when every group the start can be in is packed
    before the start reaches it: window >= residual_len + G (`fits`); shorter windows take the
    ring (`StaticQuantWindowLayer`). `n_groups` counts the groups flushed so far (positions),
    `straddle` the group the start is in (-1: before the first), `slot_of[b, j % slots]` the bag
    slot of group j and `group_at` the group of each bag slot."""

    # Set by the driver: False for a step at which no sequence's window start enters a group
    # (known from its host counters), which then skips decoding a group into the edge.
    enters_now = True

    @staticmethod
    def fits(config: PNMixConfig, window: int) -> bool:
        return window >= config.residual_len + config.group_size

    @staticmethod
    def start_group(config: PNMixConfig, window: int, held: int) -> int:
        """The packed group that a sequence holding `held` positions has its window's start in
        (positions > held - 1 - window), -1 while the start is before the first group. `_window_step`
        computes the same on the device."""
        first = held - window
        return (first - config.n_sink) // config.group_size if first >= config.n_sink else -1

    def __init__(self, dyn: PNMixLayer, window: int) -> None:
        cfg = dyn.config
        if not self.fits(cfg, window):
            raise ValueError(f"window {window} < residual_len + G = {cfg.residual_len + cfg.group_size}: "
                             "allowed a larger window (smaller ones take StaticQuantWindowLayer)")
        self.window = window
        # The group each row's window starts in after the prefill; the bag starts with it and
        # every later group, and `_window_step` then moves it to the edge as a step would.
        self._first_bag = [max(0, self.start_group(cfg, window, n)) for n in dyn.lengths]
        super().__init__(dyn, max_len=0)
        self.is_sliding = True
        b, h, _, d = self.k_sink.shape
        dev = self.n_groups.device
        self.k_edge = self.k_sink.new_zeros((b, h, max(cfg.n_sink, cfg.group_size), d))
        self.v_edge = torch.zeros_like(self.k_edge)
        self.edge_len = torch.zeros_like(self.sink_len)
        first = torch.tensor(self._first_bag, dtype=torch.long, device=dev)
        self.bag_len = (self.n_groups.long() - first).clamp(min=0).to(torch.int32)
        self.group_at = torch.empty((b, self.slots), dtype=torch.long, device=dev)
        self.slot_of = torch.empty_like(self.group_at)
        self._bag_from(first)
        self.straddle = first - 1
        self._window_step()

    def _bag_from(self, first: torch.Tensor) -> None:
        """Slot maps of a bag whose slot i holds group first[b] + i: `group_at` and `slot_of`."""
        slots = torch.arange(self.slots, device=first.device).expand_as(self.group_at).contiguous()
        self.group_at.copy_(first[:, None] + slots)
        self.slot_of.scatter_(1, self.group_at.remainder(self.slots), slots)

    def _group_slots(self, max_len: int) -> int:
        # Whole groups in a window, and one flush's worth more: a flush appends its groups before
        # the step moves the one the start entered out of the bag.
        cfg = self.config
        self.slots = self.window // cfg.group_size + self.groups_per_flush + 1
        return self.slots

    def _copy_groups(self, out: torch.Tensor, like: torch.Tensor, n_groups: list[int], per_group: int) -> None:
        for b, (ng, first) in enumerate(zip(n_groups, self._first_bag, strict=True)):
            n = max(0, ng - first)  # groups first .. ng - 1 in slots 0 .. n - 1
            out[b, :, : n * per_group] = like[b, :, first * per_group : ng * per_group]

    def _slots(self, groups: torch.Tensor) -> torch.Tensor:
        # A flush's groups n_groups .. n_groups + k - 1 go to the bag's next slots.
        return self.bag_len[:, None].long() + (groups - self.n_groups[:, None].long())

    def _flush(self) -> None:
        n = self.groups_per_flush
        full = self.res_len == self.config.residual_len
        step = torch.arange(n, device=full.device)
        slot = self.bag_len[:, None].long() + step
        group = self.n_groups[:, None].long() + step
        super()._flush()
        _put_index(self.group_at, slot, group, full)
        _put_index(self.slot_of, group.remainder(self.slots), slot, full)
        self.bag_len += full.to(torch.int32) * n

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        super()._append(key, value)
        self._window_step()

    def _window_step(self) -> None:
        """Moves the window's start to the newest token's (positions > seen - 1 - window): where it
        entered a group, that group leaves the bag for the edge; sets the edge's admitted length.
        Device work only."""
        cfg = self.config
        g, dev = cfg.group_size, self.n_groups.device
        seen = (self.sink_len + self.n_groups * g + self.res_len).long()
        first = seen - self.window  # the oldest position the newest query sees
        cur = torch.where(first >= cfg.n_sink, torch.div(first - cfg.n_sink, g, rounding_mode="floor"), -1)
        rows = torch.arange(seen.shape[0], device=dev)[:, None]
        zero = torch.zeros_like(self.edge_len)
        if self.enters_now:
            self._enter_group(cur, rows, zero)
        # Before the first group the edge is the sinks, newest first.
        sinks = cfg.n_sink
        before = cur < 0
        if sinks:
            order = (self.sink_len[:, None].long() - 1 - torch.arange(sinks, device=dev)).clamp(min=0)
            put_block(self.k_edge, zero, self.k_sink[rows, :, order].transpose(1, 2), before)
            put_block(self.v_edge, zero, self.v_sink[rows, :, order].transpose(1, 2), before)
        admitted = torch.where(before, self.sink_len.long() - first.clamp(min=0), sinks + (cur + 1) * g - first)
        self.edge_len.copy_(admitted.clamp(min=0).to(torch.int32))

    def _enter_group(self, cur: torch.Tensor, rows: torch.Tensor, zero: torch.Tensor) -> None:
        """Where a sequence's window start entered group `cur` [B] this step: the group's tokens
        decoded into the edge, newest first, and the group out of the bag."""
        cfg = self.config
        cross = cur > self.straddle  # by one group at most: the start moves one position a step
        at = self.slot_of.gather(1, cur.clamp(min=0).remainder(self.slots)[:, None])  # [B, 1]
        keys = packing.dequantize_keys(packing.PackedKeys(*(getattr(self, f)[rows, :, at].transpose(1, 2) for f in
                                                            KEY_FIELDS)),
                                       self.salient_channels, cfg.b_low)  # [B, H, G, d]
        tokens = self._token_slots(at)  # [B, G]
        values = packing.dequantize_values(packing.PackedValues(*(getattr(self, f)[rows, :, tokens].transpose(1, 2)
                                                                  for f in VALUE_FIELDS)),
                                           cfg.value_bits, cfg.value_group_size)
        put_block(self.k_edge, zero, keys.flip(2), cross)  # newest first
        put_block(self.v_edge, zero, values.flip(2), cross)
        # The group leaves the bag: the bag's last slot moves into its slot.
        last = (self.bag_len.long() - 1).clamp(min=0)[:, None]
        moved = self.group_at.gather(1, last)
        for names, dst, src in ((KEY_FIELDS, at, last), (VALUE_FIELDS, tokens, self._token_slots(last))):
            for name in names:
                t = getattr(self, name)
                put_slots(t, dst, t[rows, :, src].transpose(1, 2), cross)
        _put_index(self.group_at, at, moved, cross)
        _put_index(self.slot_of, moved.remainder(self.slots), at, cross)
        self.bag_len -= cross.to(torch.int32)
        self.straddle.copy_(torch.maximum(self.straddle, cur))

    def decode_cache(self) -> Any:
        return dataclasses.replace(super().decode_cache(), k_sink=self.k_edge, v_sink=self.v_edge,
                                   sink_len=self.edge_len, n_groups=self.bag_len)

    def groups_bound(self) -> int | None:
        bound = super().groups_bound()
        return self.slots if bound is None else min(bound, self.slots)

    def hold(self, sinks: int, groups: int, residual: int) -> None:
        """Every sequence's counters set to hold `sinks` sinks, `groups` flushed groups and
        `residual` residual tokens, the bag and edge as the window then admits them (the stored
        bytes as they are: for timing)."""
        self.sink_len.fill_(sinks)
        self.n_groups.fill_(groups)
        self.res_len.fill_(residual)
        cur = self.start_group(self.config, self.window, sinks + groups * self.config.group_size + residual)
        self.straddle.fill_(cur)
        self.bag_len.fill_(max(0, groups - cur - 1))
        self._bag_from(torch.full_like(self.straddle, cur + 1))
        self._window_step()

    def nbytes(self) -> int:
        return super().nbytes() + sum(t.nbytes for t in (self.k_edge, self.v_edge, self.slot_of, self.group_at))


def _put_index(t: torch.Tensor, at: torch.Tensor, value: torch.Tensor, where: torch.Tensor) -> None:
    """t[b, at[b, i]] = value[b, i] where where[b], else unchanged; t [B, N], at/value [B, n]."""
    t.scatter_(1, at, torch.where(where[:, None], value, t.gather(1, at)))


def quant_window_layer(dyn: PNMixLayer, window: int) -> StaticQuantLayer:
    """The static layer of a quantized window: the kernels' bag where it fits, else the ring."""
    if StaticQuantBagWindowLayer.fits(dyn.config, window):
        return StaticQuantBagWindowLayer(dyn, window)
    return StaticQuantWindowLayer(dyn, window)


def attend_prefix(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scaling: float,
                  use_kernels: bool, max_tokens: int | None) -> torch.Tensor:
    """query [B, H_q, 1, d] over slots 0 .. lengths[b] - 1 of k/v [B, H_kv, capacity, d] (lengths
    int32, on the device): [B, 1, H_q, d]. The flash-decoding kernel (kernels/decode_full.py, its
    plan for at most `max_tokens`) with kernels, else SDPA with a length mask (with a mask SDPA
    does not split long sequences)."""
    b, hq, _, d = query.shape
    if use_kernels:
        from pnmix.kernels.decode_full import full_decode_attention

        return full_decode_attention(query[:, :, 0], k, v, lengths, scaling, max_tokens=max_tokens).unsqueeze(1)
    h = k.shape[1]
    mask = (torch.arange(k.shape[2], device=query.device)[None, :] < lengths[:, None])[:, None, None]
    q = query.reshape(b, h, hq // h, d)  # query head j reads KV head j // (hq // h)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(b, 1, hq, d)


class StaticFullLayer(_StaticLayer):
    """One layer's unquantized cache (the fp16 baseline): [B, H_kv, max_len, d] keys and values."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor, max_len: int,
                 layer_idx: int, prefix: bool = False) -> None:
        """keys/values [B, H_kv, T, d] of a prefill with left padding; real bool [B, T]: real tokens.
        prefix: every row's real tokens are its first ones (a built cache holds no padding)."""
        super().__init__()
        b, h, t, d = keys.shape
        self.layer_idx = layer_idx
        self.k = torch.zeros((b, h, max_len, d), dtype=keys.dtype, device=keys.device)
        self.v = torch.zeros_like(self.k)
        if prefix:  # one copy for the batch, slots past a row's tokens zero as below
            keep, zero = real[:, None, :, None], torch.zeros((), dtype=keys.dtype, device=keys.device)
            self.k[:, :, :t] = torch.where(keep, keys, zero)
            self.v[:, :, :t] = torch.where(keep, values, zero)
        else:
            for i in range(b):  # drop the left padding: sequence i holds its real tokens from slot 0
                cols = real[i].nonzero().squeeze(-1)
                self.k[i, :, : cols.numel()] = keys[i][:, cols]
                self.v[i, :, : cols.numel()] = values[i][:, cols]
        self.lengths = real.sum(-1).to(torch.int32)
        # The flash-decoding kernel where the quantized layers use theirs (`attend_prefix`).
        self.use_kernels = backend.kernels_enabled(keys.device) and backend.head_dim_supported(d)
        self.is_initialized = True

    def append_attend(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
                      scaling: float) -> torch.Tensor:
        """Append one token per sequence and attend over each sequence's tokens: [B, 1, H_q, d]."""
        _appender(self.use_kernels)(key, value, self.k, self.v, self.lengths)
        return attend_prefix(query, self.k, self.v, self.lengths, scaling, self.use_kernels, self.plan_tokens)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class StaticWindowLayer(_StaticLayer):
    """A sliding-window layer's cache in the model's dtype: [B, H_kv, window, d] keys and values
    as a ring (position p in slot p mod window) and each sequence's positions seen (`lengths`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, held: list[int], seen: list[int], window: int,
                 layer_idx: int) -> None:
        """keys/values [B, H_kv, T, d] whose last held[b] columns are sequence b's newest tokens
        (positions seen[b] - held[b] .. seen[b] - 1); of those, the last window - 1 are kept."""
        super().__init__()
        b, h, _, d = keys.shape
        self.layer_idx, self.window = layer_idx, window
        self.k = keys.new_zeros((b, h, window, d))
        self.v = torch.zeros_like(self.k)
        t = keys.shape[2]
        for row, (n, end) in enumerate(zip(held, seen, strict=True)):
            m = min(n, window - 1)
            slots = torch.arange(end - m, end, device=keys.device) % window
            self.k[row, :, slots] = keys[row, :, t - m : t]
            self.v[row, :, slots] = values[row, :, t - m : t]
        self.lengths = torch.tensor(seen, dtype=torch.int64, device=keys.device)
        # The slots in use after a step, min(positions seen, window): the ring holds exactly the
        # positions the sliding mask admits, and attention does not depend on their order (RoPE is
        # already in the keys), so the fp16 decode kernel of the full layers attends over slots
        # 0 .. filled - 1 as over a sequence of that length, with no mask.
        self.filled = self.lengths.clamp(max=window).to(torch.int32)
        self.rows = torch.arange(b, device=keys.device)
        self.use_kernels = backend.kernels_enabled(keys.device) and backend.head_dim_supported(d)
        self.is_sliding = True
        self.is_initialized = True

    def append_attend(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
                      scaling: float) -> torch.Tensor:
        """Append one token per sequence into its ring and attend over the window: [B, 1, H_q, d]."""
        slot = self.lengths % self.window
        self.k[self.rows, :, slot] = key[:, :, 0].to(self.k.dtype)
        self.v[self.rows, :, slot] = value[:, :, 0].to(self.v.dtype)
        self.lengths += 1
        self.filled.copy_(self.lengths.clamp(max=self.window))
        bound = self.window if self.plan_tokens is None else min(self.window, self.plan_tokens)
        return attend_prefix(query, self.k, self.v, self.filled, scaling, self.use_kernels, bound)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


# The layers of the generator whose step is running (or being captured) now. The step's
# attention is one operator per layer that takes only the step's own tensors and the layer index:
# the cache buffers it appends to, quantizes into and reads stay outside what torch.compile
# traces (as a serving engine keeps its KV cache outside the compiled model), so the compiled code
# neither copies them nor depends on the config, and the host-side choices inside (a flush step or
# not, the kernels' launch plans) are made when the step runs eagerly or is captured.
_STEPPING: list[Any] = []


@torch.library.custom_op("pnmix::static_attend", mutates_args=())
def static_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                  scaling: float) -> torch.Tensor:
    """Layer `layer_idx` of the stepping generator appends key/value [B, H_kv, 1, d] and attends
    query [B, H_q, 1, d] over its cache: [B, 1, H_q, d]. Declared free of mutations: it mutates
    none of its arguments, and its output feeds the next layer, which orders the layers' calls."""
    return _STEPPING[layer_idx].append_attend(key, value, query, scaling).contiguous()


@static_attend.register_fake
def _static_attend_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                         scaling: float) -> torch.Tensor:
    b, hq, _, d = query.shape
    return query.new_empty((b, 1, hq, d))


def _decode_step(decoder: Any, lm_head: Any, ids: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                 cache_kw: dict, bias: torch.Tensor, rope_kinds: tuple[str, ...] | None = None) -> None:
    """One decode step through the model's own modules: tokens ids [B, 1] at positions pos [B, 1]
    -> greedy next tokens into `out` [B] and `ids`, positions + 1. `bias` [V] is added to the
    logits before the argmax (zeros: the plain argmax; -inf: a banned token). `rope_kinds`: each
    layer's kind where the model keeps a RoPE table per kind (Gemma 3: local and global bases),
    else None. What torch.compile compiles."""
    h = decoder.embed_tokens(ids)  # Gemma's embedding scales itself
    if rope_kinds is None:
        tables = [decoder.rotary_emb(h, pos)] * len(decoder.layers)
    else:
        by_kind = {kind: decoder.rotary_emb(h, pos, kind) for kind in sorted(set(rope_kinds))}
        tables = [by_kind[kind] for kind in rope_kinds]
    for layer, pe in zip(decoder.layers, tables, strict=True):
        o = layer(h, attention_mask=None, position_ids=pos, use_cache=True, cache_position=pos[0],
                  position_embeddings=pe, **cache_kw)
        h = o[0] if isinstance(o, tuple) else o
    nxt = (lm_head(decoder.norm(h[:, -1])) + bias).argmax(-1)
    out.copy_(nxt)
    ids.copy_(nxt[:, None])
    pos.add_(1)


_COMPILED: dict[str, Any] = {}


def _compiled_step(backend_name: str) -> Any:
    """`_decode_step` under torch.compile with `backend_name` (one per process: the code it
    compiles is keyed by the model and the layer kinds, not by the generator). Whole graph, no
    breaks: the norms, RoPE, residual adds and MLP activation of every layer fuse into a few
    kernels around the GEMMs and the attention operator, and the stand-ins of `pnmix.projections`
    make q/k/v and gate/up one GEMM each. Batch sizes after the first compile
    once more with a symbolic batch (torch's automatic dynamic shapes)."""
    if backend_name not in _COMPILED:
        _COMPILED[backend_name] = torch.compile(_decode_step, backend=with_merged_linears(backend_name),
                                                fullgraph=True)
    return _COMPILED[backend_name]


class StaticCache(Cache):
    """The static layers of one batch, handed to the model's decoder layers during a step."""

    def __init__(self, layers: list[Any]) -> None:
        super().__init__(layers=layers)
        self.static_layers = layers

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.static_layers)


def method_config(method: str | PNMixConfig | LayerwiseConfig) -> LayerwiseConfig | None:
    """None for the fp16 baseline, else the (layer-wise) PN-Mix config the static path supports:
    keys and values quantized in every layer."""
    if isinstance(method, str) and method == "fp16":
        return None
    if not isinstance(method, PNMixConfig | LayerwiseConfig):
        raise ConfigError("method", method, "'fp16', a PNMixConfig or a LayerwiseConfig")
    layerwise = as_layerwise(method)
    if not (layerwise.keys_quantized and layerwise.values_quantized):
        raise ConfigError("method", method.to_dict(), "'fp16' or a config with quantized keys and values in "
                                                      "every layer (the static path has no mixed mode)")
    return layerwise


class StaticGenerator:
    """Greedy generation with a static cache; the decode step is a replayed CUDA graph on CUDA.

        gen = StaticGenerator(model, preset("pnmix-paper"), max_len=8192 + 141)
        tokens = gen.generate(input_ids, attention_mask, max_new_tokens=64)   # [B, 64]

    `method` is "fp16" or a PN-Mix config whose keys and values are quantized (PN-Mix, KIVI), one
    for every layer or layer-wise (`pnmix.layerwise.LayerwiseConfig`: each layer's kernels launch
    with its own bits and salient ratio).
    `max_len` bounds prompt + generated tokens per sequence. `graphs` (default: on CUDA) captures
    the step; off, the same step runs eagerly. `compile` (default: where graphs are on) runs the
    step through torch.compile (True: Inductor; a string: that torch.compile backend) before the
    capture; the attention stays the PN-Mix kernels, behind an operator the compiler does not
    enter, and the q/k/v and gate/up projections run as one GEMM each (`pnmix.projections`: the
    model's Linear weights become views of one fused tensor per group, same values and memory).
    No end-of-sequence stop: every sequence gets `max_new_tokens` tokens (a serving loop would
    mask finished rows).
    """

    def __init__(self, model: Any, method: str | PNMixConfig | LayerwiseConfig, max_len: int,
                 graphs: bool | None = None, compile: bool | str | None = None) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"invalid max_len={max_len!r}: allowed an integer >= 2 (prompt + new tokens per row)")
        self.kinds = layer_kinds(model.config)  # raises for layer kinds PN-Mix cannot serve
        self.window = sliding_window(model.config)
        self.model = model
        self.layerwise = method_config(method)
        # The fields every layer shares (sinks, residual, G) set the flush schedule: the default's.
        self.config = self.layerwise.default if self.layerwise is not None else None
        self.max_len = max_len
        self.graphs_on = model.device.type == "cuda" if graphs is None else graphs
        if compile is None:
            compile = self.graphs_on
        if not isinstance(compile, bool | str):
            raise ValueError(f"invalid compile={compile!r}: allowed True, False, None or a torch.compile backend name")
        try:
            self._step_fn = _compiled_step("inductor" if compile is True else compile) if compile else _decode_step
        except RuntimeError as exc:  # torch's InvalidBackend: a name torch.compile does not know
            raise ValueError(f"invalid compile={compile!r}: not a torch.compile backend; allowed True, False, None "
                             f"or one of {', '.join(torch._dynamo.list_backends())}") from exc
        self.decoder = model.get_decoder()
        rope = inspect.signature(self.decoder.rotary_emb.forward).parameters
        self.rope_kinds = tuple(self.decoder.config.layer_types) if "layer_type" in rope else None
        # Added to the logits before each step's argmax (`ban`); zeros leave every logit as it is.
        head = model.lm_head.weight
        self.bias = torch.zeros(head.shape[0], dtype=head.dtype, device=head.device)
        # Compiled, the q/k/v and gate/up projections run as one GEMM each (pnmix/projections.py).
        self._swaps = fuse_siblings(self.decoder) if compile else []
        self.cache: StaticCache | None = None
        self.layers: list[Any] = []
        self._bags: list[StaticQuantBagWindowLayer] = []  # the layers `arm` tells whether a window enters a group
        self._graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self._warm: set[Any] = set()
        self._pool: Any = None

    # -- prefill (eager) ------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the prompt [B, T] (left padding marked 0 in attention_mask); returns the first tokens [B]."""
        model, dev = self.model, self.model.device
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: allowed [batch, tokens] with tokens >= 1")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)}: allowed the shape of input_ids "
                             f"{tuple(input_ids.shape)}")
        ids = input_ids.to(dev)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(dev)
        real = mask.bool()
        n_real = real.sum(-1)
        if int(n_real.min()) == 0:
            raise ValueError("a row of attention_mask has no real token: allowed rows with at least one 1")
        if int(n_real.max()) + 1 > self.max_len:
            raise ValueError(f"prompt of {int(n_real.max())} tokens leaves no room under max_len={self.max_len}")
        use_pnmix_attention(model)
        cache: Any = new_cache(model, self.layerwise) if self.layerwise is not None else DynamicCache()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **cache_kwargs(model, cache), **keep)  # only the last position's logits: B x vocab
        first = out.logits[:, -1].argmax(-1)
        held, seen = n_real.tolist(), n_real.tolist()
        layers: list[Any] = []
        for i, (kind, cl) in enumerate(zip(self.kinds, cache.layers, strict=True)):
            if isinstance(cl, PNMixLayer) and kind != FULL:  # a window the config quantizes
                layers.append(quant_window_layer(cl, self.window or 0))
            elif kind != FULL:  # the prefill's last columns are every row's newest real tokens
                layers.append(StaticWindowLayer(cl.keys, cl.values, held, seen, self.window or 0, i))
            elif self.config is not None:
                layers.append(StaticQuantLayer(cl, self.max_len))
            else:
                layers.append(StaticFullLayer(cl.keys, cl.values, real, self.max_len, i))
        del cache, out
        self._begin(layers, first, n_real)
        return first

    def ban(self, token_ids: list[int]) -> None:
        """Never picks these tokens from now on (as `generate` with min_new_tokens keeps the end of
        sequence out): their logits get -inf before the argmax, inside the replayed graph too."""
        self.bias[torch.tensor(token_ids, dtype=torch.long, device=self.bias.device)] = float("-inf")

    @torch.inference_mode()
    def start(self, cache: Any, first: torch.Tensor) -> None:
        """Starts decoding from a prefilled `PNMixCache` (e.g. `pnmix.prefill.build_cache`) whose
        config is this generator's ("fp16" takes a cache of the fp16 preset); first [B]: the tokens
        the prefill predicted. Copies the cache into the static buffers, as `prefill` does."""
        cfg = cache.pnmix_config
        if (self.config is None) != (not (cfg.keys_quantized or cfg.values_quantized)):
            raise ValueError("the cache's config is not this generator's method")
        seen = list(cache.layers[0].lengths)
        lengths = torch.tensor(seen, device=self.model.device)
        if int(lengths.max()) + 1 > self.max_len:
            raise ValueError(f"prompt of {int(lengths.max())} tokens leaves no room under max_len={self.max_len}")
        width = int(lengths.max())
        real = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        layers: list[Any] = []
        for i, (kind, la) in enumerate(zip(self.kinds, cache.layers, strict=True)):
            if isinstance(la, PNMixLayer) and kind != FULL:  # a window the config quantizes
                layers.append(quant_window_layer(la, self.window or 0))
            elif kind != FULL:  # a `BatchWindowLayer`: row b's newest tokens end at its slot count[b]
                layers.append(self._window_from_batch(la, i))
            elif self.config is not None:
                layers.append(StaticQuantLayer(la, self.max_len))
            else:  # an unquantized PN-Mix cache holds every token in its residual buffer
                layers.append(StaticFullLayer(la.k_res[:, :, :width], la.v_res[:, :, :width], real, self.max_len, i,
                                              prefix=True))
        use_pnmix_attention(self.model)
        self._begin(layers, first.to(self.model.device), lengths)

    def _window_from_batch(self, la: Any, i: int) -> StaticWindowLayer:
        """The static ring of a `pnmix.cache.BatchWindowLayer` (each row's slots 0..count - 1 hold
        its positions from `start`): every row's newest tokens right-aligned, then kept."""
        b, h, _, d = la.k.shape
        width = max(la.count)
        k = la.k.new_zeros((b, h, width, d))
        v = torch.zeros_like(k)
        for row, c in enumerate(la.count):
            k[row, :, width - c :] = la.k[row, :, :c]
            v[row, :, width - c :] = la.v[row, :, :c]
        return StaticWindowLayer(k, v, list(la.count), list(la.lengths), la.window, i)

    def _begin(self, layers: list[Any], first: torch.Tensor, n_real: torch.Tensor) -> None:
        """Installs the static layers and the next step's inputs; first [B], n_real [B] (device)."""
        self.cache = StaticCache(layers)
        self.layers = layers
        self._bags = [la for la in layers if isinstance(la, StaticQuantBagWindowLayer)]
        # Decoder layers take the cache as `cache` on newer transformers, `past_key_values` on 5.17.
        params = inspect.signature(self.decoder.layers[0].forward).parameters
        self._cache_kw = {"cache" if "cache" in params else "past_key_values": self.cache}
        self.ids = first[:, None].clone()  # the next step's input token, per sequence
        self.pos = n_real[:, None].clone()  # its position: real tokens held so far
        self.out = first.clone()
        self.host_len = n_real.tolist()  # host mirrors of the lengths (one read, at prefill)
        cfg = self.config
        if cfg is not None:
            self.host_sink = [min(cfg.n_sink, n) for n in self.host_len]
            self.host_res = next(la for la in layers if isinstance(la, StaticQuantLayer)).res_len.tolist()
        self._graphs.clear()
        self._warm.clear()

    # -- decode ---------------------------------------------------------------------------------

    def _graph_key(self) -> Any:
        """Advances the host counters by one step; returns what selects this step's graph."""
        self.host_len = [n + 1 for n in self.host_len]
        if self.max_len < max(self.host_len):
            raise ValueError(f"max_len={self.max_len} reached: no room for another token")
        flush = False
        if self.config is not None:
            cfg = self.config
            for b in range(len(self.host_len)):
                if self.host_sink[b] < cfg.n_sink:
                    self.host_sink[b] += 1
                else:
                    self.host_res[b] += 1
                    if self.host_res[b] == cfg.residual_len:
                        self.host_res[b], flush = 0, True
        return self.arm(flush, max(self.host_len), self._window_enters_group())

    def _window_enters_group(self) -> bool:
        """Whether some sequence's window start enters a packed group this step (its bag layers
        then move that group to their edge): the start, positions held - window, is a group's first
        position. Every layer shares the sinks and G (`self.config`)."""
        if not self._bags:
            return False
        bag = self._bags[0]
        return any(bag.start_group(bag.config, bag.window, n) > bag.start_group(bag.config, bag.window, n - 1)
                   for n in self.host_len)

    def arm(self, flush: bool, tokens: int, enters: bool = True) -> tuple[bool, int, bool]:
        """Sets the host-side choices of the next step on every layer and returns its graph's key:
        whether it flushes (quantized layers; fp16 never does), the bound its launch plans are
        made for, `tokens` (the most any sequence holds after the step) rounded up to a power of
        two (`kernels.plan.length_bucket`; a plan made for the capacity would split a short cache
        as a full one, and a bucket's graph serves every step up to its bound), and whether a
        quantized window's start may enter a group (`StaticQuantBagWindowLayer.enters_now`; only
        where the model has such windows)."""
        bound = length_bucket(tokens, self.max_len)
        flush = flush and self.config is not None
        enters = enters and bool(self._bags)
        for layer in self.layers:
            layer.plan_tokens = bound
            if self.config is not None:
                layer.flush_now = flush
        for layer in self._bags:
            layer.enters_now = enters
        return (flush, bound, enters)

    def _step_body(self) -> None:
        """One decode step on the static buffers: device work only."""
        outer = _STEPPING[:]
        _STEPPING[:] = self.layers
        try:
            with swapped(self._swaps):
                self._step_fn(self.decoder, self.model.lm_head, self.ids, self.pos, self.out, self._cache_kw,
                              self.bias, self.rope_kinds)
        finally:
            _STEPPING[:] = outer

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One decode step for every sequence; returns the new tokens [B] (a device tensor, reused)."""
        if self.cache is None:
            raise RuntimeError("call prefill() before step()")
        key = self._graph_key()
        if not self.graphs_on:
            self._step_body()
        elif key in self._graphs:
            self._graphs[key].replay()
        elif key in self._warm:  # seen once eagerly (kernels compiled): capture, then run it
            self.capture(key).replay()
        else:
            self._step_body()
            self._warm.add(key)
        return self.out

    def capture(self, key: Any) -> torch.cuda.CUDAGraph:
        """Records the step as it stands (the graph for `key`) without running it; all graphs share
        one memory pool. The step must have run eagerly once before (Triton compiles on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step_body()
        self._graphs[key] = graph
        return graph

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 32) -> torch.Tensor:
        """Greedy tokens [B, max_new_tokens] (the first from the prefill)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"invalid max_new_tokens={max_new_tokens!r}: allowed an integer >= 1")
        tokens = [self.prefill(input_ids, attention_mask).clone()]
        for _ in range(max_new_tokens - 1):
            tokens.append(self.step().clone())
        return torch.stack(tokens, dim=1)


def static_method(config: AnyConfig, device: torch.device, head_dim: int) -> str | AnyConfig | None:
    """What the static path runs for `config` on `device`: "fp16" (nothing quantized), the config
    (keys and values quantized, decode kernels available), or None (not covered: mixed configs,
    or a quantized config whose attention would take the torch path, which syncs with the host)."""
    if not (config.keys_quantized or config.values_quantized):
        return "fp16"
    if backend.use_triton(device, config, head_dim):  # the kernels need both keys and values quantized
        return config
    return None


@torch.inference_mode()
def decode_cost(model: Any, method: str | PNMixConfig, input_ids: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    """(decode tokens/s, peak device bytes) of a static generation of `new_tokens` after `input_ids`.

    Two untimed steps first (on CUDA they compile the kernels and capture the step's graph), then
    the rest are timed; the first token comes from the prefill. Peak bytes: CUDA only, else 0.
    """
    import time

    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gen = StaticGenerator(model, method, max_len=input_ids.shape[1] + new_tokens)
    gen.prefill(input_ids)
    for _ in range(2):
        gen.step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    timed = max(1, new_tokens - 3)
    for _ in range(timed):
        gen.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = int(torch.cuda.max_memory_allocated()) if cuda else 0
    return timed * input_ids.shape[0] / seconds, peak
