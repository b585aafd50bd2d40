"""One storage suite, run against SQLite and the local PostgreSQL server (`db` fixture)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import threading
import time
from collections import Counter
from datetime import UTC, datetime

import pytest
from sqlalchemy import event, func, select, text

from pnmix.bits import key_bits
from pnmix.config import PNMixConfig
from pnmix.storage import (
    Database,
    FrontPointIn,
    InvalidValueError,
    ModelIn,
    NoFeasiblePointError,
    NotFoundError,
    StorageError,
    claim_next_queued_campaign,
    create_campaign,
    list_front_points,
    recommend,
    recommend_with_ties,
    replace_front,
    update_campaign_progress,
    upgrade,
    upsert_model,
)
from pnmix.storage.orm import Campaign, FrontPoint, Model
from pnmix.storage.settings import default_db_path, load_storage_settings
from pnmix.storage.testing import postgres_skip_reason, sqlite_url, temporary_postgres_url, truncate_all

CONFIGS = {
    "w42": PNMixConfig(b_high=4, b_low=2, salient_ratio=0.25, n_sink=8),  # 2.75325 bits at d=64
    "paper": PNMixConfig(),  # 3/1, r=0.5, 32 sinks: 2.26343
    "kivi2g64": PNMixConfig(b_high=2, b_low=2, group_size=64, salient_ratio=0.0, n_sink=0),  # 2.5
    "kivi2": PNMixConfig(b_high=2, b_low=2, salient_ratio=0.0, n_sink=0),  # 2.25
    "g64_31": PNMixConfig(b_high=3, b_low=1, group_size=64, salient_ratio=0.25, n_sink=16),  # 2.00685
    "w21": PNMixConfig(b_high=2, b_low=1, salient_ratio=0.5, n_sink=0),  # 1.75002
    "kivi1": PNMixConfig(b_high=1, b_low=1, salient_ratio=0.0, n_sink=0),  # 1.25
}


def point(name: str, trial: int, accuracy: float, throughput: float, kv_bytes: int) -> FrontPointIn:
    return FrontPointIn(
        config=CONFIGS[name], accuracy=accuracy, kv_bytes=kv_bytes, throughput=throughput, trial_number=trial,
        backend="torch", device="cpu", accuracy_parts={"passkey": accuracy, "kl": 0.01 * trial},
        versions={"torch": "2.13.0", "transformers": "5.24.0"}, accuracy_se=0.01 + 0.001 * trial if trial % 2 else None,
    )


# Two fronts of one campaign of the embedded model (head_dim 64), metrics chosen to exercise ranking.
FRONT_3 = [
    point("w42", 0, 0.95, 10.0, 3000),
    point("paper", 1, 0.90, 20.0, 2000),
    point("kivi2g64", 2, 0.90, 20.0, 1800),  # ties paper on accuracy and throughput, fewer bytes
    point("kivi2", 3, 0.85, 40.0, 1900),
]
FRONT_225 = [
    point("kivi2", 0, 0.85, 40.0, 1900),
    point("g64_31", 1, 0.70, 25.0, 1500),
    point("w21", 2, 0.60, 30.0, 1200),
    point("kivi1", 3, 0.30, 50.0, 800),
]


@pytest.fixture(scope="module")
def pg_url():
    reason = postgres_skip_reason()
    if reason:
        pytest.skip(reason)
    with temporary_postgres_url() as url:
        db = Database(url)
        upgrade(db)
        db.dispose()
        yield url


@pytest.fixture(scope="module")
def sqlite_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("template")
    db = Database(sqlite_url(folder))
    upgrade(db)
    db.dispose()
    return folder / "pnmix.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path, sqlite_template):
    if request.param == "sqlite":
        shutil.copy(sqlite_template, tmp_path / "pnmix.db")
        database = Database(sqlite_url(tmp_path))
    else:
        database = Database(request.getfixturevalue("pg_url"))
        truncate_all(database)
    yield database
    database.dispose()


@pytest.fixture
def seeded(db):
    with db.session() as s:
        campaign = create_campaign(s, "smollm2-135m", [3.0, 2.25], n_trials=8, status="running", worker_id="w1")
        replace_front(s, campaign.id, 3.0, FRONT_3)
        replace_front(s, campaign.id, 2.25, FRONT_225)
        campaign_id = campaign.id
    return db, campaign_id


def snapshot(db: Database) -> dict[str, list[tuple]]:
    with db.engine.connect() as conn:
        return {
            t: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {t} ORDER BY id"))]
            for t in ("pnmix_models", "pnmix_campaigns", "pnmix_front_points")
        }


# -- models ------------------------------------------------------------------------------------


def test_upsert_model_inserts_once_then_updates(db):
    with db.session() as s:
        upsert_model(s, ModelIn("org/tiny", "qwen3", "hub", 4, 8, 2, 128, location="org/tiny"))
    with db.session() as s:
        upsert_model(s, ModelIn("org/tiny", "qwen3", "local", 6, 8, 4, 64, location="/ckpt"))
    with db.session(readonly=True) as s:
        rows = s.scalars(select(Model)).all()
        assert len(rows) == 1
        m = rows[0]
        assert (m.source, m.location, m.num_layers, m.num_kv_heads, m.head_dim) == ("local", "/ckpt", 6, 4, 64)
        assert m.created_at.tzinfo is UTC and m.updated_at >= m.created_at


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(head_dim=63), "head_dim"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(num_layers=0), "num_layers"),
        (dict(source="ftp"), "source"),
        (dict(name=""), "name"),
    ],
)
def test_model_in_refuses_bad_shapes(kwargs, field):
    base = dict(name="m", family="llama", source="hub", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)
    with pytest.raises(InvalidValueError, match=field):
        ModelIn(**{**base, **kwargs})


# -- campaigns ---------------------------------------------------------------------------------


def test_create_campaign_registers_a_registry_model(db):
    with db.session() as s:
        c = create_campaign(s, "smollm2-135m", [3.0, 2.5, 2.25], n_trials=7)
        assert (c.status, c.trials_done, c.trials_total, c.started_at) == ("queued", 0, 21, None)
    with db.session(readonly=True) as s:
        m = s.scalars(select(Model)).one()
        assert (m.name, m.family, m.source, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
            "smollm2-135m", "llama", "embedded", 30, 9, 3, 64,
        )
        assert s.get(Campaign, c.id).budgets == [3.0, 2.5, 2.25]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(model="no-such-model"), "unknown model"),
        (dict(budgets=[]), "budgets"),
        (dict(budgets=[0.0]), "budget"),
        (dict(budgets=[16.5]), "budget"),
        (dict(budgets=[math.nan]), "budget"),
        (dict(budgets=[2.0, 2.0]), "twice"),
        (dict(n_trials=0), "n_trials"),
        (dict(method="gptq"), "method"),
        (dict(objectives=["accuracy"]), "objectives"),
        (dict(objectives=["accuracy", "key_bits", "speed"]), "objective"),
        (dict(status="done"), "status"),
    ],
)
def test_create_campaign_refuses_bad_input_and_writes_nothing(db, kwargs, message):
    before = snapshot(db)
    args = dict(model="smollm2-135m", budgets=[2.5], n_trials=3) | kwargs
    with pytest.raises(StorageError, match=message), db.session() as s:
        create_campaign(s, args.pop("model"), args.pop("budgets"), args.pop("n_trials"), **args)
    assert snapshot(db) == before


def test_claim_takes_the_oldest_queued_campaign(db):
    with db.session() as s:
        ids = [create_campaign(s, "smollm2-135m", [2.5], n_trials=1).id for _ in range(3)]
        create_campaign(s, "smollm2-135m", [2.5], n_trials=1, status="running", worker_id="other")
    claimed = []
    for _ in range(4):
        with db.session() as s:
            c = claim_next_queued_campaign(s, "worker-a")
            claimed.append(None if c is None else (c.id, c.status, c.worker_id, c.started_at is not None))
    assert claimed == [(i, "running", "worker-a", True) for i in ids] + [None]


def test_claim_locks_with_skip_locked_on_postgres(db):
    with db.session() as s:
        create_campaign(s, "smollm2-135m", [2.5], n_trials=1)
    statements: list[str] = []

    def record(conn, cursor, statement, *args):
        statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        with db.session() as s:
            assert claim_next_queued_campaign(s, "w") is not None
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    selects = [st for st in statements if "FROM pnmix_campaigns" in st and st.lstrip().startswith("SELECT")]
    if db.backend == "postgresql":
        assert "FOR UPDATE SKIP LOCKED" in selects[0]
    else:  # SQLite has no row locks: BEGIN IMMEDIATE serializes writers instead
        assert "FOR UPDATE" not in selects[0]


def test_concurrent_workers_never_claim_one_campaign_twice(db):
    with db.session() as s:
        queued = {create_campaign(s, "smollm2-135m", [2.5], n_trials=1).id for _ in range(12)}
    claims: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        try:
            while True:
                with db.session() as s:
                    c = claim_next_queued_campaign(s, name)
                    got = None if c is None else c.id
                if got is None:
                    return
                with lock:
                    claims.append((name, got))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    ids = [cid for _, cid in claims]
    assert Counter(ids).most_common(1)[0][1] == 1 and set(ids) == queued
    with db.session(readonly=True) as s:
        rows = s.scalars(select(Campaign)).all()
        assert {(r.id, r.worker_id) for r in rows} == {(cid, w) for w, cid in claims}
        assert all(r.status == "running" for r in rows)


def test_progress_updates_and_status_transitions(db):
    with db.session() as s:
        cid = create_campaign(s, "smollm2-135m", [3.0, 2.25], n_trials=5).id
    with db.session() as s:
        c = update_campaign_progress(s, cid, status="running", study_names={"3.0": "smollm2-135m@3.0"})
        assert c.started_at is not None and c.heartbeat_at is not None
    with db.session() as s:
        c = update_campaign_progress(s, cid, trials_done=4, study_names={"2.25": "smollm2-135m@2.25"}, message="ok")
    with db.session(readonly=True) as s:
        c = s.get(Campaign, cid)
        assert (c.trials_done, c.trials_total, c.message) == (4, 10, "ok")
        assert c.study_names == {"3.0": "smollm2-135m@3.0", "2.25": "smollm2-135m@2.25"}
    with pytest.raises(InvalidValueError, match="more than trials_total"), db.session() as s:
        update_campaign_progress(s, cid, trials_done=11)
    with pytest.raises(InvalidValueError, match="back to queued"), db.session() as s:
        update_campaign_progress(s, cid, status="queued")
    with db.session() as s:
        c = update_campaign_progress(s, cid, trials_done=10, status="done")
        assert c.finished_at is not None and c.finished_at >= c.started_at
    with pytest.raises(InvalidValueError, match="finished campaign"), db.session() as s:
        update_campaign_progress(s, cid, trials_done=3)
    with pytest.raises(NotFoundError), db.session() as s:
        update_campaign_progress(s, 9999, trials_done=1)
    with db.session(readonly=True) as s:
        assert s.get(Campaign, cid).trials_done == 10


# -- fronts ------------------------------------------------------------------------------------


def test_replace_front_stores_every_field_and_the_formula_bits(seeded):
    db, cid = seeded
    with db.session(readonly=True) as s:
        points = list_front_points(s, "smollm2-135m", budget=3.0).items
        assert [p.trial_number for p in sorted(points, key=lambda p: p.trial_number)] == [0, 1, 2, 3]
        by_trial = {p.trial_number: p for p in points}
        for given in FRONT_3:
            p = by_trial[given.trial_number]
            assert p.config == given.config  # every PNMixConfig field round-trips
            assert p.key_bits == pytest.approx(key_bits(given.config, 64).total, abs=1e-12)
            assert (p.accuracy, p.throughput, p.kv_bytes) == (given.accuracy, given.throughput, given.kv_bytes)
            assert p.accuracy_parts == dict(given.accuracy_parts)
            assert p.accuracy_se == given.accuracy_se  # a float, or None where none was measured
            assert p.versions == {"torch": "2.13.0", "transformers": "5.24.0"}
            assert (p.budget, p.backend, p.device, p.campaign_id) == (3.0, "torch", "cpu", cid)
            assert p.created_at.tzinfo is UTC and abs((datetime.now(UTC) - p.created_at).total_seconds()) < 300
        assert by_trial[1].key_bits == pytest.approx(2.26343, abs=1e-5)  # the paper config at d = 64
        assert list_front_points(s, "smollm2-135m").total == 8
        assert [p.key_bits for p in points] == sorted(p.key_bits for p in points)


def test_replace_front_replaces_only_its_budget(seeded):
    db, cid = seeded
    with db.session() as s:
        replace_front(s, cid, 3.0, [point("kivi2", 7, 0.5, 1.0, 10)])
    with db.session(readonly=True) as s:
        assert [p.trial_number for p in list_front_points(s, "smollm2-135m", budget=3.0).items] == [7]
        assert list_front_points(s, "smollm2-135m", budget=2.25).total == 4
    with db.session() as s:
        replace_front(s, cid, 3.0, [])
    with db.session(readonly=True) as s:
        assert list_front_points(s, "smollm2-135m", budget=3.0).total == 0


@pytest.mark.parametrize(
    ("budget", "points", "message"),
    [
        (2.25, [point("paper", 9, 0.9, 1.0, 1)], "over the budget"),  # 2.2634 > 2.25
        (2.5, [point("kivi1", 9, 0.9, 1.0, 1)], "not one of campaign"),
        (3.0, [point("kivi1", 1, 0.9, 1.0, 1), point("kivi2", 1, 0.8, 1.0, 1)], "appears twice"),
        (3.0, [FrontPointIn(PNMixConfig(value_group_size=48), 0.5, 1, 1.0, 0, "torch", "cpu")], "value_group_size"),
    ],
)
def test_refused_front_leaves_the_old_front(seeded, budget, points, message):
    db, cid = seeded
    before = snapshot(db)
    with pytest.raises(InvalidValueError, match=message), db.session() as s:
        replace_front(s, cid, budget, points)
    assert snapshot(db) == before


def test_a_failure_after_the_delete_rolls_the_whole_front_back(seeded):
    db, cid = seeded
    before = snapshot(db)
    with pytest.raises(RuntimeError, match="crash"), db.session() as s:
        replace_front(s, cid, 3.0, [point("kivi1", 5, 0.1, 1.0, 1)])
        assert list_front_points(s, "smollm2-135m", budget=3.0).total == 1  # visible inside the transaction
        raise RuntimeError("crash between the write and the commit")
    assert snapshot(db) == before


def test_the_database_itself_refuses_a_point_over_its_budget(seeded):
    db, cid = seeded
    with pytest.raises(StorageError, match="(?i)check|constraint"), db.session() as s:
        p = s.scalars(select(FrontPoint).where(FrontPoint.budget == 2.25)).first()
        p.key_bits = 2.5  # bypasses the write API
        s.flush()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(accuracy=1.5), "accuracy"),
        (dict(accuracy=math.nan), "accuracy"),
        (dict(throughput=-1.0), "throughput"),
        (dict(kv_bytes=-3), "kv_bytes"),
        (dict(kv_bytes=1.5), "kv_bytes"),
        (dict(trial_number=-1), "trial_number"),
        (dict(backend=""), "backend"),
        (dict(accuracy_parts={"kl": math.inf}), "accuracy_parts"),
        (dict(accuracy_se=-0.1), "accuracy_se"),
        (dict(accuracy_se=math.nan), "accuracy_se"),
    ],
)
def test_front_point_in_refuses_bad_measurements(kwargs, field):
    base = dict(config=PNMixConfig(), accuracy=0.5, kv_bytes=10, throughput=1.0, trial_number=0, backend="torch",
                device="cpu")
    with pytest.raises(InvalidValueError, match=field):
        FrontPointIn(**{**base, **kwargs})


# -- recommend ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "optimize", "min_accuracy", "expected"),
    [
        (3.0, "accuracy", 0.0, "w42"),
        (2.6, "accuracy", 0.0, "paper"),  # ties kivi2g64 on accuracy: fewer key bits
        (2.3, "accuracy", 0.0, "paper"),
        (2.26, "accuracy", 0.0, "kivi2"),  # the paper config needs 2.26343
        (2.3, "throughput", 0.0, "kivi1"),
        (2.3, "throughput", 0.5, "kivi2"),
        (2.3, "memory", 0.0, "kivi1"),
        (2.3, "memory", 0.65, "g64_31"),
        (1.25, "accuracy", 0.0, "kivi1"),  # exactly at the budget counts
    ],
)
def test_recommend_picks_the_best_point_within_the_budget(seeded, target, optimize, min_accuracy, expected):
    db, _ = seeded
    with db.session(readonly=True) as s:
        best = recommend(s, "smollm2-135m", target, optimize, min_accuracy)
        assert best.config == CONFIGS[expected]
        assert best.key_bits <= target + 1e-9 and best.accuracy >= min_accuracy


@pytest.mark.parametrize(
    ("target", "min_accuracy", "smallest"),
    [(1.0, 0.0, 1.25), (1.5, 0.5, 1.7500152587890625), (3.0, 0.99, None)],
)
def test_recommend_says_the_smallest_feasible_bits(seeded, target, min_accuracy, smallest):
    db, _ = seeded
    with pytest.raises(NoFeasiblePointError) as info, db.session(readonly=True) as s:
        recommend(s, "smollm2-135m", target, "accuracy", min_accuracy)
    if smallest is None:
        assert info.value.smallest_bits is None and "no front points" in str(info.value)
    else:
        assert info.value.smallest_bits == pytest.approx(smallest, abs=1e-12)
        assert f"{smallest:.5f}" in str(info.value)


def test_recommend_chooses_the_fewest_bits_among_points_tied_within_two_standard_errors(db):
    def p(name: str, trial: int, accuracy: float, se: float | None) -> FrontPointIn:
        return dataclasses.replace(point(name, trial, accuracy, 10.0 + trial, 1000), accuracy_se=se)

    with db.session() as s:
        campaign = create_campaign(s, "smollm2-135m", [3.0], n_trials=8, status="running", worker_id="w1")
        replace_front(s, campaign.id, 3.0, [
            p("w42", 0, 0.80, 0.02),  # the most accurate
            p("paper", 1, 0.77, 0.02),  # 0.030 below; 2 SE of the difference: 2 * hypot(0.02, 0.02) = 0.057
            p("kivi2", 2, 0.76, None),  # no standard error: tied only when equal
            p("g64_31", 3, 0.72, 0.02),  # 0.080 below: not tied with w42 (0.057)
            p("w21", 4, 0.745, 0.01),  # 0.055 below: not tied with w42 (2 * hypot(0.02, 0.01) = 0.045)
        ])
    with db.session(readonly=True) as s:
        rec = recommend_with_ties(s, "smollm2-135m", 3.0)
        chosen, ties = rec.point, rec.ties
        assert [t.config for t in ties] == [CONFIGS["paper"], CONFIGS["w42"]]  # fewest key bits first
        assert chosen.config == CONFIGS["paper"] == recommend(s, "smollm2-135m", 3.0).config
        # The record says what chose them: the floor, the point they tie with, the SE each tie was judged by.
        assert rec.floor == 0.0 and rec.best.config == CONFIGS["w42"] and rec.others == [ties[1]]
        assert rec.tie_se[chosen.id] == pytest.approx(math.hypot(0.02, 0.02)) and not rec.paired[chosen.id]
        # Within 2.5 bits paper (0.77) is the most accurate: g64_31 (0.050 below, 2 SE 0.057) and w21
        # (0.025 below, 2 SE 0.045) are tied with it, kivi2 (no SE) is not.
        rec = recommend_with_ties(s, "smollm2-135m", 2.5)
        chosen, ties = rec.point, rec.ties
        assert [t.config for t in ties] == [CONFIGS["w21"], CONFIGS["g64_31"], CONFIGS["paper"]]
        assert chosen.config == CONFIGS["w21"]
        rec = recommend_with_ties(s, "smollm2-135m", 3.0, "throughput")
        chosen, ties = rec.point, rec.ties
        assert chosen.config == CONFIGS["w21"] and ties == []  # only accuracy has ties


def test_recommend_refuses_unknown_model_and_objective(seeded):
    db, _ = seeded
    with pytest.raises(NotFoundError, match="unknown model"), db.session(readonly=True) as s:
        recommend(s, "nope", 3.0)
    with pytest.raises(InvalidValueError, match="optimize"), db.session(readonly=True) as s:
        recommend(s, "smollm2-135m", 3.0, "speed")


# -- engine ------------------------------------------------------------------------------------


def test_errors_name_the_url_without_its_password():
    db = Database("postgresql+psycopg2://alice:s3cret@127.0.0.1:1/nowhere")
    with pytest.raises(StorageError) as info:
        db.ping()
    assert "s3cret" not in str(info.value) and "alice:***@127.0.0.1:1/nowhere" in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_bad_urls_are_one_line_errors(tmp_path):
    with pytest.raises(StorageError, match="invalid database URL"):
        Database("not a url")
    with pytest.raises(StorageError, match="file path"):
        Database("sqlite://")


def test_sqlite_runs_in_wal_mode_with_busy_timeout_and_foreign_keys(tmp_path):
    db = Database(sqlite_url(tmp_path), busy_timeout_s=7.5)
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 7500
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    db.dispose()


def test_sqlite_writer_waits_for_the_lock_within_the_busy_timeout(tmp_path, sqlite_template):
    shutil.copy(sqlite_template, tmp_path / "pnmix.db")
    holder, patient, impatient = (Database(sqlite_url(tmp_path), busy_timeout_s=t) for t in (30, 30, 0.2))
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.session() as s:
            create_campaign(s, "smollm2-135m", [2.5], n_trials=1)
            locked.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(10)
    with pytest.raises(StorageError, match="locked"), impatient.session() as s:
        create_campaign(s, "smollm2-135m", [2.0], n_trials=1)
    with patient.session(readonly=True) as s:  # WAL: readers are not blocked by the writer
        assert s.scalar(select(func.count()).select_from(Campaign)) == 0
    start = time.monotonic()
    threading.Timer(0.5, release.set).start()
    with patient.session() as s:
        create_campaign(s, "smollm2-135m", [2.0], n_trials=1)
    assert time.monotonic() - start >= 0.4  # it waited for the holder instead of failing
    thread.join(10)
    with patient.session(readonly=True) as s:
        assert sorted(c.budgets[0] for c in s.scalars(select(Campaign))) == [2.0, 2.5]
    for d in (holder, patient, impatient):
        d.dispose()


def test_postgres_read_only_sessions_refuse_writes(pg_url):
    db = Database(pg_url)
    truncate_all(db)
    with pytest.raises(StorageError, match="read-only"), db.session(readonly=True) as s:
        create_campaign(s, "smollm2-135m", [2.5], n_trials=1)
    with db.session() as s:  # the connection went back to the pool writable
        create_campaign(s, "smollm2-135m", [2.5], n_trials=1)
    db.dispose()


def test_settings_choose_the_database(monkeypatch, tmp_path):
    monkeypatch.delenv("PNMIX_DATABASE_URL", raising=False)
    monkeypatch.delenv("PNMIX_DB_PATH", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_db_path() == tmp_path / "data" / "pnmix" / "pnmix.db"
    assert load_storage_settings().url == f"sqlite:///{tmp_path / 'data' / 'pnmix' / 'pnmix.db'}"
    monkeypatch.setenv("PNMIX_DB_PATH", str(tmp_path / "x.db"))
    assert load_storage_settings().url == f"sqlite:///{tmp_path / 'x.db'}"
    monkeypatch.setenv("PNMIX_DATABASE_URL", "postgresql+psycopg2://u@h/db")
    assert load_storage_settings().url == "postgresql+psycopg2://u@h/db"
    assert load_storage_settings(database_url="sqlite:///y.db").url == "sqlite:///y.db"
    monkeypatch.setenv("PNMIX_DB_BUSY_TIMEOUT_S", "-1")
    with pytest.raises(StorageError, match="PNMIX_DB_BUSY_TIMEOUT_S"):
        load_storage_settings()
