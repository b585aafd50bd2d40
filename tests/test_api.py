"""The REST service in process (FastAPI TestClient): routes, problems, pagination, auth, bad input."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from test_storage import CONFIGS, FRONT_3, FRONT_225, point

from pnmix.api.app import create_app
from pnmix.api.settings import Settings
from pnmix.bits import key_bits
from pnmix.config import PNMixConfig
from pnmix.storage import (
    Database,
    FrontPointIn,
    ModelIn,
    SchemaError,
    claim_next_queued_campaign,
    create_campaign,
    registry_model,
    replace_front,
    upgrade,
    upsert_model,
)
from pnmix.storage.testing import postgres_skip_reason, sqlite_url, temporary_postgres_url

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def seed(db: Database) -> dict[str, int]:
    """smollm2-135m with two fronts (see test_storage), a hub model with a slash, a shape model with no
    front (campaigns score accuracy: a shape model gets none), a queued campaign."""
    upgrade(db)
    with db.session() as s:
        main = create_campaign(s, "smollm2-135m", [3.0, 2.25], n_trials=8, status="running", worker_id="w1")
        replace_front(s, main.id, 3.0, FRONT_3)
        replace_front(s, main.id, 2.25, FRONT_225)
        upsert_model(s, ModelIn("org/tiny-llama", "llama", "hub", 4, 8, 2, 128, location="org/tiny-llama"))
        hub = create_campaign(s, "org/tiny-llama", [2.5], n_trials=2, method="kivi", status="running")
        replace_front(s, hub.id, 2.5, [point("kivi2", 0, 0.5, 5.0, 100)])
        upsert_model(s, registry_model("qwen3-8b-shape"))
        queued = create_campaign(s, "org/tiny-llama", [2.0], n_trials=3)
        return {"main": main.id, "hub": hub.id, "queued": queued.id}


def count_rows(db: Database) -> dict[str, int]:
    with db.engine.connect() as conn:
        return {
            t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar()
            for t in ("pnmix_models", "pnmix_campaigns", "pnmix_front_points")
        }


def campaigns_dump(db: Database) -> list[tuple]:
    with db.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT * FROM pnmix_campaigns ORDER BY id"))]


def assert_problem(r, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["status"] == status and body["title"] and body["type"]
    return body


@pytest.fixture
def env(tmp_path):
    db = Database(sqlite_url(tmp_path))
    ids = seed(db)
    settings = Settings(database_url=sqlite_url(tmp_path), api_token=TOKEN)
    with TestClient(create_app(settings)) as client:
        yield client, db, ids
    db.dispose()


# -- reads -------------------------------------------------------------------------------------


def test_health_reports_a_ready_database(env):
    client, _, _ = env
    r = client.get("/v1/health")
    assert r.status_code == 200
    body = r.json()
    assert (body["status"], body["ready"], body["backend"]) == ("ok", True, "sqlite")
    assert body["schema_revision"] == body["schema_head"] == "0009"


def test_models_are_listed_by_name_with_their_fronts(env):
    client, _, _ = env
    body = client.get("/v1/models").json()
    assert body["total"] == 3 and [m["name"] for m in body["items"]] == ["org/tiny-llama", "qwen3-8b-shape",
                                                                         "smollm2-135m"]
    smol = body["items"][2]
    assert (smol["front_points"], smol["budgets"], smol["head_dim"], smol["num_kv_heads"]) == (8, [3.0, 2.25], 64, 3)
    page = client.get("/v1/models", params={"limit": 1, "offset": 1}).json()
    assert (page["total"], page["limit"], page["offset"]) == (3, 1, 1)
    assert [m["name"] for m in page["items"]] == ["qwen3-8b-shape"]
    assert client.get("/v1/models", params={"offset": 10}).json()["items"] == []


def test_a_model_name_may_contain_a_slash(env):
    client, _, ids = env
    assert client.get("/v1/models/org/tiny-llama").json()["head_dim"] == 128
    fronts = client.get("/v1/models/org/tiny-llama/fronts").json()
    assert fronts["total"] == 1 and fronts["items"][0]["campaign_id"] == ids["hub"]
    assert fronts["items"][0]["key_bits"] == pytest.approx(key_bits(CONFIGS["kivi2"], 128).total)
    assert_problem(client.get("/v1/models/org/unknown"), 404)


def test_fronts_filter_by_budget_and_paginate(env):
    client, _, _ = env
    body = client.get("/v1/models/smollm2-135m/fronts", params={"budget": 2.25}).json()
    assert body["total"] == 4 and body["model"] == "smollm2-135m"
    bits = [p["key_bits"] for p in body["items"]]
    assert bits == sorted(bits) and bits[0] == pytest.approx(1.25)
    assert {p["trial_number"] for p in body["items"]} == {0, 1, 2, 3}
    page = client.get("/v1/models/smollm2-135m/fronts", params={"budget": 2.25, "limit": 2, "offset": 2}).json()
    assert [p["key_bits"] for p in page["items"]] == bits[2:]
    assert client.get("/v1/models/smollm2-135m/fronts").json()["total"] == 8
    assert client.get("/v1/models/smollm2-135m/fronts", params={"budget": 7}).json()["total"] == 0
    first = client.get("/v1/models/smollm2-135m/fronts", params={"budget": 3.0}).json()["items"][0]
    assert first["config"] == CONFIGS["kivi2"].to_dict() and first["accuracy_parts"]["passkey"] == 0.85
    assert first["versions"] == {"torch": "2.13.0", "transformers": "5.24.0"}
    assert first["accuracy_se"] == pytest.approx(0.013)
    assert [p["accuracy_se"] for p in body["items"] if p["trial_number"] == 0] == [None]  # not measured


def test_recommend_returns_the_best_config_within_the_budget(env):
    client, _, _ = env
    r = client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.6})
    assert r.status_code == 200, r.text
    body = r.json()
    # paper and kivi2g64 tie on accuracy (0.9): the one with fewer key bits is recommended.
    assert PNMixConfig.from_json(body["pnmix_config"]) == CONFIGS["paper"]
    assert body["point"]["config"] == CONFIGS["paper"].to_dict()
    p = body["point"]
    assert (p["accuracy"], p["throughput"], p["kv_bytes"], p["budget"]) == (0.9, 20.0, 2000, 3.0)
    assert p["key_bits"] == pytest.approx(2.26343, abs=1e-5)
    assert [t["config"] for t in body["ties"]] == [CONFIGS["paper"].to_dict(), CONFIGS["kivi2g64"].to_dict()]
    assert (body["optimize"], body["target_bits"], body["min_accuracy"]) == ("accuracy", 2.6, 0.0)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"optimize": "throughput", "min_accuracy": 0}, "kivi1"),
        # Without a floor, only points with 90% of the best accuracy within the bits (0.9 here) count.
        ({"optimize": "throughput"}, "kivi2"),
        ({"optimize": "throughput", "min_accuracy": 0.5}, "kivi2"),
        ({"optimize": "memory", "min_accuracy": 0.65}, "g64_31"),
        ({"optimize": "accuracy"}, "paper"),
    ],
)
def test_recommend_objectives(env, params, expected):
    client, _, _ = env
    body = client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.3, **params}).json()
    assert PNMixConfig.from_json(body["pnmix_config"]) == CONFIGS[expected]


def test_nothing_fits_is_a_404_naming_the_smallest_feasible_bits(env):
    client, _, _ = env
    body = assert_problem(client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 1.0}), 404)
    assert body["type"] == "urn:pnmix:problem:no-feasible-point"
    assert body["smallest_feasible_bits"] == pytest.approx(1.25) and "1.25000" in body["detail"]
    body = assert_problem(
        client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2, "min_accuracy": 0.99}), 404
    )
    assert body["smallest_feasible_bits"] is None
    body = assert_problem(client.get("/v1/recommend", params={"model": "qwen3-8b-shape", "target_bits": 3}), 404)
    assert "no front points" in body["detail"]


@pytest.mark.parametrize(
    ("query", "status", "field"),
    [
        ("model=nope&target_bits=2", 404, None),
        ("model=smollm2-135m&target_bits=0", 422, "target_bits"),
        ("model=smollm2-135m&target_bits=-1", 422, "target_bits"),
        ("model=smollm2-135m&target_bits=abc", 422, "target_bits"),
        ("model=smollm2-135m&target_bits=nan", 422, "target_bits"),
        ("model=smollm2-135m&target_bits=inf", 422, "target_bits"),
        ("model=smollm2-135m&target_bits=1e309", 422, "target_bits"),
        ("model=smollm2-135m&target_bits=17", 422, "target_bits"),
        ("model=smollm2-135m", 422, "target_bits"),
        ("target_bits=2", 422, "model"),
        ("model=smollm2-135m&target_bits=2&optimize=speed", 422, "optimize"),
        ("model=smollm2-135m&target_bits=2&min_accuracy=2", 422, "min_accuracy"),
        ("model=smollm2-135m&target_bits=2&campaign_id=0", 422, "campaign_id"),
        ("model=smollm2-135m&target_bits=2&campaign_id=99999999999", 422, "campaign_id"),
    ],
)
def test_bad_recommend_input_is_a_problem_not_a_500(env, query, status, field):
    client, _, _ = env
    body = assert_problem(client.get(f"/v1/recommend?{query}"), status)
    if field:
        assert body["errors"][0]["loc"][-1] == field and field in body["detail"]


@pytest.mark.parametrize(
    "url",
    [
        "/v1/models?limit=501",
        "/v1/models?limit=0",
        "/v1/models?offset=-1",
        "/v1/campaigns?limit=100000",
        "/v1/campaigns?status=paused",
        "/v1/campaigns/abc",
        "/v1/campaigns/0",
        "/v1/models/smollm2-135m/fronts?limit=9999",
        "/v1/models/smollm2-135m/fronts?budget=0",
    ],
)
def test_bad_list_parameters_are_422_problems(env, url):
    client, _, _ = env
    assert_problem(client.get(url), 422)


def test_campaigns_list_newest_first_with_filters(env):
    client, _, ids = env
    body = client.get("/v1/campaigns").json()
    assert [c["id"] for c in body["items"]] == [ids["queued"], ids["hub"], ids["main"]] and body["total"] == 3
    queued = client.get("/v1/campaigns", params={"status": "queued"}).json()["items"]
    assert [(c["id"], c["model"], c["trials_total"]) for c in queued] == [(ids["queued"], "org/tiny-llama", 3)]
    by_model = client.get("/v1/campaigns", params={"model": "org/tiny-llama"}).json()["items"]
    assert [(c["id"], c["method"]) for c in by_model] == [(ids["queued"], "pnmix"), (ids["hub"], "kivi")]
    one = client.get(f"/v1/campaigns/{ids['main']}").json()
    assert (one["status"], one["budgets"], one["trials_total"], one["progress"], one["worker_id"]) == (
        "running", [3.0, 2.25], 16, 0.0, "w1",
    )
    assert_problem(client.get("/v1/campaigns/999"), 404)


# -- writes ------------------------------------------------------------------------------------


def test_enqueued_campaign_is_what_a_worker_claims(env):
    client, db, _ = env
    body = {"model": "smollm2-135m", "budgets": [3.0, 2.5], "n_trials": 12, "objectives": ["accuracy", "key_bits",
                                                                                           "throughput"]}
    r = client.post("/v1/campaigns", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    created = r.json()
    assert r.headers["location"] == f"/v1/campaigns/{created['id']}"
    assert (created["status"], created["trials_total"], created["profile"], created["method"]) == (
        "queued", 24, "quick", "pnmix-alloc",
    )
    assert client.get(r.headers["location"]).json() == created
    claimed = []
    while True:
        with db.session() as s:
            c = claim_next_queued_campaign(s, "gpu-1")
            if c is None:
                break
            claimed.append((c.id, c.objectives))
    assert claimed[-1] == (created["id"], ["accuracy", "key_bits", "throughput"])
    assert client.get(r.headers["location"]).json()["status"] == "running"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong-token"}, 401),
        ({"Authorization": f"Bearer {TOKEN}x"}, 401),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 401),
        ({"Authorization": f"Basic {TOKEN}"}, 401),
        ({"Authorization": TOKEN}, 401),
    ],
)
def test_writes_need_the_exact_token(env, headers, status):
    client, db, _ = env
    before = campaigns_dump(db)
    r = client.post("/v1/campaigns", json={"model": "smollm2-135m", "budgets": [2.5]}, headers=headers)
    assert_problem(r, status)
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert campaigns_dump(db) == before


def test_reads_ignore_tokens(env):
    client, _, _ = env
    for headers in ({"Authorization": "Bearer wrong"}, AUTH, {"Authorization": "Basic abc"}):
        assert client.get("/v1/recommend?model=smollm2-135m&target_bits=3", headers=headers).status_code == 200
        assert client.get("/v1/campaigns", headers=headers).status_code == 200


def test_without_a_configured_token_writes_are_off(tmp_path):
    db = Database(sqlite_url(tmp_path))
    seed(db)
    before = campaigns_dump(db)
    with TestClient(create_app(Settings(database_url=sqlite_url(tmp_path), api_token=None))) as client:
        for headers in ({}, AUTH, {"Authorization": "Bearer "}):
            body = assert_problem(client.post("/v1/campaigns", json={"model": "smollm2-135m", "budgets": [2]},
                                              headers=headers), 403)
            assert "PNMIX_API_TOKEN" in body["detail"]
    with TestClient(create_app(Settings(database_url=sqlite_url(tmp_path), api_token=""))) as client:
        assert_problem(client.post("/v1/campaigns", json={"model": "smollm2-135m", "budgets": [2]},
                                   headers={"Authorization": "Bearer "}), 403)
    assert campaigns_dump(db) == before
    db.dispose()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "unknown-model", "budgets": [2.5]}, 404),
        ({"model": "smollm2-135m", "budgets": []}, 422),
        ({"model": "smollm2-135m", "budgets": [0]}, 422),
        ({"model": "smollm2-135m", "budgets": [-2]}, 422),
        ({"model": "smollm2-135m", "budgets": [99]}, 422),
        ({"model": "smollm2-135m", "budgets": ["two"]}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5, 2.5]}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5] * 17}, 422),
        ({"model": "smollm2-135m", "budgets": 2.5}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5], "n_trials": 0}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5], "n_trials": 10**9}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5], "method": "gptq"}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5], "objectives": ["accuracy"]}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5], "objectives": ["accuracy", "key_bits", "key_bits"]}, 422),
        ({"model": "smollm2-135m", "budgets": [2.5], "status": "done"}, 422),
        ({"model": "", "budgets": [2.5]}, 422),
        ({"budgets": [2.5]}, 422),
        ([1, 2, 3], 422),
        ("not an object", 422),
    ],
)
def test_rejected_writes_leave_the_database_unchanged(env, body, status):
    client, db, _ = env
    before = (count_rows(db), campaigns_dump(db))
    assert_problem(client.post("/v1/campaigns", json=body, headers=AUTH), status)
    assert (count_rows(db), campaigns_dump(db)) == before


def test_malformed_json_is_a_422_problem(env):
    client, db, _ = env
    before = campaigns_dump(db)
    r = client.post("/v1/campaigns", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert_problem(r, 422)
    assert campaigns_dump(db) == before


def test_unknown_routes_and_methods_are_problems(env):
    client, _, _ = env
    assert_problem(client.get("/v1/nothing-here"), 404)
    assert_problem(client.delete("/v1/campaigns/1", headers=AUTH), 405)
    assert_problem(client.put("/v1/models", headers=AUTH), 405)


def test_openapi_and_docs(env):
    client, _, _ = env
    schema = client.get("/openapi.json").json()
    assert set(schema["paths"]) == {
        "/v1/health", "/v1/models", "/v1/models/{name}", "/v1/models/{name}/fronts", "/v1/recommend",
        "/v1/campaigns", "/v1/campaigns/{campaign_id}",
    }
    assert "Problem" in schema["components"]["schemas"]
    post = schema["paths"]["/v1/campaigns"]["post"]["responses"]
    assert set(post) >= {"201", "401", "403", "422"} and "application/problem+json" in post["422"]["content"]
    r = client.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()


# -- the database misbehaving ------------------------------------------------------------------


def test_an_unreachable_database_is_a_503_problem_without_secrets():
    settings = Settings(database_url="postgresql+psycopg2://bob:hunter2@127.0.0.1:1/db", check_schema=False)
    with TestClient(create_app(settings)) as client:
        body = assert_problem(client.get("/v1/models"), 503)
        assert "hunter2" not in client.get("/v1/models").text
        assert body["detail"] == "the database is not available"
        health = client.get("/v1/health")
        assert health.status_code == 503 and health.json()["ready"] is False
        assert "bob:***@" in health.json()["detail"] and "hunter2" not in health.text


def test_the_service_refuses_to_start_on_an_old_schema(tmp_path):
    with pytest.raises(SchemaError, match="pnmix db upgrade"), TestClient(
        create_app(Settings(database_url=sqlite_url(tmp_path)))
    ):
        pass
    db = Database(sqlite_url(tmp_path))
    upgrade(db, "0001")
    with pytest.raises(SchemaError, match="revision 0001, this pnmix needs 0009: run `pnmix db upgrade`"), TestClient(
        create_app(Settings(database_url=sqlite_url(tmp_path)))
    ):
        pass
    with TestClient(create_app(Settings(database_url=sqlite_url(tmp_path), check_schema=False))) as client:
        health = client.get("/v1/health")
        assert health.status_code == 503 and "pnmix db upgrade" in health.json()["detail"]
    db.dispose()


# -- PostgreSQL --------------------------------------------------------------------------------


def test_service_on_postgres():
    reason = postgres_skip_reason()
    if reason:
        pytest.skip(reason)
    with temporary_postgres_url() as url:
        db = Database(url)
        ids = seed(db)
        with TestClient(create_app(Settings(database_url=url, api_token=TOKEN))) as client:
            assert client.get("/v1/health").json()["backend"] == "postgresql"
            body = client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.6}).json()
            assert PNMixConfig.from_json(body["pnmix_config"]) == CONFIGS["paper"]  # tied with kivi2g64, fewer key bits
            r = client.post("/v1/campaigns", json={"model": "org/tiny-llama", "budgets": [2.0]}, headers=AUTH)
            assert r.status_code == 201, r.text
            assert [c["id"] for c in client.get("/v1/campaigns", params={"status": "queued"}).json()["items"]] == [
                r.json()["id"], ids["queued"],
            ]
            assert_problem(client.post("/v1/campaigns", json={"model": "x", "budgets": [2.0]}, headers=AUTH), 404)
            assert client.get("/v1/campaigns").json()["total"] == 4
        db.dispose()


def test_the_recommendation_carries_its_held_out_score(env):
    from pnmix.storage import HoldoutIn, recommend, set_holdout

    client, db, _ = env
    params = {"model": "smollm2-135m", "target_bits": 2.3}
    assert client.get("/v1/recommend", params=params).json()["point"]["holdout"] is None
    with db.session() as s:
        p = recommend(s, "smollm2-135m", 2.3)
        held = HoldoutIn(p.accuracy - 0.01, 0.02, {"passkey": 25, "fidelity": 3}, None)
        set_holdout(s, p.campaign_id, p.budget, p.trial_number, held)
        in_search, se = p.accuracy, p.accuracy_se
    held = client.get("/v1/recommend", params=params).json()["point"]["holdout"]
    assert held["accuracy"] == pytest.approx(in_search - 0.01) and held["units"] == {"passkey": 25, "fidelity": 3}
    assert held["minus_in_search"] == pytest.approx(-0.01) and held["pnmix_paper"] is None
    assert held["minus_in_search_se"] == (None if se is None else pytest.approx((0.02**2 + se**2) ** 0.5))


def test_a_campaign_names_its_files_and_hold_out_share_checked_at_enqueue(env, tmp_path):
    client, db, _ = env
    docs = tmp_path / "docs.txt"
    docs.write_text("One long document.\n\nAnother.\n")
    body = {"model": "smollm2-135m", "budgets": [2.5], "tasks": ["fidelity", f"texts:{docs}@512+128"],
            "holdout": 0.3}
    r = client.post("/v1/campaigns", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    from pnmix.storage import get_campaign
    from pnmix.tuner.search.spec import CampaignSpec

    with db.session(readonly=True) as s:
        spec = CampaignSpec.from_campaign(get_campaign(s, r.json()["id"]))
    assert spec.tasks == ("fidelity", f"texts:{docs}@512+128") and spec.holdout == 0.3
    before = campaigns_dump(db)
    (tmp_path / "empty.txt").write_text("")
    for bad, status, needle in (({"tasks": [f"texts:{tmp_path / 'missing.txt'}"]}, 404, "does not exist"),
                                ({"tasks": [f"texts:{tmp_path / 'empty.txt'}"]}, 422, "is empty"),
                                ({"tasks": [f"items:{docs}"]}, 422, "not valid JSON"),
                                ({"tasks": ["items:  "]}, 422, "pattern"), ({"tasks": ["gsm8k"]}, 422, "pattern"),
                                ({"holdout": 0.9}, 422, "holdout"), ({"holdout": True}, 422, "holdout")):
        r = client.post("/v1/campaigns", json={"model": "smollm2-135m", "budgets": [2.5], **bad}, headers=AUTH)
        assert r.status_code == status and needle in r.text, (bad, r.text)
    assert campaigns_dump(db) == before


def test_recommend_in_an_engines_syntax_answers_with_the_best_recipe_it_loads(env):
    from pnmix.recipes import EngineRecipe, parse

    client, db, _ = env
    bf16_ends = EngineRecipe.uniform(30, "fp8").with_layers({0: "bf16", 29: "bf16"})  # 8.53 bits, two-level
    mixed = EngineRecipe.uniform(30, "fp8", "nvfp4").with_layers({0: "bf16"})  # FP8 keys + NVFP4 values
    with db.session() as s:
        engine = create_campaign(s, "smollm2-135m", [9.0], n_trials=2, method="engine", budget_on="kv",
                                 objectives=["accuracy", "kv_bits"], status="running")
        replace_front(s, engine.id, 9.0, [
            FrontPointIn(mixed, accuracy=0.99, kv_bytes=900, throughput=0.0, trial_number=0, backend="torch",
                         device="cpu", accuracy_se=0.005),
            FrontPointIn(bf16_ends, accuracy=0.97, kv_bytes=1200, throughput=0.0, trial_number=1, backend="torch",
                         device="cpu", accuracy_se=0.005)])
    params = {"model": "smollm2-135m", "target_bits": 9.0, "bits_of": "kv"}
    best = client.get("/v1/recommend", params=params).json()
    # Without a format: the most accurate point of any method (the recipe with NVFP4 values).
    assert best["point"]["recipe"] == mixed.to_dict()["layers"] and best["point"]["config"] is None
    assert best["engine_config"] is None and EngineRecipe.from_dict(json.loads(best["pnmix_config"])) == mixed
    # vLLM cannot load FP8 keys with NVFP4 values: its answer is the two-level recipe, in its flags.
    vllm = client.get("/v1/recommend", params={**params, "format": "vllm"}).json()
    assert vllm["format"] == "vllm"
    assert vllm["engine_config"] == "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 29"
    assert parse(vllm["engine_config"], "vllm", 30) == bf16_ends
    modelopt = client.get("/v1/recommend", params={**params, "format": "modelopt"}).json()
    assert parse(modelopt["engine_config"], "modelopt", 30) == mixed
    # PN-Mix points still answer without a format, unchanged.
    assert client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.6}).json()["point"][
        "recipe"] is None
    body = assert_problem(client.get("/v1/recommend", params={**params, "format": "tensorrt"}), 422)
    assert "format" in json.dumps(body)
