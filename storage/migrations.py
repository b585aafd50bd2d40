"""Alembic, driven from code: `pnmix db upgrade` and the schema check the service and tuner run.

Our version table is `pnmix_alembic_version`, because Optuna's RDB storage owns `alembic_version`
in the same database. Migrations live in `alembic/versions/`: at the repository root in a checkout,
where `alembic.ini` lets developers use the `alembic` command too (`alembic revision --autogenerate
-m ...`), and in `pnmix/alembic/` of an installed wheel; in both it is the folder beside this
package's own (pyproject.toml maps `alembic/` there).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine, inspect

from pnmix.storage.engine import Database, wrap_errors
from pnmix.storage.errors import SchemaError, StorageError

VERSION_TABLE = "pnmix_alembic_version"
ALEMBIC_DIR = Path(__file__).resolve().parents[1] / "alembic"  # the checkout's root, or the installed pnmix/
UPGRADE_HINT = "run `pnmix db upgrade`"


def alembic_config(url: str | None = None):  # -> alembic.config.Config (imported lazily)
    from alembic.config import Config

    if not (ALEMBIC_DIR / "env.py").is_file():
        raise StorageError(f"migration scripts not found at {ALEMBIC_DIR}; reinstall pnmix "
                           "(they ship as pnmix/alembic)")
    config = Config()
    config.set_main_option("script_location", str(ALEMBIC_DIR))
    config.set_main_option("version_table", VERSION_TABLE)
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


@lru_cache(maxsize=1)
def head_revision() -> str:
    """The newest revision in alembic/versions (read once per process)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "alembic/versions holds no revision"
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None when our tables were never created."""
    from alembic.runtime.migration import MigrationContext

    with wrap_errors(_where(engine)), engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(db: Database, revision: str = "head") -> tuple[str | None, str | None]:
    """Brings the schema to `revision` in one transaction; returns (before, after). A `revision`
    older than the database's is refused: an upgrade never goes back (Alembic would do nothing)."""
    order = revision_order()
    before = current_revision(db.engine)
    if revision != "head" and before in order and revision in order and order.index(revision) < order.index(before):
        raise SchemaError(f"{db.display_url} is at revision {before}; upgrading to the older {revision} would do "
                          f"nothing: allowed head or a revision from {before} on (pnmix does not downgrade)")
    return _run(db, "upgrade", revision)


def downgrade(db: Database, revision: str) -> tuple[str | None, str | None]:
    return _run(db, "downgrade", revision)


def _run(db: Database, direction: str, revision: str) -> tuple[str | None, str | None]:
    from alembic.util.exc import CommandError

    from alembic import command

    config = alembic_config()
    before = current_revision(db.engine)
    if before is not None and before not in known_revisions():
        # Alembic would fail with "Can't locate revision"; a downgrade from it is impossible too.
        raise SchemaError(_newer_message(db.display_url, before))
    try:
        with wrap_errors(db.display_url), db.engine.begin() as conn:
            config.attributes["connection"] = conn
            getattr(command, direction)(config, revision)
    except CommandError as exc:
        raise SchemaError(f"cannot {direction} {db.display_url} to {revision!r}: {exc}") from None
    return before, current_revision(db.engine)


def has_no_pnmix_tables(db: Database) -> bool:
    """True for a database that holds none of our tables and no revision (new, or only Optuna's)."""
    return current_revision(db.engine) is None and not any(t.startswith("pnmix_") for t in _tables(db.engine))


def check_schema(db: Database) -> str:
    """Returns the head revision if the database is at it; otherwise raises SchemaError saying what to run."""
    head = head_revision()
    current = current_revision(db.engine)
    if current == head:
        return head
    if current is None:
        tables = _tables(db.engine)
        what = "has no pnmix tables" if not any(t.startswith("pnmix_") for t in tables) else "has no schema revision"
        raise SchemaError(f"database {db.display_url} {what}: {UPGRADE_HINT}")
    if current not in known_revisions():
        raise SchemaError(_newer_message(db.display_url, current))
    raise SchemaError(
        f"database {db.display_url} is at schema revision {current}, this pnmix needs {head}: {UPGRADE_HINT}"
    )


@lru_cache(maxsize=1)
def revision_order() -> tuple[str, ...]:
    """Every revision in alembic/versions, oldest first (read once per process)."""
    from alembic.script import ScriptDirectory

    return tuple(rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions())[::-1]


def known_revisions() -> frozenset[str]:
    """Every revision in alembic/versions."""
    return frozenset(revision_order())


def _newer_message(where: str, current: str) -> str:
    return (f"database {where} is at schema revision {current}, newer than this pnmix (head {head_revision()}, "
            "which does not know it): upgrade pnmix, or use another database")


def _tables(engine: Engine) -> list[str]:
    with wrap_errors(_where(engine)):
        return inspect(engine).get_table_names()


def _where(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)
