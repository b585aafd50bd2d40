"""The `pnmix` command: the root Typer app that gathers every package's commands.

It lives in `api/`, the outermost layer, because only this layer may depend on all the others
(docs/design.md, "How the parts fit"). Commands import their heavy dependencies lazily, so `pnmix bits` starts
without loading torch.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import typer

from pnmix import cli as method_cli
from pnmix.api import commands as service_cli
from pnmix.errors import PNMixError
from pnmix.inputs import InputError, shorten
from pnmix.tuner.commands import campaigns, results, scoring


def help_of(command: Callable[..., Any]) -> str:
    """A command's docstring as its help: each paragraph's lines joined into one (Typer would keep
    the docstring's line breaks, breaking sentences mid-line); indented lines stay as they are."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(p if any(line.startswith(" ") for line in p.splitlines())
                       else " ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


app = typer.Typer(
    name="pnmix",
    help="PN-Mix mixed-precision KV-cache quantization: method, tuner and service.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# The commands in the order `pnmix --help` lists them; `db` is a group of its own.
COMMANDS: list[tuple[str, Any]] = [
    ("bits", method_cli.bits), ("models", method_cli.list_models), ("generate", method_cli.generate),
    ("analyze", method_cli.analyze), ("run", campaigns.run_main_job), ("serve", service_cli.serve),
    ("db", service_cli.db_app), ("eval", scoring.eval_config), ("validate", scoring.validate),
    ("layers", scoring.layers), ("sweep", campaigns.sweep), ("tune", campaigns.tune), ("worker", campaigns.worker),
    ("fronts", results.fronts), ("recommend", results.recommend), ("export", results.export),
    ("dashboard", results.dashboard),
]
for name, command in COMMANDS:
    if isinstance(command, typer.Typer):
        app.add_typer(command, name=name)
    else:
        app.command(name, help=help_of(command))(command)

def main(argv: Sequence[str] | None = None) -> None:
    """Entry point, and the one place where the command line's errors are turned into messages.

    A refused value (an option's parser, `pnmix.inputs`) or any `PNMixError` (a library refusing
    what the user asked for, or the user's environment) ends in one line on stderr, `error: ...`,
    and exit code 2. Every other exception keeps its traceback: it is a bug, and should look like one.
    """
    try:
        code = app(args=argv, standalone_mode=False, prog_name="pnmix")
    except PNMixError as exc:
        _fail(str(exc))
    except _USAGE_ERRORS as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `pnmix` or `pnmix db` alone: the help
            print(exc.ctx.get_help())  # type: ignore[attr-defined]
            sys.exit(2)
        _fail(_usage_message(exc))
    except _ABORTS:
        _fail("aborted")
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str) -> NoReturn:
    print(f"error: {_one_line(message)}", file=sys.stderr)
    sys.exit(2)


def _one_line(text: str, limit: int = 600) -> str:
    """Messages quote what the user typed: whatever it held, the error stays one line of bounded length."""
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[: limit // 2]} ... {line[-limit // 2:]}"


def _usage_message(exc: BaseException) -> str:
    """A click usage error as one line: a value our parsers refused names the option, the value and
    what is allowed; click's own (unknown option, missing value) keep click's words."""
    param = getattr(exc, "param", None)
    refused = _input_error(exc)
    if param is not None:
        option = max(getattr(param, "opts", None) or [param.name], key=len)
        if refused is not None:
            return f"invalid {option} {shorten(refused.value)}: allowed {refused.allowed}"
        return f"invalid {option}: {getattr(exc, 'message', exc)}"
    format_message = getattr(exc, "format_message", None)
    return str(format_message() if format_message else exc)


def _input_error(exc: BaseException) -> InputError | None:
    """The `InputError` a parser raised, wherever the CLI library wrapped it (cause, or pydantic's error context)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, InputError):
            return err
        todo += [e for e in (err.__cause__, err.__context__) if e is not None]
        errors = getattr(err, "errors", None)
        if callable(errors):
            try:
                todo += [e["ctx"]["error"] for e in errors() if isinstance(e.get("ctx", {}).get("error"),
                                                                            BaseException)]
            except Exception:  # not pydantic's ValidationError after all
                pass
    return None


def _exception_types(name: str) -> tuple[type[BaseException], ...]:
    """The CLI library's exception class `name`: typer's own copy of click, and click itself."""
    import importlib

    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


_USAGE_ERRORS = _exception_types("UsageError")
_ABORTS = _exception_types("Abort") + (typer.Abort,)


if __name__ == "__main__":
    main()
