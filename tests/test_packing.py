import itertools

import pytest
import torch

from pnmix import packing

BIT_PAIRS = [(lo, hi) for lo, hi in itertools.product(range(1, 5), repeat=2) if hi >= lo]


def random_salient(lead, head_dim, n_pairs, gen):
    """Random ascending salient channel lists (rotate_half pairing) per leading index."""
    scores = torch.rand((*lead, head_dim // 2), generator=gen)
    if not n_pairs:
        return torch.zeros((*lead, 0), dtype=torch.long)
    pairs = scores.topk(n_pairs, dim=-1).indices.sort(-1).values
    return torch.cat([pairs, pairs + head_dim // 2], dim=-1)


@pytest.mark.parametrize(("b_low", "b_high"), BIT_PAIRS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_key_pack_round_trip_is_exact(b_low, b_high, group_size, ratio):
    gen = torch.Generator().manual_seed(hash((b_low, b_high, group_size, ratio)) % 2**31)
    lead, d, n_groups = (2, 3), 16, 2
    k = torch.randn((*lead, n_groups * group_size, d), generator=gen) * 3 + 0.5
    channels = random_salient(lead, d, int(ratio * d // 2), gen)
    packed = packing.quantize_keys(k, channels, b_low, b_high, group_size)
    assert packed.low.dtype == torch.uint8 and packed.low.shape == (*lead, n_groups, b_low, d, group_size // 8)
    assert packed.high.shape == (*lead, n_groups, b_high - b_low, channels.shape[-1], group_size // 8)

    # Reference: quantize each channel group directly, then compare the integer codes bit for bit.
    levels = torch.full((*lead, d), 2**b_low - 1.0)
    levels.scatter_(-1, channels, 2**b_high - 1.0)
    kg = k.view(*lead, n_groups, group_size, d)
    q_ref, scale_ref, zero_ref = packing.quantize_groups(kg, levels[..., None, None, :], dim=-2)
    q = packing.unpack_keys(packed, channels, b_low)
    assert torch.equal(q, q_ref)
    assert torch.equal(packed.scale, scale_ref.squeeze(-2)) and torch.equal(packed.zero, zero_ref.squeeze(-2))
    assert int(q.max()) <= 2**b_high - 1

    # Dequantization error: at most half a step (plus fp16 rounding of scale and zero).
    k_hat = packing.dequantize_keys(packed, channels, b_low)
    assert torch.equal(packing.fake_quantize_keys(k, channels, b_low, b_high, group_size), k_hat)
    step = packed.scale.float().repeat_interleave(group_size, dim=-2)
    slack = 2e-3 * k.abs().amax()
    assert ((k_hat - k).abs() <= step / 2 + slack).all()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_plane_pack_round_trip_on_random_codes(bits):
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (3, 64, 24), generator=gen, dtype=torch.uint8)
    planes = packing.pack_planes(q, 0, bits)
    assert planes.shape == (3, bits, 24, 8)
    assert torch.equal(packing.unpack_planes(planes, 0), q)
    # Bit order: token t of a group in byte t // 8, bit t % 8.
    t, c = 13, 5
    assert (planes[0, 0, c, t // 8] >> (t % 8)) & 1 == q[0, t, c] & 1


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_value_pack_round_trip(bits, group):
    gen = torch.Generator().manual_seed(bits * 100 + group)
    q = torch.randint(0, 2**bits, (2, 5, 64), generator=gen, dtype=torch.uint8)
    packed = packing.pack_along_channels(q, bits)
    assert packed.shape == (2, 5, 64 * bits // 8)
    assert torch.equal(packing.unpack_along_channels(packed, bits), q)
    v = torch.randn((2, 5, 64), generator=gen) * 2
    pv = packing.quantize_values(v, bits, group)
    v_hat = packing.dequantize_values(pv, bits, group)
    step = pv.scale.float().repeat_interleave(group, dim=-1)
    assert ((v_hat - v).abs() <= step / 2 + 2e-3 * v.abs().amax()).all()


def test_constant_group_quantizes_exactly():
    k = torch.full((1, 32, 4), 0.75)
    packed = packing.quantize_keys(k, torch.zeros((1, 0), dtype=torch.long), 2, 2, 32)
    assert torch.equal(packing.dequantize_keys(packed, torch.zeros((1, 0), dtype=torch.long), 2), k)


def test_halves_round_up():
    # Values exactly halfway between codes round up, not to even.
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0]).view(1, 5)
    q, scale, zero = packing.quantize_groups(x, 3, dim=-1)  # scale 1.0, zero 0.0
    assert scale.item() == 1.0 and zero.item() == 0.0
    assert q.tolist() == [[0, 1, 2, 3, 3]]
