"""Tuning on the user's own data: the texts task, string answers, the held-out split, `pnmix validate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from tiny import save_tiny_llama
from transformers import AutoTokenizer

from pnmix import models
from pnmix.config import PNMixConfig, preset
from pnmix.storage import Database, FrontPoint, head_revision, list_front_points, upgrade
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import holdout, tasks, texts
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.fidelity import reference_logits, replay
from pnmix.tuner.scoring.profiles import profile
from pnmix.tuner.search.campaign import CampaignRunner
from pnmix.tuner.search.session import find_or_create_campaign
from pnmix.tuner.search.spec import CampaignSpec

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]
DOCS = Path(__file__).resolve().parents[1] / "docs"
SMALL = PNMixConfig(b_high=2, b_low=1, group_size=32, salient_ratio=0.5, n_sink=4, residual_len=32, value_bits=2,
                    value_group_size=32)

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded):
    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tok)


@pytest.fixture(scope="module")
def docs_jsonl(tmp_path_factory) -> Path:
    """Real long text: the product's own documentation, one document a file."""
    path = tmp_path_factory.mktemp("texts") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in sorted(DOCS.glob("*.md"))))
    return path


# -- files -----------------------------------------------------------------------------------------


def test_texts_files_plain_and_jsonl(tmp_path):
    plain = tmp_path / "a.txt"
    plain.write_text("First document\nstill the first.\n\n  \nSecond one.\n\n\n\nThird.\n")
    assert texts.documents(plain) == ["First document\nstill the first.", "Second one.", "Third."]
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"text": "one"}\n\n{"text": "two\\n\\nstill two", "id": 3}\n')
    assert texts.documents(lines) == ["one", "two\n\nstill two"]
    task = texts.TextsTask(str(lines), 64, 16)
    assert texts.TextsTask.parse(task.entry()) == texts.TextsTask(str(lines.resolve()), 64, 16)
    assert texts.TextsTask.parse("texts:/x@y/f.txt") == texts.TextsTask("/x@y/f.txt")
    assert texts.TextsTask("f").lengths(8192) == (1024, 512) and texts.TextsTask("f").lengths(2048) == (256, 128)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"\n  \n\n", "is empty"),
        (b"text\x00\x01binary", "holds binary data"),
        (b"caf\xe9 latin-1", "is not UTF-8 text"),
        (b'{"text": "a"}\n[1, 2]\n', ":2: each line must be a JSON object, not list"),
        (b'{"text": "a"}\n{"body": "b"}\n', ':2: needs a "text" field'),
        (b'{"text": "a"\n', ":1: not valid JSON"),
    ],
)
def test_bad_texts_files_are_one_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(EvalError, match=message):
        texts.documents(path)


def test_string_answers_and_regular_expressions(tmp_path):
    path = tmp_path / "items.jsonl"
    rows = [{"prompt": "Capital of France?", "answer": "Paris"},
            {"prompt": "Name the clause.", "answer": "force  MAJEURE"},
            {"prompt": "Case number?", "answer": r"\bC-\d{3}/\d{2}\b", "match": "regex", "max_new_tokens": 12},
            {"question": "2 + 3?", "answer": 5}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    paris, clause, case, number = tasks.items_file(path)
    assert (paris.match, paris.max_new_tokens, case.max_new_tokens, number.match) == ("text", 32, 12, "last_number")
    assert paris.is_correct("The capital is PARIS.") and paris.is_correct("paris")
    assert not paris.is_correct("Parisian food") and not paris.is_correct("Pa ris")
    assert clause.is_correct("It is a Force\nMajeure clause") and not clause.is_correct("force")
    assert case.is_correct("See case C-123/45 of the court.") and not case.is_correct("case C-1234/45")
    assert number.is_correct("so 5") and not number.is_correct("5, no: 6")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty"),
        ('"just a string"\n', ":1: each line must be a JSON object, not str"),
        ('{"prompt": "x"}\n', ':1: needs "answer" and one of "prompt"'),
        ('{"question": "x"}\n', ':1: needs "answer" and one of "prompt"'),
        ("{not json}\n", ":1: not valid JSON"),
        ('{"prompt": "x", "question": "y", "answer": "z"}\n', ':1: needs "answer" and one of "prompt"'),
        ('{"prompt": "x", "answer": "  "}\n', ':1: "answer" must be a non-empty string'),
        ('{"prompt": "x", "answer": "(", "match": "regex"}\n', ":1: \"answer\" is not a regular expression"),
        ('{"prompt": "x", "answer": "a", "match": "fuzzy"}\n', ':1: invalid "match"'),
        ('{"prompt": "x", "answer": "a", "max_new_tokens": 0}\n', ':1: invalid "max_new_tokens"'),
        ('{"question": "x", "answer": "many"}\n', "is not a number"),
    ],
)
def test_bad_items_files_are_one_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(EvalError, match=message):
        tasks.items_file(path)


# -- the held-out split ------------------------------------------------------------------------------


def test_split_is_seeded_disjoint_and_keeps_the_profiles_counts():
    for n in (2, 3, 10, 37, 134):
        search, held = holdout.split(n, 0.25, 7, "passkey")
        assert sorted(search + held) == list(range(n)) and search and held
        assert (search, held) == holdout.split(n, 0.25, 7, "passkey")  # every worker draws the same
    assert holdout.split(40, 0.25, 7, "passkey") != holdout.split(40, 0.25, 8, "passkey")
    for count in (1, 2, 8, 12, 100):
        total = holdout.total_for(count, 0.25)
        assert total - holdout.held_count(total, 0.25) == count
        # Two held-out units at least, so that the held-out score has a standard error.
        assert holdout.held_count(total, 0.25) >= (1 if count == 1 else holdout.MIN_HELD)
    assert holdout.total_for(2, 0.25) == 4 and holdout.total_for(12, 0.25) == 16 and holdout.total_for(7, 0) == 7
    assert holdout.split(5, 0.0, 0, "x") == ([0, 1, 2, 3, 4], [])


# -- the texts part against its per-document reference ---------------------------------------------


def test_texts_part_equals_the_per_document_reference(tiny_dir, docs_jsonl):
    ev = Evaluator(tiny_dir, profile("smoke"), tasks=("texts",), texts=texts.TextsTask(str(docs_jsonl), 80, 24))
    ev.model = ev.loaded.model = ev.model.to(torch.float64)  # exact sums: batched and reference agree to rounding
    docs = texts.cut(ev.tokenizer, docs_jsonl, 80, 24)
    assert ev.unit_counts() == {"texts": len(docs)} and len(docs) >= 4
    for config in (SMALL, preset("pnmix-paper").with_(group_size=32, n_sink=4, residual_len=32), preset("fp16")):
        score = ev.evaluate(config, measure=False)
        ref = [replay(ev.model, torch.tensor([head]), tail, config, reference_logits(ev.model, torch.tensor([head]),
                                                                                      tail)) for head, tail in docs]
        assert score.units["texts"] == [r.agreement for r in ref]
        assert score.texts_kl == pytest.approx(sum(r.mean_kl for r in ref) / len(ref), rel=1e-9, abs=1e-12)
        assert score.parts["texts"] == pytest.approx(sum(r.agreement for r in ref) / len(ref), abs=1e-15)
    assert score.parts["texts"] == 1.0 and score.texts_kl < 1e-12  # fp16: the unquantized model itself


# -- a campaign's held-out units -------------------------------------------------------------------


def test_held_out_units_never_reach_a_trial_and_score_the_pick(tmp_path, tiny_dir, docs_jsonl):
    entry = texts.TextsTask(str(docs_jsonl), 64, 16).entry()
    spec = CampaignSpec(model=tiny_dir, budgets=(2.5,), n_trials=4, profile="smoke", tasks=("fidelity", entry),
                        holdout=0.5)
    db = Database(f"sqlite:///{tmp_path / 'pnmix.db'}")
    upgrade(db)
    campaign_id = find_or_create_campaign(db, spec)
    ev = Evaluator(tiny_dir, profile("smoke"), tasks=spec.tasks, holdout=spec.holdout)
    seen: list[tuple[str, str, tuple[int, ...]]] = []
    phase = ["search"]
    engine = ev.engine
    scored = engine.fidelity

    def spy(config, chunk=None, rows=None, part="fidelity"):
        seen.append((phase[0], part, tuple(rows)))
        return scored(config, chunk, rows, part)

    engine.fidelity = spy  # type: ignore[method-assign]
    runner = CampaignRunner(db, db.url, campaign_id, spec, ev)
    score_holdout = runner.score_holdout

    def at_the_end():
        phase[0] = "holdout"
        score_holdout()

    runner.score_holdout = at_the_end  # type: ignore[method-assign]
    runner.run()
    held = {part: set(ev.indices(part, "holdout")) for part in ("fidelity", "texts")}
    assert all(held.values()) and ev.unit_counts("search")["fidelity"] == profile("smoke").fidelity_prompts
    in_search = [(part, rows) for ph, part, rows in seen if ph == "search"]
    assert in_search and all(not held[part] & set(rows) for part, rows in in_search)
    at_end = {(part, rows) for ph, part, rows in seen if ph == "holdout"}
    assert at_end == {(part, tuple(sorted(held[part]))) for part in held}
    with db.session(readonly=True) as s:
        points = list_front_points(s, tiny_dir, campaign_id=campaign_id).items
        picked = [p for p in points if p.holdout_accuracy is not None]
        assert len(picked) == 1 and picked[0].holdout["units"] == {part: len(h) for part, h in held.items()}
        assert picked[0].holdout_gap()[1] is not None
    db.dispose()


# -- validate --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_validate_scores_a_config_and_baselines_paired_on_the_users_texts(tmp_path, docs_jsonl):
    config = tmp_path / "cfg.json"
    config.write_text(SMALL.with_(group_size=64, residual_len=64).to_json())
    out = subprocess.run([*PNMIX, "validate", "--config", str(config), "--texts", str(docs_jsonl), "--text-prefix",
                          "128", "--text-tokens", "32", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["tasks"] == ["texts"] and report["units"] == {"texts": len(list(DOCS.glob("*.md")))}
    fp16 = report["scores"]["fp16"]
    assert fp16["accuracy"] == 1.0 and fp16["texts_kl"] < 1e-6  # fp32 sums: batched vs one pass
    diff = report["config_minus"]["fp16"]["accuracy"]
    assert diff["diff"] == pytest.approx(report["scores"]["config"]["accuracy"] - 1.0)
    assert diff["diff"] < 0 and diff["se"] > 0


def test_a_texts_file_without_a_usable_document_stores_nothing(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A short note.\n\nAnother short note.\n")
    db = tmp_path / "db" / "pnmix.db"
    out = subprocess.run([*PNMIX, "tune", "--texts", str(short), "--budgets", "2.5", "--trials", "1",
                          "--profile", "smoke", "--storage", f"sqlite:///{db}"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no document holds the 1536 tokens a document needs" in lines[0], out.stderr
    assert not db.exists()


def test_the_migration_from_the_previous_head_keeps_points_and_adds_held_out_scores(tmp_path):
    from pnmix.storage import HoldoutIn, set_holdout
    from pnmix.storage.migrations import downgrade

    db = Database(f"sqlite:///{tmp_path / 'pnmix.db'}")
    upgrade(db)
    downgrade(db, "0005")
    from sqlalchemy import text

    with db.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO pnmix_models (id, name, family, source, location, num_layers, num_heads, num_kv_heads,"
            " head_dim, created_at, updated_at) VALUES (1, 'smollm2-135m', 'llama', 'embedded', '', 30, 9, 3, 64,"
            " '2026-11-01 10:00:00+00:00', '2026-11-01 10:00:00+00:00')"))
        conn.execute(text(
            "INSERT INTO pnmix_campaigns (id, model_id, method, budgets, n_trials, profile, objectives, backend,"
            " budget_on, options, status, trials_done, trials_total, study_names, created_at) VALUES (1, 1, 'pnmix',"
            " '[2.5]', 4, 'quick', '[\"accuracy\", \"key_bits\"]', 'auto', 'key', '{}', 'done', 4, 4, '{}',"
            " '2026-11-01 10:00:00+00:00')"))
        conn.execute(text(
            "INSERT INTO pnmix_front_points (campaign_id, model_id, budget, budget_on, trial_number, b_high, b_low,"
            " group_size, salient_ratio, n_sink, residual_len, value_bits, value_group_size, criterion, seed,"
            " accuracy, accuracy_se, accuracy_parts, key_bits, kv_bits, kv_bytes, throughput, backend, device,"
            " versions, unit_influence, created_at) VALUES (1, 1, 2.5, 'key', 0, 2, 2, 128, 0.0, 0, 128, 2, 32,"
            " 'qk_pair_norm', 0, 0.75, 0.05, '{}', 2.25, 2.625, 1, 1.0, 'torch', 'cpu', '{}', NULL,"
            " '2026-11-01 10:06:00+00:00')"))
    assert upgrade(db) == ("0005", head_revision())
    with db.session() as s:
        point = s.query(FrontPoint).one()
        assert (point.holdout_accuracy, point.holdout, point.holdout_gap(), point.holdout_summary()) == (
            None, None, None, None)
        set_holdout(s, 1, 2.5, 0, HoldoutIn(0.6, 0.04, {"passkey": 30}, {"accuracy": 0.5, "accuracy_se": 0.05,
                                                                          "diff": 0.1, "diff_se": 0.03}))
    with db.session(readonly=True) as s:
        summary = s.query(FrontPoint).one().holdout_summary()
        assert summary["minus_in_search"] == pytest.approx(-0.15)
        assert summary["minus_in_search_se"] == pytest.approx((0.04**2 + 0.05**2) ** 0.5)
        assert summary["holds"] is False  # 0.15 below, more than 2 x 0.064
        assert summary["pnmix_paper"]["diff"] == 0.1 and summary["units"] == {"passkey": 30}
    db.dispose()
