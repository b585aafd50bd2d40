"""The methods a campaign tunes, as typed objects: what each searches and what it answers with.

A `Method` says which knobs its trials sample (bit pairs, sinks, salient ratios, a fixed saliency
criterion), how its configs are formed (`Shape`: sampled for every layer, sampled per group of
layers, or set layer by layer by an allocator), which bit figures its budgets may bound, and what
`pnmix export --format` writes of its answers. `tuner/search/space.py` reads its knobs from here,
so no module compares method names.

Every answer, of any method, has one bit formula and one cache (`pnmix.configs`): a PN-Mix
config's key and KV bits from `pnmix.bits` and its `PNMixCache`; an engine recipe's effective
bits (Model-Optimizer's `kv_effective_bits`) and its `pnmix.recipe_cache.RecipeCache`, so the
methods' fronts lie on one KV-bits axis.

The engine method (`engine`) answers with engine recipes (`pnmix.recipes.EngineRecipe`): each
layer's (key format, value format) among those a family of serving engines loads, a `Pool`:

    modelopt:  per layer bf16, FP8, FP8 keys + NVFP4 values, or NVFP4 (Model-Optimizer's
               mixed-precision KV config; TensorRT-LLM and SGLang load those without the FP8/NVFP4 pair)
    vllm:      one quantized dtype (FP8 or NVFP4) and layers left in bf16: vLLM's
               --kv-cache-dtype with --kv-cache-dtype-skip-layers
    llamacpp:  keys and values each a llama.cpp cache type (bf16, q8_0, q4_0) for the middle layers
               and one other type for up to `END_LAYERS` first and last layers: ik_llama.cpp's
               --cache-type-k-first/-last and their value twins
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pnmix.kv_formats import KVFormat
from pnmix.recipes import ENGINES, EngineRecipe, LayerFormats, expresses
from pnmix.storage.vocabulary import METHODS as METHOD_NAMES
from pnmix.storage.vocabulary import BudgetOn
from pnmix.tuner.search.axes import SINKS

ALL_PAIRS = tuple(f"{hi}/{lo}" for lo in range(1, 5) for hi in range(lo, 5))
END_LAYERS = 4  # llamacpp: the most first (and last) layers that take the other cache type


class Shape(StrEnum):
    """How a method's configs are formed."""

    UNIFORM = "uniform"  # one config for every layer, its knobs sampled
    GROUPED = "grouped"  # one config per group of layers, each group's knobs sampled
    ALLOCATED = "allocated"  # each layer's bits and ratio set by the allocator at sampled shared fields
    RECIPES = "recipes"  # each layer's engine formats set by the allocator within a sampled pool


@dataclass(frozen=True)
class Pool:
    """The per-layer (key, value) formats one family of engines loads (the module docstring)."""

    name: str
    pairs: tuple[LayerFormats, ...]  # what a layer may take, cheapest first
    one_quantized: bool = False  # vllm: every quantized layer in one dtype
    ends_only: bool = False  # llamacpp: a middle type, and another for the first and last layers

    def holds(self, recipe: EngineRecipe) -> bool:
        """Whether `recipe` is one of this pool's."""
        if any(f not in self.pairs for f in recipe.layers):
            return False
        if self.one_quantized:
            return len({f for f in recipe.layers if f.key != KVFormat.BF16}) <= 1
        if self.ends_only:
            return expresses(recipe, "llamacpp")
        return True


def _pairs(*names: str) -> tuple[LayerFormats, ...]:
    out = []
    for name in names:
        key, _, value = name.partition("/")
        out.append(LayerFormats(KVFormat(key), KVFormat(value or key)))
    return tuple(out)


GGUF = ("q4_0", "q8_0", "bf16")
POOLS = {
    "modelopt": Pool("modelopt", _pairs("nvfp4", "fp8/nvfp4", "fp8", "bf16")),
    "vllm": Pool("vllm", _pairs("nvfp4", "fp8", "bf16"), one_quantized=True),
    "llamacpp": Pool("llamacpp", _pairs(*(f"{k}/{v}" for k in GGUF for v in GGUF)), ends_only=True),
}
# The uniform recipes every engine of a pool loads: the baselines a tuned recipe must beat.
UNIFORM = (("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8", "nvfp4"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))


def pool_of(recipe: EngineRecipe) -> Pool | None:
    """The first pool that holds `recipe` (None: no engine family loads it)."""
    return next((p for p in POOLS.values() if p.holds(recipe)), None)


@dataclass(frozen=True)
class Method:
    name: str
    shape: Shape
    pairs: tuple[str, ...] = ALL_PAIRS  # (b_high, b_low) pairs its configs take
    sinks: tuple[int, ...] = SINKS
    ratios: bool = True  # whether a mixed pair's salient ratio is searched (else 0)
    criterion: str | None = None  # a fixed saliency criterion (else the space's)
    budgets: tuple[BudgetOn, ...] = (BudgetOn.KEY, BudgetOn.KV)  # the figures its budgets may bound
    exports: tuple[str, ...] = ("json",)  # what `pnmix export --format` writes of its answers

    @property
    def layered(self) -> bool:
        """Whether its configs are layer-wise (one entry per layer group)."""
        return self.shape in (Shape.GROUPED, Shape.ALLOCATED, Shape.RECIPES)

    @property
    def allocated(self) -> bool:
        """Whether an allocator sets each layer, not trial parameters."""
        return self.shape in (Shape.ALLOCATED, Shape.RECIPES)

    @property
    def recipes(self) -> bool:
        """Whether it answers with engine recipes rather than PN-Mix configs."""
        return self.shape == Shape.RECIPES


METHODS = {m.name: m for m in (
    Method("pnmix-alloc", Shape.ALLOCATED),
    Method("pnmix", Shape.UNIFORM),
    Method("kivi", Shape.UNIFORM, pairs=("1/1", "2/2"), sinks=(0,), ratios=False),
    Method("kitty", Shape.UNIFORM, pairs=("4/2",), sinks=(32,), criterion="k_magnitude"),
    Method("pnmix-layers", Shape.GROUPED),
    Method("engine", Shape.RECIPES, pairs=(), sinks=(0,), ratios=False, budgets=(BudgetOn.KV,),
           exports=("json", *ENGINES)),
)}
assert tuple(METHODS) == METHOD_NAMES, "storage.vocabulary.METHODS names the methods, in this order"
