"""The fp16/bf16 baseline's decode kernel (kernels/decode_full.py) vs attention in fp32, per sequence.

Under TRITON_INTERPRET=1 on small shapes; fresh random inputs; unequal lengths (one of a single
token, one at full capacity); GQA 1, 3, 4; head_dim 64 and 128; several token splits.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from pnmix.kernels.decode_full import full_decode_attention  # noqa: E402


@pytest.mark.parametrize(("gqa", "d", "dtype", "splits"), [
    (4, 128, torch.bfloat16, None), (3, 64, torch.float16, 3), (1, 64, torch.float32, 1), (4, 64, torch.bfloat16, 5),
])
def test_full_decode_matches_attention(gqa, d, dtype, splits):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    bsz, hkv, cap = 3, 2, 200
    lengths = [cap, 1, 77]
    q = (torch.randn((bsz, hkv * gqa, d), generator=gen) * 1.5).to(dtype)
    k = (torch.randn((bsz, hkv, cap, d), generator=gen) * 1.5).to(dtype)
    v = torch.randn((bsz, hkv, cap, d), generator=gen).to(dtype)
    out = full_decode_attention(q, k, v, torch.tensor(lengths, dtype=torch.int32), d**-0.5, num_splits=splits)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        qb = q[b].float().view(hkv, gqa, d)
        w = torch.softmax(qb @ k[b, :, :n].float().transpose(-1, -2) * d**-0.5, dim=-1)
        want = (w @ v[b, :, :n].float()).reshape(hkv * gqa, d)
        err = ((out[b].float() - want).norm() / want.norm()).item()
        assert err <= 1e-2, f"sequence {b} (length {n}): relative error {err:.2e}"


def test_full_decode_plans_for_a_bound_on_the_lengths():
    # max_tokens 80 over a capacity of 200: 2 splits cover 80 tokens (48 each at block_n 16) where
    # the capacity's plan splits 200, and nothing past the bound is read (NaN there would show).
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    bsz, hkv, gqa, d, cap = 3, 2, 4, 64, 200
    lengths = torch.tensor([80, 1, 77], dtype=torch.int32)
    q = torch.randn((bsz, hkv * gqa, d), generator=gen)
    k = torch.randn((bsz, hkv, cap, d), generator=gen)
    v = torch.randn((bsz, hkv, cap, d), generator=gen)
    whole = full_decode_attention(q, k, v, lengths, d**-0.5, num_splits=2, block_n=16)
    k[:, :, 80:] = 1e4
    v[:, :, 80:] = float("nan")
    bounded = full_decode_attention(q, k, v, lengths, d**-0.5, num_splits=2, block_n=16, max_tokens=80)
    assert torch.isfinite(bounded).all()
    assert ((bounded - whole).norm() / whole.norm()).item() <= 1e-3  # the same sums, merged from other splits


def test_a_window_ring_on_the_kernel_attends_as_the_sliding_mask():
    # StaticWindowLayer (a hybrid's sliding layer on the static path) through this kernel over its
    # ring's filled slots, against the same ring under masked SDPA, step by step while the rings
    # fill and wrap: sequences that start below, at and past the window.
    from pnmix.static import StaticWindowLayer

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    bsz, hkv, gqa, d, window, t = 3, 2, 2, 64, 24, 40
    keys = torch.randn((bsz, hkv, t, d), generator=gen)
    values = torch.randn((bsz, hkv, t, d), generator=gen)
    held, seen = [5, 24, 40], [5, 24, 61]
    ring = StaticWindowLayer(keys, values, held, seen, window, 0)
    masked = StaticWindowLayer(keys, values, held, seen, window, 0)
    ring.use_kernels, masked.use_kernels = True, False
    for step in range(30):
        k, v = torch.randn((2, bsz, hkv, 1, d), generator=gen)
        q = torch.randn((bsz, hkv * gqa, 1, d), generator=gen)
        ring.plan_tokens = None if step % 2 else 61 + step + 1
        got, want = ring.append_attend(k, v, q, d**-0.5), masked.append_attend(k, v, q, d**-0.5)
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-3, f"step {step}: relative error {err:.2e}"  # a slot out of the window: ~0.1
    assert ring.filled.tolist() == [window, window, window] and ring.lengths.tolist() == [35, 54, 91]
