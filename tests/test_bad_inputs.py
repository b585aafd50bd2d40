"""Bad input of every kind the fuzz generators name: one line naming what is wrong and what is
allowed (CLI: stderr, exit code 2; HTTP: a 4xx problem), before anything is written."""

from __future__ import annotations

import json
import sys

import pytest
from test_cli_fuzz import run, snapshot, world  # noqa: F401  (world: the fixture)

from pnmix.config import ConfigError, PNMixConfig
from pnmix.layerwise import load_config

# Generators: each makes the bad texts of one kind from a valid one, so new fields and options get them too.


def non_ascii_digits(n: int) -> list[str]:
    """`n` in other scripts' digits (Arabic-Indic, Devanagari, fullwidth), and superscript or circled
    digits: str.isdigit() accepts every one of them, int() only some."""
    out = ["".join(chr(zero + int(c)) for c in str(n)) for zero in (0x0660, 0x0966, 0xFF10)]
    return [*out, "\u00b2", "1\u00b2", "\u2460"]


def duplicated(obj: dict, key: str) -> str:
    """`obj` as JSON with `key` given twice (the second value differs), as a text a parser reads."""
    text = json.dumps(obj)
    inner = json.dumps({key: obj[key]})[1:-1]
    return text[:-1] + ", " + inner.replace(json.dumps(obj[key]), json.dumps("other")) + "}"


def test_a_layer_key_in_other_digits_is_one_line_naming_the_layers():
    base = {"default": {"b_high": 3, "b_low": 1}}
    for key in non_ascii_digits(3):
        with pytest.raises(ConfigError, match=r"invalid layers=.*: allowed a layer \"N\" or an inclusive range"):
            load_config(json.dumps({**base, "layers": {key: {"b_high": 4}}}))
        with pytest.raises(ConfigError, match="invalid layers="):
            load_config(json.dumps({**base, "layers": {f"0-{key}": {"b_high": 4}}}))


def test_a_key_given_twice_is_refused_in_every_json_object_of_a_config():
    single = {"b_high": 3, "b_low": 1, "group_size": 64}
    for key in single:
        with pytest.raises(ConfigError, match=f"'{key}' given twice"):
            PNMixConfig.from_json(duplicated(single, key))
    layered = {"default": single, "layers": {"0-3": {"b_high": 4}}}
    for key in ("default", "layers"):
        with pytest.raises(ConfigError, match="given twice"):
            load_config(duplicated(layered, key))
    text = '{"default": {"b_high": 3}, "layers": {"0-3": {"b_high": 4}, "0-3": {"b_high": 2}}}'
    with pytest.raises(ConfigError, match="'0-3' given twice"):
        load_config(text)
    with pytest.raises(ConfigError, match="'b_high' given twice"):
        load_config('{"default": {"b_high": 3}, "layers": {"0-3": {"b_high": 4, "b_high": 2}}}')


def test_the_bits_command_refuses_such_files_in_one_line(tmp_path, world):  # noqa: F811
    places, root, _ = world
    bad = [json.dumps({"default": {"b_high": 3, "b_low": 1}, "layers": {k: {"b_high": 4}}})
           for k in non_ascii_digits(2)]
    bad.append('{"b_high": 5, "b_high": 3}')
    before = snapshot(root)
    for i, text in enumerate(bad):
        path = places.root / f"bad-{i}.json"
        path.write_text(text, encoding="utf-8")
        before = snapshot(root)
        code, _, err = run(["bits", "--config", str(path), "--layers", "30"])
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: invalid "), (text, err)
        assert snapshot(root) == before


def test_storage_urls_with_query_parameters_and_environment_numbers(tmp_path, world, monkeypatch):  # noqa: F811
    places, root, url = world
    existing = url.removeprefix("sqlite:///")
    cases = [
        (["fronts", "--storage", f"sqlite:///{existing}?timeout=abc"], "takes no query parameters (given: timeout)"),
        (["fronts", "--storage", f"sqlite:///{existing}?timeout=1e999&mode=ro"], "takes no query parameters"),
        (["tune", "--enqueue", "--trials", "1", "--storage", f"sqlite:///{tmp_path}/q.db?cache=shared"],
         "takes no query parameters"),
    ]
    for argv, needle in cases:
        before = snapshot(root)
        code, _, err = run(argv)
        assert code == 2 and err.count("\n") == 1 and needle in err, (argv, err)
        assert snapshot(root) == before and not (tmp_path / "q.db").exists()
    # Every number the environment gives: those read straight (pnmix.storage.vocabulary.ENVIRONMENT: a campaign
    # reads them, so `tune --enqueue`), the storage's (`fronts`) and the service's (`serve`).
    from pnmix.api.settings import Settings
    from pnmix.storage.vocabulary import ENVIRONMENT

    numeric = {f"PNMIX_{k.upper()}" for k, f in Settings.model_fields.items() if f.annotation in (int, float)}
    commands = {**{name: ["tune", "--enqueue", "--trials", "1"] for name in ENVIRONMENT},
                **{name: ["serve"] for name in numeric}, "PNMIX_DB_BUSY_TIMEOUT_S": ["fronts"]}
    assert {"PNMIX_MAX_HEADER_BYTES", "PNMIX_MAX_BODY_BYTES", "PNMIX_PORT"} <= set(commands)
    for name, command in commands.items():
        for value in ("inf", "-inf", "nan", "1e999", "abc", "", "0x10", "-1", "\u0661", "1\u00b2", "9" * 400):
            sys.modules.pop("pnmix.tuner.search.campaign", None)  # read again at import, as a new process would
            monkeypatch.setenv(name, value)
            before = snapshot(root)
            code, _, err = run(command)
            assert code == 2 and err.count("\n") == 1 and name in err, (name, value, err)
            assert snapshot(root) == before
        monkeypatch.delenv(name)
    sys.modules.pop("pnmix.tuner.search.campaign", None)


def test_a_downgrade_asked_of_upgrade_and_missing_folders_for_workers(tmp_path, world):  # noqa: F811
    _, root, url = world
    code, _, err = run(["db", "upgrade", "--database-url", url, "--revision", "0001"])
    assert code == 2 and "upgrading to the older 0001 would do nothing" in err and "does not downgrade" in err
    missing = tmp_path / "not-there" / "deeper" / "pnmix.db"
    for argv in (["worker", "--storage", f"sqlite:///{missing}"],
                 ["tune", "--enqueue", "--trials", "1", "--storage", f"sqlite:///{missing}"]):
        code, _, err = run(argv)
        assert code == 2 and err.count("\n") == 1 and str(missing.parent) in err, err
        assert not (tmp_path / "not-there").exists()


def test_generate_refuses_what_the_model_or_the_static_path_cannot_take_before_loading(world, monkeypatch):  # noqa: F811
    from pnmix import models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(models, "load", no_load)
    for argv, needle in ((["--value-group", "48"], "invalid value_group_size=48: allowed a positive divisor of "
                                                    "head_dim=64"),
                         (["--static", "--b-high", "16"], "the static path has no mixed mode")):
        code, _, err = run(["generate", "--prompt", "hi", *argv])
        assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_the_service_refuses_unmeetable_budgets_large_headers_and_other_encodings(tmp_path):
    from fastapi.testclient import TestClient

    from pnmix.api.app import create_app
    from pnmix.api.settings import Settings
    from pnmix.storage import Database, list_campaigns, upgrade

    db = Database(f"sqlite:///{tmp_path / 'pnmix.db'}")
    upgrade(db)
    auth = {"Authorization": "Bearer t"}

    def stored() -> int:
        with db.session(readonly=True) as s:
            return list_campaigns(s).total

    with TestClient(create_app(Settings(database_url=db.url, api_token="t"))) as client:
        for budgets, method in (([1e-300], "pnmix-alloc"), ([3.0, 1.0], "pnmix"), ([1.24], "kivi")):
            r = client.post("/v1/campaigns", headers=auth, json={"model": "smollm2-135m", "budgets": budgets,
                                                                 "method": method})
            assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text
            assert "allowed budgets >= 1.25000 key bits, the smallest that can be met" in r.json()["detail"]
        r = client.post("/v1/campaigns", headers=auth, json={"model": "smollm2-135m", "budgets": [0.5],
                                                             "budget_on": "kv"})
        assert r.status_code == 422 and "kv bits" in r.json()["detail"]
        assert stored() == 0
        body = json.dumps({"model": "smollm2-135m", "budgets": [2.5]})
        for encoded, ctype in ((body.encode("utf-16"), "application/json"),
                               (body.encode("utf-16-le"), "application/json"),
                               (body.encode("utf-32"), "application/json"),
                               (b"\xef\xbb\xbf" + body.encode(), "application/json"),
                               (body.encode(), "application/json; charset=latin-1")):
            r = client.post("/v1/campaigns", headers={**auth, "Content-Type": ctype}, content=encoded)
            assert r.status_code in (415, 422) and r.headers["content-type"] == "application/problem+json", r.text
        assert stored() == 0
        for size in (100_000, 1 << 20, 8 << 20):
            r = client.get("/v1/models", headers={"X-Big": "x" * size})
            assert r.status_code == 431 and "PNMIX_MAX_HEADER_BYTES" in r.json()["detail"]
        assert client.get("/v1/models", headers={"X-Fine": "x" * 8000}).status_code == 200
        ok = client.post("/v1/campaigns", headers={**auth, "Content-Type": "application/json; charset=utf-8"},
                         content=body.encode())
        assert ok.status_code == 201, ok.text
    db.dispose()


def test_enqueueing_a_budget_nothing_can_meet_is_one_line(tmp_path, world):  # noqa: F811
    _, root, _ = world
    before = snapshot(root)
    code, _, err = run(["tune", "--enqueue", "--budgets", "1e-300", "--trials", "1"])
    assert code == 2 and err.count("\n") == 1 and "allowed budgets >= 1.25000 key bits" in err, err
    code, _, err = run(["tune", "--enqueue", "--method", "kivi", "--budgets", "3", "--budgets", "1.2"])
    assert code == 2 and "invalid budget 1.2" in err
    assert snapshot(root) == before
