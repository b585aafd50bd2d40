"""Database faults: which errors are worth a retry, and how to say what went wrong in one line.

A dropped connection, a PostgreSQL server that refuses connections for a while, or a SQLite
lock held past the busy timeout are *transient*: the same transaction can succeed a moment
later. A full disk, a read-only database file or a missing table are *permanent*: retrying
only delays the error. Both kinds arrive as SQLAlchemy `OperationalError`s, so the driver's
message decides.

    try:
        ...
    except Exception as exc:
        if is_transient(exc): retry
        raise StorageError(describe(exc, db.display_url)) from None

Both functions walk the exception's `__cause__`/`__context__` chain, so they see through our
`StorageError` and Optuna's `StorageInternalError`, which wrap the SQLAlchemy error.
"""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    PendingRollbackError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

# Driver messages (lowercase) that no retry can fix, with what to tell the user.
_ROLLED_BACK = "; nothing was written by the failed transaction"
_PERMANENT = {
    "database or disk is full": "cannot write {where}: the disk is full (database or disk is full)" + _ROLLED_BACK,
    "readonly database": "cannot write {where}: the database file is read-only (attempt to write a readonly "
                         "database)" + _ROLLED_BACK,
    "read-only": "cannot write {where}: read-only ({message})" + _ROLLED_BACK,
    "disk i/o error": "cannot write {where}: disk I/O error (disk full, a file size limit, or a failing disk)"
                      + _ROLLED_BACK,
    "file is not a database": "cannot open {where}: the file is not a SQLite database",
    "database disk image is malformed": "cannot read {where}: the database file is corrupt (disk image is malformed)",
    "no such table": None,
    "does not exist": None,
    "password authentication failed": None,
    "permission denied": None,
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def database_error(exc: BaseException) -> SQLAlchemyError | None:
    """The SQLAlchemy error behind `exc` (itself, or what it wraps), if any."""
    for err in _chain(exc):
        if isinstance(err, SQLAlchemyError):
            return err
    return None


def _driver_message(err: SQLAlchemyError) -> tuple[str, str]:
    original = err.orig if isinstance(err, DBAPIError) and err.orig is not None else err
    lines = str(original).strip().splitlines()
    return type(original).__name__, (lines[0] if lines else "").strip()


def is_transient(exc: BaseException) -> bool:
    """True when `exc` comes from a lost connection, an unreachable server or a busy lock."""
    err = database_error(exc)
    if err is None:
        return False
    if isinstance(err, DBAPIError) and err.connection_invalidated:
        return True
    if isinstance(err, DisconnectionError | PoolTimeoutError):
        return True
    if isinstance(err, PendingRollbackError):  # a session still holding a transaction a lost connection ended
        return True
    if isinstance(err, OperationalError | InterfaceError):
        message = _driver_message(err)[1].lower()
        return not any(needle in message for needle in _PERMANENT)
    return False


def describe(exc: BaseException, where: str) -> str:
    """One line naming the database (`where`, password masked by the caller) and what failed."""
    err = database_error(exc)
    if err is None:
        text = str(exc).strip().splitlines()
        return f"database error on {where}: {text[0] if text else type(exc).__name__}"[:400]
    if isinstance(err, PendingRollbackError):
        return f"database error on {where}: the connection was lost in the middle of a transaction"
    kind, message = _driver_message(err)
    lowered = message.lower()
    for needle, plain in _PERMANENT.items():
        if plain and needle in lowered:
            return plain.format(where=where, message=message)
    return f"database error on {where}: {kind}: {message or type(err).__name__}"[:400]
