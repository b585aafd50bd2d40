"""The allocator in the loop: what a `pnmix-alloc` campaign asks of it (docs/layerwise.md).

A trial of this method samples only the fields every layer shares (G, sinks, the value format
when values are searched: `SearchSpace.suggest_shared`); `AllocatorLoop.config` turns them into
the trial's layer-wise config, one of three kinds (its `origin`):

- allocation: the knapsack's config for the budget (`tuner.search.layers.allocate`) over the
  sensitivity table at those shared fields;
- move: when the campaign has already scored that allocation, the next local move
  (`tuner.search.layers.moves`) from the most accurate config scored at those shared fields;
- proposal: a warm start's config (`warm_starts`), queued with the trial.

Sensitivity tables are computed once per key-side shared fields (the KL proxy sees keys only) and
cached on disk by the evaluator; `sensitivity_seconds` is what this loop spent on them.

With values searched (`SearchSpace.values_per_layer`: a KV budget), a trial's allocations are
first the keys' KL allocation with the space's value format in every layer, then the joint one,
whose items are each layer's keys and each layer's values (`tuner.search.layers.joint_table`), both
scored by the proxy's relative attention-output error, so a layer's value format is chosen
against the other layers' keys and values within the total KV bits; moves in the joint table may
then trade a key step for a value step (`allocations` says why the KL allocation comes first).

On a model with sliding-window layers (Gemma 3) the windows are in the knapsack too: each window
takes a candidate (quantized under it, its proxy figure measured under the sliding mask) or stays
exact (`exact_window`: 0, 16 bits), every layer weighted by the elements it holds at 32K tokens,
so the knapsack bounds the weighted figure the budget is on. In the joint KV knapsack a window's
keys and values are one choice (a key candidate with a value format, or exact), since a config
quantizes a window whole or not at all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import optuna

from pnmix.bits import DEFAULT_QUANTIZED_TOKENS, LayerPlan, key_bits, layer_figure, mean_key_bits, value_bits_total
from pnmix.config import GROUP_SIZES, UNQUANTIZED_BITS, PNMixConfig, preset
from pnmix.layerwise import AnyConfig, LayerwiseConfig, as_layerwise, config_key, simplest
from pnmix.names import FULL
from pnmix.recipes import EngineRecipe
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.proxy import ProxyMeasure
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.search import record
from pnmix.tuner.search.layers import (
    Candidate,
    ValueFormat,
    allocate,
    candidates_like,
    joint_items,
    joint_layers,
    joint_table,
    moves,
)
from pnmix.tuner.search.record import Origin, RunningTrial, running_trials, scored_configs
from pnmix.tuner.search.space import BudgetOn, SearchSpace

SCREENED = 2  # a budget's first trials: the allocations at the shared fields the proxy rates best
Table = dict[Candidate, list[float]]  # candidate -> its proxy figure on every item (layer, or layer's keys/values)


class AllocatorLoop:
    """The allocator's side of one campaign runner: its warm starts, each trial's config and the
    sensitivity tables, for a space of one group per layer (`SearchSpace.with_layers`)."""

    def __init__(self, space: SearchSpace, evaluator: Scorer, head_dim: int, num_layers: int,
                 progress: Callable[[str], None]) -> None:
        self.space = space
        self.evaluator = evaluator
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.progress = progress
        self.tables: dict[tuple[PNMixConfig, str], Any] = {}  # by key-side shared fields and kind (kl, joint)
        self.sensitivity_seconds = 0.0
        self.joint = space.values_per_layer  # items: each layer's keys, then each layer's values
        self.plan = space.plan or LayerPlan.full(num_layers)
        # The knapsack allocates every layer, a hybrid model's windows included (`windows`), each
        # weighted by the elements it holds, against the budget itself.
        self.windows = self.plan.hybrid
        self._window_layers = self.plan.window_layers
        self._plain = replace(space, plan=None)  # a full layer's own figure, not weighted

    def cost(self, config: AnyConfig) -> float:
        """A config's bits under the campaign's budget kind (key or KV bits; weighted on a hybrid model)."""
        return self.space.cost(config, self.head_dim)

    def item_cost(self, item: Candidate, base: PNMixConfig) -> float:
        """An item's bits: a layer's config under the budget kind; in the joint KV knapsack, a key
        candidate's key bits or a value format's value bits (`base`'s sinks), whose mean over the
        2L items is the KV bits."""
        if isinstance(item, ValueFormat):
            return value_bits_total(item.on(base))
        if not isinstance(item, PNMixConfig):
            return 0.0
        return mean_key_bits(item, 1, self.head_dim) if self.joint else self._plain.cost(item, self.head_dim)

    def _layer_cost(self, base: PNMixConfig, kv: bool) -> tuple[Callable[[PNMixConfig, int], float], list[int]]:
        """On a hybrid model at `base`'s shared fields: a config's bits per element in layer i (key
        bits, or `kv` the mean of key and value bits; a window at its `window_config`, an exact one,
        keys unquantized as `exact_window`'s, at 16) and the tokens each layer holds at 32K."""
        seen = DEFAULT_QUANTIZED_TOKENS + base.n_sink
        held = self.plan.held(seen)

        def bits(c: PNMixConfig, t_q: int) -> float:
            keys = key_bits(c, self.head_dim, t_q).total
            return (keys + value_bits_total(c, t_q)) / 2 if kv else keys

        def cost(c: PNMixConfig, i: int) -> float:
            return layer_figure(c if c.keys_quantized else None, self.plan.kinds[i], held[i], seen,
                                DEFAULT_QUANTIZED_TOKENS, bits)

        return cost, held

    def _joint_costs(self, base: PNMixConfig) -> dict[str, Any]:
        """`allocate`'s and `moves`' cost arguments for the joint KV knapsack at `base`'s shared fields:
        each item at `item_cost`; on a hybrid model per item and weighted by the elements its layer
        holds, a window's keys item at its config's KV bits over both halves (`_layer_cost`, weighed
        twice) and its values item (`tuner.search.layers.TIED`) at nothing, so the weighted mean is
        the weighted KV bits."""
        if not self.windows:
            return {"cost": lambda item: self.item_cost(item, base)}
        n = self.num_layers
        layer_cost, held = self._layer_cost(base, kv=True)

        def item_cost(c: Candidate, i: int) -> float:
            if i % n not in self._window_layers:
                return self.item_cost(c, base)
            return layer_cost(c, i) if i < n and isinstance(c, PNMixConfig) else 0.0

        keys = [held[i] * (2.0 if i in self._window_layers else 1.0) for i in range(n)]
        values = [0.0 if i in self._window_layers else float(held[i]) for i in range(n)]
        return {"item_cost": item_cost, "weights": keys + values}

    def _knapsack_costs(self, base: PNMixConfig) -> dict[str, Any]:
        """`allocate`'s and `moves`' cost arguments for the keys' knapsack at `base`'s shared fields:
        a candidate's bits under the budget kind; with the windows in it, per layer (`_layer_cost`)
        and each layer weighted by what it holds."""
        if not self.windows:
            return {"cost": lambda c: self._plain.cost(c, self.head_dim)}
        cost, held = self._layer_cost(base, kv=self.space.budget_on == BudgetOn.KV)
        return {"item_cost": cost, "weights": [float(t) for t in held]}

    def _with_exact(self, table: dict[Any, list[float]], base: PNMixConfig) -> dict[Any, list[float]]:
        """The keys' per-layer table with, on a hybrid model, the exact window (`base`'s
        `exact_window`) beside the candidates."""
        if not self.windows:
            return table
        return {**table, exact_window(base): [0.0 if kind != FULL else math.inf for kind in self.plan.kinds]}

    def _items(self, config: AnyConfig) -> list[Candidate]:
        """A config as the knapsack's items (`_config`'s inverse)."""
        lw = as_layerwise(config)
        if self.windows:
            exact = exact_window(self.space.shared_base(config))
            layers = [c if c is not None else exact for c in lw.held_configs(self.plan.kinds)]
        else:
            layers = lw.per_layer(self.num_layers)
        if not self.joint:
            return list(layers)
        return joint_items(layers, ValueFormat(self.space.value_bits, self.space.value_group_size),
                           self._window_layers)

    def _config(self, items: Sequence[Candidate]) -> AnyConfig:
        """The config of the knapsack's items, in its simplest form."""
        return self._layers_config(joint_layers(items, self._window_layers) if self.joint
                                   else list(items))  # type: ignore[arg-type]

    def _layers_config(self, layers: list[PNMixConfig]) -> AnyConfig:
        """The config of the layers' configs. On a hybrid model the windows quantized are listed in
        `windows`, and an exact one takes the quantized layers' most common config (the default),
        so that no range names it."""
        if not self.windows:
            return simplest(LayerwiseConfig.from_layers(layers))
        quantized = [c for c in layers if c.keys_quantized]
        default = max(dict.fromkeys(quantized), key=quantized.count)
        windows = [i for i, (c, kind) in enumerate(zip(layers, self.plan.kinds, strict=True))
                   if kind != FULL and c.keys_quantized]
        return simplest(LayerwiseConfig.from_layers([c if c.keys_quantized else default for c in layers], windows))

    # -- warm starts -----------------------------------------------------------------------------

    def warm_starts(self, budget: float, uniform: Sequence[AnyConfig],
                    limit: int) -> list[tuple[dict, AnyConfig | None]]:
        """(parameters, proposal) of the trials to queue, at most `limit`: first the
        allocations at the `SCREENED` shared-field settings the proxy rates best for the budget
        (`screen`), then each uniform candidate that fits (the presets, the model's stored fronts,
        `fullest_within`; each an allocation whose layers are all alike). A trial's parameters are
        the shared fields; a uniform candidate rides along as its `proposal`."""
        space = self.space
        fits: list[AnyConfig] = []
        for c in uniform:
            cfg = space.recast(c)
            if isinstance(cfg, EngineRecipe):
                continue  # another method's answer
            if space.contains(cfg) and self.cost(cfg) <= budget and cfg not in fits:
                fits.append(cfg)
        queue: list[tuple[PNMixConfig, AnyConfig | None]] = [(b, None) for b in self.screen(budget)[:SCREENED]]
        queue += [(space.shared_base(c), c) for c in fits]
        out: list[tuple[dict, AnyConfig | None]] = []
        seen: set[str] = set()
        for base, proposal in queue:
            params = space.params_of(base)
            frozen = config_key({"params": params, "proposal": proposal.to_dict() if proposal is not None else None})
            if frozen in seen:
                continue
            seen.add(frozen)
            out.append((params, proposal))
            if len(out) >= limit:
                break
        return out

    def screen(self, budget: float) -> list[PNMixConfig]:
        """Shared-field settings (as base configs) ranked by how the proxy rates their allocation at
        `budget`: the summed proxy KL over the layers of the knapsack's choice, least
        first (a setting where nothing fits last). Coordinate-wise, so that it costs a few tables,
        not one per combination: every sink count at the paper's G (128), then every G at the sink
        count that ranked first. Which of a budget's shared fields hold its best allocation is
        what a short sampled search finds or misses by chance (docs/search.md)."""
        paper = self.space.shared_base(self.space.recast(preset("pnmix-paper")))
        rated: dict[PNMixConfig, float] = {}
        for n_sink in self.space.sinks():
            base = paper.with_(n_sink=n_sink)
            rated[base] = self._rating(base, budget)
        first = min(rated, key=lambda b: (rated[b], -b.n_sink))
        for group in GROUP_SIZES:
            base = first.with_(group_size=group)
            if base not in rated:
                rated[base] = self._rating(base, budget)
        return sorted(rated, key=lambda b: (rated[b], -b.group_size, -b.n_sink))

    def _rating(self, base: PNMixConfig, budget: float) -> float:
        """The proxy's figure for the keys' allocation at `base`'s shared fields: its summed KL."""
        table = self.table(base)
        try:
            layers = allocate(table, budget, self.head_dim, **self._knapsack_costs(base))
        except EvalError:
            return math.inf
        return sum(table[c][i] for i, c in enumerate(layers))

    # -- a trial's config ------------------------------------------------------------------------

    def config(self, trial: optuna.Trial, running: RunningTrial, budget: float,
               studies: Sequence[optuna.Study]) -> tuple[AnyConfig, Origin]:
        """The config of a trial whose parameters are the shared fields, and its origin: the queued
        `proposal` (a warm start) where it has these shared fields; else the allocator's config for
        the budget at them (with per-layer values: first the keys' allocation at the space's value
        format, then the joint one); or, when the campaign (`studies`: this budget's first, then the
        others) has already scored or is scoring those, the next local move from the best config
        scored at these shared fields within the budget (real scores decide what the proxy cannot
        tell apart)."""
        space = self.space
        base = space.suggest_shared(trial)
        cfg = running.proposal
        if cfg is not None and not isinstance(cfg, EngineRecipe) and space.contains(cfg) and \
                space.shared_base(cfg) == base:
            return cfg, Origin.PROPOSAL
        allocations = self.allocations(base, budget, running)
        if not allocations:  # not even the cheapest candidate fits: it is proposed, and skipped as over budget
            return min(self.table(base), key=self.cost), Origin.ALLOCATION
        taken = taken_configs(studies)
        for allocation in allocations:
            if config_key(allocation.to_dict()) not in taken:
                return allocation, Origin.ALLOCATION
        best = self.best_scored(studies[0], base, budget)
        start = best if best is not None else allocations[0]
        table: Table = self.joint_table(base) if self.joint else {c: row for c, row in self.table(base).items()}
        costs = self._joint_costs(base) if self.joint else self._knapsack_costs(base)
        for changed in moves(self._items(start), table, budget, lambda item: self.item_cost(item, base),
                             item_cost=costs.get("item_cost"), weights=costs.get("weights")):
            cfg = self._config(changed)
            if config_key(cfg.to_dict()) not in taken:
                return cfg, Origin.MOVE
        return allocations[0], Origin.ALLOCATION  # no move left: the allocation's score is reused

    def allocations(self, base: PNMixConfig, budget: float, running: RunningTrial | None = None) -> list[AnyConfig]:
        """The knapsack's configs for `budget` at `base`'s shared fields, in the order trials take
        them: the keys' allocation over the KL table with the value format every layer shares (the
        space's, or the trial's); with per-layer values, then the joint allocation of each layer's
        keys and values. The keys' allocation comes first because, measured, the joint proxy
        weighs value errors too lightly against key errors: alone it traded value bits for key
        bits that real scores did not repay. Empty when nothing fits."""
        out: list[AnyConfig] = []
        try:
            layers = allocate(self.table(base, running), budget, self.head_dim, **self._knapsack_costs(base))
            out.append(self._layers_config(layers))
        except EvalError:
            pass
        if self.joint:
            joint = self.joint_table(base, running)
            try:
                items = allocate(joint, budget, self.head_dim, **self._joint_costs(base))
                cfg = self._config(items)
                if cfg not in out:
                    out.append(cfg)
            except EvalError:
                pass
        return out

    def table(self, base: PNMixConfig, running: RunningTrial | None = None) -> dict[PNMixConfig, list[float]]:
        """The keys' sensitivity table at `base`'s shared fields: each candidate's proxy KL per
        layer (`Evaluator.sensitivity`, cached on disk per model, profile and seed), with
        `base`'s value format (with per-layer values, `base` holds the space's); computed once per
        loop, the seconds it took recorded on the trial that needed it (`sensitivity_s`)."""
        keys = self._keys_base(base)
        rows = self._computed((keys, "kl"), running, lambda: self._with_exact(
            dict(self.evaluator.sensitivity(candidates_like(keys, self.space))), keys))
        values = {"value_bits": base.value_bits, "value_group_size": base.value_group_size}
        return {c.with_(**values): row for c, row in rows.items()}  # type: ignore[union-attr]

    def joint_table(self, base: PNMixConfig, running: RunningTrial | None = None) -> Table:
        """Per-layer values: the joint table of each key candidate's and each value format's relative
        attention-output error per layer (`tuner.search.layers.joint_table`), computed once per loop."""
        keys = self._keys_base(base)

        def compute() -> Table:
            formats = self.space.value_choices(self.head_dim)
            values = self.evaluator.value_sensitivity(formats, keys)
            outputs = self.evaluator.sensitivity(candidates_like(keys, self.space), measure=ProxyMeasure.OUTPUT)
            return joint_table(outputs, {ValueFormat(*f): row for f, row in values.items()}, self._window_layers,
                               exact_window(base))

        return self._computed((keys, "joint"), running, compute)

    def _keys_base(self, base: PNMixConfig) -> PNMixConfig:
        # The KL proxy sees keys only: one table per key-side shared fields, whatever the value format.
        return base.with_(value_bits=self.space.value_bits, value_group_size=self.space.value_group_size)

    def _computed(self, key: tuple[PNMixConfig, str], running: RunningTrial | None,
                  compute: Callable[[], Any]) -> Any:
        if key not in self.tables:
            started = time.perf_counter()
            self.progress(f"layer sensitivity at {key[0].label} ({key[1]})")
            self.tables[key] = compute()
            seconds = time.perf_counter() - started
            self.sensitivity_seconds += seconds
            if running is not None:
                running.add_sensitivity_seconds(seconds)
        return self.tables[key]

    def next_move(self, study: optuna.Study, budget: float, latest: tuple[AnyConfig, float],
                  n_trials: int) -> tuple[dict, AnyConfig] | None:
        """After a scored trial, with nothing queued and a slot left: the parameters (shared fields)
        of the budget's most accurate config so far (`latest`, the trial just scored, with it), so
        that the next trial is a local move from it rather than an allocation at whatever fields
        the sampler draws; with the config to name as its origin."""
        trials = study.get_trials(deepcopy=False)
        if any(t.state == optuna.trial.TrialState.WAITING for t in trials):
            return None
        if sum(1 for t in trials if record.takes_slot(t)) >= n_trials:
            return None
        _, best = max([(latest[1], latest[0]), *self._scored_within(study, budget)], key=lambda x: x[0])
        return self.space.params_of(self.space.shared_base(best)), best

    def best_scored(self, study: optuna.Study, base: PNMixConfig, budget: float) -> AnyConfig | None:
        """The most accurate config scored in `study` (shared scores included) within `budget` whose
        shared fields are `base`'s."""
        here = [(a, cfg) for a, cfg in self._scored_within(study, budget) if self.space.shared_base(cfg) == base]
        return max(here, key=lambda x: x[0])[1] if here else None

    def _scored_within(self, study: optuna.Study, budget: float) -> list[tuple[float, AnyConfig]]:
        """(accuracy, config) of every config of this space scored in `study` (shared scores
        included) within `budget`, in trial order."""
        out = []
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            r = record.read(t)
            cfg = r.config
            if (r.has_score and r.bits is not None and r.bits <= budget and r.accuracy is not None
                    and isinstance(cfg, (PNMixConfig, LayerwiseConfig)) and self.space.contains(cfg)):
                out.append((r.accuracy, cfg))
        return out


def exact_window(base: PNMixConfig) -> PNMixConfig:
    """The knapsack's candidate for a window kept in the model's dtype: `base` with exact keys (the
    window's values stay exact too: a config's `windows` do not list it)."""
    return base.with_(b_high=UNQUANTIZED_BITS, b_low=UNQUANTIZED_BITS, salient_ratio=0.0)


def taken_configs(studies: Sequence[optuna.Study]) -> set[str]:
    """Configs the campaign's studies have scored, or that a running trial is scoring now."""
    taken: set[str] = set()
    for st in studies:
        taken |= scored_configs(st)
        taken |= {config_key(r.config_dict) for r in map(record.read, running_trials(st)) if r.config_dict is not None}
    return taken
