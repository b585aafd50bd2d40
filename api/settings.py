"""Service settings: one pydantic-settings class, `PNMIX_*` environment variables.

The database settings (`PNMIX_DATABASE_URL`, `PNMIX_DB_PATH`, `PNMIX_DB_BUSY_TIMEOUT_S`) come from
`storage.settings.StorageSettings`, so the service reads the database the tuner writes.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import SettingsConfigDict

from pnmix.errors import PNMixError
from pnmix.storage.settings import StorageSettings
from pnmix.storage.vocabulary import BODY_BYTES, HEADER_BYTES, PAGE_SIZE, PORT

MAX_PAGE_SIZE = int(PAGE_SIZE.high)


class SettingsError(PNMixError, ValueError):
    pass


class Settings(StorageSettings):
    model_config = SettingsConfigDict(env_prefix="PNMIX_", extra="ignore")

    api_token: SecretStr | None = Field(
        default=None, description="bearer token for writes (POST /v1/campaigns); unset disables writes"
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=PORT.low, le=PORT.high)
    default_page_size: int = Field(default=50, ge=PAGE_SIZE.low, le=PAGE_SIZE.high)
    check_schema: bool = Field(default=True, description="refuse to start unless the schema is at head")
    max_body_bytes: int = Field(default=64 * 1024, ge=BODY_BYTES.low, le=BODY_BYTES.high,
                                description="larger request bodies are refused with 413")
    max_header_bytes: int = Field(default=16 * 1024, ge=HEADER_BYTES.low, le=HEADER_BYTES.high,
                                  description="requests whose header fields (names and values) hold more bytes "
                                              "are refused with 431")

    @property
    def writes_enabled(self) -> bool:
        return self.api_token is not None and bool(self.api_token.get_secret_value())


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides (None means "not given")."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise SettingsError(f"bad setting PNMIX_{loc.upper()}: {err['msg']}") from None
