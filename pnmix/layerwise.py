"""Layer-wise PN-Mix: one `PNMixConfig` per decoder layer, written as a default plus overrides.

Layers are not equally sensitive to quantization, so a cache may give each layer its own
bit pair, salient ratio and value format. What may differ between layers is `LAYER_FIELDS`
(b_high, b_low, salient_ratio, value_bits, value_group_size); everything else is shared by every
layer: the token group G, the residual length and the sink count fix when a token leaves the fp16
residual and is packed, and the static CUDA-graph path runs one flush schedule for all layers;
the saliency criterion is one per cache as well, and values are quantized in every layer or in
none.

JSON form (`LayerwiseConfig.from_json`), ranges inclusive and counted from 0:

    {"default": {"b_high": 3, "b_low": 1, "salient_ratio": 0.5, ...},
     "layers": {"0-3": {"b_high": 4, "b_low": 2, "salient_ratio": 0.3}, "29": {"salient_ratio": 0.7}}}

A layer no range names takes the default. Ranges may not overlap; a range past the model's last
layer is refused when the config meets the model (`per_layer`). Every error is one line that
names the layer range and what is allowed.

On a model with sliding-window layers (Gemma 3), a window stays in the model's dtype unless
`"windows"` lists its layer: `"windows": [0, 1, 2]` quantizes those windows, each under its
layer's config (the default or a range's), keeping the window's semantics (its last window - 1
tokens). Without the key (every config written before windows could be quantized) no window is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pnmix.config import ConfigError, PNMixConfig, unique_keys, utf8_text
from pnmix.names import FULL

LAYER_FIELDS = ("b_high", "b_low", "salient_ratio", "value_bits", "value_group_size")
VALUE_FIELDS = ("value_bits", "value_group_size")


@dataclass(frozen=True)
class LayerRange:
    """Layers `first`..`last` (inclusive) with `changes` applied to the default."""

    first: int
    last: int
    changes: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"

    @classmethod
    def parse(cls, text: str, changes: Any) -> LayerRange:
        allowed = 'a layer "N" or an inclusive range "A-B" of layers counted from 0, A <= B'
        parts = text.split("-") if isinstance(text, str) else []
        # ASCII digits only: str.isdigit() also accepts "²" or "١", which int() then refuses
        if len(parts) not in (1, 2) or not all(p.strip().isascii() and p.strip().isdigit() and len(p.strip()) <= 6
                                               for p in parts):
            raise ConfigError("layers", text, allowed)
        first, last = int(parts[0]), int(parts[-1])
        if first > last:
            raise ConfigError("layers", text, allowed)
        if not isinstance(changes, dict) or not changes:
            raise ConfigError(f"layers {text}", changes, "a non-empty JSON object of " + ", ".join(LAYER_FIELDS))
        for name in changes:
            if name not in LAYER_FIELDS:
                raise ConfigError(f"layers {text}: {name}", changes[name],
                                  f"the same value in every layer (per layer: {', '.join(LAYER_FIELDS)}; "
                                  "G, residual, sinks and criterion are shared)")
        return cls(first, last, tuple(sorted(changes.items())))


@dataclass(frozen=True)
class LayerwiseConfig:
    default: PNMixConfig
    ranges: tuple[LayerRange, ...] = ()
    windows: tuple[int, ...] = ()  # the sliding-window layers whose windows are quantized

    def __post_init__(self) -> None:
        if not isinstance(self.default, PNMixConfig):
            raise ConfigError("default", type(self.default).__name__, "a PNMixConfig")
        allowed = "a list of the sliding-window layers to quantize, each once, counted from 0"
        if not isinstance(self.windows, tuple | list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 10**6 for i in self.windows):
            raise ConfigError("windows", self.windows, allowed)
        if len(set(self.windows)) != len(self.windows):
            raise ConfigError("windows", list(self.windows), allowed)
        object.__setattr__(self, "windows", tuple(sorted(self.windows)))
        spans = sorted(self.ranges, key=lambda r: r.first)
        # One spelling per config: ranges in layer order, whatever order the JSON listed them in
        # (`to_json` sorts its keys as text, "10" before "2").
        object.__setattr__(self, "ranges", tuple(spans))
        for a, b in zip(spans, spans[1:], strict=False):
            if b.first <= a.last:
                raise ConfigError(f"layers {b.name}", f"overlaps layers {a.name}",
                                  "ranges that name each layer at most once")
        for r in self.ranges:  # each range's layers must form a valid config on their own
            cfg = self._layer_config(r)
            if cfg.values_quantized != self.default.values_quantized:
                raise ConfigError(f"layers {r.name}: value_bits", cfg.value_bits,
                                  "quantized values in every layer or in none (the default's value_bits="
                                  f"{self.default.value_bits})")

    def _layer_config(self, r: LayerRange) -> PNMixConfig:
        try:
            return self.default.with_(**dict(r.changes))
        except ConfigError as exc:
            raise ConfigError(f"layers {r.name}: {exc.field}", exc.value, exc.allowed) from None

    def for_layer(self, index: int) -> PNMixConfig:
        """The config of layer `index` (the default where no range names it)."""
        for r in self.ranges:
            if r.first <= index <= r.last:
                return self._layer_config(r)
        return self.default

    def named_layers(self, num_layers: int) -> list[int]:
        """The layers (below `num_layers`) that a range names: those that do not take the default."""
        return sorted({i for r in self.ranges for i in range(r.first, min(r.last, num_layers - 1) + 1)})

    def per_layer(self, num_layers: int) -> list[PNMixConfig]:
        """One config per layer of a model with `num_layers` layers; refuses ranges past its end."""
        for r in self.ranges:
            if r.last >= num_layers:
                raise ConfigError(f"layers {r.name}", r.last,
                                  f"layers 0-{num_layers - 1} (the model has {num_layers})")
        if self.windows and self.windows[-1] >= num_layers:
            raise ConfigError("windows", self.windows[-1], f"layers 0-{num_layers - 1} (the model has {num_layers})")
        return [self.for_layer(i) for i in range(num_layers)]

    def held_configs(self, kinds: Sequence[str]) -> list[PNMixConfig | None]:
        """What each layer of a model whose layers are of `kinds` stores: its config, or None for a
        sliding-window layer whose window stays in the model's dtype (one `windows` does not list)."""
        return [c if kind == FULL or i in self.windows else None
                for i, (c, kind) in enumerate(zip(self.per_layer(len(kinds)), kinds, strict=True))]

    # -- what every layer shares, read as on a single config (the cache, the static path and the
    # scoring engine ask these of either form) --------------------------------------------------

    @property
    def keys_quantized(self) -> bool:
        return all(self._layer_config(r).keys_quantized for r in self.ranges) and self.default.keys_quantized

    @property
    def values_quantized(self) -> bool:
        return self.default.values_quantized

    @property
    def group_size(self) -> int:
        return self.default.group_size

    @property
    def n_sink(self) -> int:
        return self.default.n_sink

    @property
    def residual_len(self) -> int:
        return self.default.residual_len

    @property
    def values_per_layer(self) -> bool:
        """Whether some layer's value format differs from the default's."""
        return any(name in VALUE_FIELDS for r in self.ranges for name, _ in r.changes)

    @property
    def criterion(self) -> str:
        return self.default.criterion

    def check_head_dim(self, head_dim: int) -> None:
        """`PNMixConfig.check_head_dim` of every layer's config (a layer may have its own value group)."""
        self.default.check_head_dim(head_dim)
        for r in self.ranges:
            try:
                self._layer_config(r).check_head_dim(head_dim)
            except ConfigError as exc:
                raise ConfigError(f"layers {r.name}: {exc.field}", exc.value, exc.allowed) from None

    @property
    def uniform(self) -> bool:
        """Whether every layer has the default's config (no range changes anything) and no window is
        quantized."""
        return not self.windows and all(self._layer_config(r) == self.default for r in self.ranges)

    @property
    def label(self) -> str:
        """The default, then each other layer config's bits and ratio (and value format where it
        differs from the default's) with where it applies: its range when it has one ("3/1 G128 r0.5
        s32; 0-3: 4/2 r0.3 V4/32"), else its layer count ("...; 9 layers 1/1 r0"; the JSON form
        lists the layers)."""
        where: dict[PNMixConfig, list[str]] = {}
        count: dict[PNMixConfig, int] = {}
        for r in sorted(self.ranges, key=lambda r: r.first):
            c = self._layer_config(r)
            where.setdefault(c, []).append(r.name)
            count[c] = count.get(c, 0) + r.last - r.first + 1
        parts = [self.default.label]
        for c, names in where.items():
            at = f"{names[0]}:" if len(names) == 1 else f"{count[c]} layers"
            same = (c.value_bits, c.value_group_size) == (self.default.value_bits, self.default.value_group_size)
            values = "" if same else f" V{c.value_bits}/{c.value_group_size}"
            parts.append(f"{at} {c.b_high}/{c.b_low} r{c.salient_ratio:g}{values}")
        if self.windows:
            parts.append(f"{len(self.windows)} windows quantized")
        return "; ".join(parts)

    @classmethod
    def from_layers(cls, configs: list[PNMixConfig], windows: Sequence[int] = ()) -> LayerwiseConfig:
        """The compact form of one config per layer: the most common config is the default, and
        each run of consecutive layers that differs from it is a range. The configs must agree on
        every shared field. `windows`: the sliding-window layers quantized."""
        if not configs:
            raise ConfigError("layers", "[]", "at least one layer's config")
        default = max(dict.fromkeys(configs), key=configs.count)  # the most common; the first of equals
        ranges: list[LayerRange] = []
        start = 0
        for i in range(1, len(configs) + 1):
            if i < len(configs) and configs[i] == configs[start]:
                continue
            cfg = configs[start]
            if cfg != default:
                changes = {f: getattr(cfg, f) for f in LAYER_FIELDS if getattr(cfg, f) != getattr(default, f)}
                if cfg != default.with_(**changes):
                    raise ConfigError(f"layer {start}", cfg.label, "the default's shared fields (G, residual, "
                                                                    "sinks, criterion)")
                ranges.append(LayerRange(start, i - 1, tuple(sorted(changes.items()))))
            start = i
        return cls(default, tuple(ranges), tuple(windows))

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"default": self.default.to_dict(),
                               "layers": {r.name: dict(r.changes) for r in sorted(self.ranges, key=lambda r: r.first)}}
        if self.windows:  # absent otherwise: a config without quantized windows keeps its one spelling
            out["windows"] = list(self.windows)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> LayerwiseConfig:
        if not isinstance(data, dict) or "default" not in data:
            raise ConfigError("config", type(data).__name__, 'a JSON object {"default": {...}, "layers": {...}}')
        unknown = sorted(set(data) - {"default", "layers", "windows"})
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], "default, layers, windows")
        layers = data.get("layers") or {}
        if not isinstance(layers, dict):
            raise ConfigError("layers", type(layers).__name__, 'a JSON object {"A-B": {field: value}}')
        windows = data.get("windows", [])
        if not isinstance(windows, list):
            raise ConfigError("windows", windows, "a list of the sliding-window layers to quantize, counted from 0")
        return cls(PNMixConfig.from_dict(data["default"]),
                   tuple(LayerRange.parse(k, v) for k, v in layers.items()), tuple(windows))

    @classmethod
    def from_json(cls, text: str | bytes) -> LayerwiseConfig:
        config = load_config(text)
        return config if isinstance(config, LayerwiseConfig) else cls(config)


AnyConfig = PNMixConfig | LayerwiseConfig  # what the cache, the static path and the scoring engine take


def as_layerwise(config: PNMixConfig | LayerwiseConfig) -> LayerwiseConfig:
    """Either form as a layer-wise config (a single config: every layer the same)."""
    return config if isinstance(config, LayerwiseConfig) else LayerwiseConfig(config)


def simplest(config: PNMixConfig | LayerwiseConfig) -> PNMixConfig | LayerwiseConfig:
    """A layer-wise config whose layers are all alike as its single config; anything else as it is.
    Stored points, trial records and JSON answers hold this form, so one cache has one spelling."""
    if isinstance(config, LayerwiseConfig) and config.uniform:
        return config.default
    return config


def config_from_dict(data: Any) -> PNMixConfig | LayerwiseConfig:
    """Either form from its `to_dict()`: layer-wise when it has a "default" key, else a single one."""
    if isinstance(data, dict) and "default" in data:
        return LayerwiseConfig.from_dict(data)
    return PNMixConfig.from_dict(data)


def load_config(text: str | bytes) -> PNMixConfig | LayerwiseConfig:
    """A config from JSON: a layer-wise one when it has a "default" key, else a single one."""
    text = utf8_text(text)
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)  # "0-3" twice is refused, not merged
    except ConfigError:
        raise
    except (RecursionError, ValueError, TypeError):  # JSONDecodeError is a ValueError
        return PNMixConfig.from_json(text)  # raises the parse error in PNMixConfig's own one-line words
    return config_from_dict(data)


def config_key(config: Any) -> str:
    """A config (a PN-Mix config, an engine recipe, or its dict) as one comparable string: what
    identifies a config across trials, studies and sweep files."""
    return json.dumps(config if isinstance(config, dict) else config.to_dict(), sort_keys=True)
