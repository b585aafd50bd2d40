"""The options the tuner's commands share, and the helpers that turn them into work: every option parses
through a checker of pnmix.inputs or storage.vocabulary, refused before any work (api/cli.py prints it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pnmix import inputs
from pnmix.config import PRESETS
from pnmix.inputs import Choice, InputFile, Int, ModelName, Names, Number, OutputFile
from pnmix.names import BACKENDS
from pnmix.recipes import ENGINES
from pnmix.storage import vocabulary
from pnmix.storage.vocabulary import BUDGET_ON, METHODS, DatabaseUrl
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import parts
from pnmix.tuner.scoring.holdout import HOLDOUT
from pnmix.tuner.scoring.profiles import PROFILES
from pnmix.tuner.search.methods import METHODS as KINDS

# Every option parses through a checker of pnmix.inputs or storage.vocabulary (refused before any work;
# api/cli.py prints it).
ProfileOpt = Annotated[str, typer.Option("--profile", help=", ".join(PROFILES), parser=Choice(tuple(PROFILES)))]
BackendOpt = Annotated[str, typer.Option(help=", ".join(BACKENDS), parser=Choice(BACKENDS))]
MethodOpt = Annotated[str, typer.Option(help=f"{', '.join(METHODS)}: pnmix-alloc gives each layer its bits by the "
                                        "allocator (per-layer sensitivity, knapsack, local moves scored for real); "
                                        "engine gives each layer serving-engine KV formats (FP8, NVFP4, llama.cpp "
                                        "types) the same way, under a KV budget (--budget-on kv); the others search "
                                        "uniform configs of each method's knobs, or layer groups",
                                        parser=Choice(METHODS))]
SeedOpt = Annotated[int, typer.Option(help="task (and sampler) seed", parser=Int(inputs.SEED))]
TrialsOpt = Annotated[int, typer.Option(help="trials per budget", parser=Int(vocabulary.TRIALS))]
BitsOpt = Annotated[float, typer.Option(help="bit budget (key bits, or KV bits with --bits-of kv)",
                                        parser=Number(inputs.BUDGET))]
BitsOfOpt = Annotated[str, typer.Option(help="what --bits bounds: key bits per key element, or kv: key and value "
                                        "bits per cached element", parser=Choice(BUDGET_ON))]
EngineOpt = Annotated[str | None, typer.Option(
    "--format", help="a serving engine (vllm, modelopt, trtllm, sglang, llamacpp): the best engine recipe it loads "
    "as it is, printed in its syntax", parser=Choice(ENGINES))]
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
                                                 parser=Names(parts.NAMES,
                                                              with_arguments=parts.WITH_ARGUMENT))]


_STORAGE_HELP = "database URL (default: PNMIX_DATABASE_URL or the SQLite file PNMIX_DB_PATH)"


StorageOpt = Annotated[str | None, typer.Option("--storage", help=_STORAGE_HELP, parser=DatabaseUrl())]


# Commands that only read never create a database: a SQLite file must already be there.
ReadStorageOpt = Annotated[str | None, typer.Option("--storage", help=_STORAGE_HELP,
                                                    parser=DatabaseUrl(must_exist=True))]


SWEPT = tuple(m for m, kind in KINDS.items() if not kind.layered)  # a sweep covers a uniform space


def texts_task(texts: str | None, prefix: int | None, tokens: int | None) -> Any:
    """The texts task of the options (tuner/scoring/texts.py), or None; one line for lengths without a file."""
    from pnmix.tuner.scoring.texts import TextsTask

    if texts is None:
        if prefix is not None or tokens is not None:
            raise EvalError("--text-prefix and --text-tokens need --texts")
        return None
    return TextsTask(texts, prefix, tokens)


def named_tasks(tasks: str | None) -> tuple[str, ...] | None:
    """--tasks as a tuple of names (None: the profile's built-in tasks)."""
    return tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None


def task_list(tasks: str | None, items: str | None, texts: Any) -> tuple[str, ...] | None:
    """The task list a campaign stores (`tuner.scoring.parts.campaign_entries`) of --tasks, --items, --texts."""
    return parts.campaign_entries(named_tasks(tasks), items, texts)


def load_config_file(path: str) -> Any:
    """A PNMixConfig (what `pnmix export` writes), a layer-wise config (docs/layerwise.md) or an
    engine recipe (docs/engines.md) from a JSON file; bad files end in one line."""
    from pathlib import Path

    from pnmix.configs import load_answer
    from pnmix.recipes import RecipeError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return load_answer(text)
    except (TypeError, RecipeError) as exc:  # e.g. a field given twice through an odd mapping
        raise EvalError(f"config file {path}: {exc}") from None


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


def objective_list(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def compare_names() -> tuple[str, ...]:
    from pnmix.tuner.scoring.peers import PEERS  # transformers' quantized caches scored beside the presets

    return (*PRESETS, *PEERS)


def objective_names() -> tuple[str, ...]:
    from pnmix.storage.write import OBJECTIVES  # SQLAlchemy: only when --objectives is parsed

    return tuple(OBJECTIVES)


def optimize_names() -> tuple[str, ...]:
    from pnmix.storage.read import OPTIMIZE  # SQLAlchemy: only when --optimize is parsed

    return OPTIMIZE


# `pnmix tune`'s own options.
BudgetsOpt = Annotated[list[float] | None, typer.Option(
    "--budgets", help="bit budgets (repeat or space), on the figure --budget-on names; on a hybrid model weighted by "
    "the elements each layer holds at 32K tokens (default 3.0, 2.5, 2.25, 2.0, 1.5, on a hybrid model the budgets "
    "that leave its full-attention layers those bits)", parser=Number(inputs.BUDGET))]
BudgetOnOpt = Annotated[str, typer.Option(help="what the budgets bound: key (key bits per key element) or kv (key "
                                          "and value bits per cached element)", parser=Choice(BUDGET_ON))]
SearchValuesOpt = Annotated[bool, typer.Option(help="search value bits and value group size too (needs "
                                               "--budget-on kv; pnmix-alloc: each layer's own)")]
LayerGroupsOpt = Annotated[int, typer.Option(help="--method pnmix-layers: groups of layers (by sensitivity), each "
                                             "with its own bit pair and salient ratio",
                                             parser=Int(vocabulary.LAYER_GROUPS))]
ObjectivesOpt = Annotated[str, typer.Option(help="accuracy,key_bits[,kv_bytes][,throughput] (under --budget-on kv, "
                                            "key_bits stands for the KV bits)",
                                            parser=Names(objective_names, must_include=("accuracy", "key_bits")))]
MultiFidelityOpt = Annotated[bool, typer.Option(help="screen candidates with the attention-KL proxy before scoring "
                                                "them (off by default: on the GPU it pruned configs of the true "
                                                "front)")]
RacingOpt = Annotated[bool, typer.Option(help="race candidates on growing shares of the items")]
HoldoutOpt = Annotated[float, typer.Option(help="share of every task's items and documents held back from the "
                                           "search; each budget's pick is scored on them at the end (0: none)",
                                           parser=Number(HOLDOUT))]
PlotOpt = Annotated[str | None, typer.Option(help="Pareto plot PNG path (default out/campaign-<id>.png)",
                                             parser=OutputFile(create_folders=True))]
