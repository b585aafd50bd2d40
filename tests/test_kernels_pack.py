"""Quantize + pack kernels vs the torch reference (`pnmix.packing`), bit for bit, under TRITON_INTERPRET=1.

Every (b_low, b_high) pair with 1 <= b_low <= b_high <= 4, every G in {32, 64, 128}, salient
ratios 0 / 0.5 / 1 for keys; value bits 1, 2, 4, 8 with two group sizes; fp32, bf16 and fp16
inputs; fresh random inputs per case; outputs poisoned (0xA5 bytes, NaN scales) before the run.
"""

from __future__ import annotations

import itertools
import os

os.environ["TRITON_INTERPRET"] = "1"  # set before the kernels are decorated; only these tests use Triton

import pytest  # noqa: E402
import torch  # noqa: E402

from pnmix import packing  # noqa: E402
from pnmix.kernels.layout import PackedKeys, PackedValues, channel_order  # noqa: E402
from pnmix.kernels.pack import quantize_pack_keys, quantize_pack_values  # noqa: E402

BIT_PAIRS = [(lo, hi) for lo, hi in itertools.product(range(1, 5), repeat=2) if hi >= lo]
POISON = 0xA5


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def random_salient(lead: tuple[int, ...], head_dim: int, n_pairs: int, gen: torch.Generator) -> torch.Tensor:
    """Ascending salient channels of random rotate_half pairs, int64 [*lead, 2 * n_pairs]."""
    if not n_pairs:
        return torch.zeros((*lead, 0), dtype=torch.long)
    scores = torch.rand((*lead, head_dim // 2), generator=gen)
    pairs = scores.topk(n_pairs, dim=-1).indices.sort(-1).values
    return torch.cat([pairs, pairs + head_dim // 2], dim=-1)


def poisoned_keys(lead, n_groups, b_low, b_high, d, n_sc, g) -> PackedKeys:
    u8 = dict(dtype=torch.uint8)
    return PackedKeys(
        torch.full((*lead, n_groups, b_low, d, g // 8), POISON, **u8),
        torch.full((*lead, n_groups, b_high - b_low, n_sc, g // 8), POISON, **u8),
        torch.full((*lead, n_groups, d), float("nan"), dtype=torch.float16),
        torch.full((*lead, n_groups, d), float("nan"), dtype=torch.float16),
    )


def assert_same_bytes(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} vs {want.shape}"
    if got.dtype == torch.float16:
        got, want = got.view(torch.int16), want.view(torch.int16)  # bit patterns, NaN-safe
    bad = (got != want).nonzero()
    assert bad.shape[0] == 0, f"{name}: {bad.shape[0]} of {got.numel()} differ, first at {bad[:3].tolist()}"


@pytest.mark.parametrize(("b_low", "b_high"), BIT_PAIRS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_key_pack_is_bit_exact(b_low, b_high, group_size, ratio):
    gen = fresh_generator()
    lead, d, n_groups = (2, 3), 16, 2
    k = torch.randn((*lead, n_groups * group_size, d), generator=gen) * 3 + 0.5
    k[0, 1, :, 5] = 0.75  # a constant channel: scale 0, every code 0
    channels = random_salient(lead, d, round(ratio * d / 2), gen)
    out = poisoned_keys(lead, n_groups, b_low, b_high, d, channels.shape[-1], group_size)
    got = quantize_pack_keys(k, channels, b_low, b_high, group_size, out=out)
    want = packing.quantize_keys(k, channels, b_low, b_high, group_size)
    for name in ("low", "high", "scale", "zero"):
        assert_same_bytes(name, getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("d", "b_low", "b_high", "group_size"), [(64, 1, 3, 128), (128, 2, 4, 32)])
def test_key_pack_half_inputs_wider_heads_strided(dtype, d, b_low, b_high, group_size):
    gen = fresh_generator()
    full = (torch.randn((2, 2, 3 * group_size + 5, d), generator=gen) * 2).to(dtype)
    k = full[:, :, 5:]  # a strided view, as the cache passes slices of its buffers
    channels = random_salient((2, 2), d, d // 4, gen)
    got = quantize_pack_keys(k, channels, b_low, b_high, group_size,
                             out=poisoned_keys((2, 2), 3, b_low, b_high, d, channels.shape[-1], group_size))
    want = packing.quantize_keys(k, channels, b_low, b_high, group_size)
    for name in ("low", "high", "scale", "zero"):
        assert_same_bytes(name, getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_pack_is_bit_exact(bits, group_size, dtype):
    gen = fresh_generator()
    lead, t, d = (2, 3), 37, 64  # 222 rows: not a multiple of the kernel's row block
    v = (torch.randn((*lead, t, d), generator=gen) * 2 - 0.3).to(dtype)
    v[1, 2, 7, :group_size] = -1.25  # a constant group
    vg = d // group_size
    out = PackedValues(
        torch.full((*lead, t, d * bits // 8), POISON, dtype=torch.uint8),
        torch.full((*lead, t, vg), float("nan"), dtype=torch.float16),
        torch.full((*lead, t, vg), float("nan"), dtype=torch.float16),
    )
    got = quantize_pack_values(v, bits, group_size, out=out)
    want = packing.quantize_values(v, bits, group_size)
    for name in ("packed", "scale", "zero"):
        assert_same_bytes(name, getattr(got, name), getattr(want, name))


def test_channel_order_puts_salient_channels_last_in_stored_order():
    gen = fresh_generator()
    channels = random_salient((3, 2), 16, 3, gen)
    order = channel_order(channels, 16)
    assert order.dtype == torch.int32 and order.shape == (3, 2, 16)
    assert torch.equal(order[..., 10:].long(), channels)  # salient, ascending, as the high rows are stored
    rest = order[..., :10].long()
    assert (rest[..., 1:] > rest[..., :-1]).all()
    assert torch.equal(order.sort(-1).values, torch.arange(16, dtype=torch.int32).expand(3, 2, 16))


def test_unsupported_shapes_are_refused():
    with pytest.raises(ValueError, match="unsupported key shape"):
        quantize_pack_keys(torch.randn(1, 64, 24), torch.zeros(1, 0, dtype=torch.long), 2, 2, 32)
    with pytest.raises(ValueError, match="unsupported value bits"):
        quantize_pack_values(torch.randn(1, 4, 16), 3, 16)
