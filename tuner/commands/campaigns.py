"""Campaign commands: `pnmix tune`, `pnmix worker`, `pnmix sweep` and the main job `pnmix run`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pnmix.cli import (
    ModelOpt,
    budget_table,
    console,
)
from pnmix.inputs import Choice, Int, OutputFile
from pnmix.storage import vocabulary
from pnmix.storage.vocabulary import DEFAULT_METHOD, BudgetOn, Shard
from pnmix.tuner.commands.options import (
    SWEPT,
    BackendOpt,
    BudgetOnOpt,
    BudgetsOpt,
    HoldoutOpt,
    ItemsOpt,
    LayerGroupsOpt,
    LmEvalLimitOpt,
    LmEvalTaskOpt,
    MethodOpt,
    MultiFidelityOpt,
    ObjectivesOpt,
    PlotOpt,
    ProfileOpt,
    RacingOpt,
    SearchValuesOpt,
    SeedOpt,
    StorageOpt,
    TaskListOpt,
    TextPrefixOpt,
    TextsOpt,
    TextTokensOpt,
    TrialsOpt,
    objective_list,
    task_list,
    texts_task,
)
from pnmix.tuner.commands.render import (
    against_paper,
    budget_list,
    budget_words,
    holdout_line,
    pm,
    print_fronts,
    print_holdout,
    print_ties,
)
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring.holdout import DEFAULT_SHARE
from pnmix.tuner.search.space import ALLOCATED, DEFAULT_LAYER_GROUPS

if TYPE_CHECKING:
    from pnmix.tuner.search.spec import CampaignSpec


def _evaluator(spec: CampaignSpec, progress: Callable[[str], None]) -> Any:
    return _load_evaluator(spec.model, spec.profile, spec.seed, spec.tasks, spec.backend, progress, spec.holdout)


def _load_evaluator(model: str, profile_name: str, seed: int, tasks: tuple[str, ...] | None, backend: str,
                    progress: Callable[[str], None], holdout: float = 0.0) -> Any:
    import torch

    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.search.queue import check_backend

    check_backend(backend)
    device = "cuda" if torch.cuda.is_available() and backend != "torch" else "cpu"
    if backend in ("torch", "triton"):
        from pnmix import backend as pnmix_backend

        pnmix_backend.set_backend(backend)
    return Evaluator(model, profile(profile_name), seed, progress=progress, tasks=tasks, device=device,
                     holdout=holdout)


def run_campaign(db: Any, campaign_id: int, spec: CampaignSpec, worker_id: str = "local") -> dict[float, Any]:
    """Runs a campaign with a live progress display; returns its studies by budget."""
    import optuna
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from pnmix.tuner.search import record
    from pnmix.tuner.search.campaign import CampaignRunner
    from pnmix.tuner.search.fronts import front_trials
    from pnmix.tuner.search.queue import check_runnable
    from pnmix.tuner.search.studies import finished

    # The progress display says what happens; failed trials and database retries get one-line warnings
    # from the runner (Optuna's own would print a traceback for every failed trial).
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[best]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        status = bar.add_task("loading model and preparing tasks", total=None, best="")

        def say(message: str) -> None:
            bar.update(status, description=message)

        check_runnable(spec)  # the model and the backend, before anything loads
        runner = CampaignRunner(db, db.url, campaign_id, spec, _evaluator(spec, say), progress=say,
                                worker_id=worker_id)
        tasks = {b: bar.add_task(f"budget {b:g} bits", total=spec.n_trials, best="") for b in spec.budgets}
        for b in spec.budgets:
            bar.update(tasks[b], completed=runner.finished_count(b))

        def on_trial(budget: float, study: Any) -> None:
            front = front_trials(study)
            best = max((r.accuracy or 0.0 for r in map(record.read, front)), default=0.0)  # front trials are scored
            bar.update(tasks[budget], completed=len(finished(study)), best=f"best accuracy {best:.3f}")

        studies = runner.run(on_trial=on_trial)
        bar.update(status, description="done")
    if runner.sensitivity_seconds or runner.kernels_compiled:  # a campaign's fixed costs besides preparation
        console.print(f"[dim]sensitivity tables {runner.sensitivity_seconds:.1f} s; kernel specialisations "
                      f"compiled by its trials: {runner.kernels_compiled} in {runner.compile_seconds:.1f} s[/dim]")
    return studies


def tune(
    model: ModelOpt = "smollm2-135m",
    budgets: BudgetsOpt = None,
    # 45: in the replay against the ground truth (benchmarks/bench_tuner.py) 45 a budget reached
    # 0.97-0.98 of the true front at each budget within a tenth of a full sweep's seconds; 30, 0.88-0.95.
    trials: TrialsOpt = 30,
    method: MethodOpt = DEFAULT_METHOD,
    budget_on: BudgetOnOpt = "key",
    search_values: SearchValuesOpt = False,
    layer_groups: LayerGroupsOpt = DEFAULT_LAYER_GROUPS,
    profile_name: ProfileOpt = "quick",
    objectives: ObjectivesOpt = "accuracy,key_bits",
    backend: BackendOpt = "auto",
    seed: SeedOpt = 0,
    multi_fidelity: MultiFidelityOpt = False,
    racing: RacingOpt = False,
    tasks: TaskListOpt = None,
    items: ItemsOpt = None,
    texts: TextsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
    holdout: HoldoutOpt = DEFAULT_SHARE,
    lm_eval_task: LmEvalTaskOpt = None,
    lm_eval_limit: LmEvalLimitOpt = None,
    storage: StorageOpt = None,
    plot: PlotOpt = None,
    enqueue: Annotated[bool, typer.Option(help="only queue it for `pnmix worker`")] = False,
) -> None:
    """Run (or resume) an Optuna campaign: one study per budget, fronts stored in SQL."""
    from pnmix import models
    from pnmix.tuner.commands.plot import pareto_plot
    from pnmix.tuner.search.campaign import optuna_storage
    from pnmix.tuner.search.session import find_or_create_campaign, open_db
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    chosen = with_lm_eval(task_list(tasks, items, texts_task(texts, text_prefix, text_tokens)), lm_eval_task,
                          lm_eval_limit)
    spec = CampaignSpec(model=model, budgets=tuple(budgets or default_budgets(model)), n_trials=trials,
                        method=method, profile=profile_name, objectives=objective_list(objectives), seed=seed,
                        multi_fidelity=multi_fidelity, racing=racing, backend=backend,
                        space=SearchSpace(method=method, budget_on=budget_on, search_values=search_values,
                                          layer_groups=layer_groups),
                        tasks=chosen, holdout=holdout)
    check_campaign(spec)
    db = open_db(storage, create=True, create_folder=not enqueue)  # a queued campaign's workers write elsewhere
    campaign_id = find_or_create_campaign(db, spec, status="queued" if enqueue else "running")
    optuna_storage(db.url)  # creates Optuna's tables now, before any worker races to
    if enqueue:
        console.print(f"campaign {campaign_id} queued for `pnmix worker`")
        return
    plan = models.layer_plan(model)
    console.print(f"campaign {campaign_id}: {model}, {method}, budgets {budget_list(spec.budgets, budget_on, plan)}, "
                  f"{trials} trials each, profile {profile_name}, storage {db.display_url}")
    studies = run_campaign(db, campaign_id, spec)
    print_fronts(db, model, campaign_id)
    print_holdout(db, model, campaign_id, spec.budgets, budget_on)
    path = pareto_plot(studies, Path(plot or f"out/campaign-{campaign_id}.png"), f"{model}: campaign {campaign_id}",
                       budget_on=budget_on, plan=plan)
    console.print(f"Pareto plot: {path}")



def default_budgets(model: str) -> list[float]:
    """The budgets a campaign takes by default: 3.0, 2.5, 2.25, 2.0 and 1.5 key bits, on a hybrid model
    the weighted budgets that leave its full-attention layers those bits."""
    from pnmix import models

    plan = models.layer_plan(model)
    return [plan.budget_for(b) for b in (3.0, 2.5, 2.25, 2.0, 1.5)]


def with_lm_eval(chosen: tuple[str, ...] | None, task: str | None, limit: int | None) -> tuple[str, ...] | None:
    """The task list with --lm-eval-task's entry, which carries the task to the campaign's workers
    (tuner/scoring/harness.py)."""
    if not task and limit is None:
        return chosen
    from pnmix.tuner.scoring import harness, parts

    if not task:
        raise EvalError("--lm-eval-limit needs --lm-eval-task")
    harness.check_extra()
    return (*(chosen or parts.BUILT_IN), harness.spec_entry(task, limit))


def check_campaign(spec: CampaignSpec) -> None:
    """What a worker could not run, in one line before the database: the model, budgets no config
    reaches, a texts file without a usable document."""
    from pnmix import models
    from pnmix.tuner.scoring.parts import Parts
    from pnmix.tuner.scoring.texts import check_usable
    from pnmix.tuner.search.queue import check_budgets_reachable, check_layer_kinds

    models.resolve(spec.model, purpose="accuracy")
    check_layer_kinds(spec.space, spec.model)
    space = spec.space.with_plan(models.layer_plan(spec.model))  # a hybrid model's budgets are weighted
    check_budgets_reachable(space, spec.budgets, models.model_shape(spec.model).head_dim, spec.model)
    if (texts := Parts.parse(spec.tasks).texts) is not None:
        check_usable(spec.model, texts)

def sweep(
    out: Annotated[str, typer.Option("--out", help="sweep file (JSON Lines); resumed when it exists",
                                     parser=OutputFile(create_folders=True))],
    model: ModelOpt = "smollm2-135m",
    method: Annotated[str, typer.Option(help=f"{', '.join(SWEPT)}: the search space to cover",
                                        parser=Choice(SWEPT))] = "pnmix",
    profile_name: ProfileOpt = "full",
    seed: SeedOpt = 0,
    shard: Annotated[str, typer.Option(help="I/N: score shard I of N (N processes may fill one file)",
                                       parser=Shard())] = "0/1",
    limit: Annotated[int | None, typer.Option(help="score at most this many configs, then stop",
                                              parser=Int(vocabulary.LIMIT))] = None,
    measure: Annotated[bool, typer.Option(help="also measure bytes held and decode tokens/s")] = False,
    backend: BackendOpt = "auto",
    texts: TextsOpt = None,
    items: ItemsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
) -> None:
    """Score every config of a method's search space (the ground truth a search is measured against)."""

    from pnmix.tuner.scoring.parts import Parts
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.sweep import parse_shard, run_sweep, start_file, sweep_header

    profile(profile_name)
    part = parse_shard(shard)
    space = SearchSpace(method=method)
    from pnmix import models

    models.resolve(model, purpose="accuracy")
    chosen = task_list(None, items, texts_task(texts, text_prefix, text_tokens))
    names = Parts.parse(chosen).names
    start_file(Path(out), sweep_header(model, space, profile_name, seed, names))  # before the model loads

    def prepare(message: str) -> None:  # preparation takes minutes on the full profile: say what it does
        console.print(f"[dim]{message}[/dim]")

    prepare(f"loading {model} and preparing the {profile_name} profile's tasks")
    evaluator = _load_evaluator(model, profile_name, seed, chosen, backend, progress=prepare)

    def say(k: int, n: int, cfg: Any, row: dict[str, Any]) -> None:
        console.print(f"[{k}/{n}] {cfg.label}: {row['key_bits']:.3f} bits, accuracy "
                      f"{pm(row['accuracy'], row['accuracy_se'])} ({row['seconds']:.2f} s)")

    scored = run_sweep(evaluator, space, Path(out), part, limit, measure, on_score=say)
    console.print(f"{out}: {scored} configs scored by shard {part[0]}/{part[1]}")


def worker(
    storage: StorageOpt = None,
    campaign: Annotated[int | None, typer.Option(help="attach to this campaign (default: claim queued ones)",
                                                 parser=Int(vocabulary.CAMPAIGN_ID))] = None,
    wait: Annotated[bool, typer.Option(help="keep polling for queued campaigns")] = False,
) -> None:
    """Work on campaigns from the shared database: attach to one, or claim queued ones until none is left.

    A claiming worker takes only campaigns of the backends this machine runs (tuner/search/queue.py). One it
    still cannot run (a model that is not here, a campaign this version cannot read, every trial
    failing) is marked failed with the reason, in one `warning:` line, and the worker takes the next;
    attached to one (--campaign), it ends with that line instead. A database fault stops the worker
    (the campaign stays running and is reclaimed once its heartbeat is stale); any other exception is
    a bug: the campaign is marked failed with it, and the traceback shows.
    """
    import os
    import socket
    import sys
    import time

    from pnmix.errors import PNMixError
    from pnmix.storage import StorageError
    from pnmix.tuner.errors import CannotRunHere
    from pnmix.tuner.search.queue import runnable_backends
    from pnmix.tuner.search.session import open_db
    from pnmix.tuner.search.trial import failure_reason

    db = open_db(storage, create=True, create_folder=False)
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    backends = runnable_backends()
    while True:
        campaign_id, spec, problem = _claim(db, campaign, worker_id, backends)
        if campaign_id is None:
            if not wait:
                console.print("no queued campaign")
                return
            time.sleep(5)
            continue
        try:
            if spec is None:
                raise EvalError(problem or f"campaign {campaign_id} cannot be read")
            console.print(f"worker {worker_id}: campaign {campaign_id} ({spec.model}, budgets {list(spec.budgets)})")
            run_campaign(db, campaign_id, spec, worker_id)
        except (StorageError, CannotRunHere):
            raise  # the database, or this machine: another worker (or a later run) can still finish it
        except PNMixError as exc:
            _fail_campaign(db, campaign_id, str(exc))
            if campaign is not None:
                raise
            print(f"warning: campaign {campaign_id} failed, next: {exc}", file=sys.stderr, flush=True)
        except Exception as exc:
            _fail_campaign(db, campaign_id, failure_reason(exc))
            raise
        if campaign is not None:
            return


def _claim(db: Any, campaign: int | None, worker_id: str,
           backends: Any) -> tuple[int | None, CampaignSpec | None, str | None]:
    """(campaign id, its spec, why it cannot be read): campaign `campaign`, else the next queued one (or a
    running one whose workers stopped beating: they died); (None, None, None) when there is none."""
    from pnmix.errors import PNMixError
    from pnmix.storage import claim_next_queued_campaign, get_campaign
    from pnmix.tuner.search.campaign import GRACE_S
    from pnmix.tuner.search.spec import CampaignSpec

    with db.session() as s:
        row: Any
        if campaign is not None:
            row = get_campaign(s, campaign)
        else:
            row = claim_next_queued_campaign(s, worker_id, stale_after_s=GRACE_S, backends=backends)
        if row is None:
            return None, None, None
        try:
            return int(row.id), CampaignSpec.from_campaign(row), None
        except PNMixError as exc:
            return int(row.id), None, str(exc)


def _fail_campaign(db: Any, campaign_id: int, reason: str) -> None:
    """Marks a campaign failed with `reason` (nothing when it is finished already, e.g. by its runner)."""
    import sys

    from pnmix.storage import InvalidValueError, StorageError, update_campaign_progress

    try:
        with db.session() as s:
            update_campaign_progress(s, campaign_id, status="failed", message=reason[:2000])
    except InvalidValueError:
        pass
    except StorageError as exc:  # the database is away: the campaign is reclaimed once its heartbeat is stale
        print(f"warning: campaign {campaign_id} not marked failed: {exc}", file=sys.stderr, flush=True)


def run_main_job(
    model: ModelOpt = "smollm2-135m",
    trials: TrialsOpt = 6,
    storage: StorageOpt = None,
) -> None:
    """The main job: a bit-budget table, a small allocator campaign, its fronts, the recommendation and a plot.

    The main job: bit-budget table, then a small real allocator campaign (quick profile, budgets 3.0
    and 2.25 key bits; a quarter of the items held out), its fronts, the recommendation at <= 2.25 bits
    beside pnmix-paper with its held-out score, and a plot. On a hybrid model the budgets are the
    weighted figures that leave its full-attention layers 3.0 and 2.25 bits."""

    from pnmix import models
    from pnmix.storage import recommend_with_ties
    from pnmix.tuner.commands.plot import pareto_plot
    from pnmix.tuner.search.session import find_or_create_campaign, open_db
    from pnmix.tuner.search.space import SearchSpace
    from pnmix.tuner.search.spec import CampaignSpec

    console.print(budget_table(model))
    db = open_db(storage, upgrade=True)
    # 2.25 key bits lies just under pnmix-paper's 2.263 (d = 64), which the 3.0 budget scores among its
    # warm starts: the recommendation at <= 2.25 bits, a layer-wise config, is compared with it on the
    # same items, in the search and on the held-out items.
    plan = models.layer_plan(model)
    loose, tight = plan.budget_for(3.0), plan.budget_for(2.25)
    spec = CampaignSpec(model=model, budgets=(loose, tight), n_trials=trials, profile="quick", method=ALLOCATED,
                        space=SearchSpace(method=ALLOCATED))
    campaign_id = find_or_create_campaign(db, spec)
    console.print(f"campaign {campaign_id} on {db.display_url}: budgets {budget_list(spec.budgets, plan=plan)}")
    studies = run_campaign(db, campaign_id, spec)
    print_fronts(db, model, campaign_id)
    with db.session(readonly=True) as s:
        rec = recommend_with_ties(s, model, tight, campaign_id=campaign_id)
        p = rec.point
        path = pareto_plot(studies, Path(f"out/campaign-{campaign_id}.png"), f"{model}: campaign {campaign_id}",
                           recommended=(p.budget, p.trial_number), plan=plan)
        console.print(f"recommendation at <= {budget_words(tight, BudgetOn.KEY, plan)}: {p.config.to_json()} "
                      f"(key bits {p.key_bits:.3f}, accuracy {pm(p.accuracy, p.accuracy_se)})")
        console.print(holdout_line(p))
        print_ties(rec)
        others = list(studies.values())
        console.print("recommendation " + against_paper(studies[p.budget], p.trial_number, spec.space, others))
        best = rec.best
        if best is not p:  # tied with the recommendation, but the comparison with the paper says more
            console.print(f"most accurate point ({best.config.label}, {best.key_bits:.3f} key bits) "
                          + against_paper(studies[best.budget], best.trial_number, spec.space, others))
    console.print(f"Pareto plot: {path}; the API (`pnmix serve`) and `pnmix dashboard` read {db.display_url}")
