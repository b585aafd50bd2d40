"""Which layers get the bits: layer sensitivity and a layer-wise allocation under a key-bit budget.

The proxy (tuner/proxy.py) scores each layer's attention KL from recorded Q/K traces, and a
layer's KL depends only on that layer's own keys and config. So one proxy pass per candidate
config gives a table kl[c][layer], and choosing one candidate per layer to minimise the summed
KL under a mean-bits budget is a multiple-choice knapsack over independent layers. `allocate`
solves its Lagrangian relaxation exactly (each layer takes argmin kl + lambda * bits; lambda by
bisection until the mean fits) and then spends the slack the relaxation leaves on the upgrades
with the best KL saved per bit. The result never has a larger summed proxy KL than the best
uniform candidate that fits, since uniform choices are among those it weighs. The table's
rows are also the model's layer-sensitivity profile: how much attention KL each layer takes
under a given config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pnmix.bits import key_bits
from pnmix.config import PNMixConfig
from pnmix.layerwise import LayerwiseConfig
from tuner.profiles import EvalError
from tuner.space import RATIOS, SearchSpace

BISECTION_STEPS = 60


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


def allocate(kl: Mapping[PNMixConfig, Sequence[float]], budget: float, head_dim: int,
             weights: Sequence[float] | None = None,
             cost: Callable[[PNMixConfig], float] | None = None) -> list[PNMixConfig]:
    """One config per item (a layer, or a group of layers) minimising the summed KL with the
    weighted mean bits <= budget.

    kl[c][i]: item i's KL under candidate c (every candidate lists every item); `weights[i]`: the
    layers item i stands for (default 1 each); `cost`: a candidate's bits (default its key bits,
    metadata included). Raises EvalError when not even the cheapest candidate everywhere fits.
    """
    cands = list(kl)
    n = len(next(iter(kl.values())))
    w = list(weights) if weights is not None else [1.0] * n
    bits = {c: (cost(c) if cost else key_bits(c, head_dim).total) for c in cands}
    limit = budget * sum(w) + 1e-9

    def choose(lam: float) -> list[PNMixConfig]:
        return [min(cands, key=lambda c: (kl[c][i] + lam * w[i] * bits[c], bits[c])) for i in range(n)]

    def total(choice: list[PNMixConfig]) -> float:
        return sum(wi * bits[c] for wi, c in zip(w, choice, strict=True))

    if total(choice := choose(0.0)) > limit:
        lo, hi = 0.0, 1.0
        while total(choose(hi)) > limit:
            hi *= 2
            if hi > 1e12:
                cheapest = min(bits.values())
                raise EvalError(f"no allocation fits {budget:g} key bits: the cheapest candidate needs {cheapest:.3f}")
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if total(choose(mid)) <= limit else (mid, hi)
        choice = choose(hi)
    # Spend the slack: the upgrade with the most KL saved per added bit, while it fits.
    while True:
        spare = limit - total(choice)
        best: tuple[float, int, PNMixConfig] | None = None
        for i, cur in enumerate(choice):
            for c in cands:
                extra = w[i] * (bits[c] - bits[cur])
                saved = kl[cur][i] - kl[c][i]
                if 0 < extra <= spare and saved > 0 and (best is None or saved / extra > best[0]):
                    best = (saved / extra, i, c)
        if best is None:
            return choice
        choice[best[1]] = best[2]


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


def _step_apart(a: PNMixConfig, b: PNMixConfig) -> bool:
    """Whether `b` is one step from `a`: one bit of b_high or b_low, or one salient-ratio step
    (0.1), with the other knobs kept (a uniform pair's ratio counts as 0)."""
    bits = abs(a.b_high - b.b_high) + abs(a.b_low - b.b_low)
    ratio = abs(a.salient_ratio - b.salient_ratio)
    return (bits == 1 and ratio < 0.1 + 1e-9) or (bits == 0 and abs(ratio - 0.1) < 1e-9)


def moves(choice: Sequence[PNMixConfig], kl: Mapping[PNMixConfig, Sequence[float]], budget: float,
          cost: Callable[[PNMixConfig], float]) -> list[list[PNMixConfig]]:
    """Local moves from an allocation that keep its mean cost within `budget`: one layer one step up
    (a bit or a ratio step, `_step_apart`) and another one step down, or one layer one step up where
    the slack allows it. Ranked by the proxy's change in summed KL, least harm first: the moves the
    proxy can least tell from the allocation itself, which real scores then decide between."""
    n = len(choice)
    limit = budget * n + 1e-9
    spent = sum(cost(c) for c in choice)
    cands = list(kl)
    ups: list[tuple[float, float, int, PNMixConfig]] = []  # (delta KL, delta cost, layer, new config)
    downs: list[tuple[float, float, int, PNMixConfig]] = []
    for i, cur in enumerate(choice):
        for c in cands:
            if c == cur or not _step_apart(cur, c):
                continue
            extra = cost(c) - cost(cur)
            delta = kl[c][i] - kl[cur][i]
            (ups if extra > 0 else downs).append((delta, extra, i, c))
    ranked: list[tuple[float, int, list[PNMixConfig]]] = []
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
