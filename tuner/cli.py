"""Tuner commands: eval, sweep, tune, worker, fronts, recommend, export, dashboard and the main job `run`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from pnmix import inputs
from pnmix.cli import (
    BHighOpt,
    BLowOpt,
    CriterionOpt,
    GroupOpt,
    ModelOpt,
    PresetOpt,
    RatioOpt,
    ResidualOpt,
    SinkOpt,
    VBitsOpt,
    VGroupOpt,
    budget_table,
    config_from_options,
    console,
)
from pnmix.config import PRESETS
from pnmix.inputs import Choice, InputFile, Int, ModelName, Names, Number, OutputFile
from pnmix.names import BACKENDS
from pnmix.storage import vocabulary
from pnmix.storage.vocabulary import BUDGET_ON, DEFAULT_METHOD, METHODS, DatabaseUrl, Host, Shard
from pnmix.tuner.holdout import DEFAULT_SHARE, HOLDOUT
from pnmix.tuner.profiles import PROFILES, EvalError
from pnmix.tuner.queue import ARGUMENT_TASKS, CAMPAIGN_TASKS, FILE_TASKS
from pnmix.tuner.space import ALLOCATED, DEFAULT_LAYER_GROUPS, LAYERED

SWEPT = tuple(m for m in METHODS if m not in (LAYERED, ALLOCATED))  # a sweep covers a uniform space

if TYPE_CHECKING:
    from pnmix.tuner.campaign import CampaignSpec


# Every option parses through a checker of pnmix.inputs or storage.vocabulary (refused before any work;
# api/cli.py prints it).
ProfileOpt = Annotated[str, typer.Option("--profile", help=", ".join(PROFILES), parser=Choice(tuple(PROFILES)))]
BackendOpt = Annotated[str, typer.Option(help=", ".join(BACKENDS), parser=Choice(BACKENDS))]
MethodOpt = Annotated[str, typer.Option(help=f"{', '.join(METHODS)}: pnmix-alloc gives each layer its bits by the "
                                        "allocator (per-layer sensitivity, knapsack, local moves scored for real); "
                                        "the others search uniform configs of each method's knobs, or layer groups",
                                        parser=Choice(METHODS))]
SeedOpt = Annotated[int, typer.Option(help="task (and sampler) seed", parser=Int(inputs.SEED))]
TrialsOpt = Annotated[int, typer.Option(help="trials per budget", parser=Int(vocabulary.TRIALS))]
BitsOpt = Annotated[float, typer.Option(help="bit budget (key bits, or KV bits with --bits-of kv)",
                                        parser=Number(inputs.BUDGET))]
BitsOfOpt = Annotated[str, typer.Option(help="what --bits bounds: key bits per key element, or kv: key and value "
                                        "bits per cached element", parser=Choice(BUDGET_ON))]
DbModelOpt = Annotated[str, typer.Option(help="model name", parser=ModelName())]
CampaignOpt = Annotated[int | None, typer.Option(help="campaign id", parser=Int(vocabulary.CAMPAIGN_ID))]
LmEvalTaskOpt = Annotated[str | None, typer.Option("--lm-eval-task", help="an lm-evaluation-harness generation task "
                                                   "(name or task YAML file) as an accuracy part; needs "
                                                   "the lm-eval extra", parser=inputs.Text(1, inputs.MAX_PATH))]
LmEvalLimitOpt = Annotated[int | None, typer.Option("--lm-eval-limit", help="the task's first N documents "
                                                    "(before filtering against fp16)", parser=Int(inputs.COUNT))]
ItemsOpt = Annotated[str | None, typer.Option(help="JSONL items as a task: {question, answer} with a numeric answer, "
                                              "or {prompt, answer} with a string answer (\"match\": \"regex\" for a "
                                              "regular expression)", parser=InputFile())]
TextsOpt = Annotated[str | None, typer.Option(help="your own texts as a task (plain text, one document per "
                                              "blank-line-separated block, or JSONL with a \"text\" field): each "
                                              "document's continuation is teacher-forced after its prefix",
                                              parser=InputFile())]
TextPrefixOpt = Annotated[int | None, typer.Option(help="texts: tokens of each document's prefix (default: the "
                                                   "model's context / 8, at most 1024; with --text-tokens)",
                                                   parser=Int(inputs.NEW_TOKENS))]
TextTokensOpt = Annotated[int | None, typer.Option(help="texts: tokens predicted after the prefix (default: the "
                                                   "model's context / 16, at most 512; with --text-prefix)",
                                                   parser=Int(inputs.NEW_TOKENS))]
TaskListOpt = Annotated[str | None, typer.Option("--tasks", help="comma-separated: passkey, kv_lookup, fidelity, "
                                                 "items, texts (the last two with their files)",
                                                 parser=Names((*CAMPAIGN_TASKS, *FILE_TASKS, "lm_eval"),
                                                              with_arguments=ARGUMENT_TASKS))]


def texts_task(texts: str | None, prefix: int | None, tokens: int | None) -> Any:
    """The texts task of the options (tuner/texts.py), or None; one line for lengths without a file."""
    from pnmix.tuner.texts import TextsTask

    if texts is None:
        if prefix is not None or tokens is not None:
            raise EvalError("--text-prefix and --text-tokens need --texts")
        return None
    return TextsTask(texts, prefix, tokens)


def task_list(tasks: str | None, items: str | None, texts: Any) -> tuple[str, ...] | None:
    """The task list a campaign stores: the named tasks (default: the built-in ones) and the user's
    files as entries items:PATH and texts:PATH[@PREFIX+TOKENS], which workers read (tuner/queue.py)."""
    from pnmix.tuner.evaluate import DEFAULT_TASKS

    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None
    files = (*((f"items:{Path(items).resolve()}",) if items else ()), *((texts.entry(),) if texts else ()))
    if not files:
        return chosen
    return (*(t for t in chosen or DEFAULT_TASKS if t not in FILE_TASKS), *files)


def eval_config(
    model: ModelOpt = "smollm2-135m",
    preset_name: PresetOpt = None,
    b_high: BHighOpt = None,
    b_low: BLowOpt = None,
    group_size: GroupOpt = None,
    salient_ratio: RatioOpt = None,
    sinks: SinkOpt = None,
    residual: ResidualOpt = None,
    value_bits_: VBitsOpt = None,
    value_group: VGroupOpt = None,
    criterion: CriterionOpt = None,
    profile_name: ProfileOpt = "quick",
    seed: SeedOpt = 0,
    items: ItemsOpt = None,
    texts: TextsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
    tasks: TaskListOpt = None,
    compare: Annotated[str | None, typer.Option(help="comma-separated presets or peers (hf-quanto-2, hf-quanto-4, "
                                                "hf-hqq-2, hf-hqq-4) to score side by side",
                                                parser=Names(_compare_names))] = None,
    lm_eval_task: LmEvalTaskOpt = None,
    lm_eval_limit: LmEvalLimitOpt = None,
    config_file: Annotated[str | None, typer.Option(
        "--config", help="PNMixConfig JSON file, e.g. from `pnmix export`, or a layer-wise config",
        parser=InputFile())] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Score PN-Mix configs by real inference: accuracy parts, key bits, bytes held, decode tokens/s."""
    import json

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pnmix.config import preset
    from pnmix.tuner.profiles import profile

    prof = profile(profile_name)
    from pnmix import models

    models.resolve(model, purpose="accuracy")  # an unknown model: one line before torch loads
    text_task = texts_task(texts, text_prefix, text_tokens)
    if config_file:
        if compare:
            raise EvalError("give --config or --compare, not both")
        configs = {config_file: load_config_file(config_file)}
    elif compare:
        from pnmix.tuner.peers import PEERS, peer

        # Peers (transformers' quantized caches, tuner/peers.py) are scored beside the presets on the same items.
        configs = {name.strip(): peer(name.strip()) if name.strip() in PEERS else preset(name.strip())
                   for name in compare.split(",") if name.strip()}
    else:
        cfg = config_from_options(preset_name or "pnmix-paper", b_high, b_low, group_size, salient_ratio, sinks,
                                  residual, value_bits_, value_group, criterion)
        configs = {preset_name or "config": cfg}
    from pnmix.tuner.evaluate import Evaluator  # torch: only once the configs are known to be good

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=as_json) as bar:
        task = bar.add_task("loading model", total=None)

        def say(message: str) -> None:
            bar.update(task, description=message)

        chosen = tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None
        evaluator = Evaluator(model, prof, seed, items, progress=say, tasks=chosen, lm_eval_task=lm_eval_task,
                              lm_eval_limit=lm_eval_limit, texts=text_task)
        evaluator.prepare()
        from pnmix.tuner import peers
        from pnmix.tuner.stats import paired

        scores = {}
        for name, cfg in configs.items():
            say(f"{name}: scoring")
            if isinstance(cfg, peers.Peer):
                scores[name] = peers.score(evaluator, cfg)
                scores[name].parts["proxy_kl"] = float("nan")  # the proxy models PN-Mix's quantizer only
                continue
            scores[name] = evaluator.evaluate(cfg)
            scores[name].parts["proxy_kl"] = evaluator.proxy(cfg)
    names = list(scores)
    diffs = {name: paired(scores[name].units, scores[names[0]].units) for name in names[1:]}
    if as_json:
        out = {name: s.to_dict() for name, s in scores.items()}
        for name, d in diffs.items():
            out[name]["paired_vs_" + names[0]] = {k: {"diff": v, "se": se} for k, (v, se) in d.items()}
        print(json.dumps(out))
        return
    table = Table(title=f"{model}, profile {prof.name}, seed {seed} ({evaluator.backend} on {evaluator.device}); "
                        "mean +- standard error")
    part_names = [p for p in ("passkey", "kv_lookup", "items", "lm_eval", "fidelity", "texts")
                  if any(p in s.parts for s in scores.values())]
    for col in ("config", "key bits", "accuracy", *part_names, "fid. top-1", "fid. KL", "proxy KL", "KV KiB",
                "decode tok/s", "s"):
        table.add_column(col, justify="right")
    for name, s in scores.items():
        table.add_row(name, _num(s.key_bits, ".3f"), _pm(s.accuracy, s.accuracy_se),
                      *[_pm(s.parts[p], s.parts_se.get(p)) if p in s.parts else "-" for p in part_names],
                      f"{s.fidelity_agreement:.3f}", f"{s.fidelity_kl:.4f}", _num(s.parts["proxy_kl"], ".4f"),
                      f"{s.kv_bytes / 1024:.0f}", f"{s.decode_tokens_per_s:.1f}", f"{s.seconds:.1f}")
    console.print(table)
    console.print("items: " + ", ".join(f"{k} {v}" for k, v in scores[names[0]].items.items())
                  + (f" (lm_eval: {evaluator.harness.task})" if evaluator.harness is not None else ""))
    for name, cfg in configs.items():
        if isinstance(cfg, peers.Peer):
            console.print(f"{name}: {cfg.label}; scored item by item through generate, tokens/s from its dynamic "
                          "decode" + ("; key bits n/a (its groups are not per token)"
                                      if math.isnan(scores[name].key_bits) else ""))
    if diffs:
        paired_table = Table(title=f"paired difference to {names[0]} (same items): diff +- SE; * where |diff| > 2 SE")
        for col in ("config", "accuracy", *part_names):
            paired_table.add_column(col, justify="right")
        for name, d in diffs.items():
            paired_table.add_row(name, *[_diff(*d[p]) if p in d else "-" for p in ("accuracy", *part_names)])
        console.print(paired_table)


def validate(
    config_file: Annotated[str, typer.Option("--config", help="the config to check: a PNMixConfig or layer-wise "
                                             "JSON file, e.g. from `pnmix export`", parser=InputFile())],
    against: Annotated[str, typer.Option(help="comma-separated presets to compare with, paired on the same units",
                                         parser=Names(tuple(PRESETS)))] = "fp16,pnmix-paper",
    texts: TextsOpt = None,
    items: ItemsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
    tasks: TaskListOpt = None,
    model: ModelOpt = "smollm2-135m",
    profile_name: ProfileOpt = "quick",
    seed: SeedOpt = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Check a config on your data: it and the baselines scored on the same texts and items, with
    standard errors and paired differences. With --texts or --items only those parts run (else the
    built-in tasks of the profile). Exits 0 whatever the verdict."""
    import json

    from pnmix.config import preset

    text_task = texts_task(texts, text_prefix, text_tokens)
    from pnmix import models

    models.resolve(model, purpose="accuracy")
    config = load_config_file(config_file)
    baselines = {name: preset(name) for name in against.split(",")}
    named = tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None
    if named is None and (items or text_task):
        named = (*(("items",) if items else ()), *(("texts",) if text_task else ()))
    from pnmix.tuner.evaluate import Evaluator
    from pnmix.tuner.profiles import profile
    from pnmix.tuner.stats import paired

    def say(message: str) -> None:
        if not as_json:
            console.print(f"[dim]{message}[/dim]")

    evaluator = Evaluator(model, profile(profile_name), seed, items, progress=say, tasks=named, texts=text_task)
    config.check_head_dim(evaluator.head_dim)
    scores = {"config": evaluator.evaluate(config, measure=False)}
    for name, cfg in baselines.items():
        scores[name] = evaluator.evaluate(cfg, measure=False)
    diffs = {name: paired(scores["config"].units, scores[name].units) for name in baselines}
    if as_json:
        out = {"model": model, "config": config.to_dict(), "tasks": list(evaluator.tasks),
               "units": scores["config"].items,
               "scores": {name: {"key_bits": sc.key_bits, "accuracy": sc.accuracy, "accuracy_se": sc.accuracy_se,
                                 "parts": sc.parts, "parts_se": sc.parts_se,
                                 "texts_kl": None if math.isnan(sc.texts_kl) else sc.texts_kl}
                          for name, sc in scores.items()},
               "config_minus": {name: {part: {"diff": v, "se": se, "beyond_2se": se is not None and abs(v) > 2 * se}
                                       for part, (v, se) in d.items()} for name, d in diffs.items()}}
        print(json.dumps(out))
        return
    parts = list(scores["config"].parts)
    units = ", ".join(f"{n} {k}" for k, n in scores["config"].items.items())
    table = Table(title=f"{config_file} on {model} ({units}; {evaluator.backend}): mean +- standard error; last "
                        "column: config minus that row, paired on the same units, * where beyond 2 SE")
    for col in ("", "key bits", "accuracy", *parts, *(("texts KL",) if "texts" in parts else ()), "config minus it"):
        table.add_column(col, justify="right")
    for name, sc in scores.items():
        table.add_row(name, _num(sc.key_bits, ".3f"), _pm(sc.accuracy, sc.accuracy_se),
                      *[_pm(sc.parts[p], sc.parts_se.get(p)) for p in parts],
                      *((f"{sc.texts_kl:.4f}",) if "texts" in parts else ()),
                      _diff(*diffs[name]["accuracy"]) if name in diffs else "")
    console.print(table)
    for name, d in diffs.items():
        diff, se = d["accuracy"]
        verdict = ("above it" if diff > 0 else "below it") if se is not None and abs(diff) > 2 * se else (
            "not distinguishable from it (within 2 SE)")
        console.print(f"against {name}: {verdict}")


def _num(value: float, fmt: str) -> str:
    """A number, or n/a where it does not apply (NaN: a peer's key bits or proxy KL)."""
    return "n/a" if value != value else format(value, fmt)


def _pm(value: float, se: float | None) -> str:
    return f"{value:.3f} +- {se:.3f}" if se is not None else f"{value:.3f}"


def _diff(value: float, se: float | None) -> str:
    if se is None:
        return f"{value:+.3f}"
    mark = "*" if abs(value) > 2 * se else ""
    return f"{value:+.3f} +- {se:.3f}{mark}"


def load_config_file(path: str) -> Any:
    """A PNMixConfig (what `pnmix export` writes) or a layer-wise config (docs/layerwise.md) from a
    JSON file; bad files end in one line."""
    from pathlib import Path

    from pnmix.layerwise import load_config

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return load_config(text)
    except TypeError as exc:  # e.g. a field given twice through an odd mapping
        raise EvalError(f"config file {path}: {exc}") from None


_STORAGE_HELP = "database URL (default: PNMIX_DATABASE_URL or the SQLite file PNMIX_DB_PATH)"
StorageOpt = Annotated[str | None, typer.Option("--storage", help=_STORAGE_HELP, parser=DatabaseUrl())]
# Commands that only read never create a database: a SQLite file must already be there.
ReadStorageOpt = Annotated[str | None, typer.Option("--storage", help=_STORAGE_HELP,
                                                    parser=DatabaseUrl(must_exist=True))]


def _evaluator(spec: CampaignSpec, progress: Callable[[str], None]) -> Any:
    return _load_evaluator(spec.model, spec.profile, spec.seed, spec.tasks, spec.backend, progress, spec.holdout)


def _load_evaluator(model: str, profile_name: str, seed: int, tasks: tuple[str, ...] | None, backend: str,
                    progress: Callable[[str], None], holdout: float = 0.0) -> Any:
    import torch

    from pnmix.tuner.evaluate import Evaluator
    from pnmix.tuner.profiles import profile
    from pnmix.tuner.queue import check_backend

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

    from pnmix.tuner.campaign import CampaignRunner, finished, front_trials
    from pnmix.tuner.queue import check_runnable

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
            best = max((t.user_attrs["accuracy"] for t in front), default=0.0)  # front trials are scored
            bar.update(tasks[budget], completed=len(finished(study)), best=f"best accuracy {best:.3f}")

        studies = runner.run(on_trial=on_trial)
        bar.update(status, description="done")
    if runner.sensitivity_seconds or runner.kernels_compiled:  # a campaign's fixed costs besides preparation
        console.print(f"[dim]sensitivity tables {runner.sensitivity_seconds:.1f} s; kernel specialisations "
                      f"compiled by its trials: {runner.kernels_compiled} in {runner.compile_seconds:.1f} s[/dim]")
    return studies


def print_fronts(db: Any, model: str, campaign_id: int | None = None) -> None:
    from pnmix.storage import list_front_points

    with db.session(readonly=True) as s:
        points = list_front_points(s, model, campaign_id=campaign_id, limit=500).items
        table = Table(title=f"Pareto fronts of {model}" + (f", campaign {campaign_id}" if campaign_id else ""))
        for col in ("campaign", "budget", "trial", "config", "key bits", "KV bits", "accuracy", "parts",
                    "KV KiB", "tok/s", "backend"):
            table.add_column(col, justify="right")
        for p in sorted(points, key=lambda p: (p.campaign_id, p.budget, p.bits(p.budget_on))):
            parts = " ".join(f"{k}={v:.2f}" for k, v in (p.accuracy_parts or {}).items())
            budget = f"{p.budget:g}" + (" (kv)" if p.budget_on == "kv" else "")
            table.add_row(str(p.campaign_id), budget, str(p.trial_number), p.config.label, f"{p.key_bits:.3f}",
                          f"{p.kv_bits:.3f}", f"{p.accuracy:.3f}", parts, f"{p.kv_bytes / 1024:.0f}",
                          f"{p.throughput:.1f}", p.backend)
    console.print(table if points else f"no front points stored for {model}")


def print_holdout(db: Any, model: str, campaign_id: int, budgets: Sequence[float], bits_of: str) -> None:
    """Each budget's recommendation in the campaign and its held-out score (`holdout_line`)."""
    from pnmix.storage import recommend
    from pnmix.storage.errors import NoFeasiblePointError

    with db.session(readonly=True) as s:
        for budget in sorted(budgets):
            try:
                p = recommend(s, model, budget, campaign_id=campaign_id, bits_of=bits_of)
            except NoFeasiblePointError:
                continue
            console.print(f"at <= {budget:g} {bits_of} bits: {p.config.label} ({p.bits(bits_of):.3f} bits, in-search "
                          f"accuracy {_pm(p.accuracy, p.accuracy_se)}); {holdout_line(p)}")


def tune(
    model: ModelOpt = "smollm2-135m",
    budgets: Annotated[list[float] | None, typer.Option("--budgets", help="bit budgets (repeat or space), on "
                                                        "the figure --budget-on names", parser=Number(inputs.BUDGET))
                       ] = None,
    # 45: in the replay against the ground truth (benchmarks/bench_tuner.py) 45 a budget reached
    # 0.97-0.98 of the true front at each budget within a tenth of a full sweep's seconds; 30, 0.88-0.95.
    trials: TrialsOpt = 30,
    method: MethodOpt = DEFAULT_METHOD,
    budget_on: Annotated[str, typer.Option(help="what the budgets bound: key (key bits per key element) or kv (key "
                                           "and value bits per cached element)", parser=Choice(BUDGET_ON))] = "key",
    search_values: Annotated[bool, typer.Option(help="search value bits and value group size too (needs "
                                                "--budget-on kv; pnmix-alloc: each layer's own)")] = False,
    layer_groups: Annotated[int, typer.Option(help="--method pnmix-layers: groups of layers (by sensitivity), each "
                                              "with its own bit pair and salient ratio",
                                              parser=Int(vocabulary.LAYER_GROUPS))] = DEFAULT_LAYER_GROUPS,
    profile_name: ProfileOpt = "quick",
    objectives: Annotated[str, typer.Option(help="accuracy,key_bits[,kv_bytes][,throughput] (under --budget-on kv, "
                                            "key_bits stands for the KV bits)",
                                            parser=Names(_objective_names, must_include=("accuracy", "key_bits")))
                          ] = "accuracy,key_bits",
    backend: BackendOpt = "auto",
    seed: SeedOpt = 0,
    multi_fidelity: Annotated[bool, typer.Option(
        help="screen candidates with the attention-KL proxy before scoring them (off by default: on the "
             "GPU it pruned configs of the true front)")] = False,
    racing: Annotated[bool, typer.Option(help="race candidates on growing shares of the items")] = False,
    tasks: TaskListOpt = None,
    items: ItemsOpt = None,
    texts: TextsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
    holdout: Annotated[float, typer.Option(help="share of every task's items and documents held back from the "
                                           "search; each budget's pick is scored on them at the end (0: none)",
                                           parser=Number(HOLDOUT))] = DEFAULT_SHARE,
    lm_eval_task: LmEvalTaskOpt = None,
    lm_eval_limit: LmEvalLimitOpt = None,
    storage: StorageOpt = None,
    plot: Annotated[str | None, typer.Option(help="Pareto plot PNG path (default out/campaign-<id>.png)",
                                             parser=OutputFile(create_folders=True))] = None,
    enqueue: Annotated[bool, typer.Option(help="only queue it for `pnmix worker`")] = False,
) -> None:
    """Run (or resume) an Optuna campaign: one study per budget, fronts stored in SQL."""
    from pathlib import Path

    from pnmix.tuner.campaign import CampaignSpec
    from pnmix.tuner.plot import pareto_plot
    from pnmix.tuner.session import find_or_create_campaign, open_db
    from pnmix.tuner.space import SearchSpace

    chosen = task_list(tasks, items, texts_task(texts, text_prefix, text_tokens))
    if lm_eval_task or lm_eval_limit is not None:
        from pnmix.tuner import harness
        from pnmix.tuner.evaluate import DEFAULT_TASKS

        if not lm_eval_task:
            raise EvalError("--lm-eval-limit needs --lm-eval-task")
        harness.check_extra()
        # One task-list entry carries the task to the campaign's workers (tuner/harness.py).
        chosen = (*(chosen or DEFAULT_TASKS), harness.spec_entry(lm_eval_task, lm_eval_limit))
    spec = CampaignSpec(model=model, budgets=tuple(budgets or (3.0, 2.5, 2.25, 2.0, 1.5)), n_trials=trials,
                        method=method, profile=profile_name, objectives=_objectives(objectives), seed=seed,
                        multi_fidelity=multi_fidelity, racing=racing, backend=backend,
                        space=SearchSpace(method=method, budget_on=budget_on, search_values=search_values,
                                          layer_groups=layer_groups),
                        tasks=chosen, holdout=holdout)
    from pnmix import models

    models.resolve(model, purpose="accuracy")  # what a worker could not load: one line before the database
    from pnmix.tuner.queue import check_budgets_reachable

    check_budgets_reachable(spec.space, spec.budgets, models.model_shape(model).head_dim, model)
    from pnmix.tuner.texts import TextsTask, check_usable

    for entry in spec.tasks or ():  # a texts file without a usable document: one line, before the database
        if entry.startswith("texts:"):
            check_usable(model, TextsTask.parse(entry))
    db = open_db(storage, create=True, create_folder=not enqueue)  # a queued campaign's workers write elsewhere
    campaign_id = find_or_create_campaign(db, spec, status="queued" if enqueue else "running")
    from pnmix.tuner.campaign import optuna_storage

    optuna_storage(db.url)  # creates Optuna's tables now, before any worker races to
    if enqueue:
        console.print(f"campaign {campaign_id} queued for `pnmix worker`")
        return
    console.print(f"campaign {campaign_id}: {model}, {method}, budgets {', '.join(f'{b:g}' for b in spec.budgets)}, "
                  f"{trials} trials each, profile {profile_name}, storage {db.display_url}")
    studies = run_campaign(db, campaign_id, spec)
    print_fronts(db, model, campaign_id)
    print_holdout(db, model, campaign_id, spec.budgets, budget_on)
    path = pareto_plot(studies, Path(plot or f"out/campaign-{campaign_id}.png"), f"{model}: campaign {campaign_id}",
                       budget_on=budget_on)
    console.print(f"Pareto plot: {path}")


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
    from pathlib import Path

    from pnmix.tuner.evaluate import DEFAULT_TASKS
    from pnmix.tuner.profiles import profile
    from pnmix.tuner.space import SearchSpace
    from pnmix.tuner.sweep import parse_shard, run_sweep, start_file, sweep_header

    profile(profile_name)
    part = parse_shard(shard)
    space = SearchSpace(method=method)
    from pnmix import models

    models.resolve(model, purpose="accuracy")
    chosen = task_list(None, items, texts_task(texts, text_prefix, text_tokens))
    names = tuple(dict.fromkeys(t.partition(":")[0] for t in chosen)) if chosen else DEFAULT_TASKS
    start_file(Path(out), sweep_header(model, space, profile_name, seed, names))  # before the model loads

    def prepare(message: str) -> None:  # preparation takes minutes on the full profile: say what it does
        console.print(f"[dim]{message}[/dim]")

    prepare(f"loading {model} and preparing the {profile_name} profile's tasks")
    evaluator = _load_evaluator(model, profile_name, seed, chosen, backend, progress=prepare)

    def say(k: int, n: int, cfg: Any, row: dict[str, Any]) -> None:
        console.print(f"[{k}/{n}] {cfg.label}: {row['key_bits']:.3f} bits, accuracy "
                      f"{_pm(row['accuracy'], row['accuracy_se'])} ({row['seconds']:.2f} s)")

    scored = run_sweep(evaluator, space, Path(out), part, limit, measure, on_score=say)
    console.print(f"{out}: {scored} configs scored by shard {part[0]}/{part[1]}")


def _objectives(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _compare_names() -> tuple[str, ...]:
    from pnmix.tuner.peers import PEERS  # transformers' quantized caches scored beside the presets

    return (*PRESETS, *PEERS)


def _objective_names() -> tuple[str, ...]:
    from pnmix.storage.write import OBJECTIVES  # SQLAlchemy: only when --objectives is parsed

    return tuple(OBJECTIVES)


def worker(
    storage: StorageOpt = None,
    campaign: Annotated[int | None, typer.Option(help="attach to this campaign (default: claim queued ones)",
                                                 parser=Int(vocabulary.CAMPAIGN_ID))] = None,
    wait: Annotated[bool, typer.Option(help="keep polling for queued campaigns")] = False,
) -> None:
    """Work on campaigns from the shared database: attach to one, or claim queued ones until none is left.

    A claiming worker takes only campaigns of the backends this machine runs (tuner/queue.py). One it
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
    from pnmix.storage import StorageError, claim_next_queued_campaign, get_campaign
    from pnmix.tuner.campaign import GRACE_S, CampaignSpec, failure_reason
    from pnmix.tuner.queue import CannotRunHere, runnable_backends
    from pnmix.tuner.session import open_db

    db = open_db(storage, create=True, create_folder=False)
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    backends = runnable_backends()
    while True:
        spec: CampaignSpec | None = None
        problem: str | None = None
        with db.session() as s:
            row: Any
            if campaign is not None:
                row = get_campaign(s, campaign)
            else:  # queued campaigns, and running ones whose worker stopped beating (it died)
                row = claim_next_queued_campaign(s, worker_id, stale_after_s=GRACE_S, backends=backends)
            campaign_id = int(row.id) if row is not None else None
            if row is not None:
                try:
                    spec = CampaignSpec.from_campaign(row)
                except PNMixError as exc:
                    problem = str(exc)
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


def fronts(
    model: DbModelOpt = "smollm2-135m",
    campaign: Annotated[int | None, typer.Option(help="only this campaign", parser=Int(vocabulary.CAMPAIGN_ID))] = None,
    storage: ReadStorageOpt = None,
) -> None:
    """Print the stored Pareto fronts of a model."""
    from pnmix.tuner.session import open_db

    print_fronts(open_db(storage), model, campaign)


def recommend(
    model: DbModelOpt = "smollm2-135m",
    bits: BitsOpt = 2.25,
    bits_of: BitsOfOpt = "key",
    optimize: Annotated[str, typer.Option(help="accuracy, throughput or memory", parser=Choice(_optimize_names))
                        ] = "accuracy",
    min_accuracy: Annotated[float | None, typer.Option(
        help="minimum accuracy (default: none for accuracy; for throughput and memory, "
             "90% of the best accuracy within the budget)", parser=Number(vocabulary.ACCURACY))] = None,
    storage: ReadStorageOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """The best stored config within a bit budget (key bits, or KV bits with --bits-of kv), with the
    points statistically tied with it.

    optimize=accuracy: the most accurate point and every point whose accuracy is within 2 standard
    errors of the difference from it are tied; the recommendation is the tied point with the fewest
    bits, then the highest measured throughput. optimize=throughput or memory: the fastest or
    smallest point whose accuracy is at least --min-accuracy, by default 90% of the best accuracy
    within the budget (a cache that saves memory by losing the answers is no recommendation).
    """
    import json

    from pnmix.storage import recommend_with_ties
    from pnmix.storage.read import applied_floor
    from pnmix.tuner.session import open_db

    db = open_db(storage)
    with db.session(readonly=True) as s:
        p, ties = recommend_with_ties(s, model, bits, optimize, min_accuracy, bits_of=bits_of)
        floor = applied_floor(s, model, bits, optimize, min_accuracy, bits_of=bits_of)
        config = p.config

        def row_of(q: Any) -> dict[str, Any]:
            return {"config": q.config.to_dict(), "key_bits": q.key_bits, "kv_bits": q.kv_bits, "accuracy": q.accuracy,
                    "accuracy_se": q.accuracy_se, "accuracy_parts": q.accuracy_parts, "kv_bytes": q.kv_bytes,
                    "throughput": q.throughput, "campaign": q.campaign_id, "trial": q.trial_number}

        row = {"model": model, "budget": bits, "bits_of": bits_of, "min_accuracy": floor, **row_of(p),
               "holdout": p.holdout_summary(), "ties": [row_of(q) for q in ties]}
        held = holdout_line(p)
        others = [(q.config, q.bits(bits_of), q.accuracy, q.accuracy_se) for q in ties if q is not p]
    if as_json:
        print(json.dumps(row))
        return
    console.print(f"best for {model} at <= {bits:g} {bits_of} bits ({optimize}): {config.label} -> key bits "
                  f"{row['key_bits']:.3f}, KV bits {row['kv_bits']:.3f}, accuracy "
                  f"{_pm(row['accuracy'], row['accuracy_se'])} "
                  f"(campaign {row['campaign']}, trial {row['trial']})"
                  + (f"; accuracy floor {floor:.3f}" if floor else ""))
    console.print(held)
    _print_ties(others)
    console.print(config.to_json())


def holdout_line(p: Any) -> str:
    """One sentence on a point's held-out score, its gap to the in-search score and pnmix-paper's."""
    held = p.holdout_summary()
    if held is None:
        return ("held-out: not scored (the campaign held nothing back, had not finished, or did not recommend "
                "this point for one of its budgets)")
    units = ", ".join(f"{n} {part}" for part, n in held["units"].items())
    text = (f"held-out ({units}): accuracy {_pm(held['accuracy'], held['accuracy_se'])}, minus the in-search "
            f"score {_diff(held['minus_in_search'], held['minus_in_search_se'])}")
    text += {True: ": holds (not more than 2 SE below)",
             False: ": FALLS more than 2 SE below the in-search score; the pick may not hold on unseen data",
             None: ": no standard error (a part has one held-out unit; the full profile holds out more), no verdict",
             }[held["holds"]]
    paper = held["pnmix_paper"]
    if paper:
        text += f"; minus pnmix-paper on the held-out units, paired: {_diff(paper['diff'], paper['diff_se'])}"
    return text


def _optimize_names() -> tuple[str, ...]:
    from pnmix.storage.read import OPTIMIZE  # SQLAlchemy: only when --optimize is parsed

    return OPTIMIZE


def _print_ties(others: list[tuple[Any, float, float, float | None]]) -> None:
    """The points tied with a recommendation: (config, key bits, accuracy, its SE) each."""
    if not others:
        return
    console.print(f"tied with it (accuracy within 2 SE of the most accurate; chosen: fewest bits, then "
                  f"throughput): {len(others)} more")
    for cfg, bits, acc, se in others:
        console.print(f"  {cfg.label}: {bits:.3f} bits, accuracy {_pm(acc, se)}")


def export(
    model: DbModelOpt = "smollm2-135m",
    bits: BitsOpt = 2.25,
    bits_of: BitsOfOpt = "key",
    output: Annotated[str, typer.Option("-o", "--output", help="JSON file to write (a regular file)",
                                        parser=OutputFile())] = "pnmix-config.json",
    storage: ReadStorageOpt = None,
) -> None:
    """Write the recommended config as JSON: a PNMixConfig, or a layer-wise config where the best point
    is one (`pnmix.layerwise.load_config`, `pnmix eval --config` and `pnmix bits --config` read either)."""
    from pathlib import Path

    from pnmix.storage import recommend as best_point
    from pnmix.tuner.session import open_db

    db = open_db(storage)
    with db.session(readonly=True) as s:
        config = best_point(s, model, bits, bits_of=bits_of).config
    write_regular_file(Path(output), config.to_json() + "\n")
    console.print(f"wrote {output}: {config.to_json()}")


def layers(
    model: ModelOpt = "smollm2-135m",
    bits: Annotated[float | None, typer.Option(help="mean key-bit budget (default: the base config's own bits)",
                                               parser=Number(inputs.BUDGET))] = None,
    preset_name: PresetOpt = None,
    config_file: Annotated[str | None, typer.Option(
        "--config", help="the base PNMixConfig as a JSON file (default: --preset, else pnmix-paper)",
        parser=InputFile())] = None,
    profile_name: ProfileOpt = "quick",
    output: Annotated[str | None, typer.Option("-o", "--output", help="write the layer-wise config here (JSON)",
                                               parser=OutputFile())] = None,
    plot: Annotated[str | None, typer.Option(help="draw the per-layer KL and bits here (PNG)",
                                             parser=OutputFile())] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Layer sensitivity and a layer-wise config: each layer's attention KL (the proxy) under the base
    config, then every layer's bit pair and salient ratio chosen so that the summed KL is least
    with mean key bits within --bits (tuner/layers.py; docs/layerwise.md)."""
    import json
    from pathlib import Path

    from pnmix.bits import mean_key_bits
    from pnmix.config import PNMixConfig, preset
    from pnmix.tuner.evaluate import Evaluator
    from pnmix.tuner.layers import candidates_like, layerwise_for_budget
    from pnmix.tuner.profiles import profile
    from pnmix.tuner.space import SearchSpace

    base = load_config_file(config_file) if config_file else preset(preset_name or "pnmix-paper")
    if not isinstance(base, PNMixConfig):
        raise EvalError(f"--config {config_file}: give a single PNMixConfig as the base, not a layer-wise one")
    ev = Evaluator(model, profile(profile_name), tasks=("fidelity",))
    n_layers, d = ev.loaded.shape.num_layers, ev.head_dim
    budget = bits if bits is not None else mean_key_bits(base, n_layers, d)
    space = SearchSpace()
    with console.status("proxy KL of every candidate, layer by layer"):
        kl_of = {c: ev.proxy_by_layer(c) for c in candidates_like(base, space)}
    lw = layerwise_for_budget(base, budget, d, space, kl_of)
    chosen = lw.per_layer(n_layers)
    layer_kl = [kl_of[c][i] for i, c in enumerate(chosen)]
    report: dict[str, Any] = {"model": model, "base": base.to_dict(), "budget": budget,
              "base_key_bits": mean_key_bits(base, n_layers, d), "key_bits": mean_key_bits(lw, n_layers, d),
              "sensitivity": kl_of[base], "layer_kl": layer_kl,
              "config": lw.to_dict()}
    if output:
        write_regular_file(Path(output), lw.to_json() + "\n")
    if plot:
        from pnmix.tuner.plot import layers_plot

        layers_plot(kl_of[base], chosen, layer_kl, d, Path(plot),
                    f"{model}: base {base.label} ({report['base_key_bits']:.3f} bits) -> layer-wise "
                    f"({report['key_bits']:.3f} bits)")
    if as_json:
        print(json.dumps(report))
        return
    table = Table(title=f"{model}: per-layer attention KL (proxy), base {base.label}")
    for col in ("layer", "base KL", "chosen", "its KL"):
        table.add_column(col, justify="right")
    for i, c in enumerate(chosen):
        table.add_row(str(i), f"{kl_of[base][i]:.4f}", f"{c.b_high}/{c.b_low} r{c.salient_ratio:g}",
                      f"{kl_of[c][i]:.4f}")
    console.print(table)
    console.print(f"layer-wise: {lw.label}")
    console.print(f"mean key bits {report['key_bits']:.3f} (budget {budget:.3f}; base {report['base_key_bits']:.3f}); "
                  f"summed KL {sum(layer_kl):.3f} (base {sum(kl_of[base]):.3f})"
                  + (f"; wrote {output}" if output else "") + (f"; plot {plot}" if plot else "")
                  + f"; score it: pnmix eval --config {output or 'FILE'}")


def write_regular_file(target: Path, text: str) -> None:
    """Writes `text` to `target`, a regular file or a new one, atomically: written aside and renamed, so
    a full disk never leaves a truncated file. A symbolic link, device, pipe or directory at `target` is
    refused in one line and left as it was (a rename would replace the link or the device file itself)."""
    import os
    import stat

    def refuse_special() -> None:
        try:
            mode = target.lstat().st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise EvalError(f"cannot write {target}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
                    else "a device, pipe or socket")
            raise EvalError(f"cannot write {target}: it is {kind}; give a regular file")

    refuse_special()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        refuse_special()  # what was there a moment ago may have changed since the first look
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EvalError(f"cannot write {target}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def dashboard(
    storage: ReadStorageOpt = None,
    host: Annotated[str, typer.Option(help="bind address", parser=Host())] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port", parser=Int(vocabulary.PORT))] = 8080,
) -> None:
    """Serve optuna-dashboard on the campaigns' storage."""
    from pnmix.storage.vocabulary import check_bind
    from pnmix.tuner.session import open_db

    db = open_db(storage)
    check_bind(host, port)  # before the dashboard's (slow) import: a refusal is quick
    from optuna_dashboard import run_server

    from pnmix.tuner.campaign import optuna_storage

    console.print(f"optuna-dashboard on http://{host}:{port} for {db.display_url}")
    run_server(optuna_storage(db.url), host=host, port=port)


def run_main_job(
    model: ModelOpt = "smollm2-135m",
    trials: TrialsOpt = 6,
    storage: StorageOpt = None,
) -> None:
    """The main job: bit-budget table, then a small real allocator campaign (quick profile, budgets 3.0
    and 2.25 key bits; a quarter of the items held out), its fronts, the recommendation at <= 2.25 bits
    beside pnmix-paper with its held-out score, and a plot."""
    from pathlib import Path

    from pnmix.storage import recommend_with_ties
    from pnmix.tuner.campaign import CampaignSpec
    from pnmix.tuner.plot import pareto_plot
    from pnmix.tuner.session import find_or_create_campaign, open_db
    from pnmix.tuner.space import SearchSpace

    console.print(budget_table(model))
    db = open_db(storage, upgrade=True)
    # 2.25 key bits lies just under pnmix-paper's 2.263 (d = 64), which the 3.0 budget scores among its
    # warm starts: the recommendation at <= 2.25 bits, a layer-wise config, is compared with it on the
    # same items, in the search and on the held-out items.
    spec = CampaignSpec(model=model, budgets=(3.0, 2.25), n_trials=trials, profile="quick", method=ALLOCATED,
                        space=SearchSpace(method=ALLOCATED))
    campaign_id = find_or_create_campaign(db, spec)
    console.print(f"campaign {campaign_id} on {db.display_url}")
    studies = run_campaign(db, campaign_id, spec)
    print_fronts(db, model, campaign_id)
    path = pareto_plot(studies, Path(f"out/campaign-{campaign_id}.png"), f"{model}: campaign {campaign_id}")
    with db.session(readonly=True) as s:
        p, ties = recommend_with_ties(s, model, 2.25, campaign_id=campaign_id)
        console.print(f"recommendation at <= 2.25 key bits: {p.config.to_json()} "
                      f"(key bits {p.key_bits:.3f}, accuracy {_pm(p.accuracy, p.accuracy_se)})")
        console.print(holdout_line(p))
        _print_ties([(t.config, t.key_bits, t.accuracy, t.accuracy_se) for t in ties if t is not p])
        others = list(studies.values())
        console.print("recommendation " + _against_paper(studies[p.budget], p.trial_number, spec.space, others))
        best = max([p, *ties], key=lambda q: q.accuracy)
        if best is not p:  # tied with the recommendation, but the comparison with the paper says more
            console.print(f"most accurate point ({best.config.label}, {best.key_bits:.3f} key bits) "
                          + _against_paper(studies[best.budget], best.trial_number, spec.space, others))
    console.print(f"Pareto plot: {path}; the API (`pnmix serve`) and `pnmix dashboard` read {db.display_url}")


def _against_paper(study: Any, trial_number: int, space: Any, elsewhere: Sequence[Any] = ()) -> str:
    """A point's accuracy (trial `trial_number` of `study`) minus pnmix-paper's, paired on the same
    items, as the end of a sentence about the point. pnmix-paper's score comes from `study` or else
    from one of `elsewhere`, the campaign's other budgets (one campaign scores every budget on the
    same items)."""
    from pnmix.config import preset
    from pnmix.tuner import record
    from pnmix.tuner.stats import paired

    paper = space.recast(preset("pnmix-paper")).to_dict()
    mine = next((record.read(t) for t in study.get_trials(deepcopy=False) if t.number == trial_number), None)
    theirs = None
    for other in (study, *elsewhere):
        theirs = next((r for r in map(record.read, other.get_trials(deepcopy=False))
                       if r.config_dict == paper and r.units), None)
        if theirs is not None:
            break
    if mine is None or theirs is None or not mine.units or not theirs.units:
        return "against pnmix-paper: not scored in this campaign, no paired comparison"
    if mine.config_dict == theirs.config_dict:
        return "is pnmix-paper itself"
    diff, se = paired(mine.units, theirs.units)["accuracy"]
    verdict = ("beyond two standard errors" if se and abs(diff) > 2 * se
               else "within two standard errors: not a measured difference")
    return f"minus pnmix-paper, paired on the same items: {_diff(diff, se)} ({verdict})"
