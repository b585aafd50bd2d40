"""Alembic environment for pnmix's own tables (prefix `pnmix_`, version table `pnmix_alembic_version`).

Optuna's tables may share the database; they are invisible to autogenerate (`include_name`), so
a revision never touches them. `storage.migrations` passes an open connection in
`config.attributes["connection"]`; the `alembic` command gets its URL from `-x url=...`,
`sqlalchemy.url`, or pnmix's storage settings.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from pnmix.storage.orm import Base

config = context.config
VERSION_TABLE = config.get_main_option("version_table") or "pnmix_alembic_version"
if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    if type_ == "table":
        return bool(name) and str(name).startswith("pnmix_")
    return True


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    from pnmix.storage.engine import Database
    from pnmix.storage.settings import load_storage_settings

    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    db = Database(url) if url else Database.from_settings(load_storage_settings())
    try:
        with db.engine.begin() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        db.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported; run against a database")
run_migrations_online()
