from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pnmix.api.deps import DatabaseDep
from pnmix.api.problems import PROBLEM_JSON
from pnmix.api.schemas import Health
from pnmix.storage.errors import StorageError
from pnmix.storage.migrations import current_revision, head_revision

router = APIRouter(tags=["health"])


@router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": Health, "description": "database unreachable or schema not current",
                     "content": {PROBLEM_JSON: {}}}},
)
def health(db: DatabaseDep, request: Request) -> Health | JSONResponse:
    """Liveness and readiness: the database answers and its schema is at this code's head revision."""
    head = head_revision()
    current: str | None = None
    detail: str | None = None
    try:
        db.ping()
        current = current_revision(db.engine)
        if current != head:
            detail = f"schema at {current}, expected {head}: run `pnmix db upgrade`"
    except StorageError as exc:
        detail = str(exc)
    ready = detail is None
    body = Health(
        status="ok" if ready else "unavailable", version=request.app.version, database=db.display_url,
        backend=db.backend, schema_revision=current, schema_head=head, ready=ready, detail=detail,
    )
    if ready:
        return body
    return JSONResponse(
        {"type": "about:blank", "title": "Service Unavailable", "status": 503, **body.model_dump()},
        status_code=503, media_type=PROBLEM_JSON,
    )
