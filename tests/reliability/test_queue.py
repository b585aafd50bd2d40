"""The queue cannot be poisoned: what is enqueued is what a worker can run, and a worker that still
cannot run a campaign says why and takes the next.

On the real PostgreSQL server, with real `pnmix worker` processes (the stub evaluator: a trial takes
milliseconds; every check before it is the real one):
- `POST /v1/campaigns` answers 422, storing nothing, for strict-type violations (`budgets: [true]`,
  `n_trials: true` or `"30"`), a key given twice, and campaigns no worker could run (a random-weight
  shape model); `pnmix tune --enqueue` refuses the same in one line;
- campaigns put straight into the database that no worker can run (a task this version does not
  know, a model that is not on this machine, a shape model) are marked `failed` with the reason by
  the first worker that takes them, which goes on to the next; a `triton` campaign is left queued
  for a worker with a GPU; the good campaigns after them all finish, with objectives in any order.
"""

from __future__ import annotations

import json
import subprocess

from rel_helpers import PNMIX, error_line, stub_campaign, stub_worker_args, worker_env
from sqlalchemy import select, update

from pnmix.storage import Campaign, Database, ModelIn, get_campaign, registry_model, upgrade, upsert_model

TOKEN = "queue-test-token"


def campaign_rows(url: str) -> list[tuple[int, str, str | None]]:
    db = Database(url)
    try:
        with db.session(readonly=True) as s:
            return [(r.id, r.status, r.message) for r in s.scalars(select(Campaign).order_by(Campaign.id))]
    finally:
        db.dispose()


def test_enqueue_refuses_what_no_worker_can_run(pg_url):
    from fastapi.testclient import TestClient

    from pnmix.api.app import create_app
    from pnmix.api.settings import Settings

    db = Database(pg_url)
    upgrade(db)
    db.dispose()
    good = {"model": "smollm2-135m", "budgets": [3.0]}
    bad = [
        json.dumps({**good, "budgets": [True]}),
        json.dumps({**good, "budgets": ["3.0"]}),
        json.dumps({**good, "n_trials": True}),
        json.dumps({**good, "n_trials": "30"}),
        json.dumps({**good, "n_trials": 3.5}),  # 3.0 is an integer to JSON Schema, so it is taken as 3
        '{"model": "smollm2-135m", "budgets": [3.0], "budgets": [2.0]}',
        '{"model": "smollm2-135m", "model": "qwen3-8b-shape", "budgets": [3.0]}',
        json.dumps({**good, "model": "qwen3-8b-shape"}),
        json.dumps({**good, "objectives": ["accuracy"]}),
        json.dumps({**good, "n_trials": 10_001}),
        json.dumps({**good, "budgets": [16.5]}),
    ]
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with TestClient(create_app(Settings(database_url=pg_url, api_token=TOKEN))) as client:
        for body in bad:
            r = client.post("/v1/campaigns", content=body, headers=headers)
            assert r.status_code == 422, (body, r.text)
            assert r.headers["content-type"] == "application/problem+json"
        assert campaign_rows(pg_url) == []
        r = client.post("/v1/campaigns", content=json.dumps({**good, "objectives": ["key_bits", "accuracy"]}),
                        headers=headers)
        assert r.status_code == 201, r.text
    # The command line refuses the same campaigns in one line, before the database is touched.
    for args, needle in ((("--tasks", "bogus"), "invalid --tasks 'bogus'"),
                         (("--tasks", "items"), "task items needs its file: --items PATH"),
                         (("--model", "qwen3-8b-shape"), "random weights"),
                         (("--backend", "cuda"), "invalid --backend 'cuda'"),
                         (("--trials", "0"), "invalid --trials '0'")):
        out = subprocess.run([*PNMIX, "tune", "--enqueue", "--storage", pg_url, "--budgets", "3", *args],
                             env=worker_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and needle in error_line(out.stderr), out.stderr
    assert [status for _, status, _ in campaign_rows(pg_url)] == ["queued"]


def poison(url: str) -> dict[str, int]:
    """Campaigns as an older version, or a write straight into the database, could have left them."""
    ids = {}
    ids["unknown_task"] = stub_campaign(url, (3.0,), 2, seed=1)
    ids["triton"] = stub_campaign(url, (3.0,), 2, seed=2, backend="triton")
    ids["not_here"] = stub_campaign(url, (3.0,), 2, seed=3)
    ids["shape"] = stub_campaign(url, (3.0,), 2, seed=4)
    ids["good_reversed"] = stub_campaign(url, (3.0,), 2, seed=5, objectives=("key_bits", "accuracy"))
    ids["good"] = stub_campaign(url, (3.0, 2.5), 2, seed=6)
    db = Database(url)
    try:
        with db.session() as s:
            row = get_campaign(s, ids["unknown_task"])
            row.options = {**row.options, "tasks": ["bogus"]}
            hub = upsert_model(s, ModelIn("pnmix-test-org/not-here", "llama", "hub", 2, 4, 2, 64,
                                          location="pnmix-test-org/not-here"))
            shape = upsert_model(s, registry_model("qwen3-8b-shape"))
            s.execute(update(Campaign).where(Campaign.id == ids["not_here"]).values(model_id=hub.id))
            s.execute(update(Campaign).where(Campaign.id == ids["shape"]).values(model_id=shape.id))
    finally:
        db.dispose()
    return ids


def test_workers_fail_what_they_cannot_run_with_the_reason_and_take_the_next(pg_url, procs):
    ids = poison(pg_url)
    workers = [procs.start(stub_worker_args(pg_url), worker_env(), f"w{i}") for i in range(2)]
    for w in workers:
        assert procs.finish(w, 180) == 0, procs.stderr(w)[-3000:]
    rows = {cid: (status, message) for cid, status, message in campaign_rows(pg_url)}
    assert rows[ids["good"]][0] == "done" and rows[ids["good_reversed"]][0] == "done"
    assert rows[ids["triton"]] == ("queued", None)  # left for a worker with a GPU
    status, message = rows[ids["unknown_task"]]
    assert status == "failed" and "invalid task 'bogus'" in message
    status, message = rows[ids["not_here"]]
    assert status == "failed" and "pnmix-test-org/not-here" in message
    status, message = rows[ids["shape"]]
    assert status == "failed" and "random weights" in message
    warnings = [line for w in workers for line in procs.stderr(w).strip().splitlines()]
    assert "Traceback" not in "\n".join(warnings)
    assert sorted(int(line.split()[2]) for line in warnings if line.startswith("warning: campaign ")) == sorted(
        [ids["unknown_task"], ids["not_here"], ids["shape"]])
    # Attached to the campaign it cannot run here, a worker says so in one line and leaves it queued.
    attached = procs.start(stub_worker_args(pg_url, "--campaign", str(ids["triton"])), worker_env(), "attached")
    assert procs.finish(attached, 120) == 2
    assert "backend triton needs a CUDA GPU" in error_line(procs.stderr(attached))
    assert {cid: s for cid, s, _ in campaign_rows(pg_url)}[ids["triton"]] == "queued"


def test_an_unexpected_error_fails_the_campaign_and_keeps_its_traceback(pg_url, procs):
    """A bug in a worker is no reason to leave the campaign to be claimed and crash the next worker too."""
    campaign_id = stub_campaign(pg_url, (3.0,), 2)
    env = worker_env(STUB_CRASH="1")
    worker = procs.start(stub_worker_args(pg_url), env, "crash")
    assert procs.finish(worker, 120) == 1
    assert "Traceback" in procs.stderr(worker) and "stub: a bug" in procs.stderr(worker)
    ((cid, state, message),) = campaign_rows(pg_url)
    assert (cid, state) == (campaign_id, "failed") and message == "RuntimeError: stub: a bug"
