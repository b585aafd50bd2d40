"""What the search wing asks of a scorer: the `Scorer` protocol.

`tuner.scoring.evaluate.Evaluator` is the product's scorer (real inference on a loaded model);
tests and benchmarks pass their own (recorded scores replayed). The search wing (tuner/search/)
types every scorer it holds by this protocol and calls nothing else of it.
"""

from __future__ import annotations

from typing import Any, Protocol

from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig
from pnmix.configs import Answer
from pnmix.kv_formats import KVFormat
from pnmix.layerwise import AnyConfig
from pnmix.recipes import LayerFormats
from pnmix.tuner.scoring.profiles import Profile
from pnmix.tuner.scoring.proxy import ProxyMeasure
from pnmix.tuner.scoring.score import Rung, Score, Split


class Scorer(Protocol):
    model_name: str
    profile: Profile
    seed: int
    tasks: tuple[str, ...]  # the parts it scores (tuner/scoring/parts.py)
    holdout: float  # the share of every part's units held out of the search
    head_dim: int
    num_layers: int
    plan: LayerPlan  # what each layer holds: the bit figures weigh the layers by it
    backend: str  # what runs the attention ("torch-reference", "triton", ...)
    device: str
    harness: Any  # the lm-eval part, when it runs one (tuner/scoring/harness.py)

    def prepare(self) -> dict[str, Any]: ...

    def unit_counts(self, which: Split = Split.SEARCH) -> dict[str, int]: ...

    def evaluate(self, config: Answer, reference: bool = False, measure: bool = True,
                 have: Rung | None = None, which: Split = Split.SEARCH) -> Score: ...

    def rung(self, config: Answer, upto: dict[str, int], have: Rung | None = None) -> Rung: ...

    def proxy(self, config: AnyConfig) -> float: ...

    def proxy_by_layer(self, config: AnyConfig) -> list[float]: ...

    def sensitivity(self, candidates: list[PNMixConfig],
                    measure: ProxyMeasure = ProxyMeasure.KL) -> dict[PNMixConfig, list[float]]: ...

    def value_sensitivity(self, formats: list[tuple[int, int]],
                          shared: PNMixConfig) -> dict[tuple[int, int], list[float]]: ...

    def format_sensitivity(self, formats: list[KVFormat]) -> tuple[dict[KVFormat, list[float]],
                                                                    dict[KVFormat, list[float]]]: ...

    def format_kl(self, pairs: list[LayerFormats]) -> dict[LayerFormats, list[float]]: ...
