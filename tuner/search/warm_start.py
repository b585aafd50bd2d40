"""What a campaign's new study starts with, and the layer grouping its space needs first.

- Warm starts (`WarmStarts.seed`): pnmix-paper, KIVI and Kitty where they fit the budget, the
  model's previous front, and per bit pair the config that fills the budget
  (`SearchSpace.fullest_within`: the top of a budget's front is where its best point lies, and TPE
  alone seldom reaches it), in that order; pnmix-layers first enqueues, for each of those uniform
  configs, the layer-wise one that the proxy's per-layer KL says spends the same budget best across
  the groups (`tuner.search.layers.grouped_for_budget`); pnmix-alloc queues the allocator's warm starts
  (`AllocatorLoop.warm_starts`: the screened allocations first, at least two trials); the engine
  method each pool's allocation, Model-Optimizer's rule and the fullest uniform recipe
  (`RecipeLoop.warm_starts`, all trials but one). Otherwise at most half the budget's trials
  (queued trials run first: a dead worker's retried trial queues behind them); new studies only.
- Layer groups (`WarmStarts.layered_space`): pnmix-layers groups the model's layers by sensitivity
  (each layer's proxy KL under pnmix-paper, `tuner.search.layers.group_layers`); the first worker stores
  them on the campaign row (`search_space["groups"]`), every later one, and a resumed run, reads
  them there, so all of a campaign's trials share one grouping. pnmix-alloc has one layer a group
  and an `AllocatorLoop` over them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import optuna

from pnmix.config import PNMixConfig, preset
from pnmix.layerwise import AnyConfig
from pnmix.recipes import EngineRecipe
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.search import record
from pnmix.tuner.search.allocation import SCREENED, AllocatorLoop
from pnmix.tuner.search.recipe_alloc import RecipeLoop
from pnmix.tuner.search.space import SearchSpace


class WarmStarts:
    def __init__(self, db: Any, campaign_id: int, spec: Any, evaluator: Scorer,
                 progress: Callable[[str], None]) -> None:
        self.db, self.campaign_id, self.spec, self.evaluator, self.progress = db, campaign_id, spec, evaluator, progress
        self.head_dim, self.num_layers = evaluator.head_dim, evaluator.num_layers
        self._layer_kl_cache: dict[PNMixConfig, list[float]] = {}

    def seed(self, study: optuna.Study, budget: float, space: SearchSpace,
             allocator: AllocatorLoop | RecipeLoop | None) -> None:
        """Enqueues the warm starts of a new study (the module's docstring says which)."""
        limit = max(1, self.spec.n_trials // 2)  # the sampler keeps at least half the slots
        if isinstance(allocator, RecipeLoop):  # each pool's allocation: the sampler keeps one slot
            stored = self._stored_fronts(budget, space)
            for params, proposal in allocator.warm_starts(budget, stored, max(1, self.spec.n_trials - 1)):
                record.enqueue_warm_start(study, params, proposal)
            return
        candidates: list[AnyConfig] = [preset("pnmix-paper"), preset("kivi2"), preset("kivi1"), preset("kitty")]
        candidates += self._stored_fronts(budget, space)
        candidates += space.fullest_within(budget, self.head_dim)
        if allocator is not None:
            # the screened allocations first, even where they take more than half the trials
            limit = max(limit, min(SCREENED, self.spec.n_trials))
            for params, proposal in allocator.warm_starts(budget, candidates, limit):
                record.enqueue_warm_start(study, params, proposal)
            return
        # a uniform space takes the single configs alone (another campaign's layer-wise ones cannot
        # be recast onto its one layer)
        candidates = [space.recast(c) for c in candidates if not isinstance(c, EngineRecipe)
                      and (space.layered or isinstance(c, PNMixConfig))]
        if space.layered:
            candidates = [*self._grouped(candidates, budget, space), *candidates]
        seen = set()
        for cfg in candidates:
            if not space.contains(cfg) or space.cost(cfg, self.head_dim) > budget:
                continue
            params = space.params_of(cfg)
            frozen = json.dumps(params, sort_keys=True)
            if frozen not in seen:
                seen.add(frozen)
                record.enqueue_warm_start(study, params)
            if len(seen) >= limit:
                return

    def _stored_fronts(self, budget: float, space: SearchSpace) -> list[Any]:
        """The best stored front points of this model from earlier campaigns that fit `budget` (this
        campaign's own scores reach every budget they fit by sharing: tuner/search/sharing.py)."""
        from sqlalchemy import select

        from pnmix.storage import FrontPoint, Model
        from pnmix.storage.read import bits_column

        with self.db.session(readonly=True) as s:
            rows = s.scalars(select(FrontPoint).join(Model, FrontPoint.model_id == Model.id)
                             .where(Model.name == self.spec.model, bits_column(space.budget_on) <= budget,
                                    FrontPoint.campaign_id != self.campaign_id)
                             .order_by(FrontPoint.accuracy.desc()).limit(8)).all()
            return [row.config for row in rows]

    def _grouped(self, uniform: list[AnyConfig], budget: float, space: SearchSpace) -> list[AnyConfig]:
        """pnmix-layers warm starts: for each uniform config's shared fields (G, sinks, values), the
        layer-wise config of the groups that `grouped_for_budget` finds within `budget`."""
        from pnmix.tuner.search.layers import candidates_like, grouped_for_budget

        out: list[AnyConfig] = []
        # One base per set of shared fields: the candidates differ only in bits and ratio.
        shared = {c.with_(b_high=3, b_low=1, salient_ratio=0.5): None for c in uniform
                  if isinstance(c, PNMixConfig) and c.b_high > c.b_low}
        for base in shared:
            kl_of = {c: self.layer_kl(c) for c in candidates_like(base, space)}
            cfg = grouped_for_budget(space, kl_of, budget, self.head_dim)
            if cfg is not None and cfg not in out:
                out.append(cfg)
        return out

    def layer_kl(self, config: PNMixConfig) -> list[float]:
        """The proxy's per-layer attention KL of `config`, computed once per runner."""
        if config not in self._layer_kl_cache:
            self._layer_kl_cache[config] = self.evaluator.proxy_by_layer(config)
        return self._layer_kl_cache[config]

    def layered_space(self, space: SearchSpace) -> tuple[SearchSpace, AllocatorLoop | RecipeLoop | None]:
        """The space with the model's layer groups (unchanged for a uniform space or one that has
        them), and pnmix-alloc's allocator (the engine method's: the recipe allocator)."""
        if not space.layered or space.groups:
            return space, None
        if space.recipes:
            space = space.with_layers(self.num_layers)
            return space, RecipeLoop(space, self.evaluator, self.num_layers, self.progress)
        if space.allocated:  # one layer a group: nothing to form or store
            space = space.with_layers(self.num_layers)
            return space, AllocatorLoop(space, self.evaluator, self.head_dim, self.num_layers, self.progress)
        return space.with_groups(self._stored_groups(space)), None

    def _stored_groups(self, space: SearchSpace) -> Any:
        from pnmix.storage import Campaign, get_campaign, update_campaign_progress
        from pnmix.tuner.search.layers import group_layers

        with self.db.session(readonly=True) as s:
            stored = (get_campaign(s, self.campaign_id).search_space or {}).get("groups")
        if stored:
            return stored
        self.progress(f"layer sensitivity: proxy KL of {self.num_layers} layers")
        paper = preset("pnmix-paper")
        base = space.config(paper.b_high, paper.b_low, paper.group_size, paper.salient_ratio, paper.n_sink)
        mine = group_layers(self.layer_kl(base), space.layer_groups)
        with self.db.session() as s:  # the first worker to store its groups wins; the others take them
            row = s.get(Campaign, self.campaign_id, with_for_update=True, populate_existing=True)
            stored = (row.search_space or {}).get("groups") if row is not None else None
            if not stored:
                stored = mine
                update_campaign_progress(s, self.campaign_id, search_space=space.with_groups(mine).to_dict())
        return stored
