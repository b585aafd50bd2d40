"""What a campaign is (`CampaignSpec`) and what its stored row keeps besides its columns
(`CampaignOptions`).

The command line (`pnmix tune`) and the service (`POST /v1/campaigns`) write a campaign's options
through `CampaignOptions`, so both give every option the same default; a worker reads them back
with `CampaignOptions.read`. An option a stored row lacks was written before the option existed,
and reads as what such a campaign ran with (`STORED_BEFORE`), not as today's default.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pnmix.errors import PNMixError
from pnmix.inputs import SEED, shorten
from pnmix.names import BACKENDS
from pnmix.storage.vocabulary import TRIALS
from pnmix.storage.write import check_budgets, check_objectives
from pnmix.tuner.errors import EvalError, one_line
from pnmix.tuner.scoring import parts, profiles
from pnmix.tuner.scoring.holdout import DEFAULT_SHARE, HOLDOUT
from pnmix.tuner.search.space import SearchSpace

# What a campaign stored before an option existed ran with: the proxy screen was always on, and
# nothing was held out.
STORED_BEFORE = {"multi_fidelity": True, "holdout": 0.0}


@dataclass(frozen=True)
class CampaignOptions:
    """A campaign row's `options`: the fields that are not columns of their own."""

    seed: int = 0
    multi_fidelity: bool = False  # the proxy screen: opt-in (docs/search.md, "Multi-fidelity")
    racing: bool = False  # race candidates on growing shares of the items (tuner/search/racing.py)
    tasks: tuple[str, ...] | None = None  # the task list (tuner/scoring/parts.py); None: the built-in parts
    holdout: float = DEFAULT_SHARE  # share of every part's units no trial sees (tuner/scoring/holdout.py)
    space: dict[str, Any] = field(default_factory=dict)  # `SearchSpace.to_options()`
    spec_key: str | None = None  # `CampaignSpec.key()` where the command line wrote it

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tasks"] = list(self.tasks) if self.tasks is not None else None
        if self.spec_key is None:
            del data["spec_key"]
        return data

    @classmethod
    def read(cls, stored: dict[str, Any] | None) -> CampaignOptions:
        stored = {**STORED_BEFORE, **(stored or {})}
        tasks = stored.get("tasks")
        return cls(seed=stored.get("seed", 0), multi_fidelity=stored["multi_fidelity"],
                   racing=stored.get("racing", False), tasks=tuple(tasks) if tasks else None,
                   holdout=stored["holdout"], space=stored.get("space") or {}, spec_key=stored.get("spec_key"))


@dataclass(frozen=True)
class CampaignSpec:
    """What a campaign is: the same spec resumes the same campaign (`key`)."""

    model: str
    budgets: tuple[float, ...]
    n_trials: int
    method: str = "pnmix"
    profile: str = "quick"
    objectives: tuple[str, ...] = ("accuracy", "key_bits")
    seed: int = 0
    multi_fidelity: bool = False  # the proxy screen: opt-in (docs/search.md, "Multi-fidelity")
    racing: bool = False  # race candidates on growing shares of the items (tuner/search/racing.py)
    backend: str = "auto"
    tasks: tuple[str, ...] | None = None
    space: SearchSpace = field(default_factory=SearchSpace)
    holdout: float = DEFAULT_SHARE  # share of every part's units no trial sees (tuner/scoring/holdout.py)

    def __post_init__(self) -> None:
        """Budgets and objectives get the storage's checks (the campaign row holds them); the
        profile, a name of this layer, is checked here (the method is checked by the space); the
        rest as tuner/search/queue.py says, so that what is enqueued is what a worker can run."""
        check_budgets(self.budgets)
        for name, value, allowed in (("trials", self.n_trials, TRIALS), ("seed", self.seed, SEED)):
            if not allowed.contains(value):
                raise EvalError(f"invalid {name}={shorten(value)}: allowed {allowed.allowed}")
        if self.method != self.space.method:
            raise EvalError(f"method {self.method!r} and its search space's {self.space.method!r} differ")
        object.__setattr__(self, "objectives", tuple(check_objectives(self.objectives, self.space.budget_on)))
        profiles.profile(self.profile)
        if self.backend not in BACKENDS:
            raise EvalError(f"unknown backend {shorten(self.backend)}: allowed {', '.join(BACKENDS)}")
        if self.tasks is not None:
            parts.check_entries(self.tasks)
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, int | float) or not HOLDOUT.contains(
                self.holdout):
            raise EvalError(f"invalid holdout={shorten(self.holdout)}: allowed {HOLDOUT.allowed}")

    def key(self) -> str:
        """Identity of the campaign: the same spec resumes the same campaign."""
        data = asdict(self)
        data.pop("n_trials")
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def options(self) -> dict[str, Any]:
        """What the campaign row stores besides its columns (`CampaignOptions`)."""
        return CampaignOptions(seed=self.seed, multi_fidelity=self.multi_fidelity, racing=self.racing,
                               tasks=self.tasks, holdout=self.holdout, space=self.space.to_options(),
                               spec_key=self.key()).to_dict()

    @classmethod
    def from_campaign(cls, row: Any) -> CampaignSpec:
        """The spec of a stored campaign; EvalError (with the reason) for one this version cannot run,
        e.g. written by another version or straight into the database."""
        try:
            opts = CampaignOptions.read(row.options)
            space = SearchSpace(**{**opts.space, "method": row.method, "budget_on": row.budget_on})
            return cls(model=row.model.name, budgets=tuple(row.budgets), n_trials=row.n_trials, method=row.method,
                       profile=row.profile, objectives=tuple(row.objectives), seed=opts.seed,
                       multi_fidelity=opts.multi_fidelity, racing=opts.racing, backend=row.backend,
                       tasks=opts.tasks, space=space, holdout=opts.holdout)
        except PNMixError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise EvalError(f"campaign {row.id} cannot be read by this pnmix: {one_line(exc)}") from None
