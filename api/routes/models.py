from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from pnmix.api.deps import ReadSession
from pnmix.api.problems import problem_doc
from pnmix.api.schemas import Budget, ModelPage, ModelPublic, PointPage, PointPublic
from pnmix.api.settings import MAX_PAGE_SIZE
from pnmix.storage import read
from pnmix.storage.vocabulary import CAMPAIGN_ID, OFFSET, PAGE_SIZE

router = APIRouter(tags=["models"])

Limit = Annotated[int, Query(**PAGE_SIZE.constraints(), description=f"page size, at most {MAX_PAGE_SIZE}")]
Offset = Annotated[int, Query(**OFFSET.constraints())]
Name = Annotated[str, Path(min_length=1, max_length=255, description="model name; hub ids contain a slash")]


@router.get("/models", response_model=ModelPage, responses=problem_doc(422, 503))
def list_models(session: ReadSession, limit: Limit = 50, offset: Offset = 0) -> ModelPage:
    """Models in the database, by name, with how many front points each has and at which budgets."""
    page = read.list_models(session, limit, offset)
    return ModelPage(items=[ModelPublic.of(s) for s in page.items], total=page.total, limit=limit, offset=offset)


# `{name:path}` because hub ids contain a slash (org/name); the fronts route must come first.
@router.get("/models/{name:path}/fronts", response_model=PointPage, responses=problem_doc(404, 422, 503))
def fronts(
    session: ReadSession,
    name: Name,
    budget: Annotated[Budget | None, Query(description="only the front of this budget")] = None,
    campaign_id: Annotated[int | None, Query(**CAMPAIGN_ID.constraints())] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> PointPage:
    """The model's stored Pareto points, by campaign, budget (largest first) and key bits."""
    page = read.list_front_points(session, name, budget, campaign_id, limit, offset)
    return PointPage(
        model=name, items=[PointPublic.of(p) for p in page.items], total=page.total, limit=limit, offset=offset
    )


@router.get("/models/{name:path}", response_model=ModelPublic, responses=problem_doc(404, 422, 503))
def get_model(session: ReadSession, name: Name) -> ModelPublic:
    return ModelPublic.of(read.summarize(session, read.get_model(session, name)))
