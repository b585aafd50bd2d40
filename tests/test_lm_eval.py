"""The lm-evaluation-harness model `pnmix` (pnmix/lm_eval.py) and lm-eval tasks as an accuracy part
(tuner/scoring/harness.py), on a tiny local task (tests/data/lm_eval: a YAML over a JSONL file, no download)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path

pytest.importorskip("lm_eval", reason="needs the lm-eval extra: pip install -e '.[lm-eval]'")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tiny task reads a local file; nothing is fetched

TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
TASK_YAML = TASK_DIR / "pnmix_tiny.yaml"
STOPS = ("\n", ".")

pytestmark = pytest.mark.slow


def _quantizing_config():
    """Quantizes from the 33rd token on, so the tiny task's ~40-token prompts meet quantized keys."""
    from pnmix.config import PNMixConfig

    return PNMixConfig(b_high=2, b_low=1, group_size=32, salient_ratio=0.25, n_sink=0, residual_len=32)


def _run(lm, batch_size: int):
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm.batch_size_per_gpu = batch_size
    out = lm_eval.simple_evaluate(model=lm, tasks=["pnmix_tiny"], task_manager=TaskManager(include_path=str(TASK_DIR)),
                                  log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    return out["samples"]["pnmix_tiny"]


def test_answers_equal_pnmix_generate(embedded):
    """Every answer of the harness model, batched or not, is pnmix.generation.generate's for the same prompt."""
    from pnmix.generation import generate
    from pnmix.lm_eval import PNMixLM

    config = _quantizing_config()
    lm = PNMixLM(pretrained=embedded.model, tokenizer=embedded.tokenizer, config=config, batch_size=1)
    single, batched = _run(lm, 1), _run(lm, 4)
    assert len(single) == len(batched) == 8
    eos = embedded.tokenizer.eos_token
    quantized = 0
    for one, many in zip(single, batched, strict=True):
        context, kwargs = one["arguments"][0]  # the request's (context, generation kwargs)
        ids = lm.tok_encode(context)
        import torch

        new, cache = generate(embedded.model, torch.tensor([ids]), config, max_new_tokens=kwargs["max_gen_toks"])
        quantized += cache.nbytes()["regions"]["packed_keys"] > 0
        text = embedded.tokenizer.decode(new[0], skip_special_tokens=True)
        for stop in (*STOPS, eos):
            text = text.split(stop)[0]
        assert one["resps"][0][0] == text, context
        assert many["resps"][0][0] == text, context
    assert quantized >= len(single) // 2  # most prompts are longer than the residual: their keys were quantized


def test_loglikelihood_warns_once(embedded, caplog):
    from lm_eval.api.instance import Instance

    from pnmix.lm_eval import LOGLIKELIHOOD_WARNING, PNMixLM

    lm = PNMixLM(pretrained=embedded.model, tokenizer=embedded.tokenizer, config="kivi2", batch_size=2)
    reqs = [Instance("loglikelihood", {}, ("The sky is", " blue"), i) for i in range(2)]
    with caplog.at_level("WARNING", logger="pnmix.lm_eval"):
        lm.loglikelihood(reqs, disable_tqdm=True)
        lm.loglikelihood(reqs, disable_tqdm=True)
    assert [r.getMessage() for r in caplog.records if r.name == "pnmix.lm_eval"] == [LOGLIKELIHOOD_WARNING]


def test_registered_and_config_from_file(tmp_path):
    from lm_eval.api.registry import get_model

    from pnmix.config import preset
    from pnmix.errors import PNMixError
    from pnmix.lm_eval import PNMixLM, resolve_config

    assert get_model("pnmix") is PNMixLM
    path = tmp_path / "cfg.json"
    path.write_text(preset("kitty").to_json())
    assert resolve_config(str(path)) == preset("kitty")
    assert resolve_config("kivi2") == preset("kivi2")
    with pytest.raises(PNMixError, match="neither a preset"):
        resolve_config("no-such-config")


def test_lm_eval_part_filtered_and_scored():
    """The part through an Evaluator, as `pnmix tune --lm-eval-task` passes it (a task-list entry)."""
    from pnmix.config import preset
    from pnmix.tuner.scoring import harness
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import Profile

    entry = harness.spec_entry(str(TASK_YAML), 6)
    assert harness.parse_entry(entry) == (str(TASK_YAML.resolve()), 6)
    # Our own tasks are not scored here: a profile with next to nothing of them keeps preparation short.
    tiny = Profile("lm-eval-test", passkey_items=1, passkey_filler=(2, 3), passkey_digits=5, passkey_distractors=0,
                   kv_items=1, kv_pairs=(2, 3), kv_digits=5, kv_near_miss=0, fidelity_prompts=0,
                   fidelity_tokens=8, proxy_tokens=8, pool_factor=1)
    ev = Evaluator("smollm2-135m", tiny, tasks=(entry,))
    assert ev.tasks == ("lm_eval",) and ev.harness is not None
    kept = ev.harness.kept()
    assert 0 < len(kept) <= 6 and ev.harness._cache_file().is_file()  # cached
    fp16 = ev.evaluate(preset("fp16"), measure=False)
    assert fp16.parts == {"lm_eval": 1.0} and fp16.items == {"lm_eval": len(kept)}
    low = ev.evaluate(_quantizing_config(), measure=False)
    assert set(low.units) == {"lm_eval"} and len(low.units["lm_eval"]) == len(kept)
    assert low.accuracy == low.parts["lm_eval"] and low.parts_se["lm_eval"] is not None


def test_cli_lm_eval_errors_are_one_line(tmp_path):
    run = subprocess.run([*PNMIX, "tune", "--lm-eval-limit", "3", "--storage",
                          f"sqlite:///{tmp_path / 'db.sqlite'}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == "error: --lm-eval-limit needs --lm-eval-task"


def test_missing_extra_names_the_pip_command():
    """Without the harness, `python -m pnmix.lm_eval` and the import say which pip install to run, in one line."""
    hide = "import sys; sys.modules['lm_eval'] = None; "
    run = subprocess.run([sys.executable, "-P", "-c", hide + "import runpy; runpy.run_module('pnmix.lm_eval', "
                          "run_name='__main__')", "--model", "pnmix"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: the lm-evaluation-harness model needs the lm-eval extra: pip install -e '.[lm-eval]'"]
    imp = subprocess.run([sys.executable, "-P", "-c",
                          hide + "from pnmix.tuner.scoring.harness import check_extra; check_extra()"],
                         capture_output=True, text=True, timeout=120)
    assert imp.returncode != 0 and "pip install -e '.[lm-eval]'" in imp.stderr
