"""The static path's append kernel (kernels/append.py) against its torch reference, bit for bit.

Under TRITON_INTERPRET=1; fresh random inputs each run; rows before, at and past the sink count;
values with other strides than keys (as the model's projections hand them over); no sinks (the
unquantized cache).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from pnmix.kernels.append import append_tokens  # noqa: E402
from pnmix.static import append_reference  # noqa: E402


@pytest.mark.parametrize(("n_sink", "h", "d", "dtype"), [
    (4, 3, 16, torch.bfloat16), (0, 2, 64, torch.float16), (1, 8, 32, torch.float32),
])
def test_append_matches_reference_bit_for_bit(n_sink, h, d, dtype):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    b, cap = 5, 12
    bufs = {name: torch.randn((b, h, n, d), generator=gen).to(dtype)
            for name, n in (("k_dst", cap), ("v_dst", cap), ("k_sink", n_sink), ("v_sink", n_sink))}
    sink_len = torch.tensor([0, max(0, n_sink - 1), n_sink, n_sink, n_sink], dtype=torch.int32)
    dst_len = torch.tensor([0, 0, 0, 5, cap - 1], dtype=torch.int32)
    mine = {k: v.clone() for k, v in bufs.items()}
    lens = (sink_len.clone(), dst_len.clone())
    for _ in range(2):  # the second step sees the lengths the first one wrote
        key = torch.randn((b, h, 1, d), generator=gen).to(dtype)
        value = torch.randn((b, 1, h, d), generator=gen).to(dtype).transpose(1, 2)
        sinks = (mine["k_sink"], mine["v_sink"], lens[0]) if n_sink else ()
        append_tokens(key, value, mine["k_dst"], mine["v_dst"], lens[1], *sinks)
        sinks = (bufs["k_sink"], bufs["v_sink"], sink_len) if n_sink else ()
        append_reference(key, value, bufs["k_dst"], bufs["v_dst"], dst_len, *sinks)
        dst_len.clamp_(max=cap - 1)  # the driver keeps a row below the capacity
        lens[1].clamp_(max=cap - 1)
    assert torch.equal(lens[0], sink_len) and torch.equal(lens[1], dst_len)
    for name in bufs:
        assert torch.equal(mine[name], bufs[name]), name
    if n_sink:  # the rows below the sink count filled sinks, the others the destination
        assert sink_len[:2].tolist() == [min(2, n_sink), n_sink]
        assert dst_len[2:].tolist() == [2, 7, cap - 1]
