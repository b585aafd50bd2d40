"""The FastAPI application: `create_app(settings)`; `pnmix serve` runs it under uvicorn.

Routes live under `/v1`; OpenAPI docs at `/docs` and `/openapi.json`. The lifespan opens the
database and, unless `PNMIX_CHECK_SCHEMA=false`, refuses to start when the schema is not at
this code's head revision (migrations are an explicit step: `pnmix db upgrade`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from pnmix.api import problems
from pnmix.api.limits import BodySizeLimit, HeaderSizeLimit
from pnmix.api.routes import campaigns, health, models, recommend
from pnmix.api.settings import Settings, load_settings
from pnmix.storage.engine import Database
from pnmix.storage.migrations import check_schema


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = Database.from_settings(settings, create=False)  # the service never creates a database file
        try:
            if settings.check_schema:
                check_schema(db)
            app.state.db = db
            yield
        finally:
            db.dispose()

    from importlib.metadata import version

    app = FastAPI(
        title="pnmix",
        version=version("pnmix"),
        summary="Best PN-Mix key-cache quantization config for a model at a bit budget, from tuned Pareto fronts.",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.settings = settings
    problems.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(HeaderSizeLimit, max_bytes=settings.max_header_bytes)  # added last: runs first
    for module in (health, models, recommend, campaigns):
        app.include_router(module.router, prefix="/v1")
    _add_problem_schema(app)
    return app


def _add_problem_schema(app: FastAPI) -> None:
    """Problem bodies are documented by reference; put the schema where the references point."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["Problem"] = problems.Problem.model_json_schema(ref_template="#/components/schemas/{model}")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
