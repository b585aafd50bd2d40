"""One campaign trial, from proposal to score.

1. The cap: a worker that starts a trial when other workers' trials already take the budget's
   count records it as surplus (no inference).
2. The config: the allocator's (pnmix-alloc) or the sampler's (tuner.search.space; TPE, multivariate and
   grouped, choosing among the bit pairs that have a config within the budget), and its bits (the
   formula's key bits, or KV bits under a KV budget: `SearchSpace.cost`, stored as the trial's
   "bits"); the budget is an Optuna constraint (`bits - budget <= 0`); a config over budget never
   runs inference: it completes with accuracy 0 and is marked infeasible, so the sampler learns.
3. A config the campaign already scored takes its score (tuner/search/sharing.py), and the next trial of
   the budget scores a neighbour of it (`_enqueue_neighbour`).
4. Multi-fidelity (opt-in): the proxy (attention KL on recorded traces, milliseconds) screens it; a
   candidate that an already fully evaluated trial beats on both proxy KL and bits is pruned.
5. Racing (opt-in): rung by rung against the front (tuner/search/racing.py); then the full evaluation
   by real inference (tuner.scoring.evaluate). Out of memory is recorded as the trial's error.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import optuna

from pnmix.configs import Answer, key_bits, kv_bits
from pnmix.layerwise import config_key
from pnmix.recipes import EngineRecipe
from pnmix.storage.errors import StorageError
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.search import record
from pnmix.tuner.search.allocation import AllocatorLoop
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.recipe_alloc import RecipeLoop
from pnmix.tuner.search.record import FINISHED_STATES
from pnmix.tuner.search.sharing import Sharing
from pnmix.tuner.search.studies import Studies

PRUNE_SLACK = 0.9  # prune only when an evaluated trial's proxy KL is at least 10% lower
MIN_FULL = 3  # always fully evaluate the first few candidates of a study


def failure_reason(exc: BaseException) -> str:
    """What a failed trial's `error` attribute says: out-of-memory errors are named as such."""
    text = str(exc).strip().splitlines()
    first = (text[0] if text else type(exc).__name__)[:300]
    lowered = first.lower()
    oom = isinstance(exc, MemoryError) or any(
        needle in lowered for needle in ("out of memory", "can't allocate memory", "not enough memory"))
    if oom:
        return f"out of memory: {first}" if text else f"out of memory: {type(exc).__name__}"
    return f"{type(exc).__name__}: {first}"


class Objective:
    """The objective of a campaign's studies: `run(trial, budget)` is one trial."""

    def __init__(self, spec: Any, studies: Studies, sharing: Sharing, evaluator: Scorer,
                 progress: Any) -> None:
        self.spec, self.studies, self.sharing, self.evaluator, self.progress = (
            spec, studies, sharing, evaluator, progress)
        self.head_dim, self.num_layers = evaluator.head_dim, evaluator.num_layers
        # The runner sets the grouped space (and the allocator) before any trial; on a hybrid model the
        # space weighs the layers by what they hold.
        self.space = spec.space.with_plan(evaluator.plan)
        self.allocator: AllocatorLoop | RecipeLoop | None = None
        # Kernel specialisations its trials compiled (CUDA), and the compiler's seconds on them.
        self.kernels_compiled = 0
        self.compile_seconds = 0.0

    def run(self, trial: optuna.Trial, budget: float) -> tuple[float, ...]:
        running = record.RunningTrial(trial)
        # The campaign as this trial starts: its study's trials and the scores of every study, read once.
        studies = self.studies.of_campaign(trial.study)
        view = record.campaign_view(studies)
        if self._cap_reached(trial.number, view):
            # Another worker started the last trial at the same moment: record this one as surplus
            # (no inference, excluded from the count) rather than run past the requested count.
            running.mark_surplus()
            trial.study.stop()
            raise optuna.TrialPruned("trial cap reached by other workers")
        config, bits = self._propose(trial, running, budget, studies)
        if bits > budget:
            running.mark_skipped()
            return self._values(0.0, bits, None)
        twin = self.sharing.twin(view, config)
        if twin is not None:  # a config already scored in this campaign: reuse the score, don't re-run
            # From this study, the twin stands on the front; from another budget's, the same score
            # belongs on this front too.
            running.copy_score(twin.trial, None if twin.study == trial.study.study_name else twin.study)
            self._enqueue_neighbour(trial.study, view, config, budget, trial.number)
            return tuple(twin.trial.values)
        warm = running.warm_start
        # warm starts get a proxy value too: they anchor the pruning rule. An engine recipe has no
        # proxy figure of its own (its allocator weighs the formats by the proxy already).
        if self.spec.multi_fidelity and not isinstance(config, EngineRecipe):
            proxy = self.evaluator.proxy(config)
            running.write_proxy(proxy)
            if not warm and self._dominated(view, bits, proxy):
                self.progress(f"budget {budget:g}: trial {trial.number} pruned by the proxy")
                raise optuna.TrialPruned(f"proxy KL {proxy:.4g} beaten at <= {bits:.3f} bits")
        self.progress(f"budget {budget:g}: trial {trial.number} {config.label}: evaluating")
        score = self._evaluate(running, config, bits, budget, race=self.spec.racing and not warm)
        running.write_score(score)
        if isinstance(self.allocator, AllocatorLoop) and not isinstance(config, EngineRecipe):  # (never a recipe)
            move = self.allocator.next_move(trial.study, budget, (config, score.accuracy), self.spec.n_trials)
            if move is not None:  # the next trial moves from the budget's best (docs/search.md)
                record.enqueue_neighbour(trial.study, *move)
        self.kernels_compiled += int(score.timings.get("kernels_compiled", 0))
        self.compile_seconds += score.timings.get("kernel_compile", 0.0)
        return self._values(score.accuracy, bits, score)

    def _propose(self, trial: optuna.Trial, running: record.RunningTrial, budget: float,
                 studies: list[optuna.Study]) -> tuple[Answer, float]:
        """The trial's config and its budget figure, written on the trial with the constraint;
        `studies`: the campaign's, the trial's own first."""
        origin = None
        if self.allocator is not None:
            config, origin = self.allocator.config(trial, running, budget, studies)
        else:
            config = self.space.suggest(trial, self.studies.pairs(budget, self.head_dim), head_dim=self.head_dim)
        bits = self.space.cost(config, self.head_dim)
        plan = self.evaluator.plan
        running.write_config(config, bits, key_bits(config, plan, self.head_dim),
                             kv_bits(config, plan, self.head_dim), origin)
        trial.set_constraint(f"{self.space.budget_on}_bits", bits - budget)
        return config, bits

    def _evaluate(self, running: record.RunningTrial, config: Answer, bits: float, budget: float,
                  race: bool) -> Any:
        trial = running.trial
        try:
            have = self._race(running, config, bits) if race else None
            return self.evaluator.evaluate(config, have=have) if have is not None else self.evaluator.evaluate(config)
        except (MemoryError, RuntimeError) as exc:  # torch's (CUDA or CPU) out of memory is a RuntimeError
            if isinstance(exc, StorageError):
                raise
            reason = failure_reason(exc)
            print(f"warning: budget {budget:g}: trial {trial.number} failed: {reason}", file=sys.stderr, flush=True)
            running.mark_failed(reason)
            raise

    def _race(self, running: record.RunningTrial, config: Answer, bits: float) -> Any:
        """Scores `config` rung by rung (tuner/search/racing.py) against this study's front of no more bits;
        raises TrialPruned (partial score kept) once a front point beats it with confidence, else
        returns what the rungs scored for the full evaluation to complete.

        Each finished rung is stored on the trial: a trial retried after its worker died inherits
        it, so it resumes after the last finished rung."""
        from pnmix.tuner.scoring.score import Rung
        from pnmix.tuner.search import racing

        trial = running.trial
        front = [(r.bits or 0.0, r.units) for r in map(record.read, front_trials(trial.study)) if r.units]
        have = Rung(**running.saved_rung) if running.saved_rung else None
        counts = self.evaluator.unit_counts()
        for share in racing.RUNGS[:-1]:  # the last rung is the full evaluation
            upto = racing.rung_sizes(counts, share)
            if have is None or any(len(have.units.get(p, [])) < n for p, n in upto.items()):
                have = self.evaluator.rung(config, upto, have)
                running.write_rung(have.to_dict())
            verdict = racing.judge(have.units, bits, front, share)
            if verdict.stop:
                diff, se = verdict.margin or (float("nan"), None)
                running.mark_raced_out(share, verdict.accuracy, verdict.accuracy_se, have.seconds)
                self.progress(f"trial {trial.number} stopped at {share:g} of the items: a front point is "
                              f"{diff:.3f} +- {se or 0:.3f} more accurate")
                raise optuna.TrialPruned(f"beaten by a front point at <= {bits:.3f} bits by {diff:.3f} "
                                         f"(z {verdict.z:.2f}) on {share:g} of the items")
        return have

    def _enqueue_neighbour(self, study: optuna.Study, view: record.CampaignView, config: Answer, budget: float,
                           number: int) -> None:
        """A sampler that proposes a config already scored has converged around it: the slot it
        spent buys nothing, so the next trial of the budget scores a neighbour of that config (one
        knob one step away, within the budget, drawn in an order seeded by the campaign's seed and
        the trial number) that no study of the campaign has scored or queued yet. On the ground
        truth this turns the re-proposals (about half of a budget's trials) into a local search
        along the front (docs/search.md, "Budgets")."""
        done = sum(1 for r in view.trials if r.state in FINISHED_STATES and r.kind.takes_slot)
        if done + 1 >= self.spec.n_trials:  # this trial is the budget's last: no slot left
            return
        pending = {json.dumps(r.params, sort_keys=True) for r in view.trials
                   if r.state in (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)}
        candidates = self.space.neighbours(config, self.head_dim)
        random.Random(self.spec.seed * 100_003 + number).shuffle(candidates)
        for cfg in candidates:
            params = self.space.params_of(cfg)
            if (self.space.cost(cfg, self.head_dim) <= budget and config_key(cfg.to_dict()) not in view.scored_keys
                    and json.dumps(params, sort_keys=True) not in pending):
                record.enqueue_neighbour(study, params, config)
                return

    def _cap_reached(self, number: int, view: record.CampaignView) -> bool:
        """Whether the budget's count is already taken by finished trials and by running trials that
        started before trial `number`. Start order, not trial number: a queued trial (a warm start, a
        neighbour, a dead worker's retry) holds the number it was queued with and may start after
        trials numbered above it, so by number several workers could run one trial past the count."""
        states = (*FINISHED_STATES, optuna.trial.TrialState.RUNNING)
        trials = [r for r in view.trials if r.state in states]
        mine = next((r.started for r in trials if r.number == number), None)

        def before(r: record.TrialRecord) -> bool:
            if r.state != optuna.trial.TrialState.RUNNING:
                return True
            if mine is None or r.started is None:
                return r.number < number
            return (r.started, r.number) < (mine, number)

        taken = [r for r in trials if r.number != number and r.kind.takes_slot and before(r)]
        return len(taken) >= self.spec.n_trials

    def _values(self, accuracy: float, bits: float, score: Any) -> tuple[float, ...]:
        values = {"accuracy": accuracy, f"{self.space.budget_on}_bits": bits,
                  "kv_bytes": float(score.kv_bytes) if score else 0.0,
                  "throughput": float(score.decode_tokens_per_s) if score else 0.0}
        return tuple(values[o] for o in self.spec.objectives)

    def _dominated(self, view: record.CampaignView, bits: float, proxy: float) -> bool:
        """True when a fully evaluated feasible trial has no more bits and a clearly lower proxy KL."""
        evaluated = [r for r in view.trials if r.state == optuna.trial.TrialState.COMPLETE
                     and r.accuracy is not None and r.proxy_kl is not None]
        if len(evaluated) < MIN_FULL:
            return False
        return any((r.bits or 0.0) <= bits + 1e-9 and (r.proxy_kl or 0.0) < proxy * PRUNE_SLACK for r in evaluated)
