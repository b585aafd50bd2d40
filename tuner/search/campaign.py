"""Optuna campaigns: the run loop of one multi-objective study per (model, bit budget), and its faults.

A campaign is a model, a method (search space), bit budgets, a trial count per budget, an
evaluation profile and objectives. Each budget is an Optuna study on the same database as our
tables (`pnmix:<campaign id>:<budget>`), so `pnmix dashboard` shows it and any number of
`pnmix worker` processes can share it through PostgreSQL.

The runner's rooms, each a module of its own:
  tuner/search/studies.py     one study per budget: sampler, bit pairs, counts
  tuner/search/warm_start.py  what a new study is seeded with; the layer groups of layered spaces
  tuner/search/trial.py       one trial from proposal to score: cap, twins, proxy screen, racing, evaluation
  tuner/search/sharing.py     twin reuse and the scores shared between budgets
  tuner/search/fronts.py      Pareto maths and the stored form of a front
  tuner/search/holdout_score.py  each budget's pick scored on the held-out units when it is done
  tuner/search/spec.py        what a campaign is (CampaignSpec) and the options it stores (CampaignOptions)
  tuner/search/record.py      the trial record: the only code that reads or writes a trial's attributes
This module keeps the loop over budgets (from the lowest up: a config within a budget is within
every higher one, so each later study starts with every score below it and spends its own trials
on what only its bits allow), writing fronts and progress, and fault handling. After every finished
trial the (campaign, budget) front replaces the stored one in one transaction: a killed run leaves
the last whole front. Running the same campaign again resumes it: finished trials count, none is
re-run.

Faults (docs/reliability.md): a trial that runs out of memory is recorded FAILED with the reason
(its record's `error`) and another trial takes its place, up to `MAX_FAILED_TRIALS`; a lost
database connection is retried with backoff (`PNMIX_DB_RETRIES` consecutive failures, first wait
`PNMIX_DB_RETRY_S`) and then ends the run with one line; a worker that finishes its own trials
waits for every running trial (other workers', or an orphan a dropped connection left behind),
or fails it once its heartbeat is stale so that Optuna's retry (a copy of the trial, WAITING) runs
here if the count still needs it; the campaign row carries a heartbeat
too, so `pnmix worker` can reclaim a campaign whose every worker died.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning

from pnmix.storage.errors import StorageError
from pnmix.storage.vocabulary import env_value
from pnmix.tuner.errors import EvalError, one_line
from pnmix.tuner.scoring.scorer import Scorer
from pnmix.tuner.search import record
from pnmix.tuner.search.allocation import AllocatorLoop
from pnmix.tuner.search.fronts import front_points
from pnmix.tuner.search.holdout_score import score_holdout
from pnmix.tuner.search.recipe_alloc import RecipeLoop
from pnmix.tuner.search.record import running_trials
from pnmix.tuner.search.sharing import Sharing
from pnmix.tuner.search.space import SearchSpace
from pnmix.tuner.search.spec import CampaignSpec
from pnmix.tuner.search.studies import Studies, exhausted, finished, over_budget_limit, study_name
from pnmix.tuner.search.trial import Objective
from pnmix.tuner.search.warm_start import WarmStarts

warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeats and metric names are stable enough

# A worker's trial counts as dead after GRACE_S without a heartbeat; it is then retried.
# Read when a command first imports this module: a malformed value is one line, before any work.
HEARTBEAT_S = int(env_value("PNMIX_HEARTBEAT_S", 10))
GRACE_S = int(env_value("PNMIX_GRACE_S", 30))
# Consecutive database failures tolerated (waits of DB_RETRY_S, doubling, at most 30 s) before giving up.
DB_RETRIES = int(env_value("PNMIX_DB_RETRIES", 5))
DB_RETRY_S = env_value("PNMIX_DB_RETRY_S", 1.0)
log = logging.getLogger("pnmix.tuner")

Progress = Callable[[str], None]
OnTrial = Callable[[float, optuna.Study], None] | None  # called after each finished trial of a budget


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
            log.warning("warning: trial heartbeat not recorded: %s", one_line(exc))

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
                log.warning("warning: campaign heartbeat not recorded: %s", one_line(exc))


class CampaignRunner:
    """Runs the studies of one campaign with one loaded evaluator."""

    # After each trial, collect garbage so the device memory a trial's caches held is free for the
    # next. A replay of recorded scores (benchmarks/bench_tuner.py) holds no device memory and skips it.
    collect_garbage = True

    def __init__(self, db: Any, url: str, campaign_id: int, spec: CampaignSpec, evaluator: Scorer,
                 progress: Progress | None = None, worker_id: str = "local") -> None:
        self.db, self.url, self.campaign_id, self.spec, self.evaluator = db, url, campaign_id, spec, evaluator
        self.progress = progress or (lambda message: None)
        self.worker_id = worker_id
        self.head_dim = evaluator.head_dim
        self.storage = optuna_storage(url)
        self._db_failures = 0  # consecutive; a finished trial resets it
        self.studies = Studies(self.storage, campaign_id, spec)
        self.sharing = Sharing(self.studies, self.head_dim)
        self.warm_starts = WarmStarts(db, campaign_id, spec, evaluator, self.progress)
        self.trials = Objective(spec, self.studies, self.sharing, evaluator, self.progress)
        self._layered = False  # whether the space has the model's layer groups (`_layer_groups`)

    @property
    def space(self) -> SearchSpace:
        """The campaign's space; pnmix-layers and pnmix-alloc: with the model's layer groups once a study is open."""
        return self.trials.space

    @property
    def allocator(self) -> AllocatorLoop | RecipeLoop | None:
        """pnmix-alloc's allocator (the engine method's recipe allocator), once the space has one
        group per layer."""
        return self.trials.allocator

    @property
    def sensitivity_seconds(self) -> float:
        """What this runner spent on the allocator's sensitivity tables."""
        return self.allocator.sensitivity_seconds if self.allocator else 0.0

    @property
    def kernels_compiled(self) -> int:
        """Kernel specialisations its trials compiled (CUDA)."""
        return self.trials.kernels_compiled

    @property
    def compile_seconds(self) -> float:
        return self.trials.compile_seconds

    def study(self, budget: float) -> optuna.Study:
        """The budget's study, created with its warm starts on first use; one Study object per
        budget for the runner's life (tuner/search/studies.py says why)."""
        study = self.studies.opened(budget)
        if study is not None:
            return study
        self._layer_groups()  # layered spaces: the sampler's parameters and the warm starts need the groups
        study, new = self.studies.open(budget)
        if new:
            self.warm_starts.seed(study, budget, self.space, self.allocator)
        return study

    def _layer_groups(self) -> None:
        if not self._layered:
            space, allocator = self.warm_starts.layered_space(self.space)
            self.trials.space = space
            self.trials.allocator = allocator
            self._layered = True

    def finished_count(self, budget: float) -> int:
        """Trials of `budget` that count toward its number (its study created on first use, as
        `study` does, with database faults handled as every other step's)."""
        return int(self._guarded(f"budget {budget:g}", lambda: len(finished(self.study(budget)))))

    def trials_done(self, fresh: bool = False) -> int:
        """Trials counted over every budget (tuner/search/studies.py, `Studies.trials_done`)."""
        return self.studies.trials_done(self.spec.n_trials, fresh)

    # -- running ---------------------------------------------------------------------------------

    def run(self, on_trial: Callable[[float, optuna.Study], None] | None = None) -> dict[float, optuna.Study]:
        """Runs every budget to its trial count; returns the studies by budget.

        First pass: each budget, from the lowest up, until its remaining trials are all finished or
        being run by other workers. Second pass: wait for those (failing the stale ones of dead
        workers, whose retries then run here), so that the last worker out leaves every budget
        complete and marks it done.
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

    def _run_budget(self, budget: float, on_trial: OnTrial, wait: bool) -> optuna.Study:
        study = self.study(budget)
        if self.sharing.pull(budget, study):  # what the other budgets scored that fits here and is not here yet
            self.write_front(study, budget, progress=False)
        floor = self.space.min_bits(self.head_dim)
        if budget < floor:
            if not wait:
                self.progress(f"budget {budget:g}: no config of the {self.spec.method} space fits (the smallest "
                              f"needs {floor:.3f} {self.space.budget_on} bits); its front stays empty")
        else:
            while not self._run_trials(study, budget, on_trial, wait):
                # Every running trial is another worker's or an orphan: wait for it, or for it to go stale.
                time.sleep(min(HEARTBEAT_S, 5))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ExperimentalWarning)
                    optuna.storages.fail_stale_trials(study)  # a dead worker's trial -> FAIL, plus a WAITING copy
        self.write_front(study, budget)
        return study

    def _run_trials(self, study: optuna.Study, budget: float, on_trial: OnTrial, wait: bool) -> bool:
        """Runs the budget's remaining trials; False when, in the second pass, it must wait for
        trials other workers run."""
        n = self.spec.n_trials
        while True:
            remaining = n - len(finished(study))
            if remaining <= 0 or exhausted(study, n):
                if remaining > 0 and not wait:
                    self.progress(f"budget {budget:g}: stopped after {over_budget_limit(n)} over-budget "
                                  f"proposals; few configs of the space fit {budget:g} bits")
                # The budget is complete, but a RUNNING trial would keep every worker's _finish from
                # marking the campaign done: a racing worker's surplus trial, or an orphan whose
                # creation committed while its connection dropped (no heartbeat, never told). The
                # second pass waits for it to end or go stale.
                return not wait or not running_trials(study)
            running = len(running_trials(study))  # this worker runs none between optimize calls: others'
            if remaining <= running:
                return not wait
            self._optimize(study, budget, remaining - running, on_trial)

    def _optimize(self, study: optuna.Study, budget: float, n: int, on_trial: OnTrial) -> None:
        def after_trial(st: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            if record.read(trial).original:
                for other in self.sharing.share(trial, st.study_name):
                    self.write_front(self.studies.peek(other), other, progress=False)
            self.write_front(st, budget)
            self._db_failures = 0
            if on_trial:
                on_trial(budget, st)

        def cap(st: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            # Counts every worker's finished trials, so many workers stop together.
            if len(finished(st)) >= self.spec.n_trials or exhausted(st, self.spec.n_trials):
                st.stop()

        try:
            study.optimize(functools.partial(self.trials.run, budget=budget), n_trials=n,
                           callbacks=[cap, after_trial], catch=(RuntimeError, MemoryError),
                           gc_after_trial=self.collect_garbage)
        except ValueError as exc:  # "Cannot tell a FAIL trial": ours was declared dead meanwhile
            if "Cannot tell a" not in str(exc):
                raise
            print(f"warning: budget {budget:g}: a trial of this worker went without a heartbeat for "
                  f"{GRACE_S} s (PNMIX_GRACE_S) and was retried by another worker; its result here "
                  "is dropped", file=sys.stderr, flush=True)
        self._check_failures(study, budget)

    def _check_failures(self, study: optuna.Study, budget: float) -> None:
        """Stops the campaign (status failed) once too many trials of a budget failed, e.g. all out of memory."""
        failed = [r for r in record.records(study, (optuna.trial.TrialState.FAIL,)) if r.error is not None]
        if len(failed) < max(MAX_FAILED_TRIALS, self.spec.n_trials):
            return
        message = f"budget {budget:g}: {len(failed)} trials failed, the last with {failed[-1].error}"
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
        """Each budget's pick and pnmix-paper on the held-out units (tuner/search/holdout_score.py)."""
        score_holdout(self.db, self.campaign_id, self.spec, self.space, self.evaluator, self.progress)

    def write_front(self, study: optuna.Study | None, budget: float, progress: bool = True) -> int:
        """Replaces the stored (campaign, budget) front with the study's feasible Pareto trials."""
        from pnmix.storage import replace_front

        points = front_points(study) if study is not None else []
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


MAX_FAILED_TRIALS = 3  # per budget (at least the trial count): beyond it the campaign is marked failed
