"""Optuna campaigns: one multi-objective study per (model, bit budget), fronts written to SQL.

A campaign is a model, a method (search space), bit budgets, a trial count per budget, an
evaluation profile and objectives. Each budget is an Optuna study on the same database as our
tables (`pnmix:<campaign id>:<budget>`), so `pnmix dashboard` shows it and any number of
`pnmix worker` processes can share it through PostgreSQL.

Budgets run from the lowest up, and every config scored under one budget is copied, with its
score, into the study of every other budget it fits (a COMPLETE trial marked `shared`, with
`score_from`, taking no slot): each budget's sampler learns from every score of the campaign,
each stored front holds every scored point within its bits, and a higher budget spends its own
trials on the configs only its bits allow. A worker shares what it scores as it finishes each
trial; a study also pulls what is missing when a worker starts it (scores of budgets that ran
before it existed, or of a worker that died before sharing).

A trial:
1. samples a config from the search space (tuner.space; TPE, multivariate and grouped, choosing
   among the bit pairs that have a config within the budget) and computes its bits (the formula's
   key bits, or KV bits under a KV budget: `SearchSpace.cost`, stored as the trial's "bits");
   the budget is an Optuna constraint (`bits - budget <= 0`); a config over budget never
   runs inference: it completes with accuracy 0 and is marked infeasible, so the sampler learns;
   a config the campaign already scored takes its score (no inference);
2. multi-fidelity (opt-in, `--multi-fidelity`): the proxy (attention KL on recorded traces,
   milliseconds) screens it; a candidate that an already fully evaluated trial beats on both
   proxy KL and key bits is pruned (recorded as PRUNED with its proxy value);
3. otherwise full evaluation by real inference (tuner.evaluate).
After every finished trial the (campaign, budget) front, the study's feasible Pareto trials,
replaces the stored one in one transaction: a killed run leaves the last whole front.
Running the same campaign again resumes it: finished trials count, none is re-run.

A runner keeps one Optuna Study object per budget for its whole run, so Optuna's trial cache
makes every read fetch only the trials that are new or still unfinished (finished trials never
change), other workers' included: a campaign's bookkeeping grows linearly with its trials, not
quadratically. The verdict that a campaign is done reads every study afresh.

Faults (docs/reliability.md): a trial that runs out of memory is recorded FAILED with the reason
(user attribute `error`) and another trial takes its place, up to `MAX_FAILED_TRIALS`; a lost
database connection is retried with backoff (`PNMIX_DB_RETRIES` consecutive failures, first wait
`PNMIX_DB_RETRY_S`) and then ends the run with one line; a worker that finishes its own trials
waits for every running trial (other workers', or an orphan a dropped connection left behind),
or fails it once its heartbeat is stale so that Optuna's retry (a copy of the trial, WAITING) runs
here if the count still needs it; the campaign row carries a heartbeat
too, so `pnmix worker` can reclaim a campaign whose every worker died.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning

from pnmix.bits import kv_bits, mean_key_bits
from pnmix.config import PNMixConfig, preset
from pnmix.errors import PNMixError
from pnmix.inputs import SEED, shorten
from pnmix.layerwise import AnyConfig
from pnmix.names import BACKENDS
from pnmix.storage.errors import StorageError
from pnmix.storage.vocabulary import TRIALS, env_value
from pnmix.storage.write import OBJECTIVES, check_budgets, check_objectives
from pnmix.tuner import profiles, queue, record
from pnmix.tuner.allocation import AllocatorLoop
from pnmix.tuner.holdout import DEFAULT_SHARE, HOLDOUT
from pnmix.tuner.profiles import EvalError
from pnmix.tuner.record import config_key, running_trials, scored_configs
from pnmix.tuner.space import SearchSpace

warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeats and metric names are stable enough

PRUNE_SLACK = 0.9  # prune only when an evaluated trial's proxy KL is at least 10% lower
MIN_FULL = 3  # always fully evaluate the first few candidates of a study
# A worker's trial counts as dead after GRACE_S without a heartbeat; it is then retried.
# Read when a command first imports this module: a malformed value is one line, before any work.
HEARTBEAT_S = int(env_value("PNMIX_HEARTBEAT_S", 10))
GRACE_S = int(env_value("PNMIX_GRACE_S", 30))
# Consecutive database failures tolerated (waits of DB_RETRY_S, doubling, at most 30 s) before giving up.
DB_RETRIES = int(env_value("PNMIX_DB_RETRIES", 5))
DB_RETRY_S = env_value("PNMIX_DB_RETRY_S", 1.0)
log = logging.getLogger("pnmix.tuner")

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
    multi_fidelity: bool = False  # the proxy screen: opt-in (docs/search.md, "Multi-fidelity")
    racing: bool = False  # race candidates on growing shares of the items (tuner/racing.py)
    backend: str = "auto"
    tasks: tuple[str, ...] | None = None
    space: SearchSpace = field(default_factory=SearchSpace)
    holdout: float = DEFAULT_SHARE  # share of every part's units no trial sees (tuner/holdout.py)

    def __post_init__(self) -> None:
        """Budgets and objectives get the storage's checks (the campaign row holds them); the
        profile, a name of this layer, is checked here (the method is checked by the space); the
        rest as tuner/queue.py says, so that what is enqueued is what a worker can run."""
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
            queue.check_tasks(self.tasks)
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, int | float) or not HOLDOUT.contains(
                self.holdout):
            raise EvalError(f"invalid holdout={shorten(self.holdout)}: allowed {HOLDOUT.allowed}")

    def key(self) -> str:
        """Identity of the campaign: the same spec resumes the same campaign."""
        data = asdict(self)
        data.pop("n_trials")
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def options(self) -> dict[str, Any]:
        return {"seed": self.seed, "multi_fidelity": self.multi_fidelity, "racing": self.racing, "tasks": self.tasks,
                "holdout": self.holdout, "spec_key": self.key(),
                "space": self.space.to_options()}

    @classmethod
    def from_campaign(cls, row: Any) -> CampaignSpec:
        """The spec of a stored campaign; EvalError (with the reason) for one this version cannot run,
        e.g. written by another version or straight into the database."""
        try:
            opts = row.options or {}
            space = SearchSpace(**{**opts.get("space", {}), "method": row.method, "budget_on": row.budget_on})
            tasks = tuple(opts["tasks"]) if opts.get("tasks") else None
            return cls(model=row.model.name, budgets=tuple(row.budgets), n_trials=row.n_trials, method=row.method,
                       profile=row.profile, objectives=tuple(row.objectives), seed=opts.get("seed", 0),
                       multi_fidelity=opts.get("multi_fidelity", True), racing=opts.get("racing", False),
                       backend=row.backend, tasks=tasks, space=space,
                       holdout=opts.get("holdout", 0.0))  # campaigns stored before hold-outs had none
        except PNMixError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise EvalError(f"campaign {row.id} cannot be read by this pnmix: {_one_line(exc)}") from None


def study_name(campaign_id: int, budget: float) -> str:
    return f"pnmix:{campaign_id}:{budget:g}"


def optuna_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on our database, with heartbeats so a dead worker's trial is retried.

    PostgreSQL: pooled connections are pinged before use (a connection the server dropped is
    replaced, not used). SQLite: every transaction takes the write lock at its start (`BEGIN
    IMMEDIATE`) and waits up to 60 s for it, so parallel workers queue instead of failing
    "database is locked", and two of them never pop the same enqueued trial
    (tests/reliability/test_sqlite_writers.py runs four at once).
    """
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    kwargs: dict[str, Any] = {}
    sqlite = url.startswith("sqlite")
    if sqlite:
        kwargs["connect_args"] = {"timeout": 60}
    else:
        kwargs["pool_pre_ping"] = True
    for attempt in range(3):
        try:
            storage = _Storage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                               heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2))
            break
        except Exception:  # two workers creating Optuna's tables at once: one loses the race, then finds them
            if attempt == 2:
                raise
            time.sleep(1 + attempt)
    if sqlite:
        from pnmix.storage.engine import configure_sqlite

        configure_sqlite(storage.engine, 60.0, readonly_option=False)
        storage.engine.dispose()  # the pooled connections were opened before the listeners
    return storage


class _Storage(optuna.storages.RDBStorage):
    """RDBStorage whose heartbeat survives a dropped connection.

    Optuna records a trial's heartbeat from a thread; an exception there ends the thread with a
    traceback, and the trial, though alive, goes stale and is run twice. A failed beat is skipped
    instead: the next one (a new pooled connection) usually succeeds, and if the database stays
    away the trial is retried like a dead worker's, which is right.
    """

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            super().record_heartbeat(trial_id)
        except Exception as exc:
            self.remove_session()  # this thread's session may hold a dead transaction: start afresh next beat
            log.warning("warning: trial heartbeat not recorded: %s", _one_line(exc))

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        """Optuna's stale trials, plus RUNNING ones that never recorded a heartbeat and started longer
        than the grace period ago (a worker killed, or cut off, between creating a trial and its first beat)."""
        from datetime import UTC, datetime, timedelta

        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        stale = super()._get_stale_trial_ids(study_id)
        grace = (self.grace_period or 2 * (self.heartbeat_interval or HEARTBEAT_S)) + (self.heartbeat_interval or 0)
        cutoff = datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=grace)  # stored as naive UTC
        with _create_scoped_session(self.scoped_session, True) as session:
            beating = {trial_id for (trial_id,) in session.query(models.TrialHeartbeatModel.trial_id)
                       .join(models.TrialModel).filter(models.TrialModel.study_id == study_id)}
            silent = session.query(models.TrialModel.trial_id).filter(
                models.TrialModel.study_id == study_id, models.TrialModel.state == optuna.trial.TrialState.RUNNING,
                models.TrialModel._datetime_start_utc < cutoff).all()
        return stale + [trial_id for (trial_id,) in silent if trial_id not in beating and trial_id not in stale]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


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


class CampaignHeartbeat:
    """Refreshes the campaign row's `heartbeat_at` every HEARTBEAT_S while this worker runs it."""

    def __init__(self, db: Any, campaign_id: int, worker_id: str) -> None:
        self.db, self.campaign_id, self.worker_id = db, campaign_id, worker_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"pnmix-campaign-{campaign_id}", daemon=True)

    def __enter__(self) -> CampaignHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 5)

    def _beat(self) -> None:
        from pnmix.storage import touch_campaign

        while not self._stop.wait(HEARTBEAT_S):
            try:
                with self.db.session() as s:
                    touch_campaign(s, self.campaign_id, self.worker_id)
            except Exception as exc:  # the trial loop meets the same fault and decides; a beat just waits
                log.warning("warning: campaign heartbeat not recorded: %s", _one_line(exc))


class CampaignRunner:
    """Runs the studies of one campaign with one loaded evaluator."""

    # After each trial, collect garbage so the device memory a trial's caches held is free for the
    # next. A replay of recorded scores (benchmarks/bench_tuner.py) holds no device memory and skips it.
    collect_garbage = True

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
        self.num_layers = evaluator.num_layers
        self.space = spec.space  # pnmix-layers: with the model's layer groups once `_layer_groups` has run
        self.storage = optuna_storage(url)
        self._db_failures = 0  # consecutive; a finished trial resets it
        self._studies: dict[float, optuna.Study] = {}  # by budget: `study` (its sampler) or `_peek` (reading)
        self._own: set[float] = set()
        self._pair_cache: dict[float, list[str]] = {}
        self._layer_kl_cache: dict[PNMixConfig, list[float]] = {}
        self.allocator: AllocatorLoop | None = None  # pnmix-alloc, once the space has one group per layer
        # Kernel specialisations its trials compiled (CUDA), and the compiler's seconds on them.
        self.kernels_compiled = 0
        self.compile_seconds = 0.0

    # -- the study of one budget ---------------------------------------------------------------

    def _alloc(self) -> AllocatorLoop:
        if self.allocator is None:  # set with the space's layers (`_layer_groups`), before any trial
            raise RuntimeError("the allocator runs only in pnmix-alloc campaigns")
        return self.allocator

    @property
    def sensitivity_seconds(self) -> float:
        """What this runner spent on the allocator's sensitivity tables."""
        return self.allocator.sensitivity_seconds if self.allocator else 0.0

    def study(self, budget: float) -> optuna.Study:
        """The budget's study, created with its warm start on first use; one Study object per budget
        for the runner's life.

        Keeping the object keeps Optuna's trial cache: a finished trial never changes, so each read
        fetches only the trials that are new or still unfinished (other workers' included) instead
        of every trial of the study again."""
        if budget in self._own:
            return self._studies[budget]
        self._layer_groups()  # pnmix-layers: its sampler's parameters need the groups
        # constant_liar: workers sampling at once treat each other's running trials as poor, so they
        # spread out instead of proposing (and evaluating) the same config side by side. group: the
        # salient ratio exists only when b_high > b_low; grouped, TPE models it jointly with the other
        # parameters where it exists instead of sampling it independently.
        sampler = optuna.samplers.TPESampler(seed=self.spec.seed + int(budget * 1000), multivariate=True,
                                             group=True, n_startup_trials=4, constant_liar=True)
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
        self._studies[budget] = study
        self._own.add(budget)
        return study

    def finished_count(self, budget: float) -> int:
        """Trials of `budget` that count toward its number (its study created on first use, as
        `study` does, with database faults handled as every other step's)."""
        return int(self._guarded(f"budget {budget:g}", lambda: len(finished(self.study(budget)))))

    def _pairs(self, budget: float) -> list[str]:
        """The bit pairs this budget's sampler chooses from: those with a config within the budget
        (a pair whose cheapest config is over it could only ever give over-budget proposals). A study
        an older campaign began with every pair keeps its choices (Optuna's are fixed per study)."""
        if budget not in self._pair_cache:
            study = self._studies.get(budget)
            known = study.get_trials(deepcopy=False, states=FINISHED_STATES) if study is not None else []
            old = next((t.distributions["bits"] for t in known if "bits" in t.distributions), None)
            if isinstance(old, optuna.distributions.CategoricalDistribution):
                self._pair_cache[budget] = [str(c) for c in old.choices]
                return self._pair_cache[budget]
            self._pair_cache[budget] = self.space.pairs_within(budget, self.head_dim)
        return self._pair_cache[budget]

    def _peek(self, budget: float) -> optuna.Study | None:
        """Another budget's study for reading (None while no worker has created it), kept like `study`."""
        if budget not in self._studies:
            try:
                self._studies[budget] = optuna.load_study(study_name=study_name(self.campaign_id, budget),
                                                          storage=self.storage)
            except KeyError:
                return None
        return self._studies[budget]

    def _warm_start(self, study: optuna.Study, budget: float) -> None:
        """Enqueues pnmix-paper, KIVI and Kitty where they fit the budget, the model's previous front,
        and per bit pair the config that fills the budget (`SearchSpace.fullest_within`: the top of
        a budget's front is where its best point lies, and TPE alone seldom reaches it), in that
        order; pnmix-layers first enqueues, for each of those uniform configs, the layer-wise one
        that the proxy's per-layer KL says spends the same budget best across the groups
        (`tuner.layers.grouped_for_budget`). At most half the budget's trials (queued trials run
        first: a dead worker's retried trial queues behind them); new studies only."""
        space = self.space
        candidates: list[AnyConfig] = [preset("pnmix-paper"), preset("kivi2"), preset("kivi1"), preset("kitty")]
        candidates += self._stored_fronts(budget)
        candidates += space.fullest_within(budget, self.head_dim)
        if space.allocated:
            for params, attrs in self._alloc().warm_starts(budget, candidates, max(1, self.spec.n_trials // 2)):
                study.enqueue_trial(params, user_attrs=attrs)
            return
        candidates = [space.recast(c) for c in candidates if space.layered or isinstance(c, PNMixConfig)]
        if space.layered:
            candidates = [*self._grouped(candidates, budget), *candidates]
        seen = set()
        for cfg in candidates:
            if not space.contains(cfg) or space.cost(cfg, self.head_dim) > budget:
                continue
            params = space.params_of(cfg)
            frozen = json.dumps(params, sort_keys=True)
            if frozen not in seen:
                seen.add(frozen)
                study.enqueue_trial(params, user_attrs={"warm_start": True})
            if len(seen) >= max(1, self.spec.n_trials // 2):  # the sampler keeps at least half the slots
                return

    def _stored_fronts(self, budget: float) -> list[PNMixConfig]:
        """The best stored front points of this model from earlier campaigns that fit `budget` (this
        campaign's own scores reach every budget they fit by sharing: `_share`, `_pull_shared`)."""
        from sqlalchemy import select

        from pnmix.storage import FrontPoint, Model
        from pnmix.storage.read import bits_column

        with self.db.session(readonly=True) as s:
            rows = s.scalars(select(FrontPoint).join(Model, FrontPoint.model_id == Model.id)
                             .where(Model.name == self.spec.model, bits_column(self.space.budget_on) <= budget,
                                    FrontPoint.campaign_id != self.campaign_id)
                             .order_by(FrontPoint.accuracy.desc()).limit(8)).all()
            return [row.config for row in rows]

    def _grouped(self, uniform: list[AnyConfig], budget: float) -> list[AnyConfig]:
        """pnmix-layers warm starts: for each uniform config's shared fields (G, sinks, values), the
        layer-wise config of the groups that `grouped_for_budget` finds within `budget`."""
        from pnmix.tuner.layers import candidates_like, grouped_for_budget

        out: list[AnyConfig] = []
        # One base per set of shared fields: the candidates differ only in bits and ratio.
        shared = {c.with_(b_high=3, b_low=1, salient_ratio=0.5): None for c in uniform
                  if isinstance(c, PNMixConfig) and c.b_high > c.b_low}
        for base in shared:
            kl_of = {c: self._layer_kl(c) for c in candidates_like(base, self.space)}
            cfg = grouped_for_budget(self.space, kl_of, budget, self.head_dim)
            if cfg is not None and cfg not in out:
                out.append(cfg)
        return out

    def _layer_kl(self, config: PNMixConfig) -> list[float]:
        """The proxy's per-layer attention KL of `config`, computed once per runner."""
        if config not in self._layer_kl_cache:
            self._layer_kl_cache[config] = self.evaluator.proxy_by_layer(config)
        return self._layer_kl_cache[config]

    def _layer_groups(self) -> None:
        """pnmix-layers: the model's layers in `layer_groups` groups by sensitivity (each layer's proxy
        KL under pnmix-paper, `tuner.layers.group_layers`). The first worker stores them on the
        campaign row (`search_space["groups"]`); every later one, and a resumed run, reads them
        there, so all of a campaign's trials share one grouping."""
        if not self.space.layered or self.space.groups:
            return
        if self.space.allocated:  # one layer a group: nothing to form or store
            self.space = self.space.with_layers(self.num_layers)
            self.allocator = AllocatorLoop(self.space, self.evaluator, self.head_dim, self.num_layers, self.progress)
            return
        from pnmix.storage import Campaign, get_campaign, update_campaign_progress
        from pnmix.tuner.layers import group_layers

        with self.db.session(readonly=True) as s:
            stored = (get_campaign(s, self.campaign_id).search_space or {}).get("groups")
        if not stored:
            self.progress(f"layer sensitivity: proxy KL of {self.num_layers} layers")
            paper = preset("pnmix-paper")
            base = self.space.config(paper.b_high, paper.b_low, paper.group_size, paper.salient_ratio, paper.n_sink)
            mine = group_layers(self._layer_kl(base), self.space.layer_groups)
            with self.db.session() as s:  # the first worker to store its groups wins; the others take them
                row = s.get(Campaign, self.campaign_id, with_for_update=True, populate_existing=True)
                stored = (row.search_space or {}).get("groups") if row is not None else None
                if not stored:
                    stored = mine
                    update_campaign_progress(s, self.campaign_id, search_space=self.space.with_groups(mine).to_dict())
        self.space = self.space.with_groups(stored)

    # -- one trial -------------------------------------------------------------------------------

    def objective(self, trial: optuna.Trial, budget: float) -> tuple[float, ...]:
        if self._cap_reached(trial):
            # Another worker started the last trial at the same moment: record this one as surplus
            # (no inference, excluded from the count) rather than run past the requested count.
            record.mark_surplus(trial)
            trial.study.stop()
            raise optuna.TrialPruned("trial cap reached by other workers")
        origin = None
        if self.space.allocated:
            config, origin = self._alloc().config(trial, budget, self._campaign_studies(trial.study))
        else:
            config = self.space.suggest(trial, self._pairs(budget), head_dim=self.head_dim)
        bits = self.space.cost(config, self.head_dim)
        record.write_config(trial, config, bits, mean_key_bits(config, self.num_layers, self.head_dim),
                            kv_bits(config, self.num_layers, self.head_dim), origin)
        trial.set_constraint(f"{self.space.budget_on}_bits", bits - budget)
        if bits > budget:
            record.mark_skipped(trial)
            return self._values(0.0, bits, None)
        found = self._evaluated_twin(trial.study, config)
        if found is not None:  # a config already scored in this campaign: reuse the score, don't re-run
            source, twin = found
            # From this study, the twin stands on the front; from another budget's, the same score
            # belongs on this front too.
            record.copy_score(trial, twin, None if source == trial.study.study_name else source)
            self._enqueue_neighbour(trial.study, config, budget, trial.number)
            return tuple(twin.values)
        warm = bool(trial.user_attrs.get("warm_start"))
        if self.spec.multi_fidelity:  # warm starts get a proxy value too: they anchor the pruning rule
            proxy = self.evaluator.proxy(config)
            trial.set_user_attr("proxy_kl", proxy)
            if not warm and self._dominated(trial.study, bits, proxy):
                self.progress(f"budget {budget:g}: trial {trial.number} pruned by the proxy")
                raise optuna.TrialPruned(f"proxy KL {proxy:.4g} beaten at <= {bits:.3f} bits")
        self.progress(f"budget {budget:g}: trial {trial.number} {config.label}: evaluating")
        try:
            have = self._race(trial, config, bits) if self.spec.racing and not warm else None
            score = self.evaluator.evaluate(config, have=have) if have is not None else self.evaluator.evaluate(config)
        except (MemoryError, RuntimeError) as exc:  # torch's (CUDA or CPU) out of memory is a RuntimeError
            if isinstance(exc, StorageError):
                raise
            reason = failure_reason(exc)
            print(f"warning: budget {budget:g}: trial {trial.number} failed: {reason}", file=sys.stderr, flush=True)
            record.mark_failed(trial, reason)
            raise
        record.write_score(trial, score)
        self.kernels_compiled += int(score.timings.get("kernels_compiled", 0))
        self.compile_seconds += score.timings.get("kernel_compile", 0.0)
        return self._values(score.accuracy, bits, score)

    def _race(self, trial: optuna.Trial, config: AnyConfig, bits: float) -> Any:
        """Scores `config` rung by rung (tuner/racing.py) against this study's front of no more bits;
        raises TrialPruned (partial score kept) once a front point beats it with confidence, else
        returns what the rungs scored for the full evaluation to complete.

        Each finished rung is stored on the trial ("rung"): a trial retried after its worker died
        inherits the attribute, so it resumes after the last finished rung."""
        from pnmix.tuner import racing
        from pnmix.tuner.evaluate import Rung

        front = [(budget_bits(t), t.user_attrs["units"]) for t in front_trials(trial.study)
                 if t.user_attrs.get("units")]
        saved = trial.user_attrs.get("rung")
        have = Rung(**saved) if saved else None
        counts = self.evaluator.unit_counts()
        for share in racing.RUNGS[:-1]:  # the last rung is the full evaluation
            upto = racing.rung_sizes(counts, share)
            if have is None or any(len(have.units.get(p, [])) < n for p, n in upto.items()):
                have = self.evaluator.rung(config, upto, have)
                trial.set_user_attr("rung", have.to_dict())
            verdict = racing.judge(have.units, bits, front, share)
            if verdict.stop:
                diff, se = verdict.margin or (float("nan"), None)
                trial.set_user_attr("pruned_at", share)
                trial.set_user_attr("partial_accuracy", verdict.accuracy)
                trial.set_user_attr("partial_accuracy_se", verdict.accuracy_se)
                trial.set_user_attr("seconds", have.seconds)
                self.progress(f"trial {trial.number} stopped at {share:g} of the items: a front point is "
                              f"{diff:.3f} +- {se or 0:.3f} more accurate")
                raise optuna.TrialPruned(f"beaten by a front point at <= {bits:.3f} bits by {diff:.3f} "
                                         f"(z {verdict.z:.2f}) on {share:g} of the items")
        return have

    def _enqueue_neighbour(self, study: optuna.Study, config: AnyConfig, budget: float, number: int) -> None:
        """A sampler that proposes a config already scored has converged around it: the slot it
        spent buys nothing, so the next trial of the budget scores a neighbour of that config (one
        knob one step away, within the budget, drawn in an order seeded by the campaign's seed and
        the trial number) that no study of the campaign has scored or queued yet. On the ground
        truth this turns the re-proposals (about half of a budget's trials) into a local search
        along the front (docs/search.md, "Budgets")."""
        if len(finished(study)) + 1 >= self.spec.n_trials:  # this trial is the budget's last: no slot left
            return
        scored = set().union(*(scored_configs(st) for st in self._campaign_studies(study)))
        # A queued trial holds its parameters in fixed_params until a worker starts it.
        pending = {json.dumps(t.system_attrs.get("fixed_params", t.params), sort_keys=True) for t in study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING))}
        candidates = self.space.neighbours(config, self.head_dim)
        random.Random(self.spec.seed * 100_003 + number).shuffle(candidates)
        for cfg in candidates:
            params = self.space.params_of(cfg)
            if (self.space.cost(cfg, self.head_dim) <= budget and config_key(cfg.to_dict()) not in scored
                    and json.dumps(params, sort_keys=True) not in pending):
                study.enqueue_trial(params, user_attrs={"neighbour_of": config.label})
                return

    def _campaign_studies(self, study: optuna.Study) -> list[optuna.Study]:
        """`study`, then every other budget's study of the campaign that exists yet."""
        others = [self._peek(b) for b in self.spec.budgets if study_name(self.campaign_id, b) != study.study_name]
        return [study, *(st for st in others if st is not None)]

    def _evaluated_twin(self, study: optuna.Study,
                        config: AnyConfig) -> tuple[str, optuna.trial.FrozenTrial] | None:
        """(study name, trial) of an earlier full evaluation of `config` in this campaign: in this
        budget's study first (a score shared into it included), then in the other budgets' (one
        evaluator, profile and seed per campaign, so a config scores the same under every budget)."""
        wanted = config.to_dict()
        for st in self._campaign_studies(study):
            for t in st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                attrs = t.user_attrs
                # Elsewhere, point at the original evaluation, not at another budget's copy of it.
                original = st is study or "score_from" not in attrs
                if attrs.get("config") == wanted and "accuracy" in attrs and original:
                    return st.study_name, t
        return None

    def _cap_reached(self, trial: optuna.Trial) -> bool:
        """Whether the budget's count is already taken by finished trials and by running trials that
        started before this one. Start order, not trial number: a queued trial (a warm start, a
        neighbour, a dead worker's retry) holds the number it was queued with and may start after
        trials numbered above it, so by number several workers could run one trial past the count."""
        states = (*FINISHED_STATES, optuna.trial.TrialState.RUNNING)
        trials = trial.study.get_trials(deepcopy=False, states=states)
        mine = next((t.datetime_start for t in trials if t.number == trial.number), None)

        def before(t: optuna.trial.FrozenTrial) -> bool:
            if t.state != optuna.trial.TrialState.RUNNING:
                return True
            if mine is None or t.datetime_start is None:
                return t.number < trial.number
            return (t.datetime_start, t.number) < (mine, trial.number)

        taken = [t for t in trials if t.number != trial.number and counts(t) and before(t)]
        return len(taken) >= self.spec.n_trials

    def _values(self, accuracy: float, bits: float, score: Any) -> tuple[float, ...]:
        values = {"accuracy": accuracy, f"{self.space.budget_on}_bits": bits,
                  "kv_bytes": float(score.kv_bytes) if score else 0.0,
                  "throughput": float(score.decode_tokens_per_s) if score else 0.0}
        return tuple(values[o] for o in self.spec.objectives)

    def _dominated(self, study: optuna.Study, bits: float, proxy: float) -> bool:
        """True when a fully evaluated feasible trial has no more bits and a clearly lower proxy KL."""
        evaluated = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                     if "accuracy" in t.user_attrs and "proxy_kl" in t.user_attrs]
        if len(evaluated) < MIN_FULL:
            return False
        return any(budget_bits(t) <= bits + 1e-9 and t.user_attrs["proxy_kl"] < proxy * PRUNE_SLACK
                   for t in evaluated)

    # -- sharing scores between budgets ------------------------------------------------------------

    def _share(self, trial: optuna.trial.FrozenTrial, source: str) -> None:
        """Copies a config scored in study `source` into every other budget's study it fits (a
        COMPLETE trial with its score, `score_from` and `shared`, taking no slot), and rewrites those
        budgets' fronts: each budget's sampler learns from every score of the campaign, and each
        stored front holds every scored point within its bits."""
        bits = budget_bits(trial)
        for budget in self.spec.budgets:
            if bits > budget or study_name(self.campaign_id, budget) == source:
                continue
            study = self._peek(budget)
            if study is not None and self._add_shared(study, budget, trial, source, scored_configs(study)):
                self.write_front(study, budget, progress=False)

    def _pull_shared(self, budget: float) -> None:
        """Copies into this budget's study every score of the campaign's other budgets that fits it
        and is not there yet: those of budgets that ran before its study existed, and any that a
        worker scored but did not live to share."""
        study = self._studies[budget]
        have = scored_configs(study)
        added = False
        for other in self.spec.budgets:
            source = self._peek(other) if other != budget else None
            if source is None:
                continue
            for t in source.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                if scored_here(t) and budget_bits(t) <= budget:
                    added = self._add_shared(study, budget, t, source.study_name, have) or added
        if added:
            self.write_front(study, budget, progress=False)

    def _add_shared(self, study: optuna.Study, budget: float, trial: optuna.trial.FrozenTrial, source: str,
                    have: set[str]) -> bool:
        key = config_key(trial.user_attrs["config"])
        if key in have:
            return False  # scored there already (by its own sampler, or shared before)
        have.add(key)
        distributions = dict(trial.distributions)
        if "bits" in distributions:  # this budget's choice of bit pairs (the config's pair is among them: it fits)
            distributions["bits"] = optuna.distributions.CategoricalDistribution(self._pairs(budget))
        study.add_trial(optuna.trial.create_trial(
            values=list(trial.values), params=trial.params, distributions=distributions,
            user_attrs=record.shared_attrs(trial, source),
            constraints={f"{self.space.budget_on}_bits": budget_bits(trial) - budget}))
        return True

    # -- fronts ----------------------------------------------------------------------------------

    def write_front(self, study: optuna.Study, budget: float, progress: bool = True) -> int:
        """Replaces the stored (campaign, budget) front with the study's feasible Pareto trials."""
        from pnmix.storage import FrontPointIn, replace_front
        from pnmix.tuner.stats import unit_influence

        points = []
        for r in map(record.read, front_trials(study)):
            a = r.attrs
            assert r.config is not None and r.accuracy is not None  # front trials are scored
            points.append(FrontPointIn(
                config=r.config, accuracy=float(r.accuracy), kv_bytes=int(a["kv_bytes"]),
                throughput=float(a["decode_tokens_per_s"]), trial_number=r.number, backend=str(a["backend"]),
                device=str(a["device"]), accuracy_parts=dict(a["parts"]), versions=dict(a["versions"]),
                accuracy_se=r.accuracy_se, unit_influence=unit_influence(r.units) if r.units else None))
        with self.db.session() as s:
            replace_front(s, self.campaign_id, budget, points)
        if progress:
            self.set_progress(trials_done=self.trials_done())
        return len(points)

    def set_progress(self, **changes: Any) -> None:
        """Updates the campaign row unless it is already finished (another worker may have finished it)."""
        from pnmix.storage import InvalidValueError, get_campaign, update_campaign_progress

        try:
            with self.db.session() as s:
                if get_campaign(s, self.campaign_id).status in ("done", "failed"):
                    return
                update_campaign_progress(s, self.campaign_id, **changes)
        except InvalidValueError:
            with self.db.session(readonly=True) as s:
                if get_campaign(s, self.campaign_id).status not in ("done", "failed"):
                    raise

    def trials_done(self, fresh: bool = False) -> int:
        """Trials counted over every budget. The runner's studies read only what changed since their
        last read; `fresh` reads everything again (the last worker's verdict on whether the campaign
        is done rests on it, not on a cache)."""
        done = 0
        for budget in self.spec.budgets:
            if fresh:
                try:
                    study = optuna.load_study(study_name=study_name(self.campaign_id, budget), storage=self.storage)
                except KeyError:
                    continue
            else:
                peeked = self._peek(budget)
                if peeked is None:
                    continue
                study = peeked
            # Racing workers may add one more; an exhausted budget counts as complete.
            done += self.spec.n_trials if exhausted(study, self.spec.n_trials) else min(len(finished(study)),
                                                                                        self.spec.n_trials)
        return done

    # -- running ---------------------------------------------------------------------------------

    def run(self, on_trial: Callable[[float, optuna.Study], None] | None = None) -> dict[float, optuna.Study]:
        """Runs every budget to its trial count; returns the studies by budget.

        Budgets run from the lowest up: a config within a budget is within every higher one, so each
        later study starts with every score below it (shared, `_pull_shared`) and spends its own
        trials on what only its bits allow. First pass: each budget until its remaining trials are all
        finished or being run by other workers. Second pass: wait for those (failing the stale ones
        of dead workers, whose retries then run here), so that the last worker out leaves every
        budget complete and marks it done.
        """
        self._guarded("starting", lambda: self.set_progress(
            status="running", study_names={f"{b:g}": study_name(self.campaign_id, b) for b in self.spec.budgets},
            trials_total=self.spec.n_trials * len(self.spec.budgets)))
        studies: dict[float, optuna.Study] = {}
        with CampaignHeartbeat(self.db, self.campaign_id, self.worker_id):
            for wait in (False, True):
                for budget in sorted(self.spec.budgets):  # from the lowest: see the docstring
                    studies[budget] = self._guarded(
                        f"budget {budget:g}", functools.partial(self._run_budget, budget, on_trial, wait=wait))
            self._guarded("finishing", lambda: self._finish(studies))
        return studies

    def _run_budget(self, budget: float, on_trial: Callable[[float, optuna.Study], None] | None,
                    wait: bool) -> optuna.Study:
        study = self.study(budget)
        self._pull_shared(budget)  # what the other budgets scored that fits here and is not here yet
        floor = self.space.min_bits(self.head_dim)
        if budget < floor:
            if not wait:
                self.progress(f"budget {budget:g}: no config of the {self.spec.method} space fits (the smallest "
                              f"needs {floor:.3f} {self.space.budget_on} bits); its front stays empty")
            self.write_front(study, budget)
            return study

        def after_trial(st: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            if scored_here(trial):
                self._share(trial, st.study_name)
            self.write_front(st, budget)
            self._db_failures = 0
            if on_trial:
                on_trial(budget, st)

        def objective(trial: optuna.Trial) -> tuple[float, ...]:
            return self.objective(trial, budget)

        def cap(st: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            # Counts every worker's finished trials, so many workers stop together.
            if len(finished(st)) >= self.spec.n_trials or exhausted(st, self.spec.n_trials):
                st.stop()

        while True:
            remaining = self.spec.n_trials - len(finished(study))
            if remaining <= 0 or exhausted(study, self.spec.n_trials):
                if remaining > 0 and not wait:
                    self.progress(f"budget {budget:g}: stopped after {over_budget_limit(self.spec.n_trials)} "
                                  f"over-budget proposals; few configs of the space fit {budget:g} bits")
                # The budget is complete, but a RUNNING trial would keep every worker's _finish from
                # marking the campaign done: a racing worker's surplus trial, or an orphan whose
                # creation committed while its connection dropped (no heartbeat, never told). The
                # second pass waits for it to end or go stale.
                if not wait or not running_trials(study):
                    break
            else:
                running = len(running_trials(study))  # this worker runs none between optimize calls: others'
                if remaining > running:
                    try:
                        study.optimize(objective, n_trials=remaining - running, callbacks=[cap, after_trial],
                                       catch=(RuntimeError, MemoryError),
                                       gc_after_trial=self.collect_garbage)
                    except ValueError as exc:  # "Cannot tell a FAIL trial": ours was declared dead meanwhile
                        if "Cannot tell a" not in str(exc):
                            raise
                        print(f"warning: budget {budget:g}: a trial of this worker went without a heartbeat for "
                              f"{GRACE_S} s (PNMIX_GRACE_S) and was retried by another worker; its result here "
                              "is dropped", file=sys.stderr, flush=True)
                    self._check_failures(study, budget)
                    continue
                if not wait:
                    break
            # Every running trial is another worker's or an orphan: wait for it, or for it to go stale.
            time.sleep(min(HEARTBEAT_S, 5))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)  # a dead worker's trial -> FAIL, plus a WAITING copy
        self.write_front(study, budget)
        return study

    def _check_failures(self, study: optuna.Study, budget: float) -> None:
        """Stops the campaign (status failed) once too many trials of a budget failed, e.g. all out of memory."""
        failed = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
                  if "error" in t.user_attrs]
        limit = max(MAX_FAILED_TRIALS, self.spec.n_trials)
        if len(failed) < limit:
            return
        last = failed[-1].user_attrs["error"]
        message = f"budget {budget:g}: {len(failed)} trials failed, the last with {last}"
        self.set_progress(status="failed", message=message)
        raise EvalError(f"campaign {self.campaign_id} stopped: {message}")

    def _finish(self, studies: dict[float, optuna.Study]) -> None:
        # Only the last worker out marks the campaign done: another may still be running a trial.
        running = any(running_trials(s) for s in studies.values())
        done = self.trials_done(fresh=True)
        floor = self.space.min_bits(self.head_dim)
        expected = self.spec.n_trials * sum(1 for b in self.spec.budgets if b >= floor)
        if done >= expected and not running:
            self.score_holdout()
            self.set_progress(status="done", trials_done=done)
        else:
            self.set_progress(trials_done=done)

    def score_holdout(self) -> None:
        """Scores each budget's recommended point (storage.recommend within this campaign, as
        `pnmix recommend --bits BUDGET` answers) and pnmix-paper, where it fits the budget, on the
        held-out units, and stores the result with the point. Runs once, when the campaign is done:
        points that already hold a held-out score are skipped, so a resumed campaign pays nothing."""
        from pnmix.storage import HoldoutIn, recommend, set_holdout
        from pnmix.storage.errors import NoFeasiblePointError, NotFoundError
        from pnmix.tuner.stats import paired

        # Evaluators that replay recorded scores (benchmarks, tests) hold nothing out.
        if not getattr(self.evaluator, "holdout", 0.0) or not self.evaluator.unit_counts("holdout"):
            return
        paper = self.space.recast(preset("pnmix-paper"))
        scored: dict[str, Any] = {}  # config key -> held-out Score, shared by budgets that pick the same config

        def held_out(config: AnyConfig) -> Any:
            key = record.config_key(config)
            if key not in scored:
                self.progress(f"held-out units: scoring {config.label}")
                scored[key] = self.evaluator.evaluate(config, measure=False, which="holdout")
            return scored[key]

        for budget in sorted(self.spec.budgets):
            fits = self.space.cost(paper, self.head_dim) <= budget + 1e-9
            for _ in range(3):  # another worker may replace the front between the read and the write
                with self.db.session(readonly=True) as s:
                    try:
                        point = recommend(s, self.spec.model, budget, campaign_id=self.campaign_id,
                                          bits_of=self.space.budget_on)
                    except NoFeasiblePointError:
                        break
                    where = (point.budget, point.trial_number)
                    # Scored already under a lower budget: again only to add pnmix-paper, which fits this one.
                    config, done = point.config, point.holdout_accuracy is not None and (
                        not fits or bool((point.holdout or {}).get("paper")))
                if done:
                    break
                mine = held_out(config)
                against = None
                if fits:
                    theirs = held_out(paper)
                    diff, diff_se = paired(mine.units, theirs.units)["accuracy"]
                    against = {"accuracy": theirs.accuracy, "accuracy_se": theirs.accuracy_se, "diff": diff,
                               "diff_se": diff_se}
                try:
                    with self.db.session() as s:
                        set_holdout(s, self.campaign_id, *where,
                                    HoldoutIn(mine.accuracy, mine.accuracy_se, dict(mine.items), against))
                    break
                except NotFoundError:
                    continue

    def _guarded(self, what: str, step: Callable[[], Any]) -> Any:
        """Runs `step`, again after a transient database fault (bounded, with backoff).

        Every step resumes from the database, so running it again is safe. A permanent fault (disk
        full, read-only file), or a transient one past DB_RETRIES in a row, ends the run with one line.
        """
        from pnmix.storage import describe_database_error, is_transient
        from pnmix.storage.faults import database_error

        while True:
            try:
                return step()
            except Exception as exc:
                if database_error(exc) is None or isinstance(exc, EvalError):
                    raise
                where = self.db.display_url
                self.storage.remove_session()  # Optuna's session may hold the dead transaction
                if not is_transient(exc):
                    raise StorageError(describe_database_error(exc, where)) from None
                self._db_failures += 1
                if self._db_failures > DB_RETRIES:
                    raise StorageError(f"gave up after {DB_RETRIES} retries: "
                                       f"{describe_database_error(exc, where)}") from None
                delay = min(DB_RETRY_S * 2 ** (self._db_failures - 1), 30.0)
                message = (f"warning: database fault while {what}, retry {self._db_failures}/{DB_RETRIES} in "
                           f"{delay:g} s: {describe_database_error(exc, where)}")
                print(message, file=sys.stderr, flush=True)
                self.progress(message)
                time.sleep(delay)


FINISHED_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
MAX_FAILED_TRIALS = 3  # per budget (at least the trial count): beyond it the campaign is marked failed


def budget_bits(trial: optuna.trial.FrozenTrial) -> float:
    """The figure of a trial's config that the budget bounds (key bits, or KV bits under a KV budget);
    trials recorded before KV budgets hold it as their key bits."""
    attrs = trial.user_attrs
    return float(attrs["bits"] if "bits" in attrs else attrs["key_bits"])


def counts(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial takes one of the requested slots: a config scored, reused or screened out, or
    a trial still running (tuner/record.py). Over-budget proposals cost no inference, so they take
    none (the sampler still sees them as infeasible), and neither do the surplus trials of a racing
    worker nor the scores another budget's study shared."""
    return record.takes_slot(trial)


def scored_here(trial: optuna.trial.FrozenTrial) -> bool:
    """A COMPLETE trial whose config was evaluated in its own study (not a reused or shared score)."""
    return record.kind_of(trial) == record.Kind.SCORED and "accuracy" in trial.user_attrs


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count toward the requested number."""
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED_STATES) if counts(t)]


def over_budget_limit(n_trials: int) -> int:
    return 10 * n_trials + 20


def exhausted(study: optuna.Study, n_trials: int) -> bool:
    """The sampler keeps proposing configs over the budget (few fit it): the budget ends early."""
    over = sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED_STATES)
               if record.kind_of(t) == record.Kind.SKIPPED)
    return over >= over_budget_limit(n_trials)


def front_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible, fully evaluated Pareto-optimal trials (Optuna's best_trials honour constraints).

    A trial that reused the score of an identical earlier config is left out: the earlier one stands.
    Two workers may also have scored one config side by side: its first trial stands.
    """
    front, seen = [], set()
    for t in pareto_trials(study):
        key = json.dumps(t.user_attrs.get("config"), sort_keys=True)
        if record.stands_for_its_config(t) and key not in seen:
            seen.add(key)
            front.append(t)
    return front


def pareto_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """`study.best_trials` in trial order, read without copying every trial (the scores carry
    per-unit outcomes, so a deep copy per front write would dominate a long campaign): COMPLETE
    trials, only the feasible ones when the study has constraints, none dominated by another."""
    import numpy as np

    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if any(t.constraints for t in trials):
        trials = [t for t in trials if all(c <= 0.0 for c in t.constraints.values())]
    if not trials:
        return []
    sign = np.array([-1.0 if d == optuna.study.StudyDirection.MAXIMIZE else 1.0 for d in study.directions])
    loss = np.array([t.values for t in trials], dtype=float) * sign  # lower is better in every column
    no_worse = (loss[:, None, :] <= loss[None, :, :]).all(axis=2)  # [j, i]: j is nowhere worse than i
    better = (loss[:, None, :] < loss[None, :, :]).any(axis=2)
    dominated = (no_worse & better).any(axis=0)
    return sorted((t for t, d in zip(trials, dominated, strict=True) if not d), key=lambda t: t.number)


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
