"""Where the database is: one pydantic-settings class, read from `PNMIX_*` environment variables.

`PNMIX_DATABASE_URL` (any SQLAlchemy URL, e.g. `postgresql+psycopg2://user@host/db`) wins;
without it the database is the SQLite file `PNMIX_DB_PATH` (default
`$XDG_DATA_HOME/pnmix/pnmix.db`, i.e. `~/.local/share/pnmix/pnmix.db`). The tuner, the worker, the
service and the Optuna dashboard all read the same settings, so they share one database.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from pnmix.storage.errors import StorageError
from pnmix.storage.vocabulary import SECONDS


def default_db_path() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "pnmix" / "pnmix.db"


class StorageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PNMIX_", extra="ignore")

    database_url: str | None = Field(default=None, description="SQLAlchemy URL; wins over db_path")
    db_path: Path = Field(default_factory=default_db_path, description="SQLite file used without a URL")
    db_busy_timeout_s: float = Field(default=30.0, gt=SECONDS.low, le=SECONDS.high, allow_inf_nan=False,
                                     description="SQLite: how long a writer waits for the lock: "
                                                 f"{SECONDS.allowed} seconds")

    @property
    def url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.db_path.expanduser()}"


def load_storage_settings(**overrides: object) -> StorageSettings:
    """Settings from the environment, with explicit overrides (None means "not given")."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return StorageSettings(**given)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise StorageError(f"bad storage setting: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    field = StorageSettings.model_fields.get(str(err["loc"][0])) if err["loc"] else None
    allowed = f" (allowed: {field.description})" if field is not None and field.description else ""
    return f"PNMIX_{loc.upper()}={str(err.get('input'))[:80]!r}: {err['msg']}{allowed}"
