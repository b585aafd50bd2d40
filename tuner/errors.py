"""The tuner's errors: every one a user's mistake or an unmet condition, told in one line.

Both wings raise them (scoring: tuner/scoring/, search: tuner/search/); the command line prints
their message and exits with 2 (pnmix/cli.py), the service answers them as problems (api/).
"""

from __future__ import annotations

from pnmix.errors import PNMixError


class EvalError(PNMixError):
    """A task, profile, file or campaign setting the tuner cannot run with."""


class MissingFile(EvalError):
    """A user's data file that is not there (the service answers 404, as for an unknown model)."""


class CannotRunHere(EvalError):
    """This worker lacks what the campaign needs (a GPU); another worker may run it."""


class PeerMissing(PNMixError):
    """A peer's package is not installed; the message names the pip command."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message, at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
