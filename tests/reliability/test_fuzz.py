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
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from api.app import create_app
from api.settings import Settings
from storage import Database
from storage.testing import sqlite_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_api import AUTH, TOKEN, count_rows, seed  # noqa: E402
from test_api_fuzz import OPERATIONS  # noqa: E402

EXAMPLES_PER_PAIR = 150
CASES = [(method, path, mode) for method, path in OPERATIONS
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if not (path == "/v1/health" and mode is GenerationMode.NEGATIVE)]
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


@pytest.mark.parametrize(("method", "path", "mode"), [pytest.param(*c, id=f"{c[0]} {c[1]} {c[2].value}")
                                                      for c in CASES])
def test_thousands_of_cases_no_5xx_no_schema_violation(fuzz_env, method, path, mode):
    api_schema, db = fuzz_env
    operation = api_schema[path][method]
    statuses: list[int] = []
    before = count_rows(db)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_PAIR, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call_and_validate(headers=AUTH)
        statuses.append(response.status_code)

    run()
    TOTAL["cases"] += len(statuses)
    assert len(statuses) >= EXAMPLES_PER_PAIR // 2 or path == "/v1/health"  # hypothesis ran them, not a handful
    assert max(statuses) < 500
    if mode is GenerationMode.NEGATIVE and method == "POST":
        assert 201 not in statuses and count_rows(db) == before
