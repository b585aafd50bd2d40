"""Optuna campaigns: one multi-objective study per (model, bit budget), fronts written to SQL.

A campaign is a model, a method (search space), bit budgets, a trial count per budget, an
evaluation profile and objectives. Each budget is an Optuna study on the same database as our
tables (`pnmix:<campaign id>:<budget>`), so `pnmix dashboard` shows it and any number of
`pnmix worker` processes can share it through PostgreSQL.

A trial:
1. samples a config from the search space (tuner.space) and computes its key bits (formula);
   the budget is an Optuna constraint (`key_bits - budget <= 0`); a config over budget never
   runs inference: it completes with accuracy 0 and is marked infeasible, so the sampler learns;
2. multi-fidelity: the proxy (attention KL on recorded traces, milliseconds) screens it; a
   candidate that an already fully evaluated trial beats on both proxy KL and key bits is pruned
   (recorded as PRUNED with its proxy value), because it is unlikely to reach the front;
3. otherwise full evaluation by real inference (tuner.evaluate).
After every finished trial the (campaign, budget) front, from `study.best_trials` (feasible
only), replaces the stored one in one transaction: a killed run leaves the last whole front.
Running the same campaign again resumes it: finished trials count, none is re-run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import optuna
from optuna.exceptions import ExperimentalWarning

from pnmix.bits import key_bits
from pnmix.config import PNMixConfig, preset
from tuner.profiles import EvalError
from tuner.space import SearchSpace

warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeats and metric names are stable enough

OBJECTIVES: dict[str, Literal["maximize", "minimize"]] = {
    "accuracy": "maximize", "key_bits": "minimize", "kv_bytes": "minimize", "throughput": "maximize"}
SCORE_ATTRS = ("parts", "kv_bytes", "decode_tokens_per_s", "backend", "device", "versions", "fidelity_kl",
               "fidelity_agreement", "seconds")
PRUNE_SLACK = 0.9  # prune only when an evaluated trial's proxy KL is at least 10% lower
MIN_FULL = 3  # always fully evaluate the first few candidates of a study
# A worker's trial counts as dead after GRACE_S without a heartbeat; it is then retried.
HEARTBEAT_S = int(os.environ.get("PNMIX_HEARTBEAT_S", "10"))
GRACE_S = int(os.environ.get("PNMIX_GRACE_S", "30"))

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CampaignSpec:
    model: str
    budgets: tuple[float, ...]
    n_trials: int
    method: str = "pnmix"
    profile: str = "quick"
    objectives: tuple[str, ...] = ("accuracy", "key_bits")
    seed: int = 0
    multi_fidelity: bool = True
    backend: str = "auto"
    tasks: tuple[str, ...] | None = None
    space: SearchSpace = field(default_factory=SearchSpace)

    def __post_init__(self) -> None:
        if not self.budgets:
            raise EvalError("give at least one bit budget")
        for b in self.budgets:
            if not 0 < b <= 16:
                raise EvalError(f"invalid budget {b:g}: allowed key bits in (0, 16]")
        if self.n_trials < 1:
            raise EvalError(f"invalid trials={self.n_trials}: allowed an integer >= 1")
        for name in self.objectives:
            if name not in OBJECTIVES:
                raise EvalError(f"unknown objective {name!r}: allowed {', '.join(OBJECTIVES)}")
        if self.objectives[:2] != ("accuracy", "key_bits"):
            raise EvalError("objectives must start with accuracy,key_bits (then kv_bytes and/or throughput)")

    def key(self) -> str:
        """Identity of the campaign: the same spec resumes the same campaign."""
        data = asdict(self)
        data.pop("n_trials")
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def options(self) -> dict[str, Any]:
        return {"seed": self.seed, "multi_fidelity": self.multi_fidelity, "tasks": self.tasks, "spec_key": self.key(),
                "space": {k: v for k, v in asdict(self.space).items() if k != "fixed"}}

    @classmethod
    def from_campaign(cls, row: Any) -> CampaignSpec:
        opts = row.options or {}
        space = SearchSpace(**{**opts.get("space", {}), "method": row.method})
        tasks = tuple(opts["tasks"]) if opts.get("tasks") else None
        return cls(model=row.model.name, budgets=tuple(row.budgets), n_trials=row.n_trials, method=row.method,
                   profile=row.profile, objectives=tuple(row.objectives), seed=opts.get("seed", 0),
                   multi_fidelity=opts.get("multi_fidelity", True), backend=row.backend, tasks=tasks, space=space)


def study_name(campaign_id: int, budget: float) -> str:
    return f"pnmix:{campaign_id}:{budget:g}"


def optuna_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on our database, with heartbeats so a dead worker's trial is retried."""
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 60}
    else:
        kwargs["pool_pre_ping"] = True
    for attempt in range(3):
        try:
            return RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                              heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2))
        except Exception:  # two workers creating Optuna's tables at once: one loses the race, then finds them
            if attempt == 2:
                raise
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


class CampaignRunner:
    """Runs the studies of one campaign with one loaded evaluator."""

    def __init__(self, db: Any, url: str, campaign_id: int, spec: CampaignSpec, evaluator: Any,
                 progress: Progress | None = None, worker_id: str = "local") -> None:
        self.db = db
        self.url = url
        self.campaign_id = campaign_id
        self.spec = spec
        self.evaluator = evaluator
        self.progress = progress or (lambda message: None)
        self.worker_id = worker_id
        self.head_dim = evaluator.head_dim
        self.storage = optuna_storage(url)

    # -- the study of one budget ---------------------------------------------------------------

    def study(self, budget: float) -> optuna.Study:
        sampler = optuna.samplers.TPESampler(seed=self.spec.seed + int(budget * 1000), multivariate=True,
                                             n_startup_trials=4)
        study = optuna.create_study(study_name=study_name(self.campaign_id, budget), storage=self.storage,
                                    directions=[OBJECTIVES[o] for o in self.spec.objectives], sampler=sampler,
                                    load_if_exists=True)
        if not study.metric_names:
            study.set_metric_names(list(self.spec.objectives))
            study.set_user_attr("budget", budget)
            study.set_user_attr("campaign_id", self.campaign_id)
            study.set_user_attr("model", self.spec.model)
            study.set_user_attr("method", self.spec.method)
            self._warm_start(study, budget)
        return study

    def _warm_start(self, study: optuna.Study, budget: float) -> None:
        """Enqueues pnmix-paper, KIVI at the budget and the model's previous front (new studies only)."""
        candidates: list[PNMixConfig] = [preset("pnmix-paper"), preset("kivi2"), preset("kivi1"), preset("kitty")]
        candidates += self._previous_front()
        seen = set()
        space = self.spec.space
        for cfg in candidates:
            cfg = space.config(cfg.b_high, cfg.b_low, cfg.group_size, cfg.salient_ratio, cfg.n_sink)
            if not space.contains(cfg) or key_bits(cfg, self.head_dim).total > budget:
                continue
            params = SearchSpace.params_of(cfg, space.method)
            frozen = json.dumps(params, sort_keys=True)
            if frozen not in seen:
                seen.add(frozen)
                study.enqueue_trial(params, user_attrs={"warm_start": True})

    def _previous_front(self) -> list[PNMixConfig]:
        from sqlalchemy import select

        from storage import FrontPoint, Model

        with self.db.session(readonly=True) as s:
            rows = s.scalars(select(FrontPoint).join(Model, FrontPoint.model_id == Model.id)
                             .where(Model.name == self.spec.model, FrontPoint.campaign_id != self.campaign_id)
                             .order_by(FrontPoint.accuracy.desc()).limit(8)).all()
            return [row.config for row in rows]

    # -- one trial -------------------------------------------------------------------------------

    def objective(self, trial: optuna.Trial, budget: float) -> tuple[float, ...]:
        if self._cap_reached(trial):
            # Another worker started the last trial at the same moment: record this one as surplus
            # (no inference, excluded from the count) rather than run past the requested count.
            trial.set_user_attr("surplus", True)
            trial.study.stop()
            raise optuna.TrialPruned("trial cap reached by other workers")
        config = self.spec.space.suggest(trial)
        bits = key_bits(config, self.head_dim).total
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("key_bits", bits)
        trial.set_constraint("key_bits", bits - budget)
        if bits > budget:
            trial.set_user_attr("skipped", "over budget: no inference run")
            return self._values(0.0, bits, None)
        twin = self._evaluated_twin(trial.study, config)
        if twin is not None:  # the sampler proposed a config already scored here: reuse, don't re-run
            for name in SCORE_ATTRS + ("accuracy", "proxy_kl"):
                if name in twin.user_attrs:
                    trial.set_user_attr(name, twin.user_attrs[name])
            trial.set_user_attr("reused_from", twin.number)
            return tuple(twin.values)
        warm = bool(trial.user_attrs.get("warm_start"))
        if self.spec.multi_fidelity:  # warm starts get a proxy value too: they anchor the pruning rule
            proxy = self.evaluator.proxy(config)
            trial.set_user_attr("proxy_kl", proxy)
            if not warm and self._dominated(trial.study, bits, proxy):
                self.progress(f"budget {budget:g}: trial {trial.number} pruned by the proxy")
                raise optuna.TrialPruned(f"proxy KL {proxy:.4g} beaten at <= {bits:.3f} bits")
        self.progress(f"budget {budget:g}: trial {trial.number} {config.b_high}/{config.b_low} "
                      f"G{config.group_size} r{config.salient_ratio:g} sinks {config.n_sink}: evaluating")
        try:
            score = self.evaluator.evaluate(config)
        except MemoryError as exc:
            trial.set_user_attr("error", f"out of memory: {exc}")
            raise
        except RuntimeError as exc:  # CUDA out of memory surfaces as RuntimeError
            trial.set_user_attr("error", str(exc).splitlines()[0][:300])
            raise
        for name in SCORE_ATTRS:
            trial.set_user_attr(name, getattr(score, name))
        trial.set_user_attr("accuracy", score.accuracy)
        return self._values(score.accuracy, bits, score)

    @staticmethod
    def _evaluated_twin(study: optuna.Study, config: PNMixConfig) -> optuna.trial.FrozenTrial | None:
        wanted = config.to_dict()
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if "accuracy" in t.user_attrs and t.user_attrs.get("config") == wanted:
                return t
        return None

    def _cap_reached(self, trial: optuna.Trial) -> bool:
        states = (*FINISHED_STATES, optuna.trial.TrialState.RUNNING)
        earlier = [t for t in trial.study.get_trials(deepcopy=False, states=states)
                   if t.number < trial.number and not t.user_attrs.get("surplus")]
        return len(earlier) >= self.spec.n_trials

    def _values(self, accuracy: float, bits: float, score: Any) -> tuple[float, ...]:
        values = {"accuracy": accuracy, "key_bits": bits,
                  "kv_bytes": float(score.kv_bytes) if score else 0.0,
                  "throughput": float(score.decode_tokens_per_s) if score else 0.0}
        return tuple(values[o] for o in self.spec.objectives)

    def _dominated(self, study: optuna.Study, bits: float, proxy: float) -> bool:
        """True when a fully evaluated feasible trial has no more bits and a clearly lower proxy KL."""
        evaluated = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                     if "accuracy" in t.user_attrs and "proxy_kl" in t.user_attrs]
        if len(evaluated) < MIN_FULL:
            return False
        return any(t.user_attrs["key_bits"] <= bits + 1e-9 and t.user_attrs["proxy_kl"] < proxy * PRUNE_SLACK
                   for t in evaluated)

    # -- fronts ----------------------------------------------------------------------------------

    def write_front(self, study: optuna.Study, budget: float) -> int:
        """Replaces the stored (campaign, budget) front with the study's feasible Pareto trials."""
        from storage import FrontPointIn, replace_front

        points = []
        for t in front_trials(study):
            points.append(FrontPointIn(
                config=PNMixConfig.from_dict(t.user_attrs["config"]), accuracy=float(t.user_attrs["accuracy"]),
                kv_bytes=int(t.user_attrs["kv_bytes"]), throughput=float(t.user_attrs["decode_tokens_per_s"]),
                trial_number=t.number, backend=str(t.user_attrs["backend"]), device=str(t.user_attrs["device"]),
                accuracy_parts=dict(t.user_attrs["parts"]), versions=dict(t.user_attrs["versions"])))
        with self.db.session() as s:
            replace_front(s, self.campaign_id, budget, points)
        self.set_progress(trials_done=self.trials_done())
        return len(points)

    def set_progress(self, **changes: Any) -> None:
        """Updates the campaign row unless it is already finished (another worker may have finished it)."""
        from storage import InvalidValueError, get_campaign, update_campaign_progress

        try:
            with self.db.session() as s:
                if get_campaign(s, self.campaign_id).status in ("done", "failed"):
                    return
                update_campaign_progress(s, self.campaign_id, **changes)
        except InvalidValueError:
            with self.db.session(readonly=True) as s:
                if get_campaign(s, self.campaign_id).status not in ("done", "failed"):
                    raise

    def trials_done(self) -> int:
        done = 0
        for budget in self.spec.budgets:
            try:
                study = optuna.load_study(study_name=study_name(self.campaign_id, budget), storage=self.storage)
            except KeyError:
                continue
            done += len(finished(study))
        return done

    # -- running ---------------------------------------------------------------------------------

    def run(self, on_trial: Callable[[float, optuna.Study], None] | None = None) -> dict[float, optuna.Study]:
        from optuna.study import MaxTrialsCallback

        self.set_progress(status="running",
                          study_names={f"{b:g}": study_name(self.campaign_id, b) for b in self.spec.budgets},
                          trials_total=self.spec.n_trials * len(self.spec.budgets))
        studies = {}
        for budget in self.spec.budgets:
            study = self.study(budget)
            studies[budget] = study
            floor = self.spec.space.min_key_bits(self.head_dim)
            if budget < floor:
                self.progress(f"budget {budget:g}: no config of the {self.spec.method} space fits (the smallest "
                              f"needs {floor:.3f} key bits); its front stays empty")
                self.write_front(study, budget)
                continue
            remaining = self.spec.n_trials - len(finished(study))
            if remaining <= 0:
                continue

            def after_trial(st: optuna.Study, trial: optuna.trial.FrozenTrial, budget: float = budget) -> None:
                self.write_front(st, budget)
                if on_trial:
                    on_trial(budget, st)

            # The trial cap counts every worker's finished trials, so many workers stop together.
            cap = MaxTrialsCallback(self.spec.n_trials, states=FINISHED_STATES)
            def objective(trial: optuna.Trial, budget: float = budget) -> tuple[float, ...]:
                return self.objective(trial, budget)

            study.optimize(objective, n_trials=remaining, callbacks=[cap, after_trial],
                           catch=(RuntimeError, MemoryError), gc_after_trial=True)
            self.write_front(study, budget)
        # Only the last worker out marks the campaign done: another may still be running a trial.
        running = any(s.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
                      for s in studies.values())
        done = self.trials_done()
        floor = self.spec.space.min_key_bits(self.head_dim)
        expected = self.spec.n_trials * sum(1 for b in self.spec.budgets if b >= floor)
        if done >= expected and not running:
            self.set_progress(status="done", trials_done=done)
        else:
            self.set_progress(trials_done=done)
        return studies


FINISHED_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count toward the requested number (surplus ones of a racing worker do not)."""
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED_STATES) if not t.user_attrs.get("surplus")]


def front_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible, fully evaluated Pareto-optimal trials (Optuna's best_trials honour constraints).

    A trial that reused the score of an identical earlier config is left out: the earlier one stands.
    """
    return [t for t in study.best_trials if "accuracy" in t.user_attrs and "reused_from" not in t.user_attrs]


def hypervolume_2d(points: Sequence[tuple[float, float]], budget: float) -> float:
    """Area dominated by (accuracy up, key bits down) points, reference (accuracy 0, bits = budget)."""
    pts = sorted((b, a) for a, b in points if b <= budget and a > 0)
    area, best = 0.0, 0.0
    # Sweep from the budget down: each point adds (accuracy gain) x (bits it undercuts the budget by).
    for bits, acc in pts:
        if acc > best:
            area += (acc - best) * (budget - bits)
            best = acc
    return area
