"""Where a search steps from: the fullest config of each bit pair under a budget (the warm starts
and the allocator's shared fields), and a config's neighbours one knob away (the next trial after a
re-proposal). Both read a `SearchSpace` (tuner/search/space.py) and return configs of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pnmix.config import GROUP_SIZES, PNMixConfig
from pnmix.layerwise import AnyConfig
from pnmix.tuner.search.axes import RATIOS, SINKS, VALUE_BITS, VALUE_GROUPS


class SearchSpace(Protocol):
    """What the steps read of a search space (`tuner.search.space.SearchSpace`, which calls them)."""

    @property
    def method(self) -> str: ...

    @property
    def search_values(self) -> bool: ...

    @property
    def value_bits(self) -> int: ...

    @property
    def value_group_size(self) -> int: ...

    @property
    def layered(self) -> bool: ...

    @property
    def allocated(self) -> bool: ...

    def cost(self, config: AnyConfig, head_dim: int) -> float: ...

    def contains(self, config: AnyConfig) -> bool: ...

    def config(self, b_high: int, b_low: int, group: int, ratio: float, sinks: int,
               value_bits: int | None = None, value_group_size: int | None = None) -> PNMixConfig: ...

    def per_group(self, config: AnyConfig) -> list[PNMixConfig]: ...

    def layerwise(self, per_group: Sequence[PNMixConfig]) -> AnyConfig: ...

    def sinks(self) -> list[int]: ...

    def ratios(self, hi: int, lo: int) -> list[float]: ...

    def residual(self, group: int) -> int: ...

    def value_choices(self, head_dim: int) -> list[tuple[int, int]]: ...

    def value_cost(self, values: tuple[int, int]) -> float: ...

    def pairs_within(self, budget: float, head_dim: int) -> list[str]: ...


def fullest_within(space: SearchSpace, budget: float, head_dim: int) -> list[PNMixConfig]:
    """Per bit pair, the config that spends the budget on what buys accuracy: the most salient
    channels (mixed pairs: the largest G and the most sinks, then the largest r that fits) or
    the finest groups (uniform pairs: the smallest G that fits, the most sinks). Group metadata
    and sinks cost a few hundredths of a bit; the salient ratio and G are where bits go.

    With values searched, first the fullest config of the paper's pair (3/1) for each value
    format that leaves room for it, most value bits first: which value format a budget wants is
    the new question, and a sampler that meets the infeasible formats first tends to settle on
    the cheapest one; then every pair with the space's own value format."""
    out: list[PNMixConfig] = []
    if space.search_values:
        formats = sorted(space.value_choices(head_dim), key=space.value_cost, reverse=True)
        for values in formats:
            out += _fullest(space, ["3/1"], budget, head_dim, values)
    out += _fullest(space, space.pairs_within(budget, head_dim), budget, head_dim,
                         (space.value_bits, space.value_group_size))
    return list(dict.fromkeys(out))


def _fullest(space: SearchSpace, pairs: list[str], budget: float, head_dim: int,
             values: tuple[int, int]) -> list[PNMixConfig]:
    """Per pair of `pairs`, the first config of its fullest-first order that fits `budget`."""
    sinks = sorted(space.sinks(), reverse=True)
    out: list[PNMixConfig] = []
    for pair in pairs:
        hi, lo = (int(x) for x in pair.split("/"))
        if len(space.ratios(hi, lo)) > 1:
            tries = [(max(GROUP_SIZES), r, s) for r in sorted(space.ratios(hi, lo), reverse=True) for s in sinks]
        else:
            tries = [(g, 0.0, s) for g in sorted(GROUP_SIZES) for s in sinks]
        configs = (space.config(hi, lo, g, r, s, *values) for g, r, s in tries)
        first = next((c for c in configs if space.cost(c, head_dim) <= budget), None)
        if first is not None:
            out.append(first)
    return out


def neighbours(space: SearchSpace, config: AnyConfig, head_dim: int | None = None) -> list[AnyConfig]:
    """The configs of the space one step from `config` on one searched knob (sinks, salient ratio
    (each group's, for pnmix-layers), group size, value bits and group when searched: the next
    value down or up), in that order; with `head_dim`, only value groups that divide it."""
    if not space.contains(config) or space.allocated:  # pnmix-alloc: local moves (tuner.search.layers.moves)
        return []

    def step(values: Sequence[Any], v: Any) -> list[Any]:
        i = list(values).index(v)
        return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]

    per_group = space.per_group(config) if space.layered else [config]
    assert all(isinstance(c, PNMixConfig) for c in per_group)

    def everywhere(**change: Any) -> AnyConfig:
        changed = [c.with_(**change) for c in per_group]  # type: ignore[union-attr]
        return space.layerwise(changed) if space.layered else changed[0]

    c = per_group[0]
    assert isinstance(c, PNMixConfig)
    out: list[AnyConfig] = []
    if len(space.sinks()) > 1:
        out += [everywhere(n_sink=s) for s in step(SINKS, c.n_sink)]
    for k, ck in enumerate(per_group):
        assert isinstance(ck, PNMixConfig)
        if len(space.ratios(ck.b_high, ck.b_low)) > 1:
            for r in step(RATIOS, ck.salient_ratio):
                changed = list(per_group)
                changed[k] = ck.with_(salient_ratio=r)
                out.append(space.layerwise(changed) if space.layered else changed[0])  # type: ignore[arg-type]
    out += [everywhere(group_size=g, residual_len=space.residual(g))
            for g in step(GROUP_SIZES, c.group_size)]
    if space.search_values:
        out += [everywhere(value_bits=b) for b in step(VALUE_BITS, c.value_bits)]
        out += [everywhere(value_group_size=g) for g in step(VALUE_GROUPS, c.value_group_size)
                if head_dim is None or head_dim % g == 0]
    return out
