"""The static decode path (pnmix/static.py) against `generate` and the dynamic PN-Mix cache.

On the CPU the static step runs eagerly (CUDA graphs need a GPU; benchmarks/static_study.py checks
the graph path there). What is checked here is what the graph replays: predicated appends to sinks
and residual, the in-step flush into the packed region, per-sequence lengths and positions with
left padding, and the fp16 window.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tiny import tiny_gemma3, tiny_model

from pnmix import backend
from pnmix.config import ConfigError, PNMixConfig, preset
from pnmix.generation import generate, new_cache, use_pnmix_attention
from pnmix.kernels.plan import length_bucket
from pnmix.static import StaticGenerator, StaticQuantLayer, decode_cost, static_method

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path

# Small groups so that flushes happen within a short generation; 4 sinks so that the short row
# (3 real tokens) fills its sinks during decode.
SMALL = PNMixConfig(b_high=3, b_low=1, salient_ratio=0.5, group_size=32, n_sink=4, residual_len=32,
                    value_bits=2, value_group_size=16)
KIVI_LIKE = PNMixConfig(b_high=2, b_low=2, salient_ratio=0.0, n_sink=0, group_size=32, residual_len=64,
                        value_bits=4, value_group_size=16)


def until_eos(tokens: torch.Tensor, eos: int | list[int] | None) -> list[list[int]]:
    """Each row up to and including its first end-of-sequence token (`generate` pads after it)."""
    stops = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    rows = []
    for row in tokens.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


def reference(model, ids, mask, method, n):  # type: ignore[no-untyped-def]
    if method == "fp16":
        use_pnmix_attention(model)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return out[:, ids.shape[1]:]
    return generate(model, ids, method, attention_mask=mask, max_new_tokens=n)[0]


def batch_of_three(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 70, 40 and 3 real tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 70), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    mask[2, :67] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("method", ["fp16", SMALL, KIVI_LIKE], ids=["fp16", "pnmix", "kivi-like"])
def test_static_tokens_equal_generate_tiny(family, method):
    """gemma3: five sliding-window layers of 8 tokens (rings wrapped many times over, the short row's
    filled during decode) beside a full-attention one, two RoPE bases, scaled embeddings."""
    model = tiny_gemma3(window=8, vocab_size=4096) if family == "gemma3" else tiny_model(family)
    ids, mask = batch_of_three(model.config.vocab_size, seed=3)
    n = 80  # each row flushes at least once (groups of 32) and the short row fills its sinks
    want = reference(model, ids, mask, method, n)
    got = StaticGenerator(model, method, max_len=160).generate(ids, mask, max_new_tokens=n)
    assert got.shape == (3, n)
    eos = model.generation_config.eos_token_id
    assert until_eos(got, eos) == until_eos(want, eos)


def prefill_rows(dyn, gen, shape, padding, q_heads):  # type: ignore[no-untyped-def]
    """Prefills the dynamic layer `dyn` with random keys and values of `shape` (B, H_kv, T, d),
    rows 1, 2, ... left-padded by `padding`'s counts, and random queries of q_heads heads."""
    b, h, t, d = shape
    keys = torch.randn((b, h, t, d), generator=gen)
    values = torch.randn((b, h, t, d), generator=gen)
    real = torch.ones((b, t), dtype=torch.bool)
    for row, n in enumerate(padding, start=1):
        real[row, :n] = False
    dyn.update(keys, values)
    dyn.prefill(torch.randn((b, q_heads, t, d), generator=gen), keys, values, real)


def flush_due(dyn) -> bool:  # type: ignore[no-untyped-def]
    """The driver's rule: the next step flushes if it fills some row's residual buffer."""
    return any(n >= SMALL.n_sink and r + 1 == SMALL.residual_len for n, r in zip(dyn.lengths, dyn.res_len, strict=True))


def step_both(st, dyn, gen, q_heads):  # type: ignore[no-untyped-def]
    """Feeds the static layer `st` and the dynamic layer `dyn` the same random key, value and
    query (`st` flushing by `flush_due`); returns both attention outputs."""
    b, h, _, d = dyn.k_res.shape
    k = torch.randn((b, h, 1, d), generator=gen)
    v = torch.randn((b, h, 1, d), generator=gen)
    q = torch.randn((b, q_heads, 1, d), generator=gen)
    st.flush_now = flush_due(dyn)
    got = st.append_attend(k, v, q, d**-0.5)
    dyn.append(k, v)
    return got, dyn.attend(q, d**-0.5)


def test_static_layer_bytes_equal_dynamic_layer():
    """Fed the same keys and values, a static layer ends with the dynamic layer's bytes and counters
    (sinks filled during decode, several flushes, rows at different phases)."""
    gen = torch.Generator().manual_seed(11)
    b, h, d = 3, 2, 16
    model = tiny_model("llama")
    dyn = new_cache(model, SMALL).layers[0]
    prefill_rows(dyn, gen, (b, h, 70, d), (30, 67), q_heads=2 * h)  # 70, 40 and 3 real tokens (fewer than the 4 sinks)
    st = StaticQuantLayer(dyn, max_len=200)
    for _ in range(75):
        k = torch.randn((b, h, 1, d), generator=gen)
        v = torch.randn((b, h, 1, d), generator=gen)
        st.flush_now = flush_due(dyn)
        st.append_attend(k, v, torch.randn((b, 2 * h, 1, d), generator=gen), d**-0.5)
        dyn.append(k, v)
    assert st.n_groups.tolist() == dyn.n_groups
    assert st.res_len.tolist() == dyn.res_len
    assert st.sink_len.tolist() == [min(SMALL.n_sink, n) for n in dyn.lengths]
    assert min(dyn.n_groups) >= 2  # the short row flushed too
    for i in range(b):
        ng, r = dyn.n_groups[i], dyn.res_len[i]
        for name in ("k_low", "k_high", "k_scale", "k_zero"):
            assert torch.equal(getattr(st, name)[i, :, :ng], dyn.packed[name][i, :, :ng]), name
        for name in ("v_packed", "v_scale", "v_zero"):
            g = ng * SMALL.group_size
            assert torch.equal(getattr(st, name)[i, :, :g], dyn.packed[name][i, :, :g]), name
        assert torch.equal(st.k_res[i, :, :r], dyn.k_res[i, :, :r])
        assert torch.equal(st.v_res[i, :, :r], dyn.v_res[i, :, :r])
        assert torch.equal(st.k_sink[i], dyn.k_sink[i])


@pytest.mark.parametrize("method", ["fp16", SMALL], ids=["fp16", "pnmix"])
def test_static_kernel_path_equals_generate(method):
    """PNMIX_BACKEND=triton: the static step runs the decode kernels (interpreted), as on CUDA, and
    gives the tokens of `generate` on the torch reference (generate on the kernel path equals that
    too: test_kernels_wiring)."""
    model = tiny_model("qwen3")
    ids, mask = batch_of_three(model.config.vocab_size, seed=9)
    n = 34  # rows 0 and 1 flush once (steps 30 and 28), row 2 fills its sinks
    want = reference(model, ids, mask, method, n)
    backend.set_backend("triton")
    try:
        gen = StaticGenerator(model, method, max_len=120)
        got = gen.generate(ids, mask, max_new_tokens=n)
        assert all(layer.use_kernels for layer in gen.layers)
    finally:
        backend.set_backend(None)
    eos = model.generation_config.eos_token_id
    assert until_eos(got, eos) == until_eos(want, eos)


@pytest.mark.parametrize("method", ["fp16", SMALL], ids=["fp16", "pnmix"])
def test_steps_are_planned_for_their_length_bucket(method):
    """A step's launch plans are made for the longest sequence after it, rounded up to a power of
    two (`StaticGenerator.arm`): the bound covers every sequence's tokens and packed groups, and the
    graph keys walk the buckets (lengths 71-140: 128, then 256) and, quantized, the flush steps."""
    model = tiny_model("qwen3")
    ids, mask = batch_of_three(model.config.vocab_size, seed=5)
    gen = StaticGenerator(model, method, max_len=300)
    keys = []
    arm = gen.arm
    gen.arm = lambda *args: keys.append(arm(*args)) or keys[-1]  # type: ignore[method-assign]
    gen.prefill(ids, mask)
    for _ in range(70):
        gen.step()
        layer = gen.layers[0]
        if method == "fp16":
            longest = int(layer.lengths.max())
        else:
            longest = int((layer.sink_len + layer.n_groups * SMALL.group_size + layer.res_len).max())
            assert layer.groups_bound() >= int(layer.n_groups.max())
        assert keys[-1][1] == layer.plan_tokens == length_bucket(longest, 300) >= longest
    assert {bound for _, bound, _ in keys} == {128, 256}
    assert any(flush for flush, _, _ in keys) == (method != "fp16")
    assert not any(enters for _, _, enters in keys)  # no quantized window


def test_static_tokens_equal_generate_embedded(embedded):
    """The issue's check on the embedded model: pnmix-paper and fp16, a left-padded batch of two."""
    tok, model = embedded.tokenizer, embedded.model
    texts = ["Write a detailed essay about the history of the bicycle. " * 13,
             "Explain how photosynthesis works, step by step, for a student. " * 5]
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    n = 24
    cfg = preset("pnmix-paper")
    # The first row's residual buffer fills within the generation, so a flush step is included.
    first_res = (len(rows[0]) - cfg.n_sink) % cfg.group_size
    assert cfg.residual_len - first_res < n, "prompt no longer exercises the flush step"
    eos = model.generation_config.eos_token_id
    for method in (cfg, "fp16"):
        want = reference(model, ids, mask, method, n)
        got = StaticGenerator(model, method, max_len=width + n).generate(ids, mask, max_new_tokens=n)
        assert until_eos(got, eos) == until_eos(want, eos), f"{method} differs"


@pytest.mark.parametrize("window", [8, 40, 70])
def test_static_quantized_windows_tokens_equal_generate(window):
    """A layer-wise config that quantizes every window (Gemma 3's five sliding layers): the static
    windows give `generate`'s tokens over 120 steps. Windows of 8 (inside one group of 32: sinks and
    residual only) and 40 (three ring slots, wrapped many times over; the rows' first groups leave
    the window as it passes, the short row's sinks too) are rings of packed groups; 70 (>= R + G)
    is the kernels' bag, its start entering a group every 32 steps, a row at a time: the steps
    where none enters one skip that work (`StaticGenerator._window_enters_group`)."""
    from pnmix.layerwise import LayerwiseConfig
    from pnmix.static import StaticQuantBagWindowLayer, StaticQuantWindowLayer

    model = tiny_gemma3(window=window, vocab_size=4096)
    config = LayerwiseConfig(SMALL, windows=(0, 1, 2, 3, 4))
    ids, mask = batch_of_three(model.config.vocab_size, seed=7)
    n = 120
    want = reference(model, ids, mask, config, n)
    gen = StaticGenerator(model, config, max_len=200)
    keys = []
    arm = gen.arm
    gen.arm = lambda *args: keys.append(arm(*args)) or keys[-1]  # type: ignore[method-assign]
    got = gen.generate(ids, mask, max_new_tokens=n)
    eos = model.generation_config.eos_token_id
    assert until_eos(got, eos) == until_eos(want, eos)
    bag = window >= SMALL.residual_len + SMALL.group_size
    enters = [e for _, _, e in keys]
    # Bag: a row holding n tokens enters a group where (n - 70 - 4 sinks) % 32 == 0; rows of 70,
    # 40 and 3 tokens, after step s: s = 4, 36, 68, 100; 34, 66, 98; 71, 103.
    assert sum(enters) == (9 if bag else 0) and not all(enters)
    kind = StaticQuantBagWindowLayer if bag else StaticQuantWindowLayer
    assert [type(layer) for layer in gen.layers] == [kind] * 5 + [StaticQuantLayer]
    if kind is StaticQuantWindowLayer:
        assert gen.layers[0].slots == -(-window // SMALL.group_size) + 1
    assert gen.layers[0].k_low.shape[2] < gen.layers[5].k_low.shape[2]  # a window's groups, not max_len's


def test_a_quantized_window_ring_attends_as_the_dynamic_windowed_layer():
    """Fed the same keys, values and queries, a `StaticQuantWindowLayer` (3 ring slots of 32
    tokens, a window of 70) answers every step as the dynamic cache's windowed `PNMixLayer`, which
    stores every token and masks by position, through prefill tokens, several flushes and a row
    that fills its sinks during decode; and its ring holds the dynamic layer's newest groups."""
    from pnmix.layerwise import LayerwiseConfig
    from pnmix.static import StaticQuantWindowLayer

    gen = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    b, h, d, t, window = 3, 1, 16, 90, 70
    model = tiny_gemma3(window=window)
    dyn = new_cache(model, LayerwiseConfig(SMALL, windows=(0,))).layers[0]
    assert dyn.window == window
    prefill_rows(dyn, gen, (b, h, t, d), (40, 87), q_heads=4 * h)  # 90, 50 and 3 real tokens (fewer than the 4 sinks)
    st = StaticQuantWindowLayer(dyn, window)
    assert st.slots == 4 and st.k_low.shape[2] == 4
    for _ in range(200):
        got, want = step_both(st, dyn, gen, q_heads=4 * h)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    assert st.n_groups.tolist() == dyn.n_groups and st.res_len.tolist() == dyn.res_len
    assert min(dyn.n_groups) > st.slots  # every row's ring wrapped
    for i in range(b):
        for j in range(dyn.n_groups[i] - st.slots, dyn.n_groups[i]):
            s = j % st.slots
            assert torch.equal(st.k_low[i, :, s], dyn.packed["k_low"][i, :, j])
            g = SMALL.group_size
            want = dyn.packed["v_packed"][i, :, j * g : (j + 1) * g]
            assert torch.equal(st.v_packed[i, :, s * g : (s + 1) * g], want)


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_a_quantized_window_bag_attends_as_the_dynamic_windowed_layer(path):
    """Fed the same keys, values and queries, a `StaticQuantBagWindowLayer` (window 70 >= R + G:
    the groups the window admits whole in an unordered bag, the group its start is in decoded into
    the edge, newest first) answers every step as the dynamic cache's windowed `PNMixLayer`, which
    stores every token and masks by position: rows of 90, 50 and 3 real tokens (the last fills its
    sinks during decode, then its window's start passes them), 200 steps, groups entering and
    leaving the bag; on the torch path and on the decode kernels (interpreted). The bag then holds
    exactly the groups the window admits whole, as their stored bytes."""
    from pnmix.layerwise import LayerwiseConfig
    from pnmix.static import StaticQuantBagWindowLayer, quant_window_layer

    gen = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    b, h, d, t, window = 3, 1, 16, 90, 70
    g = SMALL.group_size
    model = tiny_gemma3(window=window)
    dyn = new_cache(model, LayerwiseConfig(SMALL, windows=(0,))).layers[0]
    prefill_rows(dyn, gen, (b, h, t, d), (40, 87), q_heads=4 * h)
    backend.set_backend("triton" if path == "kernels" else None)
    try:
        st = quant_window_layer(dyn, window)
        assert isinstance(st, StaticQuantBagWindowLayer) and st.use_kernels == (path == "kernels")
        assert st.slots == window // g + 1 + 1
        crossed = 0
        for _ in range(200):
            before = st.straddle.clone()
            got, want = step_both(st, dyn, gen, q_heads=4 * h)
            crossed += int((st.straddle > before).sum())
            tol = {"rtol": 1e-5, "atol": 1e-5} if path == "torch" else {"rtol": 2e-3, "atol": 2e-3}
            assert torch.allclose(got, want, **tol), (got - want).abs().max()
    finally:
        backend.set_backend(None)
    assert crossed > 3 * b  # the start entered many groups on every row
    assert st.n_groups.tolist() == dyn.n_groups and st.res_len.tolist() == dyn.res_len
    for i in range(b):
        seen = dyn.lengths[i]
        first_whole = -(-(seen - window - SMALL.n_sink) // g) if seen - window > SMALL.n_sink else 0
        whole = list(range(first_whole, dyn.n_groups[i]))
        n = int(st.bag_len[i])
        assert sorted(st.group_at[i, :n].tolist()) == whole
        for s, j in enumerate(st.group_at[i, :n].tolist()):
            assert torch.equal(st.k_low[i, :, s], dyn.packed["k_low"][i, :, j])
            want = dyn.packed["v_packed"][i, :, j * g : (j + 1) * g]
            assert torch.equal(st.v_packed[i, :, s * g : (s + 1) * g], want)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("method", ["fp16", SMALL], ids=["fp16", "pnmix"])
def test_compiled_step_equals_eager_step(method, family):
    """The step under torch.compile (whole graph, the attention operator opaque; the aot_eager
    backend: Dynamo's capture and AOT tracing without Inductor's code generation) gives the eager
    step's tokens, with flush steps and sinks filled during decode, for a first and a second batch
    size (the second compiles with a symbolic batch); gemma3: window rings and a RoPE table per
    layer kind inside the compiled step."""
    import torch._dynamo

    model = tiny_gemma3(window=8, vocab_size=4096) if family == "gemma3" else tiny_model("qwen3")
    ids, mask = batch_of_three(model.config.vocab_size, seed=5)
    torch._dynamo.reset()
    for rows in (slice(0, 3), slice(1, 3)):
        eager = StaticGenerator(model, method, max_len=120, compile=False).generate(ids[rows], mask[rows], 40)
        compiled = StaticGenerator(model, method, max_len=120, compile="aot_eager")
        assert torch.equal(compiled.generate(ids[rows], mask[rows], 40), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert not torch._dynamo.utils.counters["graph_break"]
    with pytest.raises(ValueError, match="torch.compile backend name"):
        StaticGenerator(model, method, max_len=120, compile=3)
    with pytest.raises(ValueError, match="not a torch.compile backend; allowed True, False, None or one of"):
        StaticGenerator(model, method, max_len=120, compile="no-such-backend")


def test_bad_methods_and_lengths_are_one_line_errors():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="method"):
        StaticGenerator(model, "int4", max_len=64)
    with pytest.raises(ConfigError, match="quantized keys and values"):
        StaticGenerator(model, preset("fp16"), max_len=64)
    ids = torch.randint(3, 100, (1, 40))
    gen = StaticGenerator(model, SMALL, max_len=41)
    with pytest.raises(ValueError, match="max_len=41"):
        gen.generate(ids, max_new_tokens=5)
    with pytest.raises(ValueError, match="leaves no room"):
        StaticGenerator(model, SMALL, max_len=40).prefill(ids)
    with pytest.raises(ValueError, match="max_len"):
        StaticGenerator(model, SMALL, max_len=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        StaticGenerator(model, SMALL, max_len=64).generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"allowed \[batch, tokens\]"):
        StaticGenerator(model, SMALL, max_len=64).prefill(ids[0])
    with pytest.raises(ValueError, match="attention_mask of shape"):
        StaticGenerator(model, SMALL, max_len=64).prefill(ids, torch.ones((1, 3), dtype=torch.long))
    with pytest.raises(ValueError, match="no real token"):
        StaticGenerator(model, SMALL, max_len=64).prefill(ids, torch.zeros_like(ids))
    new_cache(model, SMALL)  # the model still works with the ordinary path afterwards


def test_static_method_and_decode_cost():
    """What the tuner measures on CUDA: which configs take the static path, and its cost figures."""
    cpu = torch.device("cpu")
    assert static_method(preset("fp16"), cpu, 64) == "fp16"
    assert static_method(preset("pnmix-paper"), cpu, 64) is None  # torch attention path: not graph-safe
    backend.set_backend("triton")
    try:
        assert static_method(preset("pnmix-paper"), cpu, 64) == preset("pnmix-paper")
    finally:
        backend.set_backend(None)
    model = tiny_model("llama")
    tok_s, peak = decode_cost(model, SMALL, torch.randint(3, 100, (2, 50)), new_tokens=12)
    assert tok_s > 0 and peak == 0  # peak memory is measured on CUDA only


def test_cli_generate_static_prints_the_same_text(embedded):
    """`pnmix generate --static` (eager on the CPU) prints what the ordinary path prints."""
    import subprocess

    def run(*extra: str) -> list[str]:
        out = subprocess.run([*PNMIX, "generate", "--prompt", "Name three colors.",
                              "--max-new-tokens", "12", *extra], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()

    plain, static = run(), run("--static")
    assert static[:-1] == plain[:-1] and static[:-1]  # the generated text
    assert "static cache, eager" in static[-1] and "12 tokens" in static[-1]
    bad = subprocess.run([*PNMIX, "generate", "--prompt", "hi", "--device", "tpu"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: invalid --device 'tpu': allowed one of cpu, cuda"


def test_banned_tokens_are_never_picked_and_the_rest_is_unchanged():
    # `ban` adds -inf to a token's logit inside the step (what exact-length trajectories use): a
    # banned token never comes out, and each row follows the unbanned run up to the step where that
    # run picked a banned token.
    model = tiny_model("llama")
    ids, mask = batch_of_three(model.config.vocab_size, seed=5)
    free = StaticGenerator(model, SMALL, max_len=120).generate(ids, mask, max_new_tokens=30)
    banned = sorted({int(t) for t in free[:, 3]})  # what each row picked at step 3, and so at least that
    gen = StaticGenerator(model, SMALL, max_len=120)
    gen.ban(banned)
    got = gen.generate(ids, mask, max_new_tokens=30)
    assert not torch.isin(got, torch.tensor(banned)).any()
    for row in range(3):
        first = next(i for i, t in enumerate(free[row].tolist()) if t in banned)
        assert first <= 3
        assert got[row, :first].tolist() == free[row, :first].tolist()
        assert got[row, first] != free[row, first]


def test_a_benchmark_finds_its_siblings_under_python_dash_p():
    # The GPU scripts run the benchmarks with `python -P`, which puts no script folder on sys.path.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('static_study', "
            "'benchmarks/static_study.py'); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.sibling('bench_decode').copy_bandwidth.__name__, 'bench_decode' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["copy_bandwidth", "False"]
