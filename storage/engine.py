"""Engines and sessions: SQLite (WAL, busy timeout, foreign keys) or PostgreSQL, chosen by URL.

    db = Database.from_settings()                # PNMIX_DATABASE_URL, or the SQLite file PNMIX_DB_PATH
    with db.session() as s:                      # one transaction: commit on success, rollback on error
        replace_front(s, campaign_id, 2.25, points)
    with db.session(readonly=True) as s:         # what the service's GET routes use
        point = recommend(s, "smollm2-135m", 2.25)

Every SQLAlchemy error leaving `Database.session()` becomes a `StorageError` whose message names
the database URL without its password.

SQLite: the driver's own transaction handling is switched off and each transaction starts with
`BEGIN IMMEDIATE` (write sessions) or `BEGIN` (read-only sessions). A write session takes the
write lock at its start and waits up to the busy timeout for it; with a deferred `BEGIN`, a
transaction that read first and then writes fails at once when another writer got in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from pnmix.storage.errors import SchemaError, StorageError
from pnmix.storage.faults import describe
from pnmix.storage.settings import StorageSettings, load_storage_settings

_READONLY = "pnmix_readonly"


def display_url(url: str | Any) -> str:
    """The URL as safe to print: password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "<unparseable database URL>"


def make_engine(url: str, *, busy_timeout_s: float = 30.0, echo: bool = False, create: bool = True,
                create_folder: bool = True) -> Engine:
    """An engine for `url`; SQLite files get WAL mode, a busy timeout and enforced foreign keys.

    `create=False` (what only reads, and the service): a SQLite file that is not there is refused in
    one line instead of being created, with its folder, by the first connection. `create_folder=False`
    (a worker, a queued campaign: processes that are not told where to write) creates the file but
    refuses a folder that does not exist.
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise StorageError(f"invalid database URL {display_url(url)!r}: expected e.g. sqlite:///path/to/pnmix.db "
                           "or postgresql+psycopg2://user@host:5432/db") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            raise StorageError(
                f"SQLite database {display_url(url)!r} must be a file path (several connections share it)"
            )
        if parsed.query:  # e.g. ?timeout=abc would reach sqlite3.connect as a float() of text
            raise StorageError(f"SQLite database URL {display_url(url)!r} takes no query parameters (given: "
                               f"{', '.join(sorted(parsed.query))}): allowed sqlite:///path/to/pnmix.db; the busy "
                               "timeout is PNMIX_DB_BUSY_TIMEOUT_S")
        path = Path(database).expanduser()
        if not create:
            try:
                exists = path.is_file()
            except OSError:  # a name too long for the file system
                exists = False
            if not exists:
                raise SchemaError(f"database {display_url(url)} does not exist: run `pnmix db upgrade` (or `pnmix "
                                  "run`) to create it")
        if not create_folder and not path.parent.is_dir():
            raise StorageError(f"the folder of SQLite database {database} does not exist ({path.parent}): create "
                               "it first; a worker or a queued campaign does not create folders")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the folder of {database}: {exc.strerror}") from None
        engine = create_engine(parsed, echo=echo, connect_args={"timeout": busy_timeout_s})
        configure_sqlite(engine, busy_timeout_s)
        return engine
    try:
        return create_engine(parsed, echo=echo, pool_pre_ping=True)
    except (ArgumentError, ImportError) as exc:
        raise StorageError(f"cannot use database {display_url(url)}: {exc}") from None


def configure_sqlite(engine: Engine, busy_timeout_s: float, readonly_option: bool = True) -> None:
    """WAL, busy timeout, foreign keys, and `BEGIN IMMEDIATE` for write transactions.

    Also applied to Optuna's engine (tuner.search.campaign) with `readonly_option=False`: Optuna cannot
    mark read-only transactions, so there every transaction takes the write lock at its start.
    Without it, two workers popping the same enqueued (WAITING) trial both see it waiting and
    both run it, because the driver's deferred transactions do not lock the read.
    """
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see the module docstring)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; a power cut may lose the last commit
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        readonly = readonly_option and conn.get_execution_options().get(_READONLY)
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


class Database:
    """An engine plus a session factory; the one object the tuner, worker and service pass around."""

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, echo: bool = False, create: bool = True,
                 create_folder: bool = True) -> None:
        self.url = url
        self.engine = make_engine(url, busy_timeout_s=busy_timeout_s, echo=echo, create=create,
                                  create_folder=create_folder)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings: StorageSettings | None = None, create: bool = True) -> Database:
        settings = settings or load_storage_settings()
        return cls(settings.url, busy_timeout_s=settings.db_busy_timeout_s, create=create)

    @property
    def display_url(self) -> str:
        return display_url(self.engine.url)

    @property
    def backend(self) -> str:
        return self.engine.dialect.name  # "sqlite" | "postgresql"

    @contextmanager
    def session(self, readonly: bool = False) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back if it raises.

        `readonly=True` takes no write lock on SQLite and runs a READ ONLY transaction on PostgreSQL.
        """
        session = self._sessions()
        try:
            with wrap_errors(self.display_url):
                if readonly:
                    options: dict[str, Any] = {_READONLY: True}
                    if self.backend == "postgresql":
                        options["postgresql_readonly"] = True
                    session.connection(execution_options=options)
                yield session
                session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def ping(self) -> None:
        """Raises StorageError unless the database answers a trivial query."""
        with wrap_errors(self.display_url), self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def wrap_errors(where: str) -> Iterator[None]:
    """Turns SQLAlchemy and driver errors into a one-line StorageError naming `where`."""
    try:
        yield
    except StorageError:
        raise
    except SQLAlchemyError as exc:
        raise StorageError(describe(exc, where)) from exc
