"""Trial scoring: tasks, filtering, long-output fidelity, the proxy, and the eval command."""

import json
import subprocess
import sys
import time

import pytest
import torch
from tiny import tiny_model

from pnmix.analysis import Trace, record_trace
from pnmix.config import PNMixConfig, preset
from pnmix.tuner.scoring import tasks
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.fidelity import reference_logits, replay, trajectory
from pnmix.tuner.scoring.profiles import Profile
from pnmix.tuner.scoring.proxy import proxy_kl
from pnmix.tuner.scoring.stats import combine

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path

SMALL = PNMixConfig(b_high=3, b_low=1, group_size=32, salient_ratio=0.5, n_sink=4, residual_len=32,
                    value_bits=2, value_group_size=16)


def test_items_are_deterministic_per_seed():
    a, b = tasks.passkey_items(4, seed=1), tasks.passkey_items(4, seed=1)
    assert a == b and a != tasks.passkey_items(4, seed=2)
    kv = tasks.kv_lookup_items(3, seed=1, pairs=(10, 20))
    assert kv == tasks.kv_lookup_items(3, seed=1, pairs=(10, 20))
    assert kv[0].answer in kv[0].prompt and kv[0].prompt.count(" number is ") == 10
    # Context grows along the list.
    assert len(a[0].prompt) < len(a[-1].prompt)


def test_numeric_items_file_and_last_number_rule(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"question": "2 + 3?", "answer": 5}, {"question": "Half of 9?", "answer": "#### 4.5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = tasks.items_file(path)
    assert [it.answer for it in items] == ["5", "4.5"]
    assert items[0].is_correct("First 2, then 3, so the answer is 5.")
    assert not items[0].is_correct("It is 5, no wait, 6")
    assert items[1].is_correct("the result: 4.50")
    assert not items[1].is_correct("no number here")


def test_combined_accuracy_weights():
    assert combine({"passkey": 1.0, "kv_lookup": 0.0, "fidelity": 0.5}) == pytest.approx(0.25 + 0.25)
    assert combine({"fidelity": 0.8}) == pytest.approx(0.8)


def test_fidelity_is_exact_for_an_unquantized_cache_and_drops_when_quantized():
    model = tiny_model("llama", seed=4)
    prompt = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cont = trajectory(model, prompt, 80)
    assert len(cont) == 80
    ref = reference_logits(model, prompt, cont)
    same = replay(model, prompt, cont, preset("fp16"), ref)
    assert same.agreement == 1.0 and same.mean_kl < 1e-6 and same.score > 0.999999
    coarse = replay(model, prompt, cont, SMALL.with_(b_high=1, b_low=1, salient_ratio=0.0), ref)
    fine = replay(model, prompt, cont, SMALL.with_(b_high=4, b_low=4, salient_ratio=0.0, value_bits=8), ref)
    assert coarse.mean_kl > fine.mean_kl > 0


@pytest.mark.parametrize("config", [SMALL, SMALL.with_(n_sink=0, value_bits=16),
                                    SMALL.with_(b_high=2, b_low=2, salient_ratio=0.0)])
def test_a_replay_in_chunks_attends_exactly_as_token_by_token_decode(config):
    # A step of n tokens sees each block that it quantizes unquantized up to the block's last token,
    # as n single-token steps do: the chunk size changes nothing but the cost.
    model = tiny_model("llama", seed=4, dtype=torch.float64)
    prompt = torch.randint(1, 128, (1, 45), generator=torch.Generator().manual_seed(2))
    cont = trajectory(model, prompt, 150)  # several residual flushes (R = 32) inside one chunk
    ref = reference_logits(model, prompt, cont)
    one_by_one = replay(model, prompt, cont, config, ref, chunk=1)
    assert one_by_one.mean_kl > 1e-4  # the cache is really quantized
    for chunk in (7, 32, 149):
        chunked = replay(model, prompt, cont, config, ref, chunk=chunk)
        assert chunked.agreement == one_by_one.agreement
        assert chunked.mean_kl == pytest.approx(one_by_one.mean_kl, rel=1e-9), chunk


def test_proxy_orders_bit_widths_on_a_real_trace():
    model = tiny_model("llama", seed=6)
    prompt = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    trace = record_trace(model, prompt, new_tokens=80)
    kls = [proxy_kl(trace, SMALL.with_(b_high=b, b_low=b, salient_ratio=0.0), "rotate_half") for b in (1, 2, 4)]
    assert kls[0] > kls[1] > kls[2] > 0
    assert proxy_kl(trace, preset("fp16"), "rotate_half") == 0.0


def test_proxy_is_fast_on_an_embedded_model_sized_trace():
    # Shaped like smollm2-135m with a 64-token prompt and 512 generated tokens.
    gen = torch.Generator().manual_seed(0)
    trace = Trace([torch.randn((9, 576, 64), generator=gen) for _ in range(30)],
                  [torch.randn((3, 576, 64), generator=gen) for _ in range(30)], 64, 0.125)
    cfg = preset("pnmix-paper")
    proxy_kl(trace, cfg, "rotate_half")  # warm-up
    best = min(_timed(lambda: proxy_kl(trace, cfg, "rotate_half")) for _ in range(3))
    assert best < 1.0, f"proxy took {best:.2f} s"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


TEST_PROFILE = Profile("test", passkey_items=2, passkey_filler=(8, 12), passkey_digits=5, passkey_distractors=1,
                       kv_items=2, kv_pairs=(10, 20), kv_digits=5, kv_near_miss=1,
                       fidelity_prompts=2, fidelity_tokens=96, proxy_tokens=160)


# The tests of one prepared evaluator run on one xdist worker, so that it is prepared once.
ONE_WORKER = pytest.mark.xdist_group("embedded-evaluator")


# Session-scoped: xdist may run other modules' tests between these on the worker, which would end a
# module-scoped fixture and prepare it again.
@pytest.fixture(scope="session")
def evaluator(embedded):
    """An evaluator of the embedded model on TEST_PROFILE, prepared once for the tests below."""
    ev = Evaluator("smollm2-135m", TEST_PROFILE, seed=0)
    ev.prepare()
    return ev


@pytest.fixture(scope="session")
def one_bit(evaluator):
    return evaluator.evaluate(preset("kivi1"))


@ONE_WORKER
def test_filtering_keeps_only_items_the_unquantized_model_answers(evaluator):
    data = evaluator.prepare()
    for name in ("passkey", "kv_lookup"):
        assert data["items"][name], f"no {name} item survived filtering"
        for item in data["items"][name]:
            assert item.is_correct(tasks.answer(evaluator.model, evaluator.tokenizer, preset("fp16"), item))
    assert evaluator.unit_counts() == {"passkey": len(data["items"]["passkey"]),
                                       "kv_lookup": len(data["items"]["kv_lookup"]), "fidelity": 2}


@ONE_WORKER
def test_fp16_scores_one_and_one_bit_keys_fail_retrieval(evaluator, one_bit):
    fp16 = evaluator.evaluate(preset("fp16"))
    assert fp16.accuracy == pytest.approx(1.0, abs=1e-6) and fp16.fidelity_kl < 1e-5
    # Short test trajectories quantize few groups, so 1-bit keys only dent fidelity; retrieval fails.
    assert one_bit.accuracy < 0.5 and one_bit.parts["fidelity"] < 0.9
    assert one_bit.kv_bytes < fp16.kv_bytes / 3
    assert one_bit.key_bits == pytest.approx(1.25)  # 1 bit + fp16 scale and zero per 128 tokens
    # Every part carries its per-unit outcomes and a standard error computed from them.
    assert len(one_bit.units["fidelity"]) == 2
    assert one_bit.accuracy_se is not None and 0 < one_bit.accuracy_se < 0.5
    assert fp16.accuracy_se < 1e-6 and one_bit.parts_se["fidelity"] > 0


@ONE_WORKER
def test_a_second_evaluator_reads_the_cache_and_scores_the_same(evaluator, one_bit):
    again = Evaluator("smollm2-135m", TEST_PROFILE, seed=0).evaluate(preset("kivi1"))
    assert again.accuracy == one_bit.accuracy and again.parts == one_bit.parts
    assert again.units == one_bit.units


@ONE_WORKER
def test_a_race_rung_completed_later_scores_as_one_evaluation(evaluator, one_bit):
    counts = evaluator.unit_counts()
    first = evaluator.rung(preset("kivi1"), dict.fromkeys(counts, 1))
    assert {k: len(u) for k, u in first.units.items()} == dict.fromkeys(counts, 1) and first.seconds > 0
    done = evaluator.evaluate(preset("kivi1"), have=first)
    assert done.units == one_bit.units and done.accuracy == one_bit.accuracy
    assert done.fidelity_agreement == one_bit.fidelity_agreement


@ONE_WORKER
def test_the_proxy_orders_one_bit_below_two_bit_keys(evaluator):
    assert evaluator.proxy(preset("kivi1")) > evaluator.proxy(preset("kivi2")) > 0


def test_a_preparation_builds_only_the_parts_it_runs(embedded):
    """An evaluator of one part builds that part alone; one that runs more adds the rest to the same file."""
    one = Evaluator("smollm2-135m", SMALLEST, seed=5, tasks=("passkey",))  # a seed no other test prepares
    one.cache_file().unlink(missing_ok=True)
    one.prepare()
    stored = json.loads(one.cache_file().read_text())
    assert stored["built"] == ["passkey"] and list(stored["items"]) == ["passkey"] and stored["trajectories"] == []
    assert one.unit_counts() == {"passkey": 1}
    every = Evaluator("smollm2-135m", SMALLEST, seed=5)
    every.prepare()
    stored_again = json.loads(one.cache_file().read_text())
    assert stored_again["built"] == ["passkey", "kv_lookup", "fidelity"] and len(stored_again["trajectories"]) == 1
    assert stored_again["items"]["passkey"] == stored["items"]["passkey"]  # the built part is kept as it was
    assert every.unit_counts() == {"passkey": 1, "kv_lookup": 1, "fidelity": 1}


# The least a preparation holds: one item of each task, one short trajectory (a rebuild is what the
# test below pays for).
SMALLEST = Profile("smallest", passkey_items=1, passkey_filler=(8, 10), passkey_digits=5, passkey_distractors=0,
                   kv_items=1, kv_pairs=(8, 10), kv_digits=5, kv_near_miss=0, fidelity_prompts=1,
                   fidelity_tokens=24, proxy_tokens=64)


def test_a_corrupt_cached_preparation_is_reported_in_one_line_and_rebuilt(embedded, capsys):
    ev = Evaluator("smollm2-135m", SMALLEST, seed=0)
    path = ev.cache_file()
    ev.prepare()
    good = json.loads(path.read_text())
    path.write_text('{"items": {"passkey": [{"task": "passkey"')  # cut off mid-write
    again = Evaluator("smollm2-135m", SMALLEST, seed=0)
    data = again.prepare()
    err = [line for line in capsys.readouterr().err.splitlines() if "cached preparation" in line]
    assert len(err) == 1 and "is unreadable" in err[0] and "rebuilding it" in err[0] and str(path) in err[0]
    assert err[0].startswith("warning: ")
    assert json.loads(path.read_text()) == good  # rebuilt to the same items
    assert [it.answer for it in data["items"]["passkey"]] == [it["answer"] for it in good["items"]["passkey"]]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--profile", "huge"), "invalid --profile 'huge': allowed one of quick, full, smoke"),
        (("--tasks", "passkey,poetry"), "invalid --tasks 'passkey,poetry': allowed distinct names among passkey"),
        (("--model", "no-such-model"), "unknown model"),
        (("--tasks", "items"), "needs a JSONL file"),
    ],
)
def test_eval_bad_input_is_one_line(args, needle):
    out = subprocess.run([*PNMIX, "eval", *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_eval_empty_items_file_is_one_line(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    out = subprocess.run([*PNMIX, "eval", "--items", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "is empty" in out.stderr and "Traceback" not in out.stderr


def test_a_model_that_answers_few_candidates_draws_more_pools(embedded):
    """Long fact lists the embedded model often misses, one candidate a kept item: the first pool
    cannot fill the count, so candidates come from more pools at the same seed, none repeated, the
    first pool's hits first."""
    from pnmix.tuner.scoring.preparation import EXTRA_POOLS

    hard = Profile("hard-kv", passkey_items=1, passkey_filler=(8, 10), passkey_digits=5, passkey_distractors=0,
                   kv_items=3, kv_pairs=(70, 80), kv_digits=7, kv_near_miss=3, fidelity_prompts=1,
                   fidelity_tokens=8, proxy_tokens=8, pool_factor=1)
    ev = Evaluator("smollm2-135m", hard, seed=7, tasks=("kv_lookup",))
    ev.cache_file().unlink(missing_ok=True)
    ev.prepare()
    kept = json.loads(ev.cache_file().read_text())["items"]["kv_lookup"]
    pools = [tasks.kv_lookup_items(3, 7, (70, 80), 7, 3, pool=k) for k in range(EXTRA_POOLS + 1)]
    drawn = [[it.prompt for it in pool] for pool in pools]
    assert len({p for pool in drawn for p in pool}) == 3 * (EXTRA_POOLS + 1)  # the pools never repeat a candidate
    where = [next(k for k, pool in enumerate(drawn) if it["prompt"] in pool) for it in kept]
    assert len(kept) == 3 and where == sorted(where) and where[-1] > 0, where
