"""Which layers get the bits: layer sensitivity and a layer-wise allocation under a key-bit budget.

The proxy (tuner/scoring/proxy.py) scores each layer's attention KL from recorded Q/K traces, and a
layer's KL depends only on that layer's own keys and config. So one proxy pass per candidate
config gives a table kl[c][layer], and choosing one candidate per layer to minimise the summed
KL under a mean-bits budget is a multiple-choice knapsack over independent layers. `allocate`
solves its Lagrangian relaxation exactly (each layer takes argmin kl + lambda * bits; lambda by
bisection until the mean fits) and then spends the slack the relaxation leaves on the upgrades
with the best KL saved per bit. The result never has a larger summed proxy KL than the best
uniform candidate that fits, since uniform choices are among those it weighs. The table's
rows are also the model's layer-sensitivity profile: how much attention KL each layer takes
under a given config.

Under a KV budget whose layers each choose a value format, keys and values are separate items of
the same knapsack: item i < L is layer i's keys (a key candidate), item L + i its values (a
`ValueFormat`), both scored in one unit (the proxy's relative attention-output error) and both
costed in bits per element, so the mean over the 2L items is the KV bits (`joint_table`). A
candidate does not apply to the other kind's items: its row holds inf there, which neither the
relaxation nor the slack step ever picks. A sliding-window layer's window is quantized whole or
kept exact, keys and values together: its keys item takes a key candidate with a value format (the
two errors added) or the exact window, and its values item only `TIED`, which costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pnmix.bits import LayerPlan, key_bits
from pnmix.config import PNMixConfig
from pnmix.layerwise import LayerwiseConfig
from pnmix.tuner.errors import EvalError
from pnmix.tuner.search.space import RATIOS, VALUE_BITS, VALUE_GROUPS, SearchSpace

BISECTION_STEPS = 60


@dataclass(frozen=True)
class ValueFormat:
    """A layer's value format as an item of the KV knapsack (`joint_table`)."""

    bits: int
    group_size: int

    def on(self, config: PNMixConfig) -> PNMixConfig:
        """`config` with this value format."""
        return config.with_(value_bits=self.bits, value_group_size=self.group_size)


@dataclass(frozen=True)
class Tied:
    """A window's values item in the KV knapsack: set by its keys item's candidate (`TIED`)."""


TIED = Tied()
Candidate = PNMixConfig | ValueFormat | Tied


def joint_table(keys: Mapping[PNMixConfig, Sequence[float]], values: Mapping[ValueFormat, Sequence[float]],
                windows: Sequence[int] = (), exact: PNMixConfig | None = None) -> dict[Candidate, list[float]]:
    """The KV knapsack's table over 2L items: layer i's keys are item i, its values item L + i
    (each candidate inf on the other kind's items). `keys` and `values` in one unit. A window
    (`windows`: layer indices) is one choice for keys and values together: on its keys item each
    key candidate with each value format (the sum of the two errors) and `exact` (0), on its
    values item only `TIED` (0)."""
    n = len(next(iter(keys.values())))
    table: dict[Candidate, list[float]] = {c: list(row) + [math.inf] * n for c, row in keys.items()}
    table.update({f: [math.inf] * n + list(row) for f, row in values.items()})
    if windows:
        table[TIED] = [math.inf] * (2 * n)
        if exact is not None:
            table[exact] = [math.inf] * (2 * n)
        for i in windows:
            for c in keys:  # a key candidate alone leaves the window's values unsaid
                table[c][i] = math.inf
            for c, row in keys.items():
                for f, value_row in values.items():
                    table.setdefault(f.on(c), [math.inf] * (2 * n))[i] = row[i] + value_row[i]
            for f in values:
                table[f][n + i] = math.inf
            table[TIED][n + i] = 0.0
            if exact is not None:
                table[exact][i] = 0.0
    return table


def joint_layers(items: Sequence[Candidate], windows: Sequence[int] = ()) -> list[PNMixConfig]:
    """Each layer's config from the 2L items of `joint_table`: its key candidate with its value
    format; a window's keys item as it is (keys and values, or the exact window)."""
    n = len(items) // 2
    out = []
    for i, (key, value) in enumerate(zip(items[:n], items[n:], strict=True)):
        assert isinstance(key, PNMixConfig)
        if i in windows:
            out.append(key)
        else:
            assert isinstance(value, ValueFormat)
            out.append(value.on(key))
    return out


def joint_items(layers: Sequence[PNMixConfig], key_values: ValueFormat, windows: Sequence[int] = ()) -> list[Candidate]:
    """The 2L items of per-layer configs (the inverse of `joint_layers`): each layer's keys as the
    key candidate with `key_values` (the value format the key candidates carry), then its values;
    a window's keys item its config as it is, its values item `TIED`."""
    keys: list[Candidate] = [c if i in windows else key_values.on(c) for i, c in enumerate(layers)]
    values: list[Candidate] = [TIED if i in windows else ValueFormat(c.value_bits, c.value_group_size)
                               for i, c in enumerate(layers)]
    return keys + values


def candidates_like(base: PNMixConfig, space: SearchSpace) -> list[PNMixConfig]:
    """The configs a layer may take beside `base`: every bit pair and salient ratio of the space,
    with `base`'s shared fields (G, sinks, residual, values, criterion)."""
    out = [base]
    for pair in space.bit_pairs():
        hi, lo = (int(x) for x in pair.split("/"))
        for r in (RATIOS if hi > lo else (0.0,)):
            cfg = base.with_(b_high=hi, b_low=lo, salient_ratio=r)
            if cfg not in out:
                out.append(cfg)
    return out


def allocate(kl: Mapping[Any, Sequence[float]], budget: float, head_dim: int,
             weights: Sequence[float] | None = None,
             cost: Callable[[Any], float] | None = None,
             item_cost: Callable[[Any, int], float] | None = None) -> list[Any]:
    """One config per item (a layer, or a group of layers) minimising the summed KL with the
    weighted mean bits <= budget.

    kl[c][i]: item i's KL under candidate c (every candidate lists every item; inf where item i
    may not take c); `weights[i]`: the layers (or elements) item i stands for (default 1 each);
    `cost`: a candidate's bits (default its key bits, metadata included), or `item_cost(c, i)`
    where they differ by item (a sliding-window layer's quantized window). Raises EvalError when
    not even the cheapest candidate everywhere fits.
    """
    cands = list(kl)
    rows = [kl[c] for c in cands]
    n = len(rows[0])
    w = list(weights) if weights is not None else [1.0] * n
    # Per item, the candidates (by index) where its KL is finite (all of them where none is): an inf
    # candidate is never chosen, and each item of the joint KV knapsack takes a small share of them.
    usable = [[j for j, row in enumerate(rows) if row[i] != math.inf] or list(range(len(cands))) for i in range(n)]
    one = [cost(c) if cost else key_bits(c, head_dim).total for c in cands] if item_cost is None else []
    bits = [[item_cost(cands[j], i) if item_cost is not None else one[j] for j in usable[i]] for i in range(n)]
    kls = [[rows[j][i] for j in usable[i]] for i in range(n)]
    limit = budget * sum(w) + 1e-9

    def pick(i: int, lam: float) -> int:  # item i's choice, as its position in `usable[i]`
        return min(range(len(kls[i])), key=lambda k: (kls[i][k] + lam * w[i] * bits[i][k], bits[i][k]))

    def choose(lam: float) -> list[int]:
        return [pick(i, lam) for i in range(n)]

    def total(choice: list[int]) -> float:
        return sum(w[i] * bits[i][k] for i, k in enumerate(choice))

    if total(choice := choose(0.0)) > limit:
        lo, hi = 0.0, 1.0
        while total(choose(hi)) > limit:
            hi *= 2
            if hi > 1e12:
                cheapest = sum(wi * min(row) for wi, row in zip(w, bits, strict=True)) / sum(w)
                raise EvalError(f"no allocation fits {budget:g} bits: the cheapest candidates need {cheapest:.3f}")
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if total(choose(mid)) <= limit else (mid, hi)
        choice = choose(hi)
    # Spend the slack: the upgrade with the most KL saved per added bit, while it fits.
    while True:
        spare = limit - total(choice)
        best: tuple[float, int, int] | None = None
        for i, cur in enumerate(choice):
            for k in range(len(kls[i])):
                extra = w[i] * (bits[i][k] - bits[i][cur])
                saved = kls[i][cur] - kls[i][k]
                if 0 < extra <= spare and saved > 0 and (best is None or saved / extra > best[0]):
                    best = (saved / extra, i, k)
        if best is None:
            return [cands[usable[i][k]] for i, k in enumerate(choice)]
        choice[best[1]] = best[2]


def spread(full: Sequence[PNMixConfig], plan: LayerPlan) -> list[PNMixConfig]:
    """One config per layer of a model from its full-attention layers' configs (in `plan.full_layers`
    order): its sliding-window layers, whose windows stay in the model's dtype whatever they are
    given, take the full layers' most common config, so the compact form names no sliding layer."""
    if not plan.hybrid:
        return list(full)
    every = [max(dict.fromkeys(full), key=list(full).count)] * len(plan.kinds)
    for i, cfg in zip(plan.full_layers, full, strict=True):
        every[i] = cfg
    return every


def layerwise_for_budget(base: PNMixConfig, budget: float, head_dim: int, space: SearchSpace,
                         kl_of: Mapping[PNMixConfig, Sequence[float]]) -> LayerwiseConfig:
    """`allocate` over `candidates_like(base)` whose per-layer KL `kl_of` holds, in compact form."""
    table = {c: kl_of[c] for c in candidates_like(base, space) if c in kl_of}
    return LayerwiseConfig.from_layers(allocate(table, budget, head_dim))


def group_layers(sensitivity: Sequence[float], k: int) -> list[list[int]]:
    """The layers ranked by sensitivity (most sensitive first) and cut into `k` groups of near-equal
    size (the first groups one larger when k does not divide the layer count): the layer groups of
    a pnmix-layers campaign. Layers of equal sensitivity keep their order."""
    order = sorted(range(len(sensitivity)), key=lambda i: -sensitivity[i])
    k = max(1, min(k, len(order)))
    size, extra = divmod(len(order), k)
    groups, start = [], 0
    for g in range(k):
        end = start + size + (1 if g < extra else 0)
        groups.append(sorted(order[start:end]))
        start = end
    return groups


def grouped_for_budget(space: Any, kl_of: Mapping[PNMixConfig, Sequence[float]], budget: float,
                       head_dim: int) -> Any:
    """The config of a pnmix-layers space (its groups set) whose groups take the candidates that
    minimise the summed per-layer KL (`kl_of`) with the budget's figure (`space.cost`) within
    `budget`: `allocate` over the groups, each weighted by its layer count. None when nothing fits."""
    table = {c: [sum(layer_kl[i] for i in g) for g in space.groups] for c, layer_kl in kl_of.items()}
    try:
        chosen = allocate(table, budget, head_dim, weights=[len(g) for g in space.groups],
                          cost=lambda c: space.cost(c, head_dim))
    except EvalError:
        return None
    return space.layerwise(chosen)


def _step_apart(a: Candidate, b: Candidate) -> bool:
    """Whether `b` is one step from `a`: one bit of b_high or b_low, or one salient-ratio step
    (0.1), with the other knobs kept (a uniform pair's ratio counts as 0); between value formats,
    the next value bits or the next value group size, the other kept; between two configs whose
    value formats differ (a window's choices in the KV knapsack), such a value step alone."""
    if not (isinstance(a, PNMixConfig) and isinstance(b, PNMixConfig)):
        if not (isinstance(a, ValueFormat) and isinstance(b, ValueFormat)):
            return False
        bits = a.group_size == b.group_size and abs(VALUE_BITS.index(a.bits) - VALUE_BITS.index(b.bits)) == 1
        groups = a.bits == b.bits and abs(VALUE_GROUPS.index(a.group_size) - VALUE_GROUPS.index(b.group_size)) == 1
        return bits or groups
    va, vb = ValueFormat(a.value_bits, a.value_group_size), ValueFormat(b.value_bits, b.value_group_size)
    if va != vb:  # a window's keys and values together: a value step with the keys kept
        return a.with_(value_bits=b.value_bits, value_group_size=b.value_group_size) == b and _step_apart(va, vb)
    n_bits = abs(a.b_high - b.b_high) + abs(a.b_low - b.b_low)
    ratio = abs(a.salient_ratio - b.salient_ratio)
    return (n_bits == 1 and ratio < 0.1 + 1e-9) or (n_bits == 0 and abs(ratio - 0.1) < 1e-9)


def moves(choice: Sequence[Any], kl: Mapping[Any, Sequence[float]], budget: float,
          cost: Callable[[Any], float], apart: Callable[[Any, Any], bool] | None = None,
          item_cost: Callable[[Any, int], float] | None = None, weights: Sequence[float] | None = None
          ) -> list[list[Any]]:
    """Local moves from an allocation that keep its (weighted) mean cost within `budget`: one layer
    one step up (`apart`; by default a bit or a ratio step, `_step_apart`) and another one step
    down, or one layer one step up where the slack allows it. Ranked by the proxy's change in
    summed KL, least harm first: the moves the proxy can least tell from the allocation itself,
    which real scores then decide between. `item_cost` and `weights` as `allocate` takes them."""
    apart = apart or _step_apart
    n = len(choice)
    w = list(weights) if weights is not None else [1.0] * n
    at = item_cost or (lambda c, i: cost(c))
    limit = budget * sum(w) + 1e-9
    spent = sum(wi * at(c, i) for i, (wi, c) in enumerate(zip(w, choice, strict=True)))
    cands = list(kl)
    ups: list[tuple[float, float, int, Any]] = []  # (delta KL, delta cost, item, new candidate)
    downs: list[tuple[float, float, int, Any]] = []
    for i, cur in enumerate(choice):
        for c in cands:
            if c == cur or not apart(cur, c) or kl[c][i] == math.inf:
                continue
            extra = w[i] * (at(c, i) - at(cur, i))
            delta = kl[c][i] - kl[cur][i]
            (ups if extra > 0 else downs).append((delta, extra, i, c))
    ranked: list[tuple[float, int, list[Any]]] = []
    for d_up, extra, i, c in ups:
        if spent + extra <= limit:
            changed = list(choice)
            changed[i] = c
            ranked.append((d_up, len(ranked), changed))
        for d_down, saved, j, e in downs:
            if j != i and spent + extra + saved <= limit:
                changed = list(choice)
                changed[i], changed[j] = c, e
                ranked.append((d_up + d_down, len(ranked), changed))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [changed for _, _, changed in ranked]
