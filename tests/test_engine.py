"""The scoring engine against the per-item reference: recorded prefills, batched answers and replay."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_gemma3, tiny_model

from pnmix.cache import PNMixLayer
from pnmix.config import PNMixConfig, preset
from pnmix.generation import cache_kwargs, generate, new_cache
from pnmix.prefill import RECORDED_CRITERIA, build_cache, record_prefill, record_prefills
from pnmix.recipes import EngineRecipe
from pnmix.static import StaticGenerator
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import stats, tasks
from pnmix.tuner.scoring.cost import COST_NEW_TOKENS, COST_PROMPT_TOKENS
from pnmix.tuner.scoring.engine import ScoringEngine, Trajectory
from pnmix.tuner.scoring.fidelity import reference_logits, replay, trajectory

SMALL = PNMixConfig(b_high=3, b_low=1, group_size=32, salient_ratio=0.5, n_sink=4, residual_len=32,
                    value_bits=2, value_group_size=16)
CONFIGS = {
    "pnmix": SMALL,
    "fp16": preset("fp16"),
    "kivi": SMALL.with_(b_high=2, b_low=2, salient_ratio=0.0, n_sink=0),
    "k_magnitude": SMALL.with_(b_high=4, b_low=2, salient_ratio=0.25, criterion="k_magnitude"),
    "keys_only": SMALL.with_(value_bits=16),
    "random": SMALL.with_(criterion="random", n_sink=0, group_size=64, residual_len=64),
}


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 120, (1, n), generator=gen) for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_built_from_a_recorded_prefill_holds_the_live_prefills_bytes(family, name):
    model = tiny_model(family, seed=3)
    config = CONFIGS[name]
    prompts = _prompts((37, 70, 101))
    built = build_cache(model, config, [record_prefill(model, p) for p in prompts])
    for b, p in enumerate(prompts):
        live = new_cache(model, config)
        with torch.inference_mode():
            model(input_ids=p, attention_mask=torch.ones_like(p), use_cache=True, **cache_kwargs(model, live))
        for got, want in zip(built.layers, live.layers, strict=True):
            assert isinstance(got, PNMixLayer) and isinstance(want, PNMixLayer)
            assert got.lengths[b] == want.lengths[0] and got.n_groups[b] == want.n_groups[0]
            assert torch.equal(got.salient_pairs[b], want.salient_pairs[0])
            for region, t in want.packed.items():
                assert torch.equal(got.packed[region][b, :, : t.shape[2]], t[0]), region
            assert torch.equal(got.k_sink[b], want.k_sink[0])
            r = want.res_len[0]
            assert torch.equal(got.k_res[b, :, :r], want.k_res[0, :, :r])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefills_recorded_together_equal_those_recorded_alone(family):
    """Right-padded batches (here of at most 200 padded tokens: rows of unlike lengths together, and
    a batch of one) give each prompt's own states, in the prompts' order; in float64 the batched
    products' rounding stays far below anything a quantizer or an argmax could see."""
    model = tiny_model(family, seed=4, dtype=torch.float64)
    prompts = _prompts((37, 70, 101, 64, 12, 70), seed=6)
    alone = [record_prefill(model, p) for p in prompts]
    together = record_prefills(model, prompts, batch_tokens=200)
    assert [s.length for s in together] == [p.shape[1] for p in prompts]
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
        for c in RECORDED_CRITERIA:
            for x, y in zip(a.scores[c], b.scores[c], strict=True):
                torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-10, atol=1e-10)
    engine = ScoringEngine(model, tokenizer=None)
    assert torch.equal(engine.greedy(SMALL, together, 30), engine.greedy(SMALL, alone, 30))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_answers_equal_per_item_generate_exactly_in_float64(name):
    model = tiny_model("llama", seed=1, dtype=torch.float64)
    model.config.eos_token_id = 7  # a token the random model does emit, so rows end at different steps
    config = CONFIGS[name]
    prompts = _prompts((37, 70, 101, 64, 12), seed=2)
    engine = ScoringEngine(model, tokenizer=None)
    tokens = engine.greedy(config, [record_prefill(model, p) for p in prompts], 40)
    ended = 0
    for row, p in enumerate(prompts):
        want = generate(model, p, config, max_new_tokens=40)[0][0].tolist()
        got = tokens[row].tolist()
        assert got[: len(want)] == want
        ended += len(want) < 40
    assert name != "fp16" or ended  # the end-of-sequence stop is exercised


def test_static_path_started_from_a_built_cache_equals_generate():
    # fp32, as the static path's own equality tests: its CPU attention is the fp32 reference.
    model = tiny_model("llama", seed=5)
    prompts = _prompts((45, 80, 33), seed=4)
    for config in (SMALL, preset("fp16")):
        cache = build_cache(model, config, [record_prefill(model, p) for p in prompts])
        first = torch.stack([record_prefill(model, p).logits for p in prompts]).argmax(-1)
        method = "fp16" if config == preset("fp16") else config
        gen = StaticGenerator(model, method, max_len=101 + 40, graphs=False)
        gen.start(cache, first)
        tokens = [first] + [gen.step().clone() for _ in range(39)]
        got = torch.stack(tokens, dim=1)
        for row, p in enumerate(prompts):
            want = generate(model, p, config, max_new_tokens=40)[0][0]  # stops at end-of-sequence
            assert torch.equal(got[row, : len(want)], want), (config, row)


@pytest.mark.parametrize(("windows", "window", "kind"), [
    (False, 40, "StaticWindowLayer"), (True, 40, "StaticQuantWindowLayer"), (True, 70, "StaticQuantBagWindowLayer")],
    ids=["exact-windows", "quantized-ring", "quantized-bag"])
def test_static_path_started_from_a_built_cache_on_a_hybrid_equals_generate(windows, window, kind):
    # What a GPU trial of a hybrid model decodes on: the static path started from the batched
    # cache, its windows as rings (in fp32, or of packed groups where the config quantizes them),
    # or, for a quantized window of at least R + G, the kernels' bag.
    from pnmix.layerwise import LayerwiseConfig

    model = tiny_gemma3(window=window, vocab_size=4096)
    prompts = _prompts((45, 80, 33), seed=4)
    config = LayerwiseConfig(SMALL, windows=(0, 1, 2, 3, 4)) if windows else SMALL
    states = [record_prefill(model, p) for p in prompts]
    cache = build_cache(model, config, states)
    first = torch.stack([s.logits for s in states]).argmax(-1)
    gen = StaticGenerator(model, config, max_len=101 + 60, graphs=False)
    gen.start(cache, first)
    assert [type(layer).__name__ for layer in gen.layers[:5]] == [kind] * 5
    got = torch.stack([first] + [gen.step().clone() for _ in range(59)], dim=1)
    for row, p in enumerate(prompts):
        want = generate(model, p, config, max_new_tokens=60)[0][0]  # stops at end-of-sequence
        assert torch.equal(got[row, : len(want)], want), row


def test_batched_replay_equals_per_trajectory_replay():
    model = tiny_model("llama", seed=4, dtype=torch.float64)
    prompts = _prompts((40, 23, 61), seed=6)
    trajs = []
    for p in prompts:
        cont = trajectory(model, p, 90)
        trajs.append(Trajectory(p[0].tolist(), cont, reference_logits(model, p, cont)))
    engine = ScoringEngine(model, tokenizer=None)
    engine.add_trajectories(trajs)
    for config in (SMALL, preset("fp16"), SMALL.with_(b_high=1, b_low=1, salient_ratio=0.0)):
        batched = engine.fidelity(config)
        for (agree, kl), traj in zip(batched, trajs, strict=True):
            ref = replay(model, torch.tensor([traj.prompt_ids]), traj.tokens, config, traj.reference_logits)
            assert agree == ref.agreement
            assert kl == pytest.approx(ref.mean_kl, rel=1e-9, abs=1e-12)
    assert all(kl < 1e-12 for _, kl in engine.fidelity(preset("fp16")))


def test_continuations_are_greedy_fp16_of_exact_length():
    model = tiny_model("llama", seed=4, dtype=torch.float64)
    prompts = _prompts((40, 23), seed=6)
    engine = ScoringEngine(model, tokenizer=None)
    got = engine.continuations([p[0].tolist() for p in prompts], 50)
    for p, cont in zip(prompts, got, strict=True):
        assert cont == trajectory(model, p, 50)


@pytest.mark.parametrize("name", ["pnmix", "fp16", "kivi", "keys_only"])
def test_cost_bytes_equal_those_of_generate_on_the_same_workload(name):
    model = tiny_model("llama", seed=2)
    model.resize_token_embeddings(4096)  # the workload's random ids reach 4000
    config = CONFIGS[name].with_(group_size=64, residual_len=128) if name != "fp16" else CONFIGS[name]
    kv_bytes, tok_s, peak = ScoringEngine(model, tokenizer=None).measure_cost(config, seed=3)
    ids = torch.randint(100, 4000, (1, COST_PROMPT_TOKENS), generator=torch.Generator().manual_seed(3))
    _, cache = generate(model, ids, config, max_new_tokens=COST_NEW_TOKENS, min_new_tokens=COST_NEW_TOKENS)
    assert kv_bytes == cache.nbytes()["total"]
    assert tok_s > 0 and peak is None


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["pnmix", "fp16"])
def test_decode_throughput_is_bounded_by_the_measured_step_time(device, name):
    """Tokens/s is one over a step time, so it lies between the fastest and slowest single step timed
    on the same workload (with room for noise): never millions of tokens a second from a clock
    difference. On CUDA the engine times the static CUDA-graph step, so that is what is timed here."""
    import statistics
    import time

    from pnmix.static import static_method

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", seed=2, dtype=dtype).to(device)
    model.resize_token_embeddings(4096)  # the workload's random ids reach 4000
    config = CONFIGS[name]
    engine = ScoringEngine(model, tokenizer=None)
    _, tok_s, _ = engine.measure_cost(config, seed=3)
    state = engine._on_device([engine._cost_state])[0]
    first = state.logits.argmax(-1)[None]
    cache = build_cache(model, config, [state])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    method = static_method(config, engine.device, state.keys[0].shape[-1]) if device == "cuda" else None
    if method is not None:
        static = StaticGenerator(model, method, max_len=COST_PROMPT_TOKENS + 24)
        static.start(cache, first)
        step = static.step
    else:
        kw = cache_kwargs(model, cache)
        feed = {"ids": first[:, None], "pos": torch.tensor([[state.length]], device=engine.device)}

        def step():
            logits = model(input_ids=feed["ids"], position_ids=feed["pos"], use_cache=True, **kw).logits
            feed["ids"], feed["pos"] = logits[:, -1].argmax(-1, keepdim=True), feed["pos"] + 1

    for _ in range(2):
        step()
    times = []
    for _ in range(12):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    # A timed step includes a synchronization the engine's runs share among their steps: allow for it
    # above; below, a shared machine's noise.
    assert 0.2 / statistics.median(times) < tok_s < 3.0 / min(times), (tok_s, min(times), statistics.median(times))


def test_an_item_longer_than_the_context_is_refused_in_one_line(embedded):
    engine = ScoringEngine(embedded.model, embedded.tokenizer)
    long = tasks.passkey_items(1, seed=0, filler_sentences=(900, 900))
    with pytest.raises(EvalError, match=r"passkey item 0 needs \d+ tokens, more than the model's context of 8192"):
        engine.add_items("passkey", long)
    assert "passkey" not in engine.items  # nothing half-added


def test_items_that_do_not_fit_memory_are_refused_in_one_line(embedded):
    engine = ScoringEngine(embedded.model, embedded.tokenizer, memory_bytes=64 * 2**20)
    items = tasks.passkey_items(2, seed=0, filler_sentences=(60, 60))
    with pytest.raises(EvalError, match=r"passkey item 0 needs \d+ MiB to decode, more than the 32 MiB available"):
        engine.add_items("passkey", items)


def test_batched_answers_agree_with_per_item_answers_on_the_embedded_model(embedded):
    """fp32 on the CPU: batching reorders float sums, so a code on a rounding boundary may flip.

    One config of each class the engine batches differently: unquantized (fp16), mixed precision with
    a salient set chosen per sequence (pnmix-paper), and uniform 1-bit keys, where a flipped code
    moves a logit most (kivi1); kivi2 and kitty are these classes at other bits or criteria."""
    engine = ScoringEngine(embedded.model, embedded.tokenizer)
    items = tasks.passkey_items(3, seed=3, filler_sentences=(6, 20), digits=5)
    items += tasks.kv_lookup_items(3, seed=3, pairs=(6, 14), digits=5)
    engine.add_items("mixed", items)
    same = total = 0
    for name in ("fp16", "pnmix-paper", "kivi1"):
        config = preset(name).with_(group_size=32, residual_len=32) if name != "fp16" else preset(name)
        for item, text in zip(items, engine.answers(config, "mixed"), strict=True):
            same += text == tasks.answer(embedded.model, embedded.tokenizer, config, item)
            total += 1
    assert total == 18 and same >= 17, f"{same}/{total} answers equal"


# -- standard errors -------------------------------------------------------------------------------


def test_item_part_standard_error_is_binomial():
    units = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    p, n = 6 / 8, 8
    assert stats.part_score("passkey", units) == p
    assert stats.part_se("passkey", units) == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    assert stats.part_se("passkey", [1.0]) is None


def test_fidelity_standard_error_by_the_delta_method():
    kls = [0.10, 0.14, 0.12, 0.20]
    mean = sum(kls) / 4
    sd = math.sqrt(sum((k - mean) ** 2 for k in kls) / 3)
    assert stats.part_score("fidelity", kls) == pytest.approx(math.exp(-mean))
    assert stats.part_se("fidelity", kls) == pytest.approx(math.exp(-mean) * sd / 2)


def test_combined_and_paired_standard_errors():
    a = {"passkey": [1.0, 1.0, 0.0, 1.0], "fidelity": [0.1, 0.2, 0.15, 0.12]}
    b = {"passkey": [1.0, 0.0, 0.0, 1.0], "fidelity": [0.3, 0.25, 0.35, 0.3]}
    w = {"passkey": 0.25 / 0.75, "fidelity": 0.5 / 0.75}
    se_a = stats.combined_se(a)
    assert se_a == pytest.approx(math.sqrt(sum((w[k] * stats.part_se(k, a[k])) ** 2 for k in a)))
    d = stats.paired(a, b)
    assert d["passkey"][0] == pytest.approx(0.25)
    assert d["passkey"][1] == pytest.approx(0.25)  # differences 0, 1, 0, 0: sd 0.5 over sqrt(4)
    want = w["passkey"] * 0.25 + w["fidelity"] * (math.exp(-0.1425) - math.exp(-0.3))
    assert d["accuracy"][0] == pytest.approx(want)
    # Pairing removes what both configs share: b shifted by a constant KL has a tiny paired SE.
    shifted = {"fidelity": [k + 0.1 for k in a["fidelity"]]}
    assert stats.paired({"fidelity": a["fidelity"]}, shifted)["fidelity"][1] < 0.2 * stats.part_se("fidelity", a[
        "fidelity"])
    with pytest.raises(ValueError, match="not the same items"):
        stats.paired({"passkey": [1.0]}, {"passkey": [1.0, 0.0]})



RECIPES = {
    "fp8/nvfp4": [("fp8", "nvfp4"), ("bf16", "bf16")],
    "q8_0/q4_0": [("q4_0", "q8_0"), ("q8_0", "q4_0")],
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_batched_recipe_answers_equal_per_item_generate_with_its_recipe_cache(name):
    # An engine recipe's batch (pnmix.recipe_cache.build_recipe_cache): each prompt stored as the
    # recipe's cache stores it alone, every decoded token round-tripped with that prompt's scales.
    model = tiny_model("llama", seed=1, dtype=torch.float64, head_dim=32)
    model.config.eos_token_id = 7
    recipe = EngineRecipe.of(RECIPES[name])
    prompts = _prompts((37, 70, 12, 64), seed=2)
    engine = ScoringEngine(model, tokenizer=None)
    tokens = engine.greedy(recipe, [record_prefill(model, p) for p in prompts], 30)
    plain = engine.greedy(preset("fp16"), [record_prefill(model, p) for p in prompts], 30)
    assert not torch.equal(tokens, plain)  # the formats change the answers of a random model
    for row, p in enumerate(prompts):
        want = generate(model, p, recipe, max_new_tokens=30)[0][0].tolist()
        assert tokens[row].tolist()[: len(want)] == want, row


def test_batched_recipe_replay_and_bytes_on_a_hybrid_model():
    model = tiny_gemma3(dtype=torch.float64, window=8, head_dim=32)
    recipe = EngineRecipe.uniform(model.config.num_hidden_layers, "fp8", "nvfp4")
    prompts = [torch.randint(1, 120, (1, n), generator=torch.Generator().manual_seed(n)) for n in (20, 31)]
    trajs = []
    for p in prompts:
        cont = trajectory(model, p, 24)
        trajs.append(Trajectory(p[0].tolist(), cont, reference_logits(model, p, cont)))
    engine = ScoringEngine(model, tokenizer=None)
    engine.add_trajectories(trajs)
    for (agree, kl), traj in zip(engine.fidelity(recipe), trajs, strict=True):
        ref = replay(model, torch.tensor([traj.prompt_ids]), traj.tokens, recipe, traj.reference_logits)
        assert agree == ref.agreement
        assert kl == pytest.approx(ref.mean_kl, rel=1e-6, abs=1e-12) and kl > 0
    kv_bytes, tok_s, peak = engine.measure_cost(recipe, seed=3)
    held = engine.plan.held(512 + 31)  # the cost workload: a 512-token prompt, 31 tokens fed back
    h, d = model.config.num_key_value_heads, 32
    assert kv_bytes == sum(n * h * d * (8 + 4.5) for n in held) // 8 and tok_s == 0.0
