"""The `pnmix` command: the root Typer app that gathers every package's commands.

It lives in `api/`, the outermost layer, because only this layer may depend on all the others
(docs/design.md, "How the parts fit"). Commands import their heavy dependencies lazily, so `pnmix bits` starts
without loading torch.
"""

from __future__ import annotations

import sys

import typer

from api import commands as service_cli
from pnmix import cli as method_cli
from pnmix.errors import PNMixError
from tuner import cli as tuner_cli

app = typer.Typer(
    name="pnmix",
    help="PN-Mix mixed-precision KV-cache quantization: method, tuner and service.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("bits")(method_cli.bits)
app.command("models")(method_cli.list_models)
app.command("generate")(method_cli.generate)
app.command("analyze")(method_cli.analyze)
app.command("run")(tuner_cli.run_main_job)
app.command("serve")(service_cli.serve)
app.add_typer(service_cli.db_app, name="db")
app.command("eval")(tuner_cli.eval_config)
app.command("sweep")(tuner_cli.sweep)
app.command("tune")(tuner_cli.tune)
app.command("worker")(tuner_cli.worker)
app.command("fronts")(tuner_cli.fronts)
app.command("recommend")(tuner_cli.recommend)
app.command("export")(tuner_cli.export)
app.command("dashboard")(tuner_cli.dashboard)


def main() -> None:
    """Entry point: user mistakes end in one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except PNMixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
