"""The backend switch, and generation through the Triton path (TRITON_INTERPRET=1 on the CPU).

The same tiny model and prompts run once on the torch path and once on the kernel path: the
packed bytes must be identical (the pack kernels are bit-exact), the kernel path must keep no
dequantized view, and the logits must agree to the kernels' fp16 arithmetic.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # set before the kernels are decorated; only these tests use Triton

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import tiny_model  # noqa: E402

from pnmix import backend  # noqa: E402
from pnmix.config import PNMixConfig, preset  # noqa: E402
from pnmix.generation import cache_kwargs, new_cache  # noqa: E402

SMALL = PNMixConfig(b_high=3, b_low=1, group_size=32, salient_ratio=0.5, n_sink=4, residual_len=32,
                    value_bits=2, value_group_size=16)


@pytest.fixture
def forced():
    """Yields a function that forces a backend; restores the default afterwards."""
    yield backend.set_backend
    backend.set_backend(None)


def test_switch_reads_env_and_override(forced, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("PNMIX_BACKEND", raising=False)
    assert backend.backend_name() == "auto" and not backend.use_triton(cpu, SMALL, 16)
    monkeypatch.setenv("PNMIX_BACKEND", "triton")
    assert backend.use_triton(cpu, SMALL, 16)
    forced("torch")
    assert not backend.use_triton(cpu, SMALL, 16)
    forced(None)
    monkeypatch.setenv("PNMIX_BACKEND", "cuda")
    with pytest.raises(ValueError, match="PNMIX_BACKEND"):
        backend.backend_name()
    with pytest.raises(ValueError, match="invalid backend"):
        forced("fast")


def test_unsupported_configs_stay_on_torch(forced):
    forced("triton")
    cpu = torch.device("cpu")
    assert not backend.use_triton(cpu, preset("fp16"), 64)  # unquantized keys and values
    assert not backend.use_triton(cpu, PNMixConfig(value_bits=16), 64)
    assert not backend.use_triton(cpu, SMALL, 48)  # head_dim not a power of two
    assert backend.use_triton(cpu, preset("pnmix-paper"), 128)


def generate(model, ids, mask, n):
    cache = new_cache(model, SMALL)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             **cache_kwargs(model, cache))
    return out, cache


def test_generation_on_the_kernel_path_matches_the_torch_path(forced, monkeypatch):
    calls = []
    attend_kernels = backend.attend_kernels
    monkeypatch.setattr(backend, "attend_kernels", lambda *a: calls.append(1) or attend_kernels(*a))
    model = tiny_model("llama", seed=3)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    # Left-padded batch, unequal lengths: 75 and 50 real tokens -> different groups and residuals.
    ids = torch.randint(1, 128, (2, 75), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :25], mask[1, :25] = 0, 0
    forced("torch")
    ref, ref_cache = generate(model, ids, mask, 10)
    assert not calls
    forced("triton")
    out, cache = generate(model, ids, mask, 10)
    assert len(calls) == 9 * 2  # every decode step of both layers went through the kernel

    layer, ref_layer = cache.layers[1], ref_cache.layers[1]
    assert layer.use_kernels and not layer.keep_view and layer.view_k.shape[-2] == 0
    assert not ref_layer.use_kernels and ref_layer.view_k.shape[-2] > 0
    assert layer.n_groups == ref_layer.n_groups and layer.res_len == ref_layer.res_len
    assert layer.n_groups[0] != layer.n_groups[1] or layer.res_len[0] != layer.res_len[1]
    for name, t in ref_layer.packed.items():
        assert torch.equal(layer.packed[name], t), f"packed {name} differs"
    # Step i's logits chose token i; a row is compared until its tokens part. Fresh random inputs
    # every run: the kernel holds codes and probabilities in fp16 (one run reached 2.1e-3), so the
    # bound is the attention tolerance, 1e-2, and a token may differ only where the reference's
    # two top logits are closer than twice the largest logit difference there (a near-tie the
    # kernel's rounding can decide: one run in about 40 hits a margin of 1.4e-3).
    n = len(ref.logits)
    got, want = out.sequences[:, -n:], ref.sequences[:, -n:]
    same = torch.ones(got.shape[0], dtype=torch.bool)
    for i, (a, b) in enumerate(zip(out.logits, ref.logits, strict=True)):
        a, b = a[same], b[same]
        err = ((a - b).norm() / b.norm()).item()
        assert err < 1e-2, f"step {i}: logits relative error {err:.2e}"
        flipped = got[same, i] != want[same, i]
        if flipped.any():
            top = b[flipped].topk(2, dim=-1).values
            margin, diff = top[:, 0] - top[:, 1], (a[flipped] - b[flipped]).abs().amax(-1)
            assert (margin <= 2 * diff).all(), f"step {i}: a token differs at a margin of {margin.tolist()}"
            same[same.clone()] = ~flipped
        if not same.any():
            break


def test_kernel_path_without_a_view_still_attends_several_tokens(forced):
    """A multi-token step (not a kernel case) rebuilds the view from the bytes: same as the torch path."""
    forced("torch")
    model = tiny_model("qwen3", seed=4)
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(5))
    _, ref_cache = generate(model, ids, torch.ones_like(ids), 1)
    forced("triton")
    _, cache = generate(model, ids, torch.ones_like(ids), 1)
    q = torch.randn((1, 4, 3, 16), generator=torch.Generator().manual_seed(6))
    got = cache.layers[0].attend(q, 0.25)
    want = ref_cache.layers[0].attend(q, 0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_kernel_switch(monkeypatch):
    """PNMIX_DECODE_KERNEL picks the fused kernel: 'auto' (the default) falls back to the Triton
    kernel where the Gluon one cannot run (here: no CUDA), with the same output; 'mma' insists."""
    from test_kernels_decode import Case, build, fresh_generator

    q, cache = build(Case(), fresh_generator())
    monkeypatch.setenv("PNMIX_DECODE_KERNEL", "triton")
    forced = backend.fused_decode(q, cache, 0.125)
    monkeypatch.delenv("PNMIX_DECODE_KERNEL", raising=False)
    assert backend.decode_kernel_name() == "auto"
    assert torch.equal(backend.fused_decode(q, cache, 0.125), forced)
    monkeypatch.setenv("PNMIX_DECODE_KERNEL", "mma")
    with pytest.raises(ValueError, match="PNMIX_DECODE_KERNEL=mma: the Gluon decode kernel cannot run here"):
        backend.fused_decode(q, cache, 0.125)
    monkeypatch.setenv("PNMIX_DECODE_KERNEL", "gluon")
    with pytest.raises(ValueError, match="invalid PNMIX_DECODE_KERNEL='gluon': allowed one of auto, triton, mma"):
        backend.fused_decode(q, cache, 0.125)


def test_salient_counts_of_one_size_class_share_a_compiled_kernel():
    # The salient count is a run-time argument: counts inside one size class give the same
    # compile-time constants (one specialisation), a count that fills its class compiles as a
    # constant (its own), one below half of the class (only below 8) is its own, and no salient
    # channels at all is its own as well.
    from pnmix.kernels.gluon.launch import kernel_constants

    def const(n_sc: int) -> dict:
        return kernel_constants(3, 3, 64, 128, 1, 3, n_sc, 2, 32)

    assert const(38) == const(44) == const(58)  # 64-channel class, not full
    assert const(20) == const(26)  # 32-channel class
    assert const(10) == const(12)  # 16-channel class, at least half of it
    # 6 fills less than half of its class (FEW: masked copies), so it is its own as well
    assert len({repr(const(n)) for n in (0, 6, 10, 12, 20, 32, 38, 64)}) == 8 - 1
    assert const(64)["FULL"] and not const(58)["FULL"] and not const(0)["SAL"]
    assert const(6)["FEW"] and not const(8)["FEW"] and not const(58)["FEW"]


def test_compile_counter_counts_compiles_and_disk_cache_reads():
    from types import SimpleNamespace

    from pnmix.kernels.compiles import Compiles, watch

    log = Compiles()
    before = log.copy()
    log(times=SimpleNamespace(total=1_500_000), cache_hit=False)  # Triton's CompileTimes: microseconds
    log(times=SimpleNamespace(total=250_000), cache_hit=False)
    log(times=SimpleNamespace(total=10_000), cache_hit=True)
    new = log.since(before)
    assert (new.compiled, new.loaded) == (2, 1)
    assert new.seconds == pytest.approx(1.75)
    assert watch() is watch()  # one listener per process
