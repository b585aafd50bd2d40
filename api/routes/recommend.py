from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from pnmix.api.deps import ReadSession
from pnmix.api.problems import problem_doc
from pnmix.api.schemas import BitsOf, Budget, Engine, Optimize, PointPublic, Recommendation
from pnmix.recipes import EngineRecipe, export
from pnmix.storage import read
from pnmix.storage.read import RELATIVE_FLOOR
from pnmix.storage.vocabulary import ACCURACY, CAMPAIGN_ID

router = APIRouter(tags=["recommend"])


@router.get("/recommend", response_model=Recommendation, responses=problem_doc(404, 422, 503))
def recommend(
    session: ReadSession,
    model: Annotated[str, Query(min_length=1, max_length=255)],
    target_bits: Annotated[Budget, Query(description="largest acceptable bits per element, of the figure "
                                         "bits_of names")],
    bits_of: Annotated[BitsOf, Query(description="key: key bits per key element; kv: key and value bits per "
                                     "cached element")] = "key",
    optimize: Optimize = "accuracy",
    min_accuracy: Annotated[float | None, Query(**ACCURACY.constraints(), description=(
        "lowest accepted accuracy; by default none for optimize=accuracy and, for throughput and memory, "
        f"{RELATIVE_FLOOR:g} times the best accuracy within target_bits"))] = None,
    campaign_id: Annotated[int | None, Query(**CAMPAIGN_ID.constraints())] = None,
    format: Annotated[Engine | None, Query(description="a serving engine: the best engine recipe it loads as it "
                                           "is, and `engine_config`, the recipe in its syntax")] = None,
) -> Response:
    """The best stored config of `model` within `target_bits` key bits (or KV bits: `bits_of=kv`).

    Every stored point carries both figures, so either question is answered from every campaign.
    `optimize=accuracy`: the most accurate point and those statistically tied with it (`ties`:
    accuracy within 2 standard errors of the difference); among them the one with the fewest
    bits, then the highest decode throughput, then the fewest KV bytes. `throughput` and `memory`
    rank by those first. `format` (vllm, modelopt, trtllm, sglang, llamacpp): only the engine
    recipes that engine loads as they are, and the answer in its syntax (`engine_config`). 404
    `urn:pnmix:problem:no-feasible-point` when nothing fits, with `smallest_feasible_bits`.
    """
    rec = read.recommend_with_ties(session, model, target_bits, optimize, min_accuracy, campaign_id, bits_of,
                                   format)
    config = rec.point.config
    body = Recommendation(
        model=model, target_bits=target_bits, bits_of=bits_of, optimize=optimize, min_accuracy=rec.floor,
        point=PointPublic.of(rec.point), pnmix_config=config.to_json(),
        format=format, engine_config=export(config, format) if isinstance(config, EngineRecipe) and format else None,
        ties=[PointPublic.of(p) for p in rec.ties],
    )
    # The hot route: the body is already a validated Recommendation, so serialize it once here
    # instead of letting FastAPI validate it again against response_model.
    return Response(body.model_dump_json(), media_type="application/json")
