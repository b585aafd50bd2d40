"""The search space: the one place that says which PN-Mix configs a campaign may try.

Searched: the (b_high, b_low) pair, token group G, salient ratio r, sink count. Fixed per
campaign: residual length, value bits and group, saliency criterion. `--method` restricts the
space to one method's own knobs (the paper's Figure 3 protocol), so tuned fronts of PN-Mix,
KIVI and a Kitty-like method compare on one model:
    pnmix: any 1 <= b_low <= b_high <= 4, G, r in {0.1..0.9} (r = 0 when b_high == b_low), sinks
    kivi:  uniform 1 or 2 bits, G; no salient channels, no sinks
    kitty: 4/2 bits, k_magnitude saliency, G and r; 32 sinks
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pnmix.config import GROUP_SIZES, PNMixConfig
from pnmix.names import METHODS
from tuner.profiles import EvalError

RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SINKS = (0, 8, 16, 32, 64)


@dataclass(frozen=True)
class SearchSpace:
    method: str = "pnmix"
    residual_len: int = 128
    value_bits: int = 2
    value_group_size: int = 32
    criterion: str = "qk_pair_norm"
    fixed: dict[str, Any] = field(default_factory=dict)  # extra fixed fields, e.g. n_sink for kivi

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise EvalError(f"unknown method {self.method!r}: allowed {', '.join(METHODS)}")

    def bit_pairs(self) -> list[str]:
        if self.method == "kivi":
            return ["1/1", "2/2"]
        if self.method == "kitty":
            return ["4/2"]
        return [f"{hi}/{lo}" for lo in range(1, 5) for hi in range(lo, 5)]

    def suggest(self, trial: Any, pairs: list[str] | None = None) -> PNMixConfig:
        """Samples a config from an Optuna trial (static categorical choices, so TPE models them);
        `pairs`: the bit pairs to choose from (default: all of the method's)."""
        bits = trial.suggest_categorical("bits", pairs or self.bit_pairs())
        b_high, b_low = (int(x) for x in bits.split("/"))
        group = trial.suggest_categorical("group_size", list(GROUP_SIZES))
        if self.method == "kivi":
            ratio, sinks = 0.0, 0
        else:
            ratio = float(trial.suggest_categorical("salient_ratio", list(RATIOS))) if b_high > b_low else 0.0
            sinks = 32 if self.method == "kitty" else int(trial.suggest_categorical("n_sink", list(SINKS)))
        return self.config(b_high, b_low, group, ratio, sinks)

    def configs(self) -> list[PNMixConfig]:
        """Every config of the space, each once: bit pair, then G, then r, then sinks."""
        out: list[PNMixConfig] = []
        for pair in self.bit_pairs():
            hi, lo = (int(x) for x in pair.split("/"))
            ratios = [0.0] if self.method == "kivi" or hi == lo else list(RATIOS)
            sinks = [0] if self.method == "kivi" else ([32] if self.method == "kitty" else list(SINKS))
            for group in GROUP_SIZES:
                out.extend(self.config(hi, lo, group, r, s) for r in ratios for s in sinks)
        return out

    def config(self, b_high: int, b_low: int, group: int, ratio: float, sinks: int) -> PNMixConfig:
        criterion = "k_magnitude" if self.method == "kitty" else self.criterion
        residual = max(self.residual_len, group)
        residual -= residual % group
        return PNMixConfig(b_high=b_high, b_low=b_low, group_size=group, salient_ratio=ratio, n_sink=sinks,
                           residual_len=residual, value_bits=self.value_bits,
                           value_group_size=self.value_group_size, criterion=criterion)

    @staticmethod
    def params_of(config: PNMixConfig, method: str) -> dict[str, Any]:
        """The trial parameters that reproduce `config` (for enqueueing warm starts)."""
        params: dict[str, Any] = {"bits": f"{config.b_high}/{config.b_low}", "group_size": config.group_size}
        if method != "kivi":
            if config.b_high > config.b_low:
                params["salient_ratio"] = config.salient_ratio
            if method != "kitty":
                params["n_sink"] = config.n_sink
        return params

    def fullest_within(self, budget: float, head_dim: int) -> list[PNMixConfig]:
        """Per bit pair, the config that spends the budget on what buys accuracy: the most salient
        channels (mixed pairs: the largest G and the most sinks, then the largest r that fits) or
        the finest groups (uniform pairs: the smallest G that fits, the most sinks). Group metadata
        and sinks cost a few hundredths of a bit; the salient ratio and G are where bits go."""
        from pnmix.bits import key_bits

        sinks = [32] if self.method == "kitty" else [0] if self.method == "kivi" else sorted(SINKS, reverse=True)
        out: list[PNMixConfig] = []
        for pair in self.pairs_within(budget, head_dim):
            hi, lo = (int(x) for x in pair.split("/"))
            if hi > lo and self.method != "kivi":
                tries = [(max(GROUP_SIZES), r, s) for r in sorted(RATIOS, reverse=True) for s in sinks]
            else:
                tries = [(g, 0.0, s) for g in sorted(GROUP_SIZES) for s in sinks]
            configs = (self.config(hi, lo, g, r, s) for g, r, s in tries)
            first = next((c for c in configs if key_bits(c, head_dim).total <= budget), None)
            if first is not None:
                out.append(first)
        return out

    def neighbours(self, config: PNMixConfig) -> list[PNMixConfig]:
        """The configs of the space one step from `config` on one searched knob (sinks, salient ratio,
        group size: the next value down or up), in that order."""
        if not self.contains(config):
            return []

        def steps(values: list[Any], v: Any) -> list[Any]:
            i = values.index(v)
            return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]

        c = config
        out: list[PNMixConfig] = []
        if self.method == "pnmix":
            out += [self.config(c.b_high, c.b_low, c.group_size, c.salient_ratio, s)
                    for s in steps(list(SINKS), c.n_sink)]
        if self.method != "kivi" and c.b_high > c.b_low:
            out += [self.config(c.b_high, c.b_low, c.group_size, r, c.n_sink)
                    for r in steps(list(RATIOS), c.salient_ratio)]
        out += [self.config(c.b_high, c.b_low, g, c.salient_ratio, c.n_sink)
                for g in steps(list(GROUP_SIZES), c.group_size)]
        return out

    def contains(self, config: PNMixConfig) -> bool:
        if f"{config.b_high}/{config.b_low}" not in self.bit_pairs() or config.group_size not in GROUP_SIZES:
            return False
        if self.method == "kivi":
            return config.salient_ratio == 0 and config.n_sink == 0
        if config.b_high > config.b_low and config.salient_ratio not in RATIOS:
            return False
        return self.method == "kitty" or config.n_sink in SINKS

    def min_key_bits(self, head_dim: int) -> float:
        """Key bits of the cheapest config in the space (below it no budget is feasible)."""
        return min(self._pair_floor(pair, head_dim) for pair in self.bit_pairs())

    def pairs_within(self, budget: float, head_dim: int) -> list[str]:
        """The bit pairs with at least one config of at most `budget` key bits (all others are over
        it whatever G, r and sinks are), in the space's order; every pair when none fits."""
        pairs = [pair for pair in self.bit_pairs() if self._pair_floor(pair, head_dim) <= budget]
        return pairs or self.bit_pairs()

    def _pair_floor(self, pair: str, head_dim: int) -> float:
        """Key bits of a bit pair's cheapest config: the largest group, the smallest salient ratio, no sinks."""
        from pnmix.bits import key_bits

        hi, lo = (int(x) for x in pair.split("/"))
        ratio = 0.0 if hi == lo else RATIOS[0]
        return key_bits(self.config(hi, lo, max(GROUP_SIZES), ratio, 32 if self.method == "kitty" else 0),
                        head_dim).total

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "bits": self.bit_pairs(), "group_size": list(GROUP_SIZES),
                "salient_ratio": [] if self.method == "kivi" else list(RATIOS),
                "n_sink": [0] if self.method == "kivi" else ([32] if self.method == "kitty" else list(SINKS)),
                "residual_len": self.residual_len, "value_bits": self.value_bits,
                "value_group_size": self.value_group_size,
                "criterion": "k_magnitude" if self.method == "kitty" else self.criterion}
