"""Host-side planning shared by the decode launchers: the GPU's size, how the packed region splits.

Flash-decoding: program (b, h_kv, split) covers a slice of sequence b's packed groups for every
query head of KV head h_kv, and the splits' partials are merged after (`kernels.combine`). Only
capacities (tensor shapes) decide a plan, never lengths, so a step needs no host synchronisation
and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch

LOG2E = math.log2(math.e)  # the kernels use exp2: scores are pre-scaled by softmax scale x log2 e


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for_programs(q: torch.Tensor, n_bh: int, ng_cap: int, programs_per_sm: int) -> int:
    """Splits per (b, h_kv) that give every SM about `programs_per_sm` programs (one SM off CUDA)."""
    target = programs_per_sm * (sm_count(q.device.index or 0) if q.is_cuda else 1)
    return max(1, min(ng_cap, -(-target // n_bh)))


def split_plan(ng_cap: int, num_splits: int) -> tuple[int, int]:
    """(groups per split, splits) for `num_splits` splits of `ng_cap` groups: at most one split a
    group, none of them empty; (0, 0) for an empty region."""
    num_splits = max(1, min(num_splits, max(ng_cap, 1)))
    groups_per_split = -(-ng_cap // num_splits) if ng_cap else 0
    return groups_per_split, (-(-ng_cap // groups_per_split) if ng_cap else 0)


def planned_groups(ng_cap: int, max_groups: int | None) -> int:
    """The packed groups a launch plan covers: the capacity `ng_cap`, or `max_groups` (a bound on
    the groups any sequence holds) within it where given."""
    return ng_cap if max_groups is None else max(0, min(ng_cap, max_groups))


def length_bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most cap (0 for n <= 0): the size a replayed step's launch
    plan is made for. A plan made from the capacity splits a short cache as a full one, and most of
    its programs start with nothing to read; one made from the length itself would need a graph per
    step. Rounded up to a power of two, a bound serves a bucket of steps (one graph each) and is at
    most twice the length."""
    return 0 if n <= 0 else min(cap, 1 << (n - 1).bit_length())


def packed_groups_bound(tokens: int, n_sink: int, group_size: int) -> int:
    """The most packed groups a sequence of at most `tokens` tokens holds: every token past its
    sinks and its residual is in a whole group."""
    return (tokens - min(n_sink, tokens)) // group_size


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, checked to take the result (q's shape, contiguous channels), or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous channels")
    return out
