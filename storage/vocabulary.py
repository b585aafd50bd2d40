"""The names and ranges that the tuner, the storage and the service share, and only they: a
campaign's fields (methods, budget kinds, trial counts, ids, accuracies), the service's ports,
hosts, pages and request limits, database URLs, shards, and the settings read from the
environment. The method (`pnmix`) has its own in `pnmix.inputs` (the parsers, bit budgets, head
dims, token counts) and `pnmix.names` (backends); this module builds on them.

It lives in `pnmix.storage` because the storage is the layer that both the tuner and the service
import, and it imports nothing heavy (the package's own names load on first use), so that the
command line parses its options before any library loads.
"""

from __future__ import annotations

import re
import stat
from enum import StrEnum
from pathlib import Path
from typing import Any

from pnmix.inputs import INT32_MAX, MAX_PATH, InputError, Int, Number, Parser, Range

METHODS = ("pnmix-alloc", "pnmix", "kivi", "kitty", "pnmix-layers", "engine")
"""The methods a campaign tunes and compares on one model, each a restriction of the config's knobs
(`pnmix.tuner.search.space` gives each its search space): PN-Mix itself, KIVI (uniform key bits, no
salient channels, no sinks) and a Kitty-like method (4/2 bits on high-magnitude channels), plus the
layer-wise ones: `pnmix-alloc` (the default), where every layer takes its own b_high, b_low and
salient ratio from the allocator (`pnmix.tuner.search.layers`: per-layer sensitivity and a knapsack under
the budget, then local moves scored by real accuracy), and `pnmix-layers`: groups of layers (formed
by layer sensitivity) that each take their own pair and ratio as sampled trial parameters; and
`engine`, whose answers are serving engines' per-layer KV formats (FP8, NVFP4, llama.cpp's types)
set by the same kind of allocator under an effective-KV-bits budget (`pnmix.tuner.search.methods`)."""
DEFAULT_METHOD = "pnmix-alloc"


class BudgetOn(StrEnum):
    """The bit figure a campaign's budgets constrain (`pnmix.bits`)."""

    KEY = "key"  # key bits per key element
    KV = "kv"  # KV bits: keys and values together per cached element


BUDGET_ON = tuple(b.value for b in BudgetOn)

TIE_Z = 2.0
"""Two accuracies within this many standard errors of their difference are tied: the points a
recommendation calls tied with its best (`pnmix.storage.read.tied_with`), and a held-out score that
`holds` against the in-search one (`pnmix.storage.orm.FrontPoint.holdout_summary`)."""

# -- ranges --------------------------------------------------------------------------------------

ACCURACY = Range(0.0, 1.0)  # a combined accuracy, and the floor a recommendation asks for
CAMPAIGN_ID = Range(1, INT32_MAX, integer=True)
TRIALS = Range(1, 10_000, integer=True)  # trials per budget of a campaign
LAYER_GROUPS = Range(1, 8, integer=True)  # groups of layers with their own bits (method pnmix-layers)
PORT = Range(1, 65535, integer=True)
PAGE_SIZE = Range(1, 500, integer=True)
OFFSET = Range(0, INT32_MAX, integer=True)
LIMIT = Range(0, INT32_MAX, integer=True)
# Settings read from the environment (the tuner's timings and retries, the service's limits)
SECONDS = Range(0.0, 86_400.0, low_open=True)  # a wait, a heartbeat, a timeout: up to a day
RETRIES = Range(0, 1000, integer=True)
BODY_BYTES = Range(1, 1 << 30, integer=True)  # a request body limit
HEADER_BYTES = Range(1024, 1 << 20, integer=True)  # a request's header limit


# The numbers read straight from the environment (the service's and the database's settings go
# through pydantic-settings instead: `storage.settings`, `api.settings`), with their ranges.
ENVIRONMENT = {
    "PNMIX_HEARTBEAT_S": Range(1, 3600, integer=True),  # a campaign trial's heartbeat interval
    "PNMIX_GRACE_S": Range(1, 86_400, integer=True),  # silence after which a trial counts as dead
    "PNMIX_DB_RETRIES": RETRIES,  # consecutive database faults a campaign retries
    "PNMIX_DB_RETRY_S": SECONDS,  # the first wait between those retries
}


def env_value(name: str, default: float) -> float:
    """The environment variable `name` (a key of `ENVIRONMENT`) as a number in its range (`default`
    when unset); anything else (text, nan, inf, a value out of range) is refused in one line naming
    the variable."""
    import os

    allowed = ENVIRONMENT[name]
    text = os.environ.get(name)
    if text is None:
        return default
    parser = Int(allowed) if allowed.integer else Number(allowed)
    try:
        return float(parser(text.strip()))
    except InputError:
        raise InputError(f"environment variable {name}", text, allowed.allowed) from None


# -- parsers of the service's and the tuner's options --------------------------------------------


_HOST = re.compile(r"[A-Za-z0-9._:\-\[\]%]{1,253}")


class Host(Parser):
    """A host name or an IP address to bind (whether it resolves is checked when binding)."""

    __name__ = "host"

    def __call__(self, text: Any) -> str:
        if not isinstance(text, str) or not _HOST.fullmatch(text):
            raise self.refuse(text, "a host name or an IP address (letters, digits, '.', '-', ':'), "
                                    "at most 253 characters")
        return text


class DatabaseUrl(Parser):
    """A SQLAlchemy URL of SQLite or PostgreSQL. `must_exist` (commands that only read): a SQLite
    file must already be there, so that reading never creates a file or a folder."""

    __name__ = "url"

    def __init__(self, must_exist: bool = False) -> None:
        self.must_exist = must_exist

    def refuse(self, text: Any, allowed: str) -> InputError:
        # A URL may hold a password: never show it, even in a refusal.
        shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", text) if isinstance(text, str) else text
        return InputError("value", shown, allowed)

    def __call__(self, text: Any) -> str:
        allowed = "a database URL such as sqlite:///path/to/pnmix.db or postgresql+psycopg2://user@host:5432/db"
        if not isinstance(text, str) or not 1 <= len(text) <= MAX_PATH or any(ord(c) < 32 for c in text):
            raise self.refuse(text, allowed)
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(text)
            backend = url.get_backend_name()
        except (ArgumentError, ValueError):
            raise self.refuse(text, allowed) from None
        if backend not in ("sqlite", "postgresql"):
            raise self.refuse(text, allowed)
        if backend == "sqlite":
            database = url.database or ""
            if database in ("", ":memory:") or database.startswith("file:"):
                raise self.refuse(text, "a SQLite URL with a file path (several connections share it)")
            if self.must_exist:
                check_existing_database(Path(database).expanduser(), text)
        elif not url.host:
            raise self.refuse(text, "a PostgreSQL URL with a host, e.g. postgresql+psycopg2://user@host:5432/db")
        return text


def check_existing_database(path: Path, shown: object) -> None:
    """Refuses a SQLite path that holds no file: a read must not create one."""
    try:
        regular = stat.S_ISREG(path.stat().st_mode)
    except OSError as exc:
        raise InputError("database", shown, f"an existing SQLite file ({exc.strerror}: run `pnmix db upgrade`, "
                                            "or `pnmix run`, to create one)") from None
    if not regular:
        raise InputError("database", shown, "an existing SQLite file (this is not a regular file)")


_SHARD = re.compile(r"([0-9]{1,6})/([0-9]{1,6})")


class Shard(Parser):
    """`I/N`: shard I of N, 0 <= I < N (N processes may split one job)."""

    __name__ = "shard"

    def __call__(self, text: Any) -> str:
        self.parse(text)
        return str(text)

    def parse(self, text: Any) -> tuple[int, int]:
        match = _SHARD.fullmatch(text) if isinstance(text, str) else None
        if match is None or not 0 <= int(match[1]) < int(match[2]):
            raise self.refuse(text, "I/N with 0 <= I < N, e.g. 0/4")
        return int(match[1]), int(match[2])


def check_bind(host: str, port: int) -> None:
    """Binds (host, port) once and lets it go, so that a host that does not resolve, a port in use or
    one this user may not take is one line before a server starts (servers report it as a trace)."""
    import socket

    allowed = "an address this machine can bind"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise InputError("address", f"{host}:{port}", f"{allowed} (the host does not resolve: {exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            raise InputError("address", f"{host}:{port}", f"{allowed} ({exc.strerror or exc})") from None
