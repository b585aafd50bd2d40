"""`pnmix serve` and `pnmix db ...`. Heavy imports (FastAPI, SQLAlchemy, uvicorn) stay inside
the functions, so that `pnmix bits` and friends start without them."""

from __future__ import annotations

from typing import Annotated

import typer

from pnmix.inputs import Choice, Int
from pnmix.storage.vocabulary import PORT, DatabaseUrl, Host, check_bind

_URL_HELP = "SQLAlchemy URL (default: PNMIX_DATABASE_URL, else the SQLite file PNMIX_DB_PATH)"
DatabaseUrlOpt = Annotated[str | None, typer.Option("--database-url", help=_URL_HELP, parser=DatabaseUrl())]
# What only reads (and the service) never creates a database: a SQLite file must already be there.
ExistingDatabaseUrl = Annotated[str | None, typer.Option("--database-url", help=_URL_HELP,
                                                         parser=DatabaseUrl(must_exist=True))]
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _revisions() -> tuple[str, ...]:
    from pnmix.storage.migrations import known_revisions

    return ("head", *sorted(known_revisions()))

db_app = typer.Typer(help="Database schema: create or upgrade pnmix's tables.", no_args_is_help=True)


def serve(
    host: Annotated[str | None, typer.Option(help="interface to bind (default PNMIX_HOST or 127.0.0.1)",
                                             parser=Host())] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default PNMIX_PORT or 8000)", parser=Int(PORT))] = None,
    database_url: ExistingDatabaseUrl = None,
    log_level: Annotated[str, typer.Option(help=", ".join(LOG_LEVELS), parser=Choice(LOG_LEVELS))] = "info",
) -> None:
    """Run the REST service (FastAPI under uvicorn): /v1/recommend, /v1/models, /v1/campaigns, docs at /docs."""
    import uvicorn

    from pnmix.api.app import create_app
    from pnmix.api.settings import load_settings
    from pnmix.storage.engine import Database
    from pnmix.storage.migrations import check_schema

    settings = load_settings(host=host, port=port, database_url=database_url)
    db = Database.from_settings(settings, create=False)  # a missing database: one line here, not uvicorn's trace
    try:
        if settings.check_schema:  # say it in one line here, before uvicorn starts
            check_schema(db)
    finally:
        db.dispose()
    check_bind(settings.host, settings.port)
    writes = "enabled" if settings.writes_enabled else "disabled (set PNMIX_API_TOKEN to enable)"
    typer.echo(f"pnmix service on http://{settings.host}:{settings.port}/docs, database {_display(settings.url)}, "
               f"writes {writes}", err=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level)


@db_app.command("upgrade")
def db_upgrade(
    database_url: DatabaseUrlOpt = None,
    revision: Annotated[str, typer.Option(help="target revision: head, or a revision id",
                                          parser=Choice(_revisions))] = "head",
) -> None:
    """Create pnmix's tables or bring them to the newest schema (idempotent)."""
    from pnmix.storage.engine import Database
    from pnmix.storage.migrations import upgrade
    from pnmix.storage.settings import load_storage_settings

    db = Database.from_settings(load_storage_settings(database_url=database_url))
    try:
        before, after = upgrade(db, revision)
    finally:
        db.dispose()
    change = f"already at {after}" if before == after else f"upgraded {before or 'empty'} -> {after}"
    typer.echo(f"{db.display_url}: {change}")


@db_app.command("current")
def db_current(database_url: ExistingDatabaseUrl = None) -> None:
    """Print the schema revision of the database and whether it is current."""
    from pnmix.storage.engine import Database
    from pnmix.storage.migrations import current_revision, head_revision, known_revisions
    from pnmix.storage.settings import load_storage_settings

    db = Database.from_settings(load_storage_settings(database_url=database_url), create=False)
    try:
        current, head = current_revision(db.engine), head_revision()
    finally:
        db.dispose()
    if current == head:
        state = "current"
    elif current is not None and current not in known_revisions():
        state = "unknown to this pnmix: written by a newer pnmix; upgrade pnmix"
    else:
        state = "needs `pnmix db upgrade`"
    typer.echo(f"{db.display_url}: revision {current or 'none'} (head {head}, {state})")


def _display(url: str) -> str:
    from pnmix.storage.engine import display_url

    return display_url(url)
