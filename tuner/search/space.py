"""The search space: the one place that says which PN-Mix configs a campaign may try, and what a
config costs against a budget.

Searched: the (b_high, b_low) pair, token group G, salient ratio r, sink count; with
`search_values`, the value bits and value group size too. Fixed per campaign: residual length,
value bits and group (unless searched), saliency criterion. `--method` restricts the space to one
method's own knobs (the paper's Figure 3 protocol; each method's are a typed `Method` in
tuner/search/methods.py), so tuned fronts of PN-Mix, KIVI and a Kitty-like method compare on one
model:
    pnmix:        any 1 <= b_low <= b_high <= 4, G, r in {0.1..0.9} (r = 0 when b_high == b_low), sinks
    kivi:         uniform 1 or 2 bits, G; no salient channels, no sinks
    kitty:        4/2 bits, k_magnitude saliency, G and r; 32 sinks
    pnmix-alloc:  PN-Mix with every layer its own bit pair and r, chosen by the allocator
                  (tuner/search/layers.py) rather than sampled: a trial's parameters are the shared
                  fields only (G, sinks, values when searched), and its per-layer pairs and ratios
                  are the knapsack's over the per-layer sensitivity at those shared fields, or a
                  local move from the best allocation scored so far, or a uniform config (one
                  allocation whose layers are all alike); `groups` holds one layer per group.
                  With values searched (a KV budget), each layer's value format is the
                  allocator's too, not a trial parameter (`values_per_layer`)
    pnmix-layers: PN-Mix with the model's layers in `layer_groups` groups (`groups`, formed by the
                  campaign from layer sensitivity), each group its own bit pair and r; G, sinks and
                  values shared by every layer (pnmix/layerwise.py says why)
    engine:       serving engines' per-layer KV formats (`pnmix.recipes.EngineRecipe`), set by
                  the recipe allocator (tuner/search/recipe_alloc.py) within a sampled pool
                  (`pool`: the formats one family of engines loads, tuner/search/methods.py);
                  under a KV budget only, its figure the effective bits

A budget bounds `budget_on`'s figure (`cost`): the key bits per key element (a layer-wise
config's mean over layers), or the KV bits, keys and values together per cached element
(`pnmix.bits.kv_bits`); on a model with sliding-window layers, either figure weighted by the
elements each layer holds at 32K tokens (`with_plan`, `pnmix.bits.weighted_key_bits`).
Searching values only makes sense under a KV budget: under a key budget they cost nothing and
the most value bits would always win, so the space refuses that pairing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, overload

from pnmix.bits import LayerPlan
from pnmix.config import GROUP_SIZES, PNMixConfig
from pnmix.configs import Answer
from pnmix.kv_formats import EFFECTIVE_BITS
from pnmix.layerwise import LayerwiseConfig, as_layerwise, simplest
from pnmix.names import FULL
from pnmix.recipes import EngineRecipe
from pnmix.storage.vocabulary import BUDGET_ON, LAYER_GROUPS, BudgetOn
from pnmix.tuner.errors import EvalError
from pnmix.tuner.search import steps
from pnmix.tuner.search.axes import RATIOS, SINKS, VALUE_BITS, VALUE_GROUPS
from pnmix.tuner.search.methods import METHODS, POOLS, Method, Shape, pool_of

LAYERED = "pnmix-layers"
ALLOCATED = "pnmix-alloc"
ENGINE = "engine"
DEFAULT_LAYER_GROUPS = 4

AnyConfig = PNMixConfig | LayerwiseConfig


@dataclass(frozen=True)
class SearchSpace:
    method: str = "pnmix"
    residual_len: int = 128
    value_bits: int = 2
    value_group_size: int = 32
    criterion: str = "qk_pair_norm"
    budget_on: str = BudgetOn.KEY  # "key" or "kv": `__post_init__` makes it a BudgetOn
    search_values: bool = False
    layer_groups: int = DEFAULT_LAYER_GROUPS  # pnmix-layers: how many groups of layers
    # pnmix-layers: the layers of each group, most sensitive group first (`with_groups`); a
    # campaign forms them from the model's sensitivity profile before its first trial
    groups: tuple[tuple[int, ...], ...] = ()
    # A model with sliding-window layers: what each layer holds, so that `cost` weighs the layers by
    # their elements (`with_plan`; None on a full-attention model, whose figures need no plan)
    plan: LayerPlan | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise EvalError(f"unknown method {self.method!r}: allowed {', '.join(METHODS)}")
        if self.budget_on not in BUDGET_ON:
            raise EvalError(f"invalid budget_on {self.budget_on!r}: allowed {', '.join(BUDGET_ON)}")
        object.__setattr__(self, "budget_on", BudgetOn(self.budget_on))
        if self.budget_on not in self.kind.budgets:
            raise EvalError(f"the {self.method} method's budgets are on {', '.join(self.kind.budgets)} bits "
                            f"(--budget-on {self.kind.budgets[0]}): its answers' figure is the effective KV bits")
        if self.search_values and self.kind.recipes:
            raise EvalError("the engine method sets every layer's value format already: leave --search-values off")
        if self.search_values and self.budget_on != BudgetOn.KV:
            raise EvalError("searching values needs a KV budget (--budget-on kv): under a key budget values "
                            "cost nothing and the most value bits would always win")
        if not LAYER_GROUPS.contains(self.layer_groups):
            raise EvalError(f"invalid layer_groups={self.layer_groups!r}: {LAYER_GROUPS.allowed}")
        object.__setattr__(self, "groups", tuple(tuple(int(i) for i in g) for g in self.groups))

    @property
    def kind(self) -> Method:
        """The method's knobs and shape (tuner/search/methods.py)."""
        return METHODS[self.method]

    # -- the model's layers in groups (pnmix-layers) ------------------------------------------------

    @property
    def layered(self) -> bool:
        """Whether the space's configs are layer-wise (its `groups` say which layers go together)."""
        return self.kind.layered

    @property
    def allocated(self) -> bool:
        """Whether each layer's formats come from an allocator, not from trial parameters."""
        return self.kind.allocated

    @property
    def recipes(self) -> bool:
        """Whether the space's answers are engine recipes (the engine method)."""
        return self.kind.recipes

    @property
    def values_per_layer(self) -> bool:
        """Whether each layer's value format comes from the allocator (pnmix-alloc with values searched)."""
        return self.allocated and self.search_values

    def with_layers(self, num_layers: int) -> SearchSpace:
        """pnmix-alloc: this space on a model of `num_layers` layers (one group per layer)."""
        return self.with_groups([[i] for i in range(num_layers)])

    def with_groups(self, groups: Sequence[Sequence[int]]) -> SearchSpace:
        """This space with the layer groups of a model (every layer in exactly one group)."""
        layers = sorted(i for g in groups for i in g)
        if layers != list(range(len(layers))) or any(not g for g in groups):
            raise EvalError(f"invalid layer groups {list(map(list, groups))}: non-empty groups that hold each "
                            "layer 0..L-1 once")
        return replace(self, groups=tuple(tuple(g) for g in groups))

    def with_plan(self, plan: LayerPlan) -> SearchSpace:
        """This space on a model whose layers hold what `plan` says (kept only for hybrid models)."""
        return replace(self, plan=plan if plan.hybrid else None)

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.groups) if self.groups else 1

    def _need_groups(self) -> None:
        if self.layered and not self.groups:
            raise EvalError("the pnmix-layers space has no layer groups yet (the campaign forms them from the "
                            "model's sensitivity profile)")

    # -- what a config costs -------------------------------------------------------------------------

    def cost(self, config: Answer, head_dim: int) -> float:
        """The figure a budget bounds: key bits (layers' mean) or KV bits, metadata included; on a
        hybrid model (`plan`), weighted by the elements each layer holds, an exact window at 16 bits. An
        engine recipe's: its effective KV bits, weighted alike (its windows in their formats)."""
        from pnmix.bits import kv_bits, mean_key_bits, weighted_key_bits, weighted_kv_bits

        if isinstance(config, EngineRecipe):
            return config.effective_bits(self.plan)
        if self.plan is not None:
            weighted = weighted_kv_bits if self.budget_on == BudgetOn.KV else weighted_key_bits
            return weighted(config, self.plan, head_dim)
        layers = self.num_layers if isinstance(config, LayerwiseConfig) else 1
        if self.budget_on == BudgetOn.KV:
            return kv_bits(config, layers, head_dim)
        return mean_key_bits(config, layers, head_dim)

    # -- the knobs ---------------------------------------------------------------------------------

    def bit_pairs(self) -> list[str]:
        return list(self.kind.pairs)

    def sinks(self) -> list[int]:
        return list(self.kind.sinks)

    def ratios(self, hi: int, lo: int) -> list[float]:
        return list(RATIOS) if self.kind.ratios and hi > lo else [0.0]

    def pools(self) -> list[str]:
        """The engine method: the pools a trial samples (tuner/search/methods.py)."""
        return list(POOLS) if self.recipes else []

    def value_choices(self, head_dim: int) -> list[tuple[int, int]]:
        """(value bits, value group size) pairs the space may take on a model of `head_dim`."""
        if not self.search_values:
            return [(self.value_bits, self.value_group_size)]
        return [(b, g) for b in VALUE_BITS for g in VALUE_GROUPS if head_dim % g == 0]

    def value_cost(self, values: tuple[int, int]) -> float:
        """Bits per value element of a (value bits, value group size) format (`pnmix.bits.value_bits`)."""
        from pnmix.bits import value_bits

        return value_bits(self.config(1, 1, max(GROUP_SIZES), 0.0, 0, *values))

    def suggest(self, trial: Any, pairs: list[str] | None = None, head_dim: int = 128) -> AnyConfig:
        """Samples a config from an Optuna trial (static categorical choices, so TPE models them);
        `pairs`: the bit pairs to choose from (default: all of the method's). pnmix-layers: one pair
        and ratio per group ("bits_0", "salient_ratio_0", ...), G and sinks shared."""
        # Parameter order as the uniform space always drew them: a seed reproduces its campaigns.
        if self.allocated:
            return self.suggest_shared(trial)
        if not self.layered:
            hi, lo = (int(x) for x in trial.suggest_categorical("bits", pairs or self.bit_pairs()).split("/"))
        group = trial.suggest_categorical("group_size", list(GROUP_SIZES))
        if not self.layered:
            ratios = self.ratios(hi, lo)
            ratio = float(trial.suggest_categorical("salient_ratio", ratios)) if len(ratios) > 1 else ratios[0]
        sinks = int(trial.suggest_categorical("n_sink", list(SINKS))) if len(self.sinks()) > 1 else self.sinks()[0]
        values: dict[str, int] = {}
        if self.search_values:
            groups = sorted({g for _, g in self.value_choices(head_dim)})
            values = {"value_bits": int(trial.suggest_categorical("value_bits", list(VALUE_BITS))),
                      "value_group_size": int(trial.suggest_categorical("value_group_size", groups))}
        if not self.layered:
            return self.config(hi, lo, group, ratio, sinks, **values)
        self._need_groups()
        per_group = []
        for k in range(len(self.groups)):
            hi, lo = (int(x) for x in trial.suggest_categorical(f"bits_{k}", self.bit_pairs()).split("/"))
            ratio = float(trial.suggest_categorical(f"salient_ratio_{k}", list(RATIOS))) if hi > lo else 0.0
            per_group.append(self.config(hi, lo, group, ratio, sinks, **values))
        return self.layerwise(per_group)

    def suggest_shared(self, trial: Any) -> PNMixConfig:
        """pnmix-alloc: the shared fields a trial samples (G, sinks), as the base config whose bits
        and ratio (and, with values searched, value format) the allocator then sets layer by layer
        (the base holds the paper's 3/1 r0.5 and the space's value format, which the allocator's
        candidates replace)."""
        group = trial.suggest_categorical("group_size", list(GROUP_SIZES))
        sinks = int(trial.suggest_categorical("n_sink", list(SINKS)))
        return self.config(3, 1, group, 0.5, sinks)

    def shared_base(self, config: AnyConfig) -> PNMixConfig:
        """The base config of `config`'s shared fields (what `suggest_shared` returns for them)."""
        base = as_layerwise(config).default.with_(b_high=3, b_low=1, salient_ratio=0.5)
        if self.values_per_layer:
            return base.with_(value_bits=self.value_bits, value_group_size=self.value_group_size)
        return base

    def layerwise(self, per_group: Sequence[PNMixConfig], windows: Sequence[int] = ()) -> AnyConfig:
        """The config whose group k's layers take `per_group[k]` (and whose `windows` are quantized),
        in its simplest form."""
        layers: list[PNMixConfig] = [per_group[0]] * self.num_layers
        for g, cfg in zip(self.groups, per_group, strict=True):
            for i in g:
                layers[i] = cfg
        return simplest(LayerwiseConfig.from_layers(layers, windows))

    def per_group(self, config: AnyConfig) -> list[PNMixConfig]:
        lw = as_layerwise(config)
        return [lw.for_layer(g[0]) for g in self.groups]

    def configs(self) -> list[PNMixConfig]:
        """Every uniform config of the space with its fixed values, each once: bit pair, then G, then
        r, then sinks (the ground truth a sweep scores)."""
        out: list[PNMixConfig] = []
        for pair in self.bit_pairs():
            hi, lo = (int(x) for x in pair.split("/"))
            for group in GROUP_SIZES:
                out.extend(self.config(hi, lo, group, r, s) for r in self.ratios(hi, lo) for s in self.sinks())
        return out

    def residual(self, group: int) -> int:
        """The space's residual length for token group `group`: at least one group, a whole number of them."""
        residual = max(self.residual_len, group)
        return residual - residual % group

    def config(self, b_high: int, b_low: int, group: int, ratio: float, sinks: int,
               value_bits: int | None = None, value_group_size: int | None = None) -> PNMixConfig:
        criterion = self.kind.criterion or self.criterion
        return PNMixConfig(b_high=b_high, b_low=b_low, group_size=group, salient_ratio=ratio, n_sink=sinks,
                           residual_len=self.residual(group),
                           value_bits=self.value_bits if value_bits is None else value_bits,
                           value_group_size=self.value_group_size if value_group_size is None else value_group_size,
                           criterion=criterion)

    @overload
    def recast(self, config: EngineRecipe) -> EngineRecipe: ...

    @overload
    def recast(self, config: AnyConfig) -> AnyConfig: ...

    def recast(self, config: Answer) -> Answer:
        """`config`'s searched knobs in this space's fixed fields (residual, criterion, values unless
        searched): how a preset or another campaign's point enters this space (a recipe as it is)."""
        if isinstance(config, EngineRecipe):
            return config

        def one(c: PNMixConfig) -> PNMixConfig:
            values = {"value_bits": c.value_bits, "value_group_size": c.value_group_size} if self.search_values else {}
            return self.config(c.b_high, c.b_low, c.group_size, c.salient_ratio, c.n_sink, **values)

        if isinstance(config, PNMixConfig):
            return one(config)
        return simplest(LayerwiseConfig.from_layers([one(c) for c in config.per_layer(self.num_layers)],
                                                    config.windows))

    def params_of(self, config: Answer) -> dict[str, Any]:
        """The trial parameters that reproduce `config` (for enqueueing warm starts and neighbours)."""
        if isinstance(config, EngineRecipe):
            pool = pool_of(config)
            return {"pool": pool.name if pool is not None else next(iter(POOLS))}
        first = as_layerwise(config).default
        params: dict[str, Any] = {"group_size": first.group_size}
        if len(self.sinks()) > 1:
            params["n_sink"] = first.n_sink
        if self.search_values and not self.values_per_layer:
            params["value_bits"], params["value_group_size"] = first.value_bits, first.value_group_size
        if self.allocated:
            return params
        if not self.layered:
            params["bits"] = f"{first.b_high}/{first.b_low}"
            if len(self.ratios(first.b_high, first.b_low)) > 1:
                params["salient_ratio"] = first.salient_ratio
            return params
        for k, c in enumerate(self.per_group(config)):
            params[f"bits_{k}"] = f"{c.b_high}/{c.b_low}"
            if c.b_high > c.b_low:
                params[f"salient_ratio_{k}"] = c.salient_ratio
        return params

    def fullest_within(self, budget: float, head_dim: int) -> list[PNMixConfig]:
        """Per bit pair, the config that spends the budget on what buys accuracy (tuner/search/steps.py)."""
        return steps.fullest_within(self, budget, head_dim) if self.bit_pairs() else []

    def neighbours(self, config: Answer, head_dim: int | None = None) -> list[AnyConfig]:
        """The configs of the space one step from `config` on one searched knob (tuner/search/steps.py);
        none of a recipe (the recipe allocator makes its own moves)."""
        if isinstance(config, EngineRecipe):
            return []
        return steps.neighbours(self, config, head_dim)

    def contains(self, config: Answer) -> bool:
        if isinstance(config, EngineRecipe) or self.recipes:
            return (isinstance(config, EngineRecipe) and self.recipes and config.num_layers == self.num_layers
                    and pool_of(config) is not None)
        if isinstance(config, LayerwiseConfig) and not self.layered:
            return False
        per_group = self.per_group(config) if self.layered else [config]
        windows = as_layerwise(config).windows
        if windows and not (self.allocated and self.plan is not None and
                            all(self.plan.kinds[i] != FULL for i in windows if i < len(self.plan.kinds))):
            return False  # quantized windows: the allocator's, on a model that has them
        if self.layered and self.layerwise(per_group, windows) != simplest(config):  # type: ignore[arg-type]
            return False  # layers of one group differ
        return all(self._contains_one(c) for c in per_group)  # type: ignore[arg-type]

    def _contains_one(self, config: PNMixConfig) -> bool:
        if f"{config.b_high}/{config.b_low}" not in self.bit_pairs() or config.group_size not in GROUP_SIZES:
            return False
        if config.salient_ratio not in self.ratios(config.b_high, config.b_low):
            return False
        if self.search_values:
            if config.value_bits not in VALUE_BITS or config.value_group_size not in VALUE_GROUPS:
                return False
        elif (config.value_bits, config.value_group_size) != (self.value_bits, self.value_group_size):
            return False
        return config.n_sink in self.sinks()

    def min_bits(self, head_dim: int) -> float:
        """The budget figure of the cheapest config in the space (below it no budget is feasible)."""
        if self.recipes:
            return min(p.bits() for pool in POOLS.values() for p in pool.pairs)
        return min(self._pair_floor(pair, head_dim) for pair in self.bit_pairs())

    def pairs_within(self, budget: float, head_dim: int) -> list[str]:
        """The bit pairs with at least one config within `budget` (all others are over it whatever G,
        r and sinks are), in the space's order; every pair when none fits. pnmix-layers: every pair
        (a group may spend more than the budget where other groups spend less)."""
        if self.layered:
            return self.bit_pairs()
        pairs = [pair for pair in self.bit_pairs() if self._pair_floor(pair, head_dim) <= budget]
        return pairs or self.bit_pairs()

    def _pair_floor(self, pair: str, head_dim: int) -> float:
        """The cost of a bit pair's cheapest config: the largest group, the smallest salient ratio, no
        sinks (the fewest the method allows), the cheapest values when they are searched."""
        hi, lo = (int(x) for x in pair.split("/"))
        ratio = self.ratios(hi, lo)[0]
        values = min(self.value_choices(head_dim), key=self.value_cost)
        cheapest: AnyConfig = self.config(hi, lo, max(GROUP_SIZES), ratio, min(self.sinks()), *values)
        if self.windows_searched:  # every window quantized too
            cheapest = LayerwiseConfig(cheapest, windows=self.plan.window_layers)  # type: ignore[arg-type,union-attr]
        return self.cost(cheapest, head_dim)

    @property
    def windows_searched(self) -> bool:
        """Whether the allocator may quantize a hybrid model's windows (`tuner.search.allocation`)."""
        return self.allocated and not self.recipes and self.plan is not None

    # -- records -----------------------------------------------------------------------------------

    def to_options(self) -> dict[str, Any]:
        """The fields a stored campaign keeps to rebuild this space (not the model's layer groups)."""
        return {k: v for k, v in asdict(self).items() if k not in ("groups", "plan")}

    def to_dict(self) -> dict[str, Any]:
        if self.recipes:
            return {"method": self.method, "pools": {name: [f"{p.key}/{p.value}" for p in pool.pairs]
                                                     for name, pool in POOLS.items()},
                    "effective_bits": {str(f): b for f, b in EFFECTIVE_BITS.items()}, "budget_on": str(self.budget_on)}
        out: dict[str, Any] = {"method": self.method, "bits": self.bit_pairs(), "group_size": list(GROUP_SIZES),
               "salient_ratio": list(RATIOS) if self.kind.ratios else [], "n_sink": self.sinks(),
               "residual_len": self.residual_len,
               "value_bits": list(VALUE_BITS) if self.search_values else self.value_bits,
               "value_group_size": list(VALUE_GROUPS) if self.search_values else self.value_group_size,
               "criterion": self.kind.criterion or self.criterion}
        if self.budget_on != BudgetOn.KEY:  # only where it differs: a sweep file's header holds this dict
            out["budget_on"] = str(self.budget_on)
        if self.kind.shape == Shape.GROUPED:
            out["layer_groups"] = self.layer_groups
            if self.groups:
                out["groups"] = [list(g) for g in self.groups]
        return out
