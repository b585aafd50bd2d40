from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from pnmix.api.deps import ReadSession, StrictJsonBody, TokenChecked, WriteSession
from pnmix.api.problems import ProblemError, problem_doc
from pnmix.api.schemas import CampaignCreate, CampaignPage, CampaignPublic, Status
from pnmix.storage import read, write
from pnmix.storage.vocabulary import CAMPAIGN_ID, OFFSET, PAGE_SIZE
from pnmix.tuner.errors import EvalError, MissingFile
from pnmix.tuner.scoring.parts import check_file_entry, file_entries
from pnmix.tuner.search.queue import check_budgets_reachable
from pnmix.tuner.search.spec import CampaignOptions

router = APIRouter(tags=["campaigns"])


@router.get("/campaigns", response_model=CampaignPage, responses=problem_doc(422, 503))
def list_campaigns(
    session: ReadSession,
    model: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
    status: Status | None = None,
    limit: Annotated[int, Query(**PAGE_SIZE.constraints())] = 50,
    offset: Annotated[int, Query(**OFFSET.constraints())] = 0,
) -> CampaignPage:
    """Campaigns, newest first, with status and progress."""
    page = read.list_campaigns(session, model, status, limit, offset)
    return CampaignPage(items=[CampaignPublic.of(c) for c in page.items], total=page.total, limit=limit, offset=offset)


@router.get("/campaigns/{campaign_id}", response_model=CampaignPublic, responses=problem_doc(404, 422, 503))
def get_campaign(session: ReadSession,
                 campaign_id: Annotated[int, Path(**CAMPAIGN_ID.constraints())]) -> CampaignPublic:
    return CampaignPublic.of(read.get_campaign(session, campaign_id))


@router.post(
    "/campaigns",
    status_code=201,
    response_model=CampaignPublic,
    dependencies=[TokenChecked, StrictJsonBody],
    responses=problem_doc(400, 401, 403, 404, 413, 415, 422, 503),
)
def enqueue_campaign(body: CampaignCreate, session: WriteSession, response: Response) -> CampaignPublic:
    """Enqueues a campaign (status `queued`) for `pnmix worker` to pick up. Needs the bearer token.

    The model must be in the database or be a registry model (`smollm2-135m`, `qwen3-8b-shape`, ...).
    """
    space = body.space()
    for entry in file_entries(body.tasks):  # the files a campaign names, before anything is stored
        try:
            check_file_entry(entry)
        except MissingFile as exc:
            raise ProblemError(404, "Not Found", str(exc)) from None
        except EvalError as exc:
            raise ProblemError(422, "Unprocessable Content", str(exc)) from None
    campaign = write.create_campaign(
        session, body.model, body.budgets, body.n_trials, method=body.method, profile=body.profile,
        objectives=body.objectives, backend=body.backend, budget_on=body.budget_on,
        search_space=space.to_dict(),
        options=CampaignOptions(tasks=tuple(body.tasks) if body.tasks else None, holdout=body.holdout,
                                space=space.to_options()).to_dict(),
    )
    try:  # refused inside the write session: it rolls back, nothing is stored
        check_budgets_reachable(space.with_plan(campaign.model.plan), body.budgets, campaign.model.head_dim,
                                body.model)
    except EvalError as exc:
        raise ProblemError(422, "Unprocessable Content", str(exc)) from None
    response.headers["Location"] = f"/v1/campaigns/{campaign.id}"
    return CampaignPublic.of(campaign)
