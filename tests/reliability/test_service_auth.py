"""Writes need the right token, the token never leaks, and big bodies and headers are refused.

Against a real `pnmix serve` (log level debug, its whole output captured): a write without a
token, with a wrong one, with an empty one or with another scheme is refused with 401 (403 when the
server has no token, or an empty one, configured) and changes nothing in the database; neither
the token nor the wrong token appears in any response or in the server's log. Bodies over
`PNMIX_MAX_BODY_BYTES` get 413, whether declared by Content-Length or streamed in chunks; header
fields over `PNMIX_MAX_HEADER_BYTES` get 431.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from serve import serve

from pnmix.api.app import create_app
from pnmix.api.settings import Settings
from pnmix.storage import Database
from pnmix.storage.testing import sqlite_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_api import AUTH, TOKEN, campaigns_dump, count_rows, seed  # noqa: E402

WRONG = "wrong-token-0123456789"
LIMIT = 8192
BODY = {"model": "smollm2-135m", "budgets": [2.0], "n_trials": 3}
REFUSED = {
    "no header": {},
    "wrong token": {"Authorization": f"Bearer {WRONG}"},
    "token plus a character": {"Authorization": f"Bearer {TOKEN}x"},
    "token prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "empty token": {"Authorization": "Bearer"},  # "Bearer " on the wire: HTTP strips the trailing space
    "empty header": {"Authorization": ""},
    "basic scheme": {"Authorization": "Basic " + base64.b64encode(f"user:{TOKEN}".encode()).decode()},
}


def padded(size: int) -> bytes:
    """A valid campaign request of exactly `size` bytes (JSON whitespace is padding)."""
    raw = json.dumps(BODY).encode()
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    db = Database(sqlite_url(folder))
    seed(db)
    yield folder, db
    db.dispose()


def test_writes_are_refused_without_the_token_and_nothing_leaks(seeded):
    folder, db = seeded
    rows, campaigns = count_rows(db), campaigns_dump(db)
    bodies: list[str] = []
    with serve(folder, str(db.url), log_level="debug", PNMIX_API_TOKEN=TOKEN,
               PNMIX_MAX_BODY_BYTES=str(LIMIT)) as server, httpx.Client(base_url=server.base, timeout=10) as client:
        for name, headers in REFUSED.items():
            r = client.post("/v1/campaigns", json=BODY, headers=headers)
            assert r.status_code == 401, (name, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.headers["www-authenticate"].startswith('Bearer realm="pnmix"')
            bodies.append(r.text + json.dumps(dict(r.headers)))
        assert count_rows(db) == rows and campaigns_dump(db) == campaigns  # refused writes changed nothing

        # Over the limit: declared, and streamed without a length. With the right token: size alone decides.
        json_type = {"Content-Type": "application/json"}
        r = client.post("/v1/campaigns", content=padded(LIMIT + 1), headers={**AUTH, **json_type})
        assert (r.status_code, r.json()["title"]) == (413, "Content Too Large")
        assert r.json()["detail"] == f"request body over {LIMIT} bytes (PNMIX_MAX_BODY_BYTES)"
        chunks = (b" " * 1024 for _ in range(64))
        r = client.post("/v1/campaigns", content=chunks, headers={**AUTH, **json_type})
        assert r.status_code == 413 and "content-length" not in r.request.headers
        r = client.post("/v1/campaigns", content=b"x" * (1 << 20), headers=json_type)
        assert r.status_code == 413  # refused before the token is even looked at
        bodies.append(r.text)
        assert count_rows(db) == rows and campaigns_dump(db) == campaigns

        for size in (100_000, 1 << 20, 8 << 20):  # header fields over PNMIX_MAX_HEADER_BYTES (16 KiB)
            r = client.get("/v1/models", headers={"X-Padding": "x" * size})
            assert r.status_code == 431 and r.headers["content-type"] == "application/problem+json", size
        assert count_rows(db) == rows and campaigns_dump(db) == campaigns

        r = client.post("/v1/campaigns", content=padded(LIMIT), headers={**AUTH, **json_type})
        assert r.status_code == 201, r.text  # exactly at the limit is fine
        bodies.append(r.text)
        assert count_rows(db)["pnmix_campaigns"] == rows["pnmix_campaigns"] + 1
    logs = server.logs()
    assert '"POST /v1/campaigns HTTP/1.1" 401' in logs and '"POST /v1/campaigns HTTP/1.1" 413' in logs
    for secret in (TOKEN, WRONG, TOKEN[:-1]):
        assert secret not in logs
        assert not [b for b in bodies if secret in b]


def test_writes_are_forbidden_when_the_server_token_is_empty_or_unset(seeded):
    _, db = seeded
    rows = count_rows(db)
    for configured in ("", None):
        with TestClient(create_app(Settings(database_url=str(db.url), api_token=configured))) as client:
            for headers in ({}, {"Authorization": "Bearer "}, AUTH, {"Authorization": "Bearer anything"}):
                r = client.post("/v1/campaigns", json=BODY, headers=headers)
                assert r.status_code == 403, r.text
                assert r.json()["detail"] == "writes are disabled: the server has no PNMIX_API_TOKEN set"
                assert TOKEN not in r.text
    assert count_rows(db) == rows
