"""Runs the Gluon decode kernels' own source on the CPU with torch (tests only).

Gluon kernels cannot run under TRITON_INTERPRET, and CI has no GPU. A layout only says which thread
holds which element; it changes no value. So executing the kernel function's Python body with the
layouts ignored computes what the GPU computes, program by program: tensors are torch tensors,
pointers are (flat tensor, offsets) pairs, `mma_v2` is a matmul of its fp16 operands added to the
accumulator, rounded toward zero to fp32 (the tensor cores' products are exact, their sums
truncate). What this checks is the kernel's arithmetic and indexing (bit positions, word and
scale offsets, splits, masks, online softmax); what it cannot check is the placement (the
layouts) and Triton's lowering, which the sm_90 compile test and `benchmarks/bench_decode.py` on the GPU cover.

Covers exactly the subset of Gluon that `kernels/gluon/` uses. Each kernel module's jit functions
run with that module's own globals, Gluon's names replaced (`gl`, `mma_v2`, `async_copy`, ...), and
so do the helpers they import from another module (with that module's globals). The helpers it
replaces are the two whose int16 <-> fp16 bitcast has no torch `.to` spelling (`_halves_f16`,
`_low_half_f16`), whose replacements do the same operations with torch's `.view`, and the seven
whose inline PTX it computes with torch (`_pack_halves`, `_byte_perm` and `_byte_perm_by`,
`_value_pairs`, `_mul_pairs`, `_f16_pairs_rounded`: one fp16 rounding per result, as `mul.rn.f16x2`
and `cvt.rn.f16x2.f32`; `_transposed_blocks`: movmatrix's cross-lane transpose, as the logical
tensor sees it).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


class Ptr:
    """A pointer tensor: a flat view of an operand's storage and int64 element offsets into it."""

    def __init__(self, flat: torch.Tensor, off: Any) -> None:
        self.flat = flat
        self.off = off

    def __add__(self, x: Any) -> Ptr:
        return Ptr(self.flat, self.off + (x.to(torch.int64) if isinstance(x, torch.Tensor) else int(x)))

    __radd__ = __add__

    def __getitem__(self, index: Any) -> Ptr:
        return Ptr(self.flat, torch.as_tensor(self.off)[index])


def pointer(t: torch.Tensor) -> Ptr:
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return Ptr(torch.as_strided(t, (n,), (1,)), torch.tensor(0, dtype=torch.int64))


class Smem:
    """A shared-memory descriptor: a torch view (index, reshape and permute give views of it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def index(self, i: Any) -> Smem:
        return Smem(self.t[int(i)])

    def reshape(self, shape: list[int]) -> Smem:
        return Smem(self.t.view(shape))

    def slice(self, start: int, length: int, dim: int = 0) -> Smem:
        return Smem(self.t.narrow(dim, int(start), int(length)))

    def permute(self, order: list[int]) -> Smem:
        return Smem(self.t.permute(*order))

    def reinterpret(self, dtype: torch.dtype, shape: list[int], layout: Any) -> Smem:
        return Smem(self.t.view(dtype).view(shape))

    _reinterpret = reinterpret  # Triton 3.6's name

    def load(self, layout: Any) -> torch.Tensor:
        return self.t.clone()

    def store(self, value: torch.Tensor) -> None:
        self.t.copy_(value)


class FakeAsyncCopy:
    """`async_copy` of the kernel: the copy happens at once, so waits and commits are no-ops; a
    masked-off element is left as it was (as on the GPU, where it is not written)."""

    @staticmethod
    def async_copy_global_to_shared(smem: Smem, ptr: Ptr, mask: Any = None) -> None:
        off = _tensor(ptr.off)
        keep = torch.ones_like(off, dtype=torch.bool) if mask is None else torch.broadcast_to(_tensor(mask), off.shape)
        if keep.any():
            smem.t[keep] = ptr.flat[off[keep]].to(smem.t.dtype)

    @staticmethod
    def commit_group() -> None:
        pass

    @staticmethod
    def wait_group(n: int = 0) -> None:
        pass


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


class FakeGluon:
    """The `gl` namespace of the kernel, on torch."""

    int16, int32, int64 = torch.int16, torch.int32, torch.int64
    float16, float32 = torch.float16, torch.float32

    def __init__(self) -> None:
        self.pid = (0, 0)

    @staticmethod
    def _layout(*args: Any, **kwargs: Any) -> None:
        return None

    SliceLayout = DotOperandLayout = NVMMADistributedLayout = DistributedLinearLayout = BlockedLayout = _layout

    @staticmethod
    def allocate_shared_memory(dtype: torch.dtype, shape: list[int], layout: Any, value: Any = None) -> Smem:
        """Filled with `value`, or with garbage (NaN floats, random ints), so that reading a slot no
        copy wrote fails."""
        if value is not None:
            return Smem(value.to(dtype).reshape(shape).clone())
        if dtype.is_floating_point:
            return Smem(torch.full(shape, float("nan"), dtype=dtype))
        info = torch.iinfo(dtype)
        return Smem(torch.randint(info.min, info.max, shape, dtype=dtype))


    def program_id(self, axis: int) -> torch.Tensor:
        return torch.tensor(self.pid[axis], dtype=torch.int32)

    @staticmethod
    def arange(start: int, end: int, layout: Any = None) -> torch.Tensor:
        return torch.arange(start, end, dtype=torch.int32)

    @staticmethod
    def full(shape: list[int], value: float, dtype: torch.dtype, layout: Any = None) -> torch.Tensor:
        return torch.full(shape, value, dtype=dtype)

    @staticmethod
    def zeros(shape: list[int], dtype: torch.dtype, layout: Any = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    @staticmethod
    def load(ptr: Ptr, mask: Any = None, other: Any = None) -> torch.Tensor:
        off = _tensor(ptr.off)
        if mask is None:
            return ptr.flat[off]
        off, mask = torch.broadcast_tensors(off, _tensor(mask))
        fill = torch.tensor(other if other is not None else 0, dtype=ptr.flat.dtype)
        if not ptr.flat.numel():  # an empty operand (no high planes): every lane is masked off
            assert not mask.any(), "unmasked load from an empty operand"
            return fill.expand(mask.shape).clone()
        return torch.where(mask, ptr.flat[torch.where(mask, off, 0)], fill)

    @staticmethod
    def store(ptr: Ptr, value: torch.Tensor, mask: Any = None) -> None:
        off, value = torch.broadcast_tensors(_tensor(ptr.off), value)
        if mask is not None:
            keep = torch.broadcast_to(_tensor(mask), off.shape)
            off, value = off[keep], value[keep]
        ptr.flat[off.reshape(-1)] = value.reshape(-1).to(ptr.flat.dtype)

    @staticmethod
    def convert_layout(x: torch.Tensor, layout: Any, assert_trivial: bool = False) -> torch.Tensor:
        return x

    @staticmethod
    def reshape(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
        return x.reshape(shape)

    @staticmethod
    def expand_dims(x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.unsqueeze(axis)

    @staticmethod
    def maximum(a: Any, b: Any) -> torch.Tensor:
        return torch.maximum(_tensor(a), _tensor(b))

    @staticmethod
    def minimum(a: Any, b: Any) -> torch.Tensor:
        return torch.minimum(_tensor(a), _tensor(b))

    @staticmethod
    def max(x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.amax(dim=axis)

    @staticmethod
    def sum(x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.sum(dim=axis)

    @staticmethod
    def permute(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
        return x.permute(*dims)

    @staticmethod
    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[..., 0], x[..., 1]

    @staticmethod
    def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack([a, b], dim=-1)

    exp2 = staticmethod(torch.exp2)
    where = staticmethod(torch.where)
    static_range = staticmethod(range)


def _mma_v2(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The exact sum rounded toward zero to fp32: the tensor cores' accumulation truncates, so an
    offset carried in the accumulator biases it (measured on the H200; `_value_products`)."""
    assert a.dtype == b.dtype == torch.float16, "mma_v2 operands are fp16 here"
    exact = acc.double() + a.double() @ b.double()
    out = exact.float()
    return torch.where(out.double().abs() > exact.abs(), torch.nextafter(out, torch.zeros_like(out)), out)


def _halves_f16(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x.to(torch.int16).view(torch.float16), (x >> 16).to(torch.int16).view(torch.float16)], -1)


def _f16_pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    lo = even.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return lo | (odd.to(torch.float16).view(torch.int16).to(torch.int32) << 16)


def _low_half_f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int16).view(torch.float16)


def _pack_halves(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo.to(torch.int32) & 0xFFFF) | (hi.to(torch.int32) << 16)


def _byte_perm(a: torch.Tensor, b: torch.Tensor, sel: Any) -> torch.Tensor:
    """PTX prmt without sign replication: byte i of the result is byte (sel >> 4i) & 7 of {b, a};
    sel an int or a tensor broadcasting with a and b."""
    both = (a.to(torch.int64) & 0xFFFFFFFF) | ((b.to(torch.int64) & 0xFFFFFFFF) << 32)
    out = sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
    return (out - ((out >> 31) << 32)).to(torch.int32)  # as a signed 32-bit word


def _value_pairs(we: torch.Tensor, wo: torch.Tensor, sel: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The inline PTX (prmt, and): the code masked in place."""
    return _byte_perm(we, wo, sel) & mask


def _mul_pairs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = (_halves_f16(x).float() * _halves_f16(y).float()).to(torch.float16)
    return _f16_pairs(out[..., 0], out[..., 1])


def _f16_pairs_rounded(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    return _f16_pairs(even.to(torch.float16), odd.to(torch.float16))


def _transposed_blocks(x: torch.Tensor) -> torch.Tensor:
    """movmatrix.trans on an m16n8 accumulator's fp16 pairs [16, 4]: every 8 x 8 block transposed,
    as the lanes see it (X[8j + a, b] = (P[8j + 2b, a], P[8j + 2b + 1, a]))."""
    p = _halves_f16(x).reshape(2, 8, 8)  # (block, row, col) of P
    t = p.transpose(1, 2).reshape(2, 8, 4, 2)  # t[j, a, b, e] = P[8j + 2b + e, a]
    return _f16_pairs(t[..., 0], t[..., 1]).reshape(16, 4)


# Gluon's names in the kernel modules, and the jit helpers computed here instead (by name, in every module).
_GLUON = {"mma_v2": _mma_v2, "async_copy": FakeAsyncCopy, "_thread_barrier": lambda: None,
          "_async_load": FakeAsyncCopy.async_copy_global_to_shared}
_REPLACED = {"_halves_f16": _halves_f16, "_low_half_f16": _low_half_f16, "_mul_pairs": _mul_pairs,
             "_byte_perm": _byte_perm, "_byte_perm_by": _byte_perm, "_pack_halves": _pack_halves,
             "_transposed_blocks": _transposed_blocks, "_f16_pairs_rounded": _f16_pairs_rounded,
             "_value_pairs": _value_pairs}


class Emulator:
    """The jit functions of the kernel modules as plain Python functions over torch. A module's
    functions run with a copy of that module's globals (`globals_of`) in which Gluon's names are
    replaced and every jit function is its emulated form, run with its own module's globals."""

    def __init__(self) -> None:
        self.gl = FakeGluon()
        self._globals: dict[str, dict[str, Any]] = {}

    def globals_of(self, module_name: str) -> dict[str, Any]:
        if module_name not in self._globals:
            env = dict(sys.modules[module_name].__dict__)
            self._globals[module_name] = env  # registered before filling: helpers may import each other
            env.update(gl=self.gl, **{k: v for k, v in _GLUON.items() if k in env})
            for name, obj in list(env.items()):
                if name in _REPLACED:
                    env[name] = _REPLACED[name]
                elif hasattr(obj, "fn") and hasattr(obj.fn, "__code__"):  # a jit function, maybe imported
                    env[name] = self.function(obj)
        return self._globals[module_name]

    def function(self, jit_fn: Any) -> types.FunctionType:
        """`jit_fn`'s Python body, run with its module's emulated globals."""
        fn = jit_fn.fn
        return types.FunctionType(fn.__code__, self.globals_of(fn.__module__), fn.__name__, fn.__defaults__)


def _pointers(arg: Any) -> Any:
    """Kernel arguments as the emulator takes them: tensors as pointers, tuples field by field."""
    if isinstance(arg, tuple):
        return type(arg)(*map(_pointers, arg)) if hasattr(arg, "_fields") else tuple(map(_pointers, arg))
    return pointer(arg) if isinstance(arg, torch.Tensor) and arg.dim() > 0 else arg


def run_split_kernel(launch: Any) -> None:
    """Runs `launch.kernel` (a `kernels.gluon.launch.SplitLaunch`'s) for every program of `launch`."""
    emu = Emulator()
    kernel = emu.function(launch.kernel)
    args = [_pointers(a) for a in launch.args]
    layouts = {k: None for k in launch.layouts}
    for bh in range(launch.grid[0]):
        for split in range(launch.grid[1]):
            emu.gl.pid = (bh, split)
            kernel(*args, **launch.constexprs, **layouts)
