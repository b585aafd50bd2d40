"""Scores shared within a campaign: a config scored once is never run again.

- Twins: a trial proposing a config the campaign has already scored takes that score (`twin`): from
  its own study first (the twin stands on the front; the copy takes a slot), else from another
  budget's study (one evaluator, profile and seed per campaign, so a config scores the same under
  every budget).
- Across budgets: every config scored under one budget is copied, with its score, into the study
  of every other budget it fits (a COMPLETE trial marked `shared`, with `score_from`, taking no
  slot): each budget's sampler learns from every score of the campaign, and each stored front holds
  every scored point within its bits. A worker shares what it scores as it finishes each trial
  (`share`); a study also pulls what is missing when a worker starts it (`pull`: scores of budgets
  that ran before it existed, or of a worker that died before sharing).

`share` and `pull` return the budgets whose studies changed; the runner rewrites their fronts.
"""

from __future__ import annotations

import optuna

from pnmix.configs import Answer
from pnmix.layerwise import config_key
from pnmix.tuner.search import record
from pnmix.tuner.search.record import scored_configs
from pnmix.tuner.search.studies import Studies, study_name

COMPLETE = (optuna.trial.TrialState.COMPLETE,)


class Sharing:
    def __init__(self, studies: Studies, head_dim: int) -> None:
        self.studies, self.head_dim = studies, head_dim

    @staticmethod
    def twin(view: record.CampaignView, config: Answer) -> record.Scored | None:
        """An earlier full evaluation of `config` in this campaign (`view`): in this budget's study
        first (a score shared into it included), then in the other budgets'."""
        wanted = config.to_dict()
        for s in view.scored:
            # Elsewhere, point at the original evaluation, not at another budget's copy of it.
            if s.record.config_dict == wanted and (s.study == view.study or not s.record.copied_from_another_study):
                return s
        return None

    def share(self, trial: optuna.trial.FrozenTrial, source: str) -> list[float]:
        """Copies a config scored in study `source` into every other budget's study it fits; returns
        the budgets whose studies received it."""
        bits = record.budget_bits(trial)
        changed = []
        for budget in self.studies.spec.budgets:
            if bits > budget or study_name(self.studies.campaign_id, budget) == source:
                continue
            study = self.studies.peek(budget)
            if study is not None and self._add(study, budget, trial, source, scored_configs(study)):
                changed.append(budget)
        return changed

    def pull(self, budget: float, study: optuna.Study) -> bool:
        """Copies into `budget`'s study every score of the campaign's other budgets that fits it and
        is not there yet; whether any was added."""
        have = scored_configs(study)
        added = False
        for other in self.studies.spec.budgets:
            source = self.studies.peek(other) if other != budget else None
            if source is None:
                continue
            for t in source.get_trials(deepcopy=False, states=COMPLETE):
                if record.read(t).original and record.budget_bits(t) <= budget:
                    added = self._add(study, budget, t, source.study_name, have) or added
        return added

    def _add(self, study: optuna.Study, budget: float, trial: optuna.trial.FrozenTrial, source: str,
             have: set[str]) -> bool:
        r = record.read(trial)
        key = config_key(r.config_dict or {})
        if key in have:
            return False  # scored there already (by its own sampler, or shared before)
        have.add(key)
        distributions = dict(trial.distributions)
        if "bits" in distributions:  # this budget's choice of bit pairs (the config's pair is among them: it fits)
            distributions["bits"] = optuna.distributions.CategoricalDistribution(
                self.studies.pairs(budget, self.head_dim))
        bits = record.budget_bits(trial)
        record.add_shared(study, trial, source, distributions,
                          {f"{self.studies.spec.space.budget_on}_bits": bits - budget})
        return True
