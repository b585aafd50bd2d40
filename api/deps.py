"""Dependencies: the database session per request, settings, and the bearer-token check for writes."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from pnmix.api.problems import ProblemError
from pnmix.api.settings import Settings
from pnmix.storage.engine import Database


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_db(request: Request) -> Database:
    return request.app.state.db


def read_session(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    with db.session(readonly=True) as session:
        yield session


def write_session(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    with db.session() as session:
        yield session


_bearer = HTTPBearer(auto_error=False, description="PNMIX_API_TOKEN, needed for writes only")


def require_token(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Writes need `Authorization: Bearer <PNMIX_API_TOKEN>`; without a configured token they are off."""
    if not settings.writes_enabled:
        raise ProblemError(403, "Forbidden", "writes are disabled: the server has no PNMIX_API_TOKEN set")
    challenge = {"WWW-Authenticate": 'Bearer realm="pnmix"'}
    if credentials is None:
        raise ProblemError(401, "Unauthorized", "this write needs Authorization: Bearer <token>", headers=challenge)
    assert settings.api_token is not None
    expected = settings.api_token.get_secret_value().encode()
    # compare_digest takes time independent of where the strings differ
    if not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise ProblemError(
            401, "Unauthorized", "invalid token", headers={**challenge, "WWW-Authenticate": challenge[
                "WWW-Authenticate"] + ', error="invalid_token"'}
        )


async def strict_json_body(request: Request) -> None:
    """Refuses a JSON body that is not UTF-8 (RFC 8259: JSON exchanged between systems is UTF-8; a
    parser would guess UTF-16 or UTF-32 from its zero bytes), with 415, and one that gives a key
    twice (a parser would keep one of the two silently), with 422."""
    import json

    body = await request.body()
    charset = request.headers.get("content-type", "").lower().partition("charset=")[2].strip(' ";')
    try:
        body.decode("utf-8")
        utf8 = b"\x00" not in body and not body.startswith(b"\xef\xbb\xbf") and charset in ("", "utf-8", "utf8")
    except UnicodeDecodeError:
        utf8 = False
    if not utf8:
        raise ProblemError(415, "Unsupported Media Type", "the JSON body is not UTF-8 (or declares another "
                           "charset): allowed UTF-8 JSON without a byte order mark")

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in items]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ProblemError(422, "Unprocessable Content", f"key {twice[0]!r} given twice in the JSON body")
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):  # not JSON at all: the body's own validation says so
        pass


SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_db)]
ReadSession = Annotated[Session, Depends(read_session)]
# scope="function": the session commits before the response is sent, so a client that reads what
# it just wrote (the Location of a new campaign) finds it; by default the exit code of a dependency
# with yield runs after the response.
WriteSession = Annotated[Session, Depends(write_session, scope="function")]
TokenChecked = Depends(require_token)
StrictJsonBody = Depends(strict_json_body)
