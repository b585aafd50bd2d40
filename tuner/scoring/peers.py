"""Peers: transformers' own quantized KV caches and the serving engines' KV formats, scored on the
same items as PN-Mix configs.

`pnmix eval --compare fp16,pnmix-paper,hf-quanto-2,...` accepts these names beside the presets:

| name | cache |
| --- | --- |
| `hf-quanto-2`, `hf-quanto-4` | `transformers.QuantizedCache("quanto")`: optimum-quanto, 2 or 4 bits, keys and values |
| `hf-hqq-2`, `hf-hqq-4` | `transformers.QuantizedCache("hqq")`: HQQ, 2 or 4 bits, keys and values |

Both with residual 128 and groups of 64, and transformers' default axes (0 for keys and values).
Engine recipes (`RecipePeer`, named `engine:KEY[/VALUE][+bf16@L.L...]`) store each layer in the
formats a serving engine would (`pnmix.recipe_cache.RecipeCache`; docs/engines.md).

The QuantizedCache peers quantize the whole prompt at prefill, keep up to `residual_length` new tokens in full
precision, and then dequantize the whole cache and quantize it again. With axis 0, quanto's groups
are 64 consecutive channels of one token (per-token groups), so their key bits follow the same
formula as PN-Mix's (`pnmix.bits`): b + 2 x 16 / 64 (an fp16 scale and offset per group; no sinks,
the residual left out). HQQ's axis-0 groups are 64 elements strided across the flattened
[batch, heads, tokens, channels] tensor, neither per token nor per channel, so the formula does
not apply and its key bits are n/a. (HQQ's per-token axis 1 cannot pack 2-bit codes unless
batch x heads x tokens is a multiple of 4, so transformers' default is what runs.)

A peer cannot use the scoring engine's prebuilt PN-Mix caches, so it is scored like the engine's
reference path: every item answered alone through `model.generate` with a fresh peer cache,
every fidelity trajectory teacher-forced one token at a time (a multi-token step through a
`QuantizedCache` attends over its own unquantized keys, which token-by-token decode does not),
the lm-eval part through `pnmix.lm_eval.PNMixLM` with the peer's cache. Bytes: the tensors the
cache holds after the engine's fixed cost workload (512-token prompt + 32 new tokens); tokens/s:
greedy decode through `model(...)` steps on that workload, as the engine times PN-Mix's dynamic
path. Both backends run on the CPU (torch 2.13, transformers 5.24).
"""

from __future__ import annotations

import importlib.util
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pnmix.inputs import shorten
from pnmix.kv_formats import EFFECTIVE_BITS, KVFormat
from pnmix.recipes import EngineRecipe
from pnmix.tuner.errors import EvalError, PeerMissing

if TYPE_CHECKING:
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.score import Score

RESIDUAL_LENGTH = 128
GROUP_SIZE = 64
EXTRA_HINT = "pip install -e '.[peers]'"



@dataclass(frozen=True)
class Peer:
    name: str
    backend: str  # "quanto" or "hqq"
    nbits: int
    package: str  # the import that must succeed
    pip_name: str
    axis: int = 0  # transformers' default for both backends

    @property
    def label(self) -> str:
        what = ("optimum-quanto, per-token groups" if self.backend == "quanto"
                else "HQQ, axis-0 groups strided across the tensor")
        return (f"transformers QuantizedCache ({what} of {GROUP_SIZE}, {self.nbits}-bit keys and values, "
                f"residual {RESIDUAL_LENGTH})")

    def check(self) -> None:
        """One line naming the pip command when the backend's package is missing."""
        try:
            found = importlib.util.find_spec(self.package) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise PeerMissing(f"peer {self.name} needs {self.pip_name}: {EXTRA_HINT}")

    def new_cache(self, model: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(self.backend, model.config, nbits=self.nbits, axis_key=self.axis,
                              axis_value=self.axis, q_group_size=GROUP_SIZE, residual_length=RESIDUAL_LENGTH)

    @property
    def backend_label(self) -> str:
        return f"transformers QuantizedCache ({self.backend})"

    def held_bytes(self, cache: Any) -> int:
        return cache_bytes(cache)

    def versions(self) -> dict[str, str]:
        return package_versions(self.pip_name)

    def key_bits(self, head_dim: int, plan: Any = None) -> float:
        """Key bits by the PN-Mix formula where its groups are per token (quanto), else NaN (n/a)."""
        if self.backend != "quanto" or head_dim % GROUP_SIZE:
            return float("nan")
        return self.nbits + 2 * 16 / GROUP_SIZE

    def to_dict(self) -> dict[str, Any]:
        return {"peer": self.name, "cache": "transformers.QuantizedCache", "backend": self.backend,
                "nbits": self.nbits, "q_group_size": GROUP_SIZE, "residual_length": RESIDUAL_LENGTH,
                "axis_key": self.axis, "axis_value": self.axis}


@dataclass(frozen=True)
class RecipePeer:
    """A serving engine's per-layer KV formats (`pnmix.recipes`), scored like a peer through its
    `RecipeCache`. Named `engine:KEY[/VALUE][+bf16@L.L...]`: every layer's keys in KEY and values in
    VALUE (default KEY), the listed layers in bf16; e.g. `engine:fp8`, `engine:fp8/nvfp4`,
    `engine:fp8+bf16@0.29`."""

    name: str
    key: KVFormat
    value: KVFormat
    bf16_layers: tuple[int, ...] = ()

    @classmethod
    def parse(cls, name: str) -> RecipePeer:
        m = re.fullmatch(r"engine:([\w]+)(?:/([\w]+))?(?:\+bf16@(\d+(?:\.\d+)*))?", name)
        formats = ", ".join(KVFormat)
        if m is None:
            raise EvalError(f"invalid engine recipe {shorten(name)}: expected engine:KEY[/VALUE][+bf16@L.L...] "
                            f"with formats among {formats}")
        try:
            key = KVFormat(m[1])
            value = KVFormat(m[2] or m[1])
        except ValueError:
            raise EvalError(f"invalid engine recipe {shorten(name)}: formats are among {formats}") from None
        layers = tuple(sorted({int(x) for x in m[3].split(".")})) if m[3] else ()
        return cls(name, key, value, layers)

    def recipe(self, num_layers: int) -> EngineRecipe:
        if any(i >= num_layers for i in self.bf16_layers):
            raise EvalError(f"engine recipe {self.name}: the model has layers 0-{num_layers - 1}")
        return EngineRecipe.uniform(num_layers, self.key, self.value).with_layers(
            {i: KVFormat.BF16 for i in self.bf16_layers})

    @property
    def label(self) -> str:
        kept = f", layers {', '.join(map(str, self.bf16_layers))} in bf16" if self.bf16_layers else ""
        return f"engine formats emulated in torch: {self.key} keys, {self.value} values{kept}"

    backend_label = "engine formats emulated (pnmix.recipe_cache)"

    def check(self) -> None:
        pass

    def new_cache(self, model: Any) -> Any:
        from pnmix.recipe_cache import RecipeCache

        return RecipeCache(model.config, self.recipe(model.config.get_text_config(decoder=True).num_hidden_layers))

    def held_bytes(self, cache: Any) -> int:
        """What the engine stores for what the cache holds: each layer's elements at its formats'
        effective bits (the per-tensor scales left out)."""
        return int(sum(layer.keys.numel() * EFFECTIVE_BITS[layer.formats.key]
                       + layer.values.numel() * EFFECTIVE_BITS[layer.formats.value] for layer in cache.layers) / 8)

    def versions(self) -> dict[str, str]:
        return {}

    def key_bits(self, head_dim: int, plan: Any = None) -> float:
        """The keys' effective bits per element, weighted by what each layer holds on a hybrid model."""
        num_layers = len(plan.kinds) if plan is not None else 1
        keys_only = EngineRecipe.of([(f.key, f.key) for f in self.recipe(num_layers).layers])
        return keys_only.effective_bits(plan)

    def kv_bits(self, plan: Any = None) -> float:
        num_layers = len(plan.kinds) if plan is not None else 1
        return self.recipe(num_layers).effective_bits(plan)

    def to_dict(self) -> dict[str, Any]:
        return {"peer": self.name, "cache": "pnmix.recipe_cache.RecipeCache", "key": str(self.key),
                "value": str(self.value), "bf16_layers": list(self.bf16_layers)}


AnyPeer = Peer | RecipePeer


def is_peer(name: str) -> bool:
    return name in PEERS or name.startswith("engine:")


PEERS = {
    "hf-quanto-2": Peer("hf-quanto-2", "quanto", 2, "optimum.quanto", "optimum-quanto"),
    "hf-quanto-4": Peer("hf-quanto-4", "quanto", 4, "optimum.quanto", "optimum-quanto"),
    "hf-hqq-2": Peer("hf-hqq-2", "hqq", 2, "hqq", "hqq"),
    "hf-hqq-4": Peer("hf-hqq-4", "hqq", 4, "hqq", "hqq"),
}


def peer(name: str) -> AnyPeer:
    found: AnyPeer = RecipePeer.parse(name) if name.startswith("engine:") else PEERS[name]
    found.check()
    return found


def held_bytes(obj: Any) -> int:
    """Bytes of the tensors `obj` holds: plain tensors, tensor subclasses (quanto's packed
    tensors, through their inner tensors), and tuples, lists and dicts of them (HQQ's codes and meta)."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = flatten()
            return sum(held_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, tuple | list):
        return sum(held_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(o) for o in obj.values())
    return 0


def cache_bytes(cache: Any) -> int:
    """What a QuantizedCache holds: every layer's quantized keys and values and its residual."""
    return sum(held_bytes(layer._quantized_keys) + held_bytes(layer._quantized_values)
               + held_bytes(layer.keys) + held_bytes(layer.values) for layer in cache.layers)


@torch.inference_mode()
def answer(model: Any, tokenizer: Any, p: AnyPeer, prompt: str, max_new_tokens: int) -> str:
    """Greedy answer to a chat prompt through `model.generate` with a fresh peer cache."""
    from pnmix.generation import cache_kwargs
    from pnmix.models import chat_ids

    ids = chat_ids(tokenizer, prompt)
    input_ids = ids["input_ids"].to(model.device)
    out = model.generate(input_ids=input_ids, attention_mask=ids["attention_mask"].to(model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id,
                         **cache_kwargs(model, p.new_cache(model)))
    return str(tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))


@torch.inference_mode()
def replay(model: Any, p: AnyPeer, prompt_ids: list[int], tokens: torch.Tensor,
           ref_logp: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(p_fp16 || p_peer)) along an fp16 trajectory, one token a step."""
    from pnmix.generation import cache_kwargs

    kw = cache_kwargs(model, p.new_cache(model))
    out = model(input_ids=torch.tensor([prompt_ids], device=model.device), use_cache=True, **kw)
    pieces = [out.logits[0, -1:].float()]
    for t in tokens[:-1].tolist():
        out = model(input_ids=torch.tensor([[t]], device=model.device), use_cache=True, **kw)
        pieces.append(out.logits[0, -1:].float())
    logits = torch.cat(pieces)
    log_q = logits.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - log_q)).sum(-1).clamp_min(0)
    agree = (logits.argmax(-1) == ref_logp.argmax(-1)).float()
    return float(agree.mean()), float(kl.mean())


def measure_cost(model: Any, p: AnyPeer, seed: int = 0) -> tuple[int, float, int | None]:
    """(bytes held, decode tokens/s, peak device bytes) of a peer's cache on the engine's cost
    workload (`tuner.scoring.cost.live_cost`): bytes are what the cache holds (`held_bytes`) once
    COST_NEW_TOKENS - 1 new tokens went in. An emulated engine recipe has no tokens/s of its own
    (the emulation's speed is not the engine's): NaN."""
    from pnmix.tuner.scoring.cost import live_cost

    kv_bytes, tok_s, peak = live_cost(model, lambda: p.new_cache(model), p.held_bytes, seed)
    return kv_bytes, (math.nan if isinstance(p, RecipePeer) else tok_s), peak


def score(evaluator: Evaluator, p: AnyPeer, measure: bool = True) -> Score:
    """A peer's Score on the evaluator's items, trajectories and lm-eval documents (see the module docstring)."""
    from pnmix.tuner.scoring.score import Score, versions

    p.check()
    data = evaluator.prepare()
    engine = evaluator.engine
    model, tokenizer = evaluator.model, evaluator.tokenizer
    start = time.perf_counter()
    counts = evaluator.unit_counts()
    units: dict[str, list[float]] = {}
    timings: dict[str, float] = {}
    items = [name for name in counts if name not in ("fidelity", "lm_eval")]
    if items:
        t0 = time.perf_counter()
        for name in items:
            evaluator.progress(f"{p.name}: {counts[name]} {name} items")
            units[name] = [float(it.is_correct(answer(model, tokenizer, p, it.prompt, it.max_new_tokens)))
                           for it in data["items"][name]]
        timings["items"] = time.perf_counter() - t0
    harness = getattr(evaluator, "harness", None)
    if "lm_eval" in counts and harness is not None:
        t0 = time.perf_counter()
        units["lm_eval"] = harness.outcomes(None, range(counts["lm_eval"]), make_cache=p.new_cache)
        timings["lm_eval"] = time.perf_counter() - t0
    agreements: list[float] = []
    if "fidelity" in counts:
        evaluator.progress(f"{p.name}: long-output fidelity, {counts['fidelity']} trajectories")
        t0 = time.perf_counter()
        pairs = [replay(model, p, prompt, engine.trajectories[i].tokens, engine.trajectories[i].ref_logp)
                 for i, (prompt, _) in enumerate(data["trajectories"])]
        timings["fidelity"] = time.perf_counter() - t0
        agreements = [a for a, _ in pairs]
        units["fidelity"] = [kl for _, kl in pairs]
    cost: tuple[int, float, int | None] = (0, math.nan, None)
    if measure and units:
        evaluator.progress(f"{p.name}: measuring bytes and decode throughput")
        t0 = time.perf_counter()
        cost = measure_cost(model, p, evaluator.seed)
        timings["cost"] = time.perf_counter() - t0
    return Score.from_units(
        units, agreements, timings, cost,
        config=p.to_dict(),
        key_bits=p.key_bits(evaluator.head_dim, evaluator.plan),
        backend=p.backend_label,
        device=evaluator.device_name(),
        versions={**versions(), **p.versions()},
        seconds=time.perf_counter() - start,
        profile=evaluator.profile.name,
    )


def package_versions(pip_name: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {pip_name: version(pip_name)}
    except PackageNotFoundError:
        return {}
