"""Bit-width accounting: the tuner's constraint (docs/design.md, same title) and KV byte totals.

Average key bits per cached key element, counted as the paper does: the fp16 residual buffer is
left out of storage and element count; `quantized_tokens` (T_q) tokens sit in the packed region
and `n_sink` fp16 sink tokens in front of them.

    payload  = T_q * d * (f * b_H + (1 - f) * b_L)      f = 2 * salient_pairs / d
    sinks    = n_sink * d * 16
    scales   = (T_q / G) * d * 2 * 16                    fp16 scale + zero per channel per group
    key_bits = (payload + sinks + scales) / ((T_q + n_sink) * d)
    metadata = d/2-bit salient mask per (layer, KV head, sequence) / ((T_q + n_sink) * d)
    total    = key_bits + metadata

A layer-wise config's key bits are the mean of its layers' totals (every layer holds as many key
elements). A model with sliding-window layers (Gemma 3) holds, at T = T_q + n_sink tokens, T in
each full-attention layer and min(T, window - 1) in each sliding one (what transformers' sliding
layer keeps between steps), in the model's dtype (16 bits) unless the config quantizes that window
(`LayerwiseConfig.windows`): then at its layer's config's figure over the tokens it holds, the sinks
counted only while the window still holds them (`window_config`). Its figures are averages weighted
by the elements each layer holds (`held_tokens`, `weighted_key_bits`). Values, counted the same way
(fp16 sinks in, the residual out):

    value    = (T_q * (b_V + 2 * 16 / G_V) + n_sink * 16) / (T_q + n_sink)     (16 when unquantized)
    kv_bits  = (key total + value) / 2

`kv_bits` is the whole cache's bits per cached element (a key and a value element each), the
figure a `--budget-on kv` campaign constrains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from pnmix.config import UNQUANTIZED_BITS, PNMixConfig
from pnmix.layerwise import LayerwiseConfig, as_layerwise
from pnmix.names import FULL

DEFAULT_QUANTIZED_TOKENS = 32768
FP16_BITS = 16


@dataclass(frozen=True)
class LayerPlan:
    """What each layer of a model holds: its kind (FULL or SLIDING, `pnmix.families.layer_kinds`)
    and the sliding window (`pnmix.models.layer_plan` reads it without loading weights)."""

    kinds: tuple[str, ...]
    window: int | None

    @classmethod
    def full(cls, num_layers: int) -> LayerPlan:
        """A model of `num_layers` full-attention layers."""
        return cls((FULL,) * num_layers, None)

    @property
    def hybrid(self) -> bool:
        return any(kind != FULL for kind in self.kinds)

    @property
    def full_layers(self) -> list[int]:
        """The full-attention layers: the ones a PN-Mix config applies to."""
        return [i for i, kind in enumerate(self.kinds) if kind == FULL]

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The sliding-window layers: the ones a layer-wise config's `windows` may list."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind != FULL)

    def held(self, tokens: int) -> list[int]:
        return held_tokens(self.kinds, self.window, tokens)

    def _held_by_kind(self, tokens: int) -> tuple[float, float]:
        """(tokens the full-attention layers hold together, tokens the windows hold together) after
        `tokens`: in the proportions of their elements, since a token is as many in every layer."""
        held = self.held(tokens)
        full = math.fsum(held[i] for i in self.full_layers)
        return full, math.fsum(held) - full

    def budget_for(self, full_bits: float, n_sink: int = 32,
                   quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS) -> float:
        """The model's weighted budget at which its full-attention layers may take `full_bits` on
        average, the windows at 16 bits (`full_layer_budget`'s inverse, rounded down to 1e-4 so the
        full layers never get more): a hybrid model's counterpart of a full-attention model's budget
        `full_bits`, which a full-attention model gets back unchanged."""
        if not self.hybrid:
            return full_bits
        full, window = self._held_by_kind(quantized_tokens + n_sink)
        return math.floor((full_bits * full + FP16_BITS * window) / (full + window) * 1e4) / 1e4

    def full_layer_budget(self, budget: float, n_sink: int,
                          quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS) -> float:
        """The mean bits the full-attention layers may take (key bits, or KV bits: the same sum) so
        that the whole model's weighted figure stays within `budget`, the windows at 16 bits: what a
        knapsack over the full layers alone bounds (less 1e-8, so that float rounding in the
        conversion never puts the weighted figure over the budget). A full-attention model: `budget`
        itself."""
        if not self.hybrid:
            return budget
        full, window = self._held_by_kind(quantized_tokens + n_sink)
        return (budget * (full + window) - FP16_BITS * window) / full - 1e-8


@dataclass(frozen=True)
class KeyBits:
    """Key bits per element, term by term (each term already divided by the element count)."""

    payload: float
    sinks: float
    scales: float
    key_bits: float  # payload + sinks + scales: the number the paper reports
    metadata: float
    total: float  # key_bits + metadata: the number the tuner's budget constrains
    salient_fraction: float
    head_dim: int
    quantized_tokens: int


def key_bits(
    config: PNMixConfig, head_dim: int = 128, quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS
) -> KeyBits:
    d, t_q = head_dim, quantized_tokens
    if not config.keys_quantized:
        return KeyBits(FP16_BITS, 0.0, 0.0, FP16_BITS, 0.0, FP16_BITS, 0.0, d, t_q)
    config.check_head_dim(d)
    f = 2 * config.salient_pairs(d) / d
    elements = (t_q + config.n_sink) * d
    payload = t_q * d * (f * config.b_high + (1 - f) * config.b_low)
    sinks = config.n_sink * d * FP16_BITS
    scales = (t_q / config.group_size) * d * 2 * FP16_BITS
    # The salient set is a d/2-bit mask per (layer, KV head, sequence); a uniform config needs none.
    metadata = (d / 2) if config.b_high != config.b_low else 0.0
    kb = (payload + sinks + scales) / elements
    return KeyBits(
        payload=payload / elements,
        sinks=sinks / elements,
        scales=scales / elements,
        key_bits=kb,
        metadata=metadata / elements,
        total=kb + metadata / elements,
        salient_fraction=f,
        head_dim=d,
        quantized_tokens=t_q,
    )


def key_bits_by_layer(config: PNMixConfig | LayerwiseConfig, num_layers: int, head_dim: int = 128,
                      quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS) -> list[KeyBits]:
    """`key_bits` of each layer's config. Every layer holds as many key elements, so the model's
    average is the plain mean of the layers' figures (`mean_key_bits`)."""
    return [key_bits(c, head_dim, quantized_tokens) for c in as_layerwise(config).per_layer(num_layers)]


def mean_key_bits(config: PNMixConfig | LayerwiseConfig, num_layers: int, head_dim: int = 128,
                  quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS) -> float:
    """The model's average key bits per element (metadata included: the tuner's figure); a config
    whose layers are all alike gives exactly its single figure."""
    configs = as_layerwise(config).per_layer(num_layers)
    if len(set(configs)) == 1:
        return key_bits(configs[0], head_dim, quantized_tokens).total
    return math.fsum(key_bits(c, head_dim, quantized_tokens).total for c in configs) / num_layers


def held_tokens(kinds: Sequence[str], window: int | None, tokens: int) -> list[int]:
    """Tokens each layer holds when the model has seen `tokens`: all of them in a full-attention
    layer, min(tokens, window - 1) in a sliding-window one (`pnmix.families.layer_kinds`)."""
    if any(kind != FULL for kind in kinds) and (window is None or window < 2):
        raise ValueError(f"sliding-window layers need a window of at least 2 tokens, got {window}")
    return [tokens if kind == FULL else min(tokens, (window or 0) - 1) for kind in kinds]


def weighted_key_bits(config: PNMixConfig | LayerwiseConfig, plan: LayerPlan, head_dim: int = 128,
                      quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS, metadata: bool = True) -> float:
    """Key bits per key element the model holds, each layer weighted by the elements it holds
    (`held_tokens` at T_q + n_sink tokens): a full-attention layer at its config's figure (`total`,
    or `key_bits` with `metadata=False`), a sliding-window layer at 16 bits. A model of full-attention
    layers only gets `mean_key_bits` itself, to the last digit: the figure budgets, fronts and the
    allocator bound on any model."""
    n = len(plan.kinds)
    if not plan.hybrid:
        return mean_key_bits(config, n, head_dim, quantized_tokens) if metadata else math.fsum(
            b.key_bits for b in key_bits_by_layer(config, n, head_dim, quantized_tokens)) / n

    def bits(c: PNMixConfig, t_q: int) -> float:
        b = key_bits(c, head_dim, t_q)
        return b.total if metadata else b.key_bits

    return _weighted(config, plan, quantized_tokens, bits)


def _weighted(config: PNMixConfig | LayerwiseConfig, plan: LayerPlan, quantized_tokens: int,
              bits: Callable[[PNMixConfig, int], float]) -> float:
    """sum(held * bits) / sum(held) over the layers: a full-attention layer at `bits(config,
    quantized_tokens)`, a quantized window at `bits` of its `window_config`, another window at 16."""
    lw = as_layerwise(config)
    seen = quantized_tokens + lw.default.n_sink
    held = plan.held(seen)
    return math.fsum(t * layer_figure(c, kind, t, seen, quantized_tokens, bits)
                     for t, c, kind in zip(held, lw.held_configs(plan.kinds), plan.kinds, strict=True)) / sum(held)


def layer_figure(config: PNMixConfig | None, kind: str, held: int, seen: int, quantized_tokens: int,
                 bits: Callable[[PNMixConfig, int], float]) -> float:
    """One layer's bits per element it holds after `seen` tokens (`bits(config, T_q)`): a full-attention
    layer at T_q = `quantized_tokens`; a quantized window at its `window_config` over the `held`
    tokens it keeps; an exact window (`config` None) at 16."""
    if config is None:
        return float(FP16_BITS)
    if kind == FULL:
        return bits(config, quantized_tokens)
    w = window_config(config, held, seen)
    return bits(w, held - w.n_sink)


def window_config(config: PNMixConfig, held: int, seen: int) -> PNMixConfig:
    """A quantized window's config as it stands after `seen` tokens, of which it holds the last
    `held`: its sinks (the sequence's first tokens) only those the window has not yet dropped."""
    sinks = max(0, min(config.n_sink, seen) - (seen - held))
    return config if sinks == config.n_sink else config.with_(n_sink=sinks)


def weighted_kv_bits(config: PNMixConfig | LayerwiseConfig, plan: LayerPlan, head_dim: int = 128,
                     quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS) -> float:
    """`kv_bits` weighted as `weighted_key_bits`: a sliding-window layer's keys and values at 16 bits.
    A model of full-attention layers only gets `kv_bits` itself, to the last digit."""
    if not plan.hybrid:
        return kv_bits(config, len(plan.kinds), head_dim, quantized_tokens)
    keys = weighted_key_bits(config, plan, head_dim, quantized_tokens)
    return (keys + _weighted(config, plan, quantized_tokens, value_bits_total)) / 2


def held_key_bits(config: PNMixConfig | LayerwiseConfig, plan: LayerPlan, head_dim: int, seq_len: int) -> float:
    """`weighted_key_bits` after `seq_len` tokens, sinks included (T_q = seq_len - n_sink): the key
    bits per key element the model holds at that context."""
    sinks = as_layerwise(config).default.n_sink
    return weighted_key_bits(config, plan, head_dim, max(seq_len - sinks, 1))


def value_bits(config: PNMixConfig) -> float:
    """Average value bits per element: b_V plus an fp16 scale and zero per group of G_V channels."""
    if not config.values_quantized:
        return float(UNQUANTIZED_BITS)
    return config.value_bits + 2 * FP16_BITS / config.value_group_size


def value_bits_total(config: PNMixConfig | LayerwiseConfig,
                     quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS, num_layers: int | None = None) -> float:
    """Value bits per element as keys are counted: codes and per-group scales over T_q tokens plus
    the fp16 sink tokens. A layer-wise config whose layers differ in value format gives the mean
    over its `num_layers` layers (every layer holds as many value elements); otherwise one
    figure serves the model."""
    lw = as_layerwise(config)
    if lw.values_per_layer:
        if num_layers is None:
            raise ValueError("value_bits_total of a config with per-layer value formats needs num_layers")
        return math.fsum(value_bits_total(c, quantized_tokens) for c in lw.per_layer(num_layers)) / num_layers
    c = lw.default
    if not c.values_quantized:
        return float(UNQUANTIZED_BITS)
    t_q = quantized_tokens
    return (t_q * value_bits(c) + c.n_sink * FP16_BITS) / (t_q + c.n_sink)


def kv_bits(config: PNMixConfig | LayerwiseConfig, num_layers: int, head_dim: int = 128,
            quantized_tokens: int = DEFAULT_QUANTIZED_TOKENS) -> float:
    """Bits per cached element over keys and values together: the mean of `mean_key_bits` and
    `value_bits_total` (a token holds as many key elements as value elements)."""
    keys = mean_key_bits(config, num_layers, head_dim, quantized_tokens)
    return (keys + value_bits_total(config, quantized_tokens, num_layers)) / 2


@dataclass(frozen=True)
class ModelShape:
    """What the KV-cache size of a model depends on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVBytes:
    """Bytes a PN-Mix cache holds for `batch` sequences of `seq_len` tokens, by region.

    Layout as after a prefill of `seq_len` tokens: `n_sink` fp16 sinks, whole groups of G tokens
    in the packed region, the remainder (< G tokens) in the fp16 residual buffer.
    """

    packed_keys: int
    key_scales: int
    salient_sets: int
    packed_values: int
    value_scales: int
    sinks: int
    residual: int
    total: int
    fp16_total: int  # the same tokens in an unquantized fp16 cache

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def kv_cache_bytes(config: PNMixConfig | LayerwiseConfig, shape: ModelShape, batch: int, seq_len: int,
                   plan: LayerPlan | None = None) -> KVBytes:
    """Bytes of the whole cache; a layer-wise config, or a model with sliding-window layers (`plan`),
    is summed layer by layer (`layer_bytes`)."""
    if isinstance(config, LayerwiseConfig) or (plan is not None and plan.hybrid):
        layers = [b.as_dict() for b in layer_bytes(config, shape, batch, seq_len, plan)]
        return KVBytes(**{name: sum(layer[name] for layer in layers) for name in layers[0]})
    return _kv_bytes(config, shape, batch, seq_len)


def layer_bytes(config: PNMixConfig | LayerwiseConfig, shape: ModelShape, batch: int, seq_len: int,
                plan: LayerPlan | None = None) -> list[KVBytes]:
    """Each layer's cache bytes after `seq_len` tokens: a full-attention layer under its config, a
    sliding-window one holding min(seq_len, window - 1) tokens: under its config where the config
    quantizes that window (its sinks while it holds them, its groups laid out as after a prefill of
    the tokens it holds), else in fp16 (in `residual`)."""
    one = ModelShape(1, shape.num_heads, shape.num_kv_heads, shape.head_dim)
    kinds = plan.kinds if plan is not None else (FULL,) * shape.num_layers
    held = held_tokens(kinds, plan.window if plan is not None else None, seq_len)
    out = []
    for c, kind, tokens in zip(as_layerwise(config).held_configs(kinds), kinds, held, strict=True):
        if kind == FULL and c is not None:
            out.append(_kv_bytes(c, one, batch, seq_len))
        elif c is not None:
            out.append(window_bytes(c, one, batch, tokens, seq_len))
        else:
            fp16 = shape.num_kv_heads * batch * tokens * shape.head_dim * 2 * 2
            out.append(KVBytes(0, 0, 0, 0, 0, 0, fp16, fp16, fp16))
    return out


def window_bytes(config: PNMixConfig, shape: ModelShape, batch: int, held: int, seen: int) -> KVBytes:
    """A quantized window's bytes after `seen` tokens, of which it holds the last `held`: its sinks
    while it holds them (`window_config`), its groups laid out as after a prefill of `held` tokens."""
    return _kv_bytes(window_config(config, held, seen), shape, batch, held)


def _kv_bytes(config: PNMixConfig, shape: ModelShape, batch: int, seq_len: int) -> KVBytes:
    d = shape.head_dim
    heads = shape.num_layers * shape.num_kv_heads * batch  # independent (layer, KV head, sequence) slots
    fp16_total = heads * seq_len * d * 2 * 2
    if not config.keys_quantized and not config.values_quantized:
        return KVBytes(0, 0, 0, 0, 0, 0, fp16_total, fp16_total, fp16_total)
    config.check_head_dim(d)
    n_sink = min(config.n_sink, seq_len)
    quantized = (seq_len - n_sink) // config.group_size * config.group_size
    residual = seq_len - n_sink - quantized
    n_sal = config.salient_pairs(d)
    groups = quantized // config.group_size
    if config.keys_quantized:
        key_payload_bits = quantized * (d * config.b_low + 2 * n_sal * config.high_planes)
        packed_keys = heads * key_payload_bits // 8
        key_scales = heads * groups * d * 2 * 2
        salient = heads * n_sal * 2  # int16 pair indices
    else:
        packed_keys, key_scales, salient = heads * quantized * d * 2, 0, 0
    if config.values_quantized:
        packed_values = heads * quantized * d * config.value_bits // 8
        value_scales = heads * quantized * (d // config.value_group_size) * 2 * 2
    else:
        packed_values, value_scales = heads * quantized * d * 2, 0
    sinks = heads * n_sink * d * 2 * 2
    residual_bytes = heads * residual * d * 2 * 2
    total = packed_keys + key_scales + salient + packed_values + value_scales + sinks + residual_bytes
    return KVBytes(
        packed_keys, key_scales, salient, packed_values, value_scales, sinks, residual_bytes, total, fp16_total
    )
