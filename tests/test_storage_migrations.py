"""Alembic migrations on SQLite and PostgreSQL: upgrade from the first revision with data, the
head schema equals the ORM, the schema check, and coexistence with Optuna's tables."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from pnmix.bits import kv_bits, value_bits_total
from pnmix.storage import Database, SchemaError, check_schema, current_revision, head_revision, upgrade
from pnmix.storage.migrations import VERSION_TABLE, downgrade
from pnmix.storage.orm import Base, Campaign
from pnmix.storage.read import list_front_points, recommend
from pnmix.storage.testing import postgres_skip_reason, sqlite_url, temporary_postgres_url


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request, tmp_path):
    """A database with no tables at all."""
    if request.param == "sqlite":
        db = Database(sqlite_url(tmp_path))
        yield db
        db.dispose()
        return
    reason = postgres_skip_reason()
    if reason:
        pytest.skip(reason)
    with temporary_postgres_url() as url:
        db = Database(url)
        yield db
        db.dispose()


def schema_diff(db: Database) -> list:
    def ours(name, type_, parent_names):
        return type_ != "table" or (name.startswith("pnmix_") and name != VERSION_TABLE)

    with db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": ours, "compare_type": True})
        return compare_metadata(context, Base.metadata)


def test_head_schema_is_exactly_the_orm(empty_db):
    assert upgrade(empty_db) == (None, head_revision())
    assert schema_diff(empty_db) == []
    assert check_schema(empty_db) == head_revision()
    assert upgrade(empty_db) == (head_revision(), head_revision())  # idempotent


def test_upgrade_from_the_first_revision_keeps_the_data(empty_db):
    db = empty_db
    upgrade(db, "0001")
    assert current_revision(db.engine) == "0001"
    columns = {c["name"] for c in inspect(db.engine).get_columns("pnmix_campaigns")}
    assert "worker_id" not in columns and "heartbeat_at" not in columns
    # Rows as a 0001-era pnmix wrote them, in raw SQL (the ORM now knows newer columns).
    with db.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO pnmix_models (id, name, family, source, location, num_layers, num_heads, num_kv_heads,"
            " head_dim, created_at, updated_at) VALUES (1, 'smollm2-135m', 'llama', 'embedded', '', 30, 9, 3, 64,"
            " :t, :t)"), {"t": "2026-11-01 10:00:00+00:00"})
        for cid, status, started in ((1, "running", "2026-11-01 10:05:00+00:00"), (2, "queued", None)):
            conn.execute(text(
                "INSERT INTO pnmix_campaigns (id, model_id, method, budgets, n_trials, profile, objectives, backend,"
                " options, status, trials_done, trials_total, study_names, created_at, started_at) VALUES"
                " (:id, 1, 'pnmix', '[2.5]', 4, 'quick', '[\"accuracy\", \"key_bits\"]', 'auto', '{}', :status,"
                " 1, 4, '{}', :t, :started)"), {"id": cid, "status": status, "t": "2026-11-01 10:00:00+00:00",
                                                "started": started})
        conn.execute(text(
            "INSERT INTO pnmix_front_points (campaign_id, model_id, budget, trial_number, b_high, b_low, group_size,"
            " salient_ratio, n_sink, residual_len, value_bits, value_group_size, criterion, seed, accuracy,"
            " accuracy_parts, key_bits, kv_bytes, throughput, backend, device, versions, created_at) VALUES"
            " (1, 1, 2.5, 0, 2, 2, 128, 0.0, 0, 128, 2, 32, 'qk_pair_norm', 0, 0.75, '{\"passkey\": 0.75}', 2.25,"
            " 123456, 14.5, 'torch', 'cpu', '{}', :t)"), {"t": "2026-11-01 10:06:00+00:00"})
    with pytest.raises(SchemaError, match=r"at schema revision 0001, this pnmix needs 0009: run `pnmix db upgrade`"):
        check_schema(db)

    assert upgrade(db) == ("0001", head_revision())
    assert schema_diff(db) == []
    with db.session(readonly=True) as s:
        running, queued = s.get(Campaign, 1), s.get(Campaign, 2)
        assert running.heartbeat_at == running.started_at  # backfilled by 0002
        assert running.started_at.isoformat() == "2026-11-01T10:05:00+00:00"
        assert (queued.heartbeat_at, queued.worker_id, running.worker_id) == (None, None, None)
        best = recommend(s, "smollm2-135m", 2.5)
        assert (best.key_bits, best.kv_bytes, best.accuracy_parts) == (2.25, 123456, {"passkey": 0.75})
        assert best.accuracy_se is None  # 0003: points stored before standard errors read as unknown
        # 0004: a single config, a key budget, and its KV bits from the formula (2-bit values, G_V = 32)
        assert (best.layers, best.budget_on, s.get(Campaign, 1).budget_on) == (None, "key", "key")
        assert best.kv_bits == pytest.approx((2.25 + 3.0) / 2)
        assert best.kv_bits == pytest.approx(kv_bits(best.config, 30, 64))  # the SQL formula is pnmix.bits'
        assert value_bits_total(best.config) == 3.0
        assert recommend(s, "smollm2-135m", 2.7, bits_of="kv").id == best.id
        assert list_front_points(s, "smollm2-135m").total == 1
        assert best.recipe is None and best.config.b_high == 2  # 0008: a PN-Mix config, no recipe
        assert best.windows is None  # 0009: no window quantized
    with db.engine.begin() as conn, pytest.raises(Exception, match="(?i)check|constraint"):
        # 0008: a point holds a PN-Mix config or a recipe, not both
        conn.execute(text("UPDATE pnmix_front_points SET recipe = '{\"layers\": []}'"))


def test_downgrade_to_nothing_and_back(empty_db):
    upgrade(empty_db)
    assert downgrade(empty_db, "base") == (head_revision(), None)
    assert not [t for t in inspect(empty_db.engine).get_table_names() if t.startswith("pnmix_") and t != VERSION_TABLE]
    upgrade(empty_db)
    assert schema_diff(empty_db) == []


def test_schema_check_names_the_command(tmp_path):
    db = Database(sqlite_url(tmp_path))
    with pytest.raises(SchemaError, match=r"has no pnmix tables: run `pnmix db upgrade`"):
        check_schema(db)
    upgrade(db)
    with db.engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'f00d'"))
    with pytest.raises(SchemaError, match="f00d, newer than this pnmix"):
        check_schema(db)
    with pytest.raises(SchemaError, match="f00d, newer than this pnmix"):  # not Alembic's "Can't locate"
        upgrade(db)
    db.dispose()


def test_lives_beside_optuna_in_one_database(tmp_path):
    """Optuna's RDB storage owns `alembic_version`; ours is `pnmix_alembic_version`."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = sqlite_url(tmp_path)
    study = optuna.create_study(storage=url, study_name="smollm2-135m@2.5", directions=["maximize", "minimize"])
    study.optimize(lambda t: (t.suggest_float("x", 0, 1), 1.0), n_trials=2)
    db = Database(url)
    upgrade(db)
    assert check_schema(db) == head_revision()
    assert schema_diff(db) == []
    with db.engine.connect() as conn:
        optuna_version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        ours = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
        assert ours == head_revision() and optuna_version != ours
        assert conn.execute(select(Campaign.id)).all() == []
    reloaded = optuna.load_study(study_name="smollm2-135m@2.5", storage=url)
    assert len(reloaded.trials) == 2
    db.dispose()


def test_a_writing_command_creates_a_new_database_but_never_migrates_an_old_one(tmp_path):
    from pnmix.tuner.search.session import open_db

    url = sqlite_url(tmp_path)
    db = open_db(url, create=True)  # what `tune` and `worker` do
    assert current_revision(db.engine) == head_revision()
    downgrade(db, "0002")
    db.dispose()
    with pytest.raises(SchemaError, match=r"at schema revision 0002, this pnmix needs 0009: run `pnmix db upgrade`"):
        open_db(url, create=True)
    with pytest.raises(SchemaError, match="does not exist"):  # commands that only read create nothing
        open_db(sqlite_url(tmp_path / "other"))
    assert not (tmp_path / "other").exists()
