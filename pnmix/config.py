"""PN-Mix method configuration: the one place that defines what a valid config is.

A config is a frozen dataclass; it validates itself on construction and raises `ConfigError`
naming the field, the value and what is allowed. Key bits of 16 on both `b_high` and `b_low`
mean "keys unquantized" (the fp16 baseline); otherwise keys are quantized at 1..4 bits.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pnmix.errors import PNMixError
from pnmix.inputs import INT32_MAX, shorten

KEY_BITS = (1, 2, 3, 4)
UNQUANTIZED_BITS = 16
GROUP_SIZES = (32, 64, 128)
VALUE_BITS = (1, 2, 4, 8, 16)
CRITERIA = ("qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range", "random")


class ConfigError(PNMixError, ValueError):
    """A config field holds a value that is not allowed. The message is one line, fit for users."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={shorten(value)}: allowed {allowed}")


def utf8_text(text: str | bytes | bytearray) -> str:
    """Config JSON as text: bytes must be UTF-8 (RFC 8259), which `json.loads` would not insist on
    (it guesses UTF-16 or UTF-32 from zero bytes)."""
    if isinstance(text, bytes | bytearray):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("config", bytes(text[:24]), "JSON text in UTF-8") from None
    return text


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`'s object hook for configs: a key given twice in one object is refused (a parser
    would silently keep the last), in every object of the document."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ConfigError("config", f"{key!r} given twice", "each key once in a JSON object")
        seen.add(key)
    return dict(pairs)


def salient_pair_count(salient_ratio: float, head_dim: int) -> int:
    """Number of salient RoPE pairs per KV head: round(r * d/2), rounding halves up.

    Halves round up (not Python's banker's rounding) so that the bit formula, the saliency
    selection and the kernels agree on every ratio.
    """
    return min(head_dim // 2, math.floor(salient_ratio * (head_dim // 2) + 0.5))


@dataclass(frozen=True)
class PNMixConfig:
    b_high: int = 3
    b_low: int = 1
    group_size: int = 128
    salient_ratio: float = 0.5
    n_sink: int = 32
    residual_len: int = 128
    value_bits: int = 2
    value_group_size: int = 32
    criterion: str = "qk_pair_norm"
    seed: int = 0  # only used by the `random` criterion

    def __post_init__(self) -> None:
        key_allowed = "1..4 with b_high >= b_low, or 16 on both (unquantized keys)"
        _check_int("b_high", self.b_high, key_allowed)
        _check_int("b_low", self.b_low, key_allowed)
        if self.b_high == UNQUANTIZED_BITS or self.b_low == UNQUANTIZED_BITS:
            if self.b_high != self.b_low:
                bad = "b_low" if self.b_low == UNQUANTIZED_BITS else "b_high"
                raise ConfigError(bad, getattr(self, bad), key_allowed)
        else:
            if self.b_high not in KEY_BITS:
                raise ConfigError("b_high", self.b_high, key_allowed)
            if self.b_low not in KEY_BITS:
                raise ConfigError("b_low", self.b_low, key_allowed)
            if self.b_low > self.b_high:
                raise ConfigError("b_low", self.b_low, f"at most b_high={self.b_high}")
        _check_int("group_size", self.group_size, "one of 32, 64, 128")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError("group_size", self.group_size, "one of 32, 64, 128")
        if (
            isinstance(self.salient_ratio, bool)
            or not isinstance(self.salient_ratio, int | float)
            or not 0.0 <= self.salient_ratio <= 1.0
        ):
            raise ConfigError("salient_ratio", self.salient_ratio, "a number in [0, 1]")
        sinks_allowed = f"an integer in [0, {INT32_MAX}]"
        _check_int("n_sink", self.n_sink, sinks_allowed)
        if self.n_sink < 0:
            raise ConfigError("n_sink", self.n_sink, sinks_allowed)
        residual_allowed = f"a positive multiple of group_size={self.group_size}, at most {INT32_MAX}"
        _check_int("residual_len", self.residual_len, residual_allowed)
        if self.residual_len <= 0 or self.residual_len % self.group_size:
            raise ConfigError("residual_len", self.residual_len, residual_allowed)
        _check_int("value_bits", self.value_bits, "one of 1, 2, 4, 8, 16")
        if self.value_bits not in VALUE_BITS:
            raise ConfigError("value_bits", self.value_bits, "one of 1, 2, 4, 8, 16")
        _check_int("value_group_size", self.value_group_size, "a positive divisor of head_dim")
        if self.value_group_size <= 0:
            raise ConfigError("value_group_size", self.value_group_size, "a positive divisor of head_dim")
        if self.criterion not in CRITERIA:
            raise ConfigError("criterion", self.criterion, "one of " + ", ".join(CRITERIA))
        _check_int("seed", self.seed, sinks_allowed)
        if self.seed < 0:
            raise ConfigError("seed", self.seed, sinks_allowed)

    # -- derived facts -------------------------------------------------------------------------

    @property
    def keys_quantized(self) -> bool:
        return self.b_high != UNQUANTIZED_BITS

    @property
    def values_quantized(self) -> bool:
        return self.value_bits != UNQUANTIZED_BITS

    @property
    def label(self) -> str:
        """The searched knobs in one short line: "3/1 G128 r0.5 s32" (b_high/b_low, G, r, sinks), then
        the value format where it is not the paper's 2 bits in groups of 32: "... V1/64"."""
        out = f"{self.b_high}/{self.b_low} G{self.group_size} r{self.salient_ratio:g} s{self.n_sink}"
        if self.values_quantized and (self.value_bits, self.value_group_size) != (2, 32):
            out += f" V{self.value_bits}/{self.value_group_size}"
        return out

    @property
    def high_planes(self) -> int:
        """Extra bit planes stored for salient channels only."""
        return self.b_high - self.b_low if self.keys_quantized else 0

    def salient_pairs(self, head_dim: int) -> int:
        if not self.keys_quantized or self.b_high == self.b_low:
            return 0
        return salient_pair_count(self.salient_ratio, head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        """Checks what depends on the model: an even head_dim that value_group_size divides."""
        if head_dim % 2:
            raise ConfigError("head_dim", head_dim, "an even number (RoPE rotates channel pairs)")
        if self.values_quantized and head_dim % self.value_group_size:
            raise ConfigError(
                "value_group_size", self.value_group_size, f"a positive divisor of head_dim={head_dim}"
            )

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PNMixConfig:
        if not isinstance(data, dict):
            raise ConfigError("config", type(data).__name__, "a JSON object of PNMixConfig fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], "a field among " + ", ".join(sorted(known)))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str | bytes) -> PNMixConfig:
        if not isinstance(text, str | bytes | bytearray):
            raise ConfigError("config", type(text).__name__, "JSON text of a PNMixConfig object")
        text = utf8_text(text)
        try:
            data = json.loads(text, object_pairs_hook=unique_keys)
        except ConfigError:
            raise
        except json.JSONDecodeError as exc:
            raise ConfigError("config", text[:40], f"valid JSON ({exc.msg} at char {exc.pos})") from None
        except RecursionError:  # absurdly nested input: refuse it like any other malformed JSON
            raise ConfigError("config", text[:40], "a flat JSON object of PNMixConfig fields") from None
        except ValueError:  # an integer of thousands of digits (Python's conversion limit), bytes not UTF-8
            raise ConfigError("config", text[:40], "JSON of PNMixConfig fields with integers of at most "
                                                   "10 digits, in UTF-8") from None
        return cls.from_dict(data)

    def with_(self, **changes: Any) -> PNMixConfig:
        return replace(self, **changes)


def _check_int(name: str, value: object, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, "an integer")
    # Every integer field fits a database INTEGER column, so a stored config reads back as it was.
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ConfigError(name, value, allowed)


PRESETS: dict[str, PNMixConfig] = {
    # No quantization at all: the reference every other config is compared with.
    "fp16": PNMixConfig(
        b_high=16, b_low=16, salient_ratio=0.0, n_sink=0, value_bits=16, group_size=128, residual_len=128
    ),
    # KIVI: uniform key bits, no salient channels, no sinks.
    "kivi2": PNMixConfig(b_high=2, b_low=2, salient_ratio=0.0, n_sink=0, group_size=128, value_bits=2),
    "kivi1": PNMixConfig(b_high=1, b_low=1, salient_ratio=0.0, n_sink=0, group_size=128, value_bits=2),
    # The paper's headline configuration.
    "pnmix-paper": PNMixConfig(
        b_high=3, b_low=1, salient_ratio=0.5, group_size=128, n_sink=32, residual_len=128, value_bits=2
    ),
    # Kitty-like: 4/2 bits on a small set of high-magnitude channels.
    "kitty": PNMixConfig(
        b_high=4, b_low=2, salient_ratio=0.0625, group_size=128, n_sink=32, value_bits=2, criterion="k_magnitude"
    ),
}


def preset(name: str) -> PNMixConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("preset", name, "one of " + ", ".join(PRESETS)) from None
