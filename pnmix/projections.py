"""Sibling projections as one GEMM in the compiled decode step.

A decoder layer's query, key and value projections read the same hidden state, and so do its MLP's
gate and up projections. At decode, with a few rows of activations, each is a GEMV bound by reading
its weight, and small GEMVs read their weights slower than one large one: on an H200 at batch 1
(cuBLAS, bf16, qwen3-8b shapes) q + k + v take 30.5 us and one 6144-row GEMM 18.0 us; gate + up
58.9 us and one 24576-row GEMM 49.7 us, 0.78 ms of a 36-layer step.

`fuse_siblings` stores each group's weights (and biases) as rows of one tensor: the model's own
Linear parameters become views of it (same values, same memory, the same eager results), and
returns `SiblingSlice` stand-ins, each running its group's one GEMM and keeping its own columns.
`swapped` puts the stand-ins in place while a compiled step is traced; the model's attention and
MLP code runs unchanged and calls them as its projections. Their calls are identical (same input,
same weight), and `merge_repeated_linears`, run on the traced graph before the compiler's backend
(`with_merged_linears`), keeps one of them (torch's compilers do not merge repeated GEMMs in an
inference graph themselves). Eagerly each stand-in would run the whole GEMM, so only the compiled
step uses them.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# (the decoder layer's submodule, its projections that read the same input), by attribute name:
# the Llama-style naming every supported family shares.
SIBLINGS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class SiblingSlice(torch.nn.Module):
    """Columns [start, stop) of one GEMM over a group's fused weight [sum of out_features, in]."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, start: int, stop: int) -> None:
        super().__init__()
        # One tensor shared by the group's stand-ins: the compiled graph sees one input per group.
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)[..., self.start : self.stop]


@dataclass(frozen=True)
class Swap:
    """Where a stand-in goes: `owner.name` is `original` outside a compiled step, `stand_in` inside."""

    owner: torch.nn.Module
    name: str
    original: torch.nn.Module
    stand_in: SiblingSlice


def _fusable(mods: list[object]) -> list[torch.nn.Linear] | None:
    """`mods` as Linear layers if they can share one weight: plain Linear layers (not a quantized or
    adapter subclass) on one real device, one dtype and one input width, with biases on all or
    none; else None."""
    linears = [m for m in mods if type(m) is torch.nn.Linear]
    if len(linears) != len(mods):
        return None
    first = linears[0].weight
    alike = (first.device.type != "meta"
             and all(m.weight.dtype == first.dtype and m.weight.device == first.device
                     and m.in_features == linears[0].in_features for m in linears)
             and len({m.bias is None for m in linears}) == 1)
    return linears if alike else None


@torch.no_grad()
def fuse_siblings(decoder: Any) -> list[Swap]:
    """Fuses every sibling group of `decoder.layers` (once per decoder; later calls return the same
    swaps). Groups that are not plain Linear layers alike (`_fusable`) stay as they are."""
    done = getattr(decoder, "_pnmix_sibling_swaps", None)
    if done is not None:
        return done
    swaps: list[Swap] = []
    # The fused tensors back the parameters, so they are inference tensors exactly where the
    # parameters are (a model loaded under inference mode); a mix fails at the next forward.
    inference = any(p.is_inference() for p in decoder.parameters())
    with torch.inference_mode(inference):
        for layer in decoder.layers:
            for owner_name, names in SIBLINGS:
                owner = getattr(layer, owner_name, None)
                if owner is None or (linears := _fusable([getattr(owner, n, None) for n in names])) is None:
                    continue
                weight = torch.cat([m.weight for m in linears])
                bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
                start = 0
                for name, m in zip(names, linears, strict=True):
                    stop = start + m.out_features
                    m.weight.data = weight[start:stop]  # a view: the fused tensor holds the memory
                    if bias is not None:
                        m.bias.data = bias[start:stop]
                    swaps.append(Swap(owner, name, m, SiblingSlice(weight, bias, start, stop)))
                    start = stop
    decoder._pnmix_sibling_swaps = swaps  # dies with the model
    return swaps


@contextlib.contextmanager
def swapped(swaps: list[Swap]) -> Iterator[None]:
    """The stand-ins in their owners' places for the duration; the originals back afterwards."""
    for s in swaps:
        setattr(s.owner, s.name, s.stand_in)
    try:
        yield
    finally:
        for s in swaps:
            setattr(s.owner, s.name, s.original)


_LINEAR = (torch._C._nn.linear, F.linear)
# Python's in-place operators as a traced graph calls them (`x += y` is operator.iadd, `x[i] = y`
# operator.setitem).
_IN_PLACE = {getattr(operator, n) for n in ("setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod",
                                             "ipow", "iand", "ior", "ixor", "ilshift", "irshift", "imatmul")}


def _mutates(node: torch.fx.Node) -> bool:
    """Whether a traced call may write a tensor in place (an in-place method or function such as
    `add_`, or an in-place operator): a repeated call past it may not read what the first one read."""
    if node.op not in ("call_method", "call_function"):
        return False
    target = node.target
    if target in _IN_PLACE:
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def merge_repeated_linears(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replaces each repeated `linear(x, weight, bias)` call of a traced graph (the same input
    nodes) by the first, unless a call between them may write in place. In place; returns `gm`."""
    first: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if _mutates(node):
            first.clear()  # what was read before may have changed
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        key = (tuple(node.args), tuple(sorted(node.kwargs.items())))
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
            merged += 1
        else:
            first[key] = node
    if merged:
        gm.graph.lint()
        gm.recompile()
    return gm


def with_merged_linears(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """The torch.compile backend `backend` (a registered name or a backend callable) run on graphs
    whose repeated linear calls are merged (`merge_repeated_linears`)."""
    from torch._dynamo.backends.registry import lookup_backend

    compiler = lookup_backend(backend)

    def compile_merged(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compiler(merge_repeated_linears(gm), example_inputs)

    compile_merged.__name__ = f"{getattr(compiler, '__name__', 'backend')}_merged_linears"
    return compile_merged
