"""User-facing errors: the CLI prints their one-line message and exits non-zero, no traceback."""


class PNMixError(Exception):
    """Base of every error caused by user input or the user's environment."""
