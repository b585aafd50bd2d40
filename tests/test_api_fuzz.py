"""Property-based tests against the service's own OpenAPI schema (schemathesis, in process).

Every operation gets generated valid and invalid inputs (15 operation x mode pairs, 25 examples
each); every response must be a documented status with a documented content type and body
schema, and never a 5xx. Bounded and derandomized: a CI run takes seconds and is reproducible.
"""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from test_api import AUTH, TOKEN, count_rows, seed

from pnmix.api.app import create_app
from pnmix.api.settings import Settings
from pnmix.storage import Database
from pnmix.storage.testing import sqlite_url

EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def fuzz_db(tmp_path_factory):
    db = Database(sqlite_url(tmp_path_factory.mktemp("fuzz")))
    seed(db)
    yield db
    db.dispose()


@pytest.fixture(scope="module")
def fuzz_app(fuzz_db):
    app = create_app(Settings(database_url=str(fuzz_db.url), api_token=TOKEN))
    with TestClient(app):  # runs the lifespan, which opens the database on app.state
        yield app


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


# The pytest plugin's `from_fixture` does not run on pytest 9, so each operation's strategy is
# driven by hypothesis directly.
OPERATIONS = [
    ("GET", "/v1/health"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{name}"),
    ("GET", "/v1/models/{name}/fronts"),
    ("GET", "/v1/recommend"),
    ("GET", "/v1/campaigns"),
    ("GET", "/v1/campaigns/{campaign_id}"),
    ("POST", "/v1/campaigns"),
]


def test_every_operation_is_fuzzed(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode.value}")
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if not (path == "/v1/health" and mode is GenerationMode.NEGATIVE)  # no input to get wrong
]


def fuzz_statuses(operation, mode: GenerationMode, examples: int) -> list[int]:
    """Status codes of up to `examples` derandomized cases of one operation; each response is
    validated against the schema (status, content type, body) as it comes."""
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call_and_validate(headers=AUTH)
        statuses.append(response.status_code)

    run()
    return statuses


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_operation_answers_5xx_or_off_schema(api_schema, fuzz_db, method, path, mode):
    before = count_rows(fuzz_db)
    statuses = fuzz_statuses(api_schema[path][method], mode, EXAMPLES_PER_OPERATION)
    assert statuses and max(statuses) < 500
    if mode is GenerationMode.NEGATIVE and method == "POST":
        # every invalid write was refused and left the database as it was
        assert 201 not in statuses and count_rows(fuzz_db) == before
