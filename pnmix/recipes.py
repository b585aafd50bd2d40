"""Engine recipes: a KV-cache format per layer, for keys and values, in the serving engines' own syntax.

An `EngineRecipe` says what each layer of a model stores (`pnmix/kv_formats.py`: bf16, FP8, NVFP4,
llama.cpp's q8_0 and q4_0), keys and values separately. Its budget figure is the effective KV bits
per element (`effective_bits`), Model-Optimizer's `kv_effective_bits`, weighted on a hybrid model
by the tokens each layer holds, as PN-Mix's weighted bits are (`pnmix.bits.LayerPlan`).

`export(recipe, engine)` writes it as each engine loads it, and `parse(text, engine)` reads that
back (the round trip the tests check); a recipe an engine cannot express is refused in one line
that says why (`RecipeError`):

- `vllm`: `--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 1 23`. One quantized dtype (`fp8` or
  `nvfp4`, keys and values alike) and a list of layers left in the model's dtype
  (`CacheConfig.cache_dtype` and `kv_cache_dtype_skip_layers` in vLLM's `vllm/config/cache.py`).
- `modelopt`: Model-Optimizer's mixed-precision KV checkpoint config, `{"kv_cache_quant_algo":
  "MIXED_PRECISION", "kv_cache_quantized_layers": {"model.layers.0.self_attn": {"quant_algo":
  "FP8"}, ...}, "kv_cache_schema_version": 1}` with `FP8`, `NVFP4` or `FP8_K_NVFP4_V` per layer; a
  layer it does not list stays unquantized (`convert_hf_quant_config_format` in Model-Optimizer's
  `modelopt/torch/export/convert_hf_config.py` keeps the map as written).
- `trtllm`: TensorRT-LLM's `KvCacheConfig.dtype` per-layer string, `"0-3:fp8,4-35:nvfp4"`, ranges of
  layers with one dtype each (`bf16`, `fp8`, `nvfp4`), keys and values alike.
- `sglang`: `--kv-cache-dtype fp8_e4m3 --kv-cache-per-layer-dtype 0-1:bf16,22-23:bf16`: a base dtype
  (`fp8_e4m3`, `fp4_e2m1`, `bf16`) and ranges that override it, keys and values alike.
- `llamacpp`: ik_llama.cpp's `-ctk TYPE -ctv TYPE` with `--cache-type-k-first TYPE,N`,
  `--cache-type-k-last TYPE,N` and their value twins: keys and values each a middle type and at
  most one other type for the first and one for the last layers, from llama.cpp's cache types
  (`bf16`, `q8_0`, `q4_0`; no FP8 or NVFP4).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pnmix.bits import LayerPlan
from pnmix.errors import PNMixError
from pnmix.kv_formats import EFFECTIVE_BITS, GGML_BLOCK, NVFP4_BLOCK, KVFormat

ENGINES = ("vllm", "modelopt", "trtllm", "sglang", "llamacpp")
DEFAULT_TOKENS = 32768  # the context the weighted figure is taken at, as PN-Mix's (`pnmix.bits`)
BLOCKS = {KVFormat.NVFP4: NVFP4_BLOCK, KVFormat.Q8_0: GGML_BLOCK, KVFormat.Q4_0: GGML_BLOCK}  # along head_dim


class RecipeError(PNMixError, ValueError):
    pass


@dataclass(frozen=True)
class LayerFormats:
    key: KVFormat
    value: KVFormat

    def bits(self) -> float:
        """Effective bits per element of the layer's keys and values together."""
        return (EFFECTIVE_BITS[self.key] + EFFECTIVE_BITS[self.value]) / 2


@dataclass(frozen=True)
class EngineRecipe:
    """Each layer's (key format, value format), layer 0 first."""

    layers: tuple[LayerFormats, ...]

    @classmethod
    def uniform(cls, num_layers: int, key: KVFormat | str, value: KVFormat | str | None = None) -> EngineRecipe:
        fmt = LayerFormats(KVFormat(key), KVFormat(value if value is not None else key))
        return cls((fmt,) * num_layers)

    @classmethod
    def of(cls, layers: Sequence[tuple[KVFormat | str, KVFormat | str]]) -> EngineRecipe:
        return cls(tuple(LayerFormats(KVFormat(k), KVFormat(v)) for k, v in layers))

    def effective_bits(self, plan: LayerPlan | None = None, tokens: int = DEFAULT_TOKENS) -> float:
        """Effective KV bits per element: each layer's, weighted by the tokens it holds after `tokens`
        (a sliding-window layer holds at most its window); the plain mean without a plan."""
        held = plan.held(tokens) if plan is not None else [1] * len(self.layers)
        if len(held) != len(self.layers):
            raise RecipeError(f"the recipe has {len(self.layers)} layers, the model {len(held)}")
        return sum(h * fmt.bits() for h, fmt in zip(held, self.layers, strict=True)) / sum(held)

    def key_bits(self, plan: LayerPlan | None = None, tokens: int = DEFAULT_TOKENS) -> float:
        """The keys' effective bits per key element, weighted as `effective_bits`."""
        return EngineRecipe.of([(f.key, f.key) for f in self.layers]).effective_bits(plan, tokens)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def label(self) -> str:
        """Each run of layers with one (key, value) format in one short line: "fp8 L0-1 bf16" (the
        most common format first, then the layers that differ), "fp8/nvfp4" for fp8 keys and nvfp4 values."""
        def name(f: LayerFormats) -> str:
            return str(f.key) if f.key == f.value else f"{f.key}/{f.value}"

        common = max(dict.fromkeys(self.layers), key=list(self.layers).count)
        rest = [f"L{a}" + (f"-{b}" if b != a else "") + f" {name(f)}" for a, b, f in _runs(self.layers) if f != common]
        return " ".join([name(common), *rest])

    def check_head_dim(self, head_dim: int) -> None:
        """Checks what depends on the model: a head_dim that every block format's block divides."""
        for fmt in dict.fromkeys(f for layer in self.layers for f in (layer.key, layer.value)):
            block = BLOCKS.get(fmt)
            if block and head_dim % block:
                raise RecipeError(f"{fmt} stores blocks of {block} along head_dim; this model's head_dim is {head_dim}")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def with_layers(self, changes: dict[int, KVFormat | tuple[KVFormat, KVFormat]]) -> EngineRecipe:
        """The recipe with the layers of `changes` replaced (a format for keys and values, or a pair)."""
        layers = list(self.layers)
        for i, f in changes.items():
            key, value = f if isinstance(f, tuple) else (f, f)
            layers[i] = LayerFormats(KVFormat(key), KVFormat(value))
        return EngineRecipe(tuple(layers))

    def to_dict(self) -> dict[str, Any]:
        return {"layers": [[str(f.key), str(f.value)] for f in self.layers]}

    @classmethod
    def from_dict(cls, data: Any) -> EngineRecipe:
        try:
            return cls.of([(k, v) for k, v in data["layers"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise RecipeError(f"not an engine recipe ({exc}): expected {{\"layers\": [[KEY, VALUE], ...]}} "
                              f"with formats among {', '.join(KVFormat)}") from None


# -- helpers -------------------------------------------------------------------------------------


def _runs(values: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """(first, last, value) of each run of equal consecutive values."""
    out: list[tuple[int, int, Any]] = []
    for i, v in enumerate(values):
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], i, v)
        else:
            out.append((i, i, v))
    return out


def _ranges_text(runs: Sequence[tuple[int, int, str]]) -> str:
    return ",".join(f"{a}-{b}:{v}" if a != b else f"{a}:{v}" for a, b, v in runs)


def _parse_ranges(text: str, num_layers: int) -> dict[int, str]:
    out: dict[int, str] = {}
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?:([\w]+)", part.strip())
        if m is None:
            raise RecipeError(f"invalid layer range {part!r}: expected FIRST-LAST:DTYPE or LAYER:DTYPE")
        first, last = int(m[1]), int(m[2] or m[1])
        if not 0 <= first <= last < num_layers:
            raise RecipeError(f"layer range {part!r} is outside the model's layers 0-{num_layers - 1}")
        out.update({i: m[3] for i in range(first, last + 1)})
    return out


def _same_kv(recipe: EngineRecipe, engine: str) -> list[KVFormat]:
    """Each layer's one format, where keys and values share it (these engines take one dtype a layer)."""
    mixed = [i for i, f in enumerate(recipe.layers) if f.key != f.value]
    if mixed:
        raise RecipeError(f"{engine} stores a layer's keys and values in one dtype; layer {mixed[0]} has "
                          f"{recipe.layers[mixed[0]].key} keys and {recipe.layers[mixed[0]].value} values")
    return [f.key for f in recipe.layers]


def _names(engine: str, names: dict[KVFormat, str], formats: Sequence[KVFormat]) -> list[str]:
    missing = [f for f in dict.fromkeys(formats) if f not in names]
    if missing:
        raise RecipeError(f"{engine} has no KV-cache dtype for {missing[0]}: it stores "
                          f"{', '.join(str(f) for f in names)}")
    return [names[f] for f in formats]


# -- vLLM ----------------------------------------------------------------------------------------

VLLM = {KVFormat.BF16: "auto", KVFormat.FP8: "fp8", KVFormat.NVFP4: "nvfp4"}


def _vllm(recipe: EngineRecipe) -> str:
    formats = _same_kv(recipe, "vllm")
    _names("vllm", VLLM, formats)
    quantized = sorted({f for f in formats if f != KVFormat.BF16})
    if len(quantized) > 1:
        raise RecipeError(f"vllm takes one quantized KV dtype and a list of bf16 layers; this recipe has "
                          f"{' and '.join(quantized)} layers (use --format modelopt or trtllm)")
    if not quantized:
        return "--kv-cache-dtype auto"
    skip = [str(i) for i, f in enumerate(formats) if f == KVFormat.BF16]
    line = f"--kv-cache-dtype {VLLM[quantized[0]]}"
    return line + (f" --kv-cache-dtype-skip-layers {' '.join(skip)}" if skip else "")


def _parse_vllm(text: str, num_layers: int) -> EngineRecipe:
    words = shlex.split(text)
    dtype, skip, i = "auto", [], 0
    while i < len(words):
        if words[i] == "--kv-cache-dtype":
            dtype, i = words[i + 1], i + 2
        elif words[i] == "--kv-cache-dtype-skip-layers":
            i += 1
            while i < len(words) and not words[i].startswith("--"):
                skip.append(words[i])
                i += 1
        else:
            raise RecipeError(f"unexpected vllm argument {words[i]!r}")
    by_name = {v: k for k, v in VLLM.items()} | {"fp8_e4m3": KVFormat.FP8, "bfloat16": KVFormat.BF16}
    if dtype not in by_name:
        raise RecipeError(f"unknown vllm KV dtype {dtype!r}")
    if any(not s.isdigit() or int(s) >= num_layers for s in skip):
        raise RecipeError(f"vllm skip layers must be layer indices below {num_layers}: {skip}")
    fmt = by_name[dtype]
    return EngineRecipe.uniform(num_layers, fmt).with_layers({int(s): KVFormat.BF16 for s in skip})


# -- Model-Optimizer -----------------------------------------------------------------------------

MODELOPT = {(KVFormat.FP8, KVFormat.FP8): "FP8", (KVFormat.NVFP4, KVFormat.NVFP4): "NVFP4",
            (KVFormat.FP8, KVFormat.NVFP4): "FP8_K_NVFP4_V"}


def _modelopt(recipe: EngineRecipe) -> str:
    layers: dict[str, dict[str, str]] = {}
    for i, f in enumerate(recipe.layers):
        if (f.key, f.value) == (KVFormat.BF16, KVFormat.BF16):
            continue  # not listed: unquantized
        algo = MODELOPT.get((f.key, f.value))
        if algo is None:
            raise RecipeError(f"modelopt has no KV algorithm for {f.key} keys with {f.value} values (layer {i}): "
                              f"it has {', '.join(MODELOPT.values())} or bf16")
        layers[f"model.layers.{i}.self_attn"] = {"quant_algo": algo}
    return json.dumps({"kv_cache_quant_algo": "MIXED_PRECISION", "kv_cache_quantized_layers": layers,
                       "kv_cache_schema_version": 1}, indent=2)


def _parse_modelopt(text: str, num_layers: int) -> EngineRecipe:
    data = json.loads(text)
    if data.get("kv_cache_schema_version") != 1:
        raise RecipeError("modelopt config: expected kv_cache_schema_version 1")
    by_algo = {v: k for k, v in MODELOPT.items()}
    layers = {}
    for name, entry in data["kv_cache_quantized_layers"].items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn", name)
        if m is None or int(m[1]) >= num_layers or entry.get("quant_algo") not in by_algo:
            raise RecipeError(f"modelopt config: unexpected layer entry {name!r}: {entry!r}")
        layers[int(m[1])] = by_algo[entry["quant_algo"]]
    return EngineRecipe.of([layers.get(i, (KVFormat.BF16, KVFormat.BF16)) for i in range(num_layers)])


# -- TensorRT-LLM and SGLang ---------------------------------------------------------------------

TRTLLM = {KVFormat.BF16: "bf16", KVFormat.FP8: "fp8", KVFormat.NVFP4: "nvfp4"}
SGLANG = {KVFormat.BF16: "bf16", KVFormat.FP8: "fp8_e4m3", KVFormat.NVFP4: "fp4_e2m1"}


def _trtllm(recipe: EngineRecipe) -> str:
    names = _names("trtllm", TRTLLM, _same_kv(recipe, "trtllm"))
    return _ranges_text(_runs(names))


def _parse_trtllm(text: str, num_layers: int) -> EngineRecipe:
    by_name = {v: k for k, v in TRTLLM.items()}
    layers = _parse_ranges(text.strip().strip('"'), num_layers)
    if sorted(layers) != list(range(num_layers)) or any(v not in by_name for v in layers.values()):
        raise RecipeError(f"trtllm dtype string must give every layer one of {', '.join(by_name)}: {text!r}")
    return EngineRecipe.uniform(num_layers, KVFormat.BF16).with_layers({i: by_name[v] for i, v in layers.items()})


def _sglang(recipe: EngineRecipe) -> str:
    names = _names("sglang", SGLANG, _same_kv(recipe, "sglang"))
    base = max(dict.fromkeys(names), key=names.count)  # the most common dtype; the others override it
    overrides = [run for run in _runs(names) if run[2] != base]
    line = f"--kv-cache-dtype {base}"
    return line + (f" --kv-cache-per-layer-dtype {_ranges_text(overrides)}" if overrides else "")


def _parse_sglang(text: str, num_layers: int) -> EngineRecipe:
    args = dict(zip(*[iter(shlex.split(text))] * 2, strict=True))
    by_name = {v: k for k, v in SGLANG.items()}
    base = args.get("--kv-cache-dtype", "bf16")
    overrides = _parse_ranges(args.get("--kv-cache-per-layer-dtype", ""), num_layers)
    if base not in by_name or any(v not in by_name for v in overrides.values()):
        raise RecipeError(f"sglang KV dtypes must be among {', '.join(by_name)}: {text!r}")
    return EngineRecipe.uniform(num_layers, by_name[base]).with_layers(
        {i: by_name[v] for i, v in overrides.items()})


# -- ik_llama.cpp --------------------------------------------------------------------------------

LLAMACPP = {KVFormat.BF16: "bf16", KVFormat.Q8_0: "q8_0", KVFormat.Q4_0: "q4_0"}


def _ends(names: list[str], side: str) -> tuple[str, tuple[str, int] | None, tuple[str, int] | None]:
    """(middle type, (first type, N) or None, (last type, M) or None) of one side's per-layer types."""
    runs = _runs(names)
    if len(runs) > 3:
        raise RecipeError(f"llamacpp gives the {side} cache a middle type and at most one type for the first "
                          f"and one for the last layers; this recipe's {side} types change {len(runs) - 1} times")
    if len(runs) == 1:
        return runs[0][2], None, None
    if len(runs) == 2:  # a first or a last block: the longer run is the middle
        (a0, a1, av), (b0, b1, bv) = runs
        if a1 - a0 >= b1 - b0:
            return av, None, (bv, b1 - b0 + 1)
        return bv, (av, a1 - a0 + 1), None
    (a0, a1, av), (_, _, mid), (c0, c1, cv) = runs
    return mid, (av, a1 - a0 + 1), (cv, c1 - c0 + 1)


def _llamacpp(recipe: EngineRecipe) -> str:
    words: list[str] = []
    for side, flag, short in (("key", "k", "ctk"), ("value", "v", "ctv")):
        names = _names("llamacpp", LLAMACPP, [getattr(f, side) for f in recipe.layers])
        middle, first, last = _ends(names, side)
        words += [f"-{short}", middle]
        if first is not None:
            words += [f"--cache-type-{flag}-first", f"{first[0]},{first[1]}"]
        if last is not None:
            words += [f"--cache-type-{flag}-last", f"{last[0]},{last[1]}"]
    return " ".join(words)


def _parse_llamacpp(text: str, num_layers: int) -> EngineRecipe:
    args = dict(zip(*[iter(shlex.split(text))] * 2, strict=True))
    by_name = {v: k for k, v in LLAMACPP.items()}
    sides: dict[str, list[KVFormat]] = {}
    for side, flag, short in (("key", "k", "ctk"), ("value", "v", "ctv")):
        types = [args.get(f"-{short}", "f16")] * num_layers
        for where, pick in (("first", lambda n: range(n)), ("last", lambda n: range(num_layers - n, num_layers))):
            entry = args.get(f"--cache-type-{flag}-{where}")
            if entry is not None:
                name, _, count = entry.partition(",")
                for i in pick(int(count)):
                    types[i] = name
        if any(t not in by_name for t in types):
            raise RecipeError(f"llamacpp {side} cache types must be among {', '.join(by_name)}: {text!r}")
        sides[side] = [by_name[t] for t in types]
    return EngineRecipe.of(list(zip(sides["key"], sides["value"], strict=True)))


# -- the entry points ----------------------------------------------------------------------------

_EXPORT = {"vllm": _vllm, "modelopt": _modelopt, "trtllm": _trtllm, "sglang": _sglang, "llamacpp": _llamacpp}
_PARSE = {"vllm": _parse_vllm, "modelopt": _parse_modelopt, "trtllm": _parse_trtllm, "sglang": _parse_sglang,
          "llamacpp": _parse_llamacpp}


def export(recipe: EngineRecipe, engine: str) -> str:
    """The recipe in `engine`'s syntax; RecipeError (one line, why) where the engine cannot express it."""
    if engine not in _EXPORT:
        raise RecipeError(f"unknown engine {engine!r}: allowed {', '.join(ENGINES)}")
    return _EXPORT[engine](recipe)


def parse(text: str, engine: str, num_layers: int) -> EngineRecipe:
    """The recipe that `export(..., engine)` wrote for a model of `num_layers` layers."""
    if engine not in _PARSE:
        raise RecipeError(f"unknown engine {engine!r}: allowed {', '.join(ENGINES)}")
    return _PARSE[engine](text, num_layers)


def expresses(recipe: EngineRecipe, engine: str) -> bool:
    """Whether `engine` can load `recipe` as it is."""
    try:
        export(recipe, engine)
    except RecipeError:
        return False
    return True
