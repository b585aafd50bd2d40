"""A campaign's Optuna studies: one per budget, their samplers, the bit pairs they choose from and
their counts.

A runner keeps one Optuna Study object per budget for its whole run, so Optuna's trial cache makes
every read fetch only the trials that are new or still unfinished (finished trials never change),
other workers' included: a campaign's bookkeeping grows linearly with its trials, not
quadratically. The verdict that a campaign is done reads every study afresh (`trials_done(fresh=True)`).
"""

from __future__ import annotations

from typing import Any

import optuna

from pnmix.storage.write import OBJECTIVES
from pnmix.tuner.search import record
from pnmix.tuner.search.record import FINISHED_STATES


def study_name(campaign_id: int, budget: float) -> str:
    return f"pnmix:{campaign_id}:{budget:g}"


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count toward the requested number."""
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED_STATES) if record.takes_slot(t)]


def over_budget_limit(n_trials: int) -> int:
    return 10 * n_trials + 20


def exhausted(study: optuna.Study, n_trials: int) -> bool:
    """The sampler keeps proposing configs over the budget (few fit it): the budget ends early."""
    over = sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED_STATES)
               if record.kind_of(t) == record.Kind.SKIPPED)
    return over >= over_budget_limit(n_trials)


class Studies:
    """The studies of one campaign, by budget: created (`open`) or read (`peek`) once per runner."""

    def __init__(self, storage: optuna.storages.BaseStorage, campaign_id: int, spec: Any) -> None:
        self.storage, self.campaign_id, self.spec = storage, campaign_id, spec
        self._studies: dict[float, optuna.Study] = {}  # by budget: `open` (its sampler) or `peek` (reading)
        self._own: set[float] = set()
        self._pair_cache: dict[float, list[str]] = {}

    def opened(self, budget: float) -> optuna.Study | None:
        """The budget's study if this runner has opened it."""
        return self._studies[budget] if budget in self._own else None

    def open(self, budget: float) -> tuple[optuna.Study, bool]:
        """The budget's study with its sampler, and whether it was just created (the runner seeds a
        new study with its warm starts)."""
        if budget in self._own:
            return self._studies[budget], False
        # constant_liar: workers sampling at once treat each other's running trials as poor, so they
        # spread out instead of proposing (and evaluating) the same config side by side. group: the
        # salient ratio exists only when b_high > b_low; grouped, TPE models it jointly with the other
        # parameters where it exists instead of sampling it independently.
        sampler = optuna.samplers.TPESampler(seed=self.spec.seed + int(budget * 1000), multivariate=True,
                                             group=True, n_startup_trials=4, constant_liar=True)
        study = optuna.create_study(study_name=study_name(self.campaign_id, budget), storage=self.storage,
                                    directions=[OBJECTIVES[o] for o in self.spec.objectives], sampler=sampler,
                                    load_if_exists=True)
        new = not study.metric_names
        if new:
            study.set_metric_names(list(self.spec.objectives))
            record.write_study_info(study, record.StudyInfo(budget, self.campaign_id, self.spec.model,
                                                            self.spec.method))
        self._studies[budget] = study
        self._own.add(budget)
        return study, new

    def peek(self, budget: float) -> optuna.Study | None:
        """Another budget's study for reading (None while no worker has created it), kept like `open`'s."""
        if budget not in self._studies:
            try:
                self._studies[budget] = optuna.load_study(study_name=study_name(self.campaign_id, budget),
                                                          storage=self.storage)
            except KeyError:
                return None
        return self._studies[budget]

    def of_campaign(self, study: optuna.Study) -> list[optuna.Study]:
        """`study`, then every other budget's study of the campaign that exists yet."""
        others = [self.peek(b) for b in self.spec.budgets
                  if study_name(self.campaign_id, b) != study.study_name]
        return [study, *(st for st in others if st is not None)]

    def pairs(self, budget: float, head_dim: int) -> list[str]:
        """The bit pairs this budget's sampler chooses from: those with a config within the budget
        (a pair whose cheapest config is over it could only ever give over-budget proposals). A study
        an older campaign began with every pair keeps its choices (Optuna's are fixed per study)."""
        if budget not in self._pair_cache:
            study = self._studies.get(budget)
            known = study.get_trials(deepcopy=False, states=FINISHED_STATES) if study is not None else []
            old = next((t.distributions["bits"] for t in known if "bits" in t.distributions), None)
            if isinstance(old, optuna.distributions.CategoricalDistribution):
                self._pair_cache[budget] = [str(c) for c in old.choices]
            else:
                # The spec's space: layer groups change neither the pairs nor the budget's figure.
                self._pair_cache[budget] = self.spec.space.pairs_within(budget, head_dim)
        return self._pair_cache[budget]

    def trials_done(self, n: int, fresh: bool = False) -> int:
        """Trials counted over every budget, at most `n` a budget. The studies read only what changed
        since their last read; `fresh` reads everything again (the last worker's verdict on whether
        the campaign is done rests on it, not on a cache)."""
        done = 0
        for budget in self.spec.budgets:
            if fresh:
                try:
                    study = optuna.load_study(study_name=study_name(self.campaign_id, budget), storage=self.storage)
                except KeyError:
                    continue
            else:
                peeked = self.peek(budget)
                if peeked is None:
                    continue
                study = peeked
            # Racing workers may add one more; an exhausted budget counts as complete.
            done += n if exhausted(study, n) else min(len(finished(study)), n)
        return done
