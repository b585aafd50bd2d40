"""The engines' KV formats (pnmix/kv_formats.py) against torch's float8 cast and hand-computed blocks."""

from __future__ import annotations

import pytest
import torch

from pnmix import kv_formats as kv


def test_fp8_is_torchs_e4m3_cast_saturated_and_scaled():
    x = torch.randn(4, 3, 17, 64) * 300  # many elements beyond +-448 once unscaled
    for scale in (1.0, 0.37, kv.fp8_scale(x)):
        expected = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        assert torch.equal(kv.fp8(x, scale), expected)
    assert kv.fp8_scale(x) == pytest.approx(float(x.abs().max()) / 448)
    # Calibrated, the largest element survives; at the default scale of 1.0 it saturates.
    big = float(x.abs().max())
    assert float(kv.fp8(x, kv.fp8_scale(x)).abs().max()) == pytest.approx(big, rel=0.07)
    assert float(kv.fp8(x).abs().max()) == 448.0
    assert kv.fp8_scale(torch.zeros(3, 8)) == 1.0


def test_q4_0_block_by_hand():
    # d = max / -8 with max = -8 (the first element of largest magnitude): d = 1, q = trunc(x + 8.5).
    head = [-8.0, 1.2, 1.5, -1.5, -1.6, 7.9, 0.49, -0.5, 8.0]
    x = torch.tensor(head + [0.0] * (32 - len(head)))
    expected = [-8.0, 1.0, 2.0, -1.0, -2.0, 7.0, 0.0, 0.0, 7.0]  # 8.0: 16.5 -> 16 -> MIN(15) -> 7
    assert kv.q4_0(x).tolist() == expected + [0.0] * (32 - len(head))
    # The scale is stored in fp16: a block whose d is not an fp16 number reads back with the fp16 d.
    y = torch.full((32,), 0.1)
    y[0] = -0.8001
    d = -0.8001 / -8
    q = torch.trunc(y / torch.tensor(d, dtype=torch.float32) + 8.5).clamp(max=15)
    assert torch.equal(kv.q4_0(y), (q - 8) * torch.tensor(d).half().float())


def test_q8_0_block_by_hand():
    head = [127.0, 0.5, -0.5, 1.49, -2.5, 126.5]
    x = torch.tensor(head + [0.0] * (32 - len(head)))
    assert kv.q8_0(x).tolist() == [127.0, 1.0, -1.0, 1.0, -3.0, 127.0] + [0.0] * 26  # half away from zero


def test_nvfp4_blocks_by_hand():
    # Block 1 sets the tensor's amax to 6 * 448, so the tensor scale is 1 and its block scale 448.
    ties = [6, -3, 2.4, 0.75, 0.25, 5, -0.3, 1.25, 1.75, 2.5, 3.5, 0, 0, 0, 0, 0]
    want = [6, -3, 2, 1, 0, 4, -0.5, 1, 2, 2, 4, 0, 0, 0, 0, 0]  # ties go to the even code
    first = torch.tensor(ties, dtype=torch.float32) * 448
    # Block 2: amax 806.4, block scale 134.4 in E4M3 is 128; 806.4 / 128 = 6.3 saturates to 6.
    second = torch.tensor([806.4, -100.0] + [0.0] * 14)
    got = kv.nvfp4(torch.cat([first, second])[None])
    assert got[0, :16].tolist() == [w * 448 for w in want]
    assert got[0, 16:].tolist() == [768.0, -128.0] + [0.0] * 14
    assert torch.equal(kv.nvfp4(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_e2m1_covers_its_values_and_saturates():
    values = torch.tensor(kv.E2M1_VALUES)
    assert torch.equal(kv.e2m1(values), values) and torch.equal(kv.e2m1(-values), -values)
    assert kv.e2m1(torch.tensor([7.0, -100.0])).tolist() == [6.0, -6.0]


@pytest.mark.parametrize("fmt", list(kv.KVFormat))
def test_every_format_round_trips_within_its_step_on_fresh_inputs(fmt):
    x = torch.randn(2, 4, 33, 64) * torch.rand(2, 4, 33, 1) * 5
    got = kv.round_trip(fmt, x, scale=kv.fp8_scale(x) if fmt == kv.KVFormat.FP8 else None)
    assert got.shape == x.shape and got.dtype == x.dtype
    err = (got - x).abs().max() / x.abs().max()
    bound = {"bf16": 2**-8, "fp8": 2**-4, "q8_0": 1 / 127, "nvfp4": 0.25, "q4_0": 1 / 8}[fmt]
    assert float(err) <= bound, (fmt, float(err))
    if fmt == kv.KVFormat.FP8:  # stored values are fixed points of the same scale
        assert torch.equal(kv.round_trip(fmt, got, scale=kv.fp8_scale(x)), got)
    if fmt == kv.KVFormat.BF16:
        assert torch.equal(got, x.to(torch.bfloat16).float())


def test_block_formats_refuse_a_head_dim_that_is_not_a_multiple_of_their_block():
    with pytest.raises(ValueError, match="multiple of the format's block of 32"):
        kv.q4_0(torch.randn(2, 48))
