"""Item 7: the OpenAPI schema, fuzzed at scale (schemathesis, in process).

The same checks as tests/test_api_fuzz.py, six times the examples: every operation with valid
and invalid inputs, up to 150 examples per (operation, mode) pair, about 2,100 cases in all (the
health route has no input, so one case). Every response
must be documented (status, content type, body schema) and none may be a 5xx; invalid writes
leave the database as it was. Derandomized, so a failure reproduces; the case count is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis import GenerationMode

from pnmix.api.app import create_app
from pnmix.api.settings import Settings
from pnmix.storage import Database
from pnmix.storage.testing import sqlite_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_api import TOKEN, count_rows, seed  # noqa: E402
from test_api_fuzz import CASES, fuzz_statuses  # noqa: E402

EXAMPLES_PER_PAIR = 150
TOTAL = {"cases": 0}


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    db = Database(sqlite_url(tmp_path_factory.mktemp("fuzz-at-scale")))
    seed(db)
    app = create_app(Settings(database_url=str(db.url), api_token=TOKEN))
    with TestClient(app):
        yield schemathesis.openapi.from_asgi("/openapi.json", app), db
    db.dispose()
    print(f"\nschema fuzz: {TOTAL['cases']} cases")


@pytest.mark.parametrize(("method", "path", "mode"), CASES)  # every operation, valid and invalid inputs
def test_thousands_of_cases_no_5xx_no_schema_violation(fuzz_env, method, path, mode):
    api_schema, db = fuzz_env
    before = count_rows(db)
    statuses = fuzz_statuses(api_schema[path][method], mode, EXAMPLES_PER_PAIR)
    TOTAL["cases"] += len(statuses)
    assert len(statuses) >= EXAMPLES_PER_PAIR // 2 or path == "/v1/health"  # hypothesis ran them, not a handful
    assert max(statuses) < 500
    if mode is GenerationMode.NEGATIVE and method == "POST":
        assert 201 not in statuses and count_rows(db) == before
