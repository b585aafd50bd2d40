"""The engine method's allocator: per-layer serving-engine KV formats under an effective-bits budget.

A trial of the `engine` method samples one parameter, its pool (tuner/search/methods.py: the
formats one family of engines loads); `RecipeLoop.config` turns it into the trial's recipe, one of
three kinds (its `origin`), as the PN-Mix allocator does (tuner/search/allocation.py):

- allocation: the recipe of the pool that the proxy likes best within the budget. Each layer's
  (key, value) pair costs its effective bits, weighted by the tokens the layer holds at 32K
  (a sliding-window layer its window), and harms by the proxy's relative attention-output error
  of its keys in the key format plus its values in the value format
  (`tuner.scoring.proxy.proxy_format_table`, every layer, windows included). modelopt: the
  knapsack over layers (`tuner.search.layers.allocate`); vllm: the knapsack once per quantized
  dtype (with bf16 the only other choice), the better kept; llamacpp: every middle type with up
  to `END_LAYERS` first and last layers in another, keys and values apart, the best pair of
  sides that fits.
- move: once the allocation is scored, the next recipe from the most accurate one scored in the
  pool within the budget: modelopt and vllm one layer a step up and another a step down (the
  pool's pairs in order of bits; `tuner.search.layers.moves`, least harm first), llamacpp the next
  recipes of its ranking; real scores decide what the proxy cannot tell apart.
- proposal: a warm start's recipe, queued with the trial (`warm_starts`).

Warm starts of a budget: each pool's allocation, Model-Optimizer's rule (its formats' knapsack
over each layer's forward KL on calibration text, `kl_rule`: scored, so the campaign's best is
never below the rule's recipe), then the fullest uniform recipe that fits (`UNIFORM`: all FP8, FP8
keys + NVFP4 values, all NVFP4, q8_0, q4_0), at most all trials but one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna

from pnmix.bits import LayerPlan
from pnmix.kv_formats import EFFECTIVE_BITS, KVFormat
from pnmix.layerwise import config_key
from pnmix.recipes import EngineRecipe, LayerFormats
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.search import record
from pnmix.tuner.search.allocation import taken_configs
from pnmix.tuner.search.layers import allocate, moves
from pnmix.tuner.search.methods import END_LAYERS, POOLS, UNIFORM, Pool
from pnmix.tuner.search.record import Origin, RunningTrial
from pnmix.tuner.search.space import SearchSpace

Table = dict[LayerFormats, list[float]]  # a layer pair -> its proxy error in every layer
WEIGHT_TOKENS = 32768  # the context at which a layer's share of the elements is taken


def modelopt_rule(kl: Table, budget: float, weights: Sequence[float]) -> EngineRecipe:
    """Model-Optimizer's mixed-precision KV rule: the knapsack over each layer's forward KL per
    format pair (`kl`), each pair costing its effective bits, the layers weighted by `weights`
    (what each holds). Raises EvalError when nothing fits."""
    return EngineRecipe(tuple(allocate(kl, budget, 0, weights=weights, cost=lambda p: p.bits())))


class RecipeLoop:
    """The recipe allocator of one campaign runner (the module docstring)."""

    def __init__(self, space: SearchSpace, evaluator: Scorer, num_layers: int,
                 progress: Callable[[str], None]) -> None:
        self.space, self.evaluator, self.num_layers, self.progress = space, evaluator, num_layers, progress
        self.plan = space.plan or LayerPlan.full(num_layers)
        self.weights = [float(w) for w in self.plan.held(WEIGHT_TOKENS)]
        self.sensitivity_seconds = 0.0
        self._errors: tuple[dict[KVFormat, list[float]], dict[KVFormat, list[float]]] | None = None
        self._kl: Table | None = None  # Model-Optimizer's per-layer forward KL (`kl_rule`)

    # -- the proxy's table -----------------------------------------------------------------------

    def errors(self, running: RunningTrial | None = None) -> tuple[dict[KVFormat, list[float]],
                                                                     dict[KVFormat, list[float]]]:
        """Each format's relative attention-output error per layer, keys and values apart;
        computed once per loop, its seconds recorded on the trial that needed it."""
        if self._errors is None:
            started = time.perf_counter()
            self.progress("layer sensitivity of the engine formats")
            formats = list(dict.fromkeys(f for pool in POOLS.values() for p in pool.pairs for f in (p.key, p.value)))
            self._errors = self.evaluator.format_sensitivity(formats)
            seconds = time.perf_counter() - started
            self.sensitivity_seconds += seconds
            if running is not None:
                running.add_sensitivity_seconds(seconds)
        return self._errors

    def table(self, pairs: Sequence[LayerFormats], running: RunningTrial | None = None) -> Table:
        keys, values = self.errors(running)
        return {p: [k + v for k, v in zip(keys[p.key], values[p.value], strict=True)] for p in pairs}

    def harm(self, recipe: EngineRecipe) -> float:
        """The proxy's summed error of a recipe (what its allocation minimises)."""
        keys, values = self.errors()
        return sum(keys[f.key][i] + values[f.value][i] for i, f in enumerate(recipe.layers))

    def cost(self, recipe: EngineRecipe) -> float:
        """A recipe's effective KV bits, weighted by what each layer holds (the budget's figure)."""
        return recipe.effective_bits(self.space.plan)

    # -- allocations -----------------------------------------------------------------------------

    def ranked(self, pool: Pool, budget: float, running: RunningTrial | None = None) -> list[EngineRecipe]:
        """The pool's recipes within `budget` that the trials take in turn: its allocation first;
        for llamacpp, its next recipes by the proxy after it. Empty when nothing fits."""
        if pool.ends_only:
            return self._ends(pool, budget, running)[:8]
        out: list[EngineRecipe] = []
        dtypes = sorted({p.key for p in pool.pairs if p.key != KVFormat.BF16}) if pool.one_quantized else [None]
        for dtype in dtypes:
            pairs = [p for p in pool.pairs if dtype is None or p.key in (dtype, KVFormat.BF16)]
            try:
                layers = allocate(self.table(pairs, running), budget, 0, weights=self.weights,
                                  cost=lambda p: p.bits())
            except EvalError:
                continue
            out.append(EngineRecipe(tuple(layers)))
        return sorted(out, key=self.harm)

    def _ends(self, pool: Pool, budget: float, running: RunningTrial | None) -> list[EngineRecipe]:
        """llamacpp: every recipe of a middle type and another for the first and the last (up to
        END_LAYERS) layers, keys and values apart, within `budget`, least proxy error first."""
        keys, values = self.errors(running)
        types = sorted({p.key for p in pool.pairs}, key=str)
        n = self.num_layers
        total = sum(self.weights)

        def sides(errors: dict[KVFormat, list[float]]) -> list[tuple[float, float, tuple[KVFormat, ...]]]:
            out: dict[tuple[KVFormat, ...], tuple[float, float]] = {}
            for mid, first, last in itertools.product(types, repeat=3):
                for nf, nl in itertools.product(range(END_LAYERS + 1), repeat=2):
                    if (nf and first == mid) or (nl and last == mid) or nf + nl > n:
                        continue
                    layers = tuple([first] * nf + [mid] * (n - nf - nl) + [last] * nl)
                    bits = sum(w * EFFECTIVE_BITS[f] for w, f in zip(self.weights, layers, strict=True)) / total
                    out[layers] = (bits, sum(errors[f][i] for i, f in enumerate(layers)))
            return [(b, e, layers) for layers, (b, e) in out.items()]

        both = [(ek + ev, (bk + bv) / 2, lk, lv) for (bk, ek, lk), (bv, ev, lv) in
                itertools.product(sides(keys), sides(values)) if (bk + bv) / 2 <= budget + 1e-9]
        both.sort(key=lambda x: (x[0], x[1]))
        return [EngineRecipe(tuple(LayerFormats(k, v) for k, v in zip(lk, lv, strict=True))) for _, _, lk, lv in both]

    def uniform(self, budget: float) -> list[EngineRecipe]:
        """The uniform recipes that fit `budget`, fullest first."""
        fits = [EngineRecipe.uniform(self.num_layers, k, v) for k, v in UNIFORM]
        fits = [r for r in fits if self.cost(r) <= budget + 1e-9]
        return sorted(fits, key=self.cost, reverse=True)

    # -- warm starts -----------------------------------------------------------------------------

    def warm_starts(self, budget: float, uniform: Sequence[Any], limit: int) -> list[tuple[dict, Any]]:
        """(parameters, proposal) of the trials to queue (the module docstring), at most `limit`;
        `uniform`: stored recipes of the model that fit, queued after the fullest uniform recipe."""
        queue: list[tuple[dict, Any]] = [({"pool": name}, None) for name in POOLS]
        stored = [r for r in uniform if isinstance(r, EngineRecipe) and self.space.contains(r)
                  and self.cost(r) <= budget]
        rule = self.kl_rule(budget)
        for recipe in [*([rule] if rule is not None else []), *self.uniform(budget)[:1], *stored]:
            queue.append((self.space.params_of(recipe), recipe))
        out, seen = [], set()
        for params, proposal in queue:
            frozen = config_key({"params": params, "proposal": proposal.to_dict() if proposal is not None else None})
            if frozen not in seen:
                seen.add(frozen)
                out.append((params, proposal))
        return out[:limit]

    def kl_rule(self, budget: float) -> EngineRecipe | None:
        """Model-Optimizer's rule (`modelopt_rule`) over its per-layer forward KL (`Scorer.format_kl`,
        computed once per loop); None when nothing fits."""
        if self._kl is None:
            started = time.perf_counter()
            self.progress("layer forward KL of Model-Optimizer's formats")
            self._kl = self.evaluator.format_kl(list(POOLS["modelopt"].pairs))
            self.sensitivity_seconds += time.perf_counter() - started
        try:
            return modelopt_rule(self._kl, budget, self.weights)
        except EvalError:
            return None

    # -- a trial's recipe ------------------------------------------------------------------------

    def config(self, trial: optuna.Trial, running: RunningTrial, budget: float,
               studies: Sequence[optuna.Study]) -> tuple[EngineRecipe, Origin]:
        """The trial's recipe and its origin (the module docstring); `studies`: the campaign's, the
        trial's own first."""
        pool = POOLS[trial.suggest_categorical("pool", list(POOLS))]
        proposal = running.proposal
        if isinstance(proposal, EngineRecipe) and pool.holds(proposal):
            return proposal, Origin.PROPOSAL
        ranked = self.ranked(pool, budget, running)
        if not ranked:  # nothing of the pool fits: its cheapest is proposed, and skipped as over budget
            return EngineRecipe((pool.pairs[0],) * self.num_layers), Origin.ALLOCATION
        taken = taken_configs(studies)
        if config_key(ranked[0].to_dict()) not in taken:
            return ranked[0], Origin.ALLOCATION
        for recipe in self._moves(pool, studies[0], budget, ranked):
            if config_key(recipe.to_dict()) not in taken:
                return recipe, Origin.MOVE
        return ranked[0], Origin.ALLOCATION  # no move left: the allocation's score is reused

    def _moves(self, pool: Pool, study: optuna.Study, budget: float, ranked: list[EngineRecipe]) -> list[EngineRecipe]:
        if pool.ends_only:
            return ranked[1:]
        start = self.best_scored(study, pool, budget) or ranked[0]
        order = {p: i for i, p in enumerate(pool.pairs)}
        table = self.table(pool.pairs)

        def apart(a: LayerFormats, b: LayerFormats) -> bool:
            return abs(order[a] - order[b]) == 1

        out = []
        for layers in moves(list(start.layers), table, float("inf"), lambda p: p.bits(), apart):
            recipe = EngineRecipe(tuple(layers))
            if pool.holds(recipe) and self.cost(recipe) <= budget + 1e-9:
                out.append(recipe)
        return out

    def best_scored(self, study: optuna.Study, pool: Pool, budget: float) -> EngineRecipe | None:
        """The most accurate recipe of `pool` scored in `study` (shared scores included) within `budget`."""
        best: tuple[float, EngineRecipe] | None = None
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            r = record.read(t)
            cfg = r.config
            if (not r.has_score or r.bits is None or r.bits > budget or r.accuracy is None
                    or not isinstance(cfg, EngineRecipe) or not pool.holds(cfg)):
                continue
            if best is None or r.accuracy > best[0]:
                best = (r.accuracy, cfg)
        return best[1] if best is not None else None
