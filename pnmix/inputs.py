"""What the entry points accept: one definition of each range, and the parsers of the `pnmix` command.

`Range`s are the numeric domains the command line and the service share: a budget is a finite
number in (0, 16] whether it comes from `pnmix recommend --bits` or `GET /v1/recommend?target_bits=`.
This module holds the parsers and the method's own ranges (bit budgets, head dims, token counts,
seeds); what only the tuner, the storage and the service name (campaign fields, ports, hosts,
pages, database URLs, shards, environment settings) is in `pnmix.storage.vocabulary`, built on it.
The service builds its fields from them (`Range.constraints()`), the storage and the tuner check
with them (`Range.check`), and each option of the `pnmix` command parses through a `Parser` built
on them. A parser runs while the command line is parsed, before the command does any work (no
model load, no database opened, no file written); it refuses a value with an `InputError`, which
the command prints as one line (`api/cli.py`). Nothing is silently replaced: a value is accepted as
given or refused.

This module imports nothing heavy, so every layer may use it; the few checks that need a library
(a database URL's syntax) import it when they run.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnmix.errors import PNMixError

INT32_MAX = 2**31 - 1  # an INTEGER column's largest value (PostgreSQL; SQLite rows are kept to it too)
MAX_NAME = 255  # a model name: the database column, and a file name's length on common file systems
MAX_PATH = 4096  # PATH_MAX on Linux
SHOWN = 160  # characters of a refused value that an error message shows (a path fits)


def shorten(value: object, limit: int = SHOWN) -> str:
    """`repr` of a value, cut in the middle when long, so that an error stays one short line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[: limit - 40]}...{text[-24:]}{size}"


class InputError(PNMixError, ValueError):
    """A value an entry point does not accept: names what, the (shortened) value and what is allowed."""

    def __init__(self, what: str, value: object, allowed: str) -> None:
        self.what, self.value, self.allowed = what, value, allowed
        super().__init__(f"invalid {what} {shorten(value)}: allowed {allowed}")


def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (both included unless `low_open`), integers only if `integer`."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    even: bool = False

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high and not (self.even and value % 2)

    @property
    def allowed(self) -> str:
        kind = ("an even integer" if self.even else "an integer") if self.integer else "a finite number"
        return f"{kind} in {'(' if self.low_open else '['}{_number_text(self.low)}, {_number_text(self.high)}]"

    def check(self, what: str, value: Any) -> Any:
        if not self.contains(value):
            raise InputError(what, value, self.allowed)
        return value

    def constraints(self) -> dict[str, Any]:
        """pydantic `Field` keyword arguments that accept exactly this range."""
        out: dict[str, Any] = {"gt" if self.low_open else "ge": self.low, "le": self.high}
        if not self.integer:
            out["allow_inf_nan"] = False
        if self.even:
            out["multiple_of"] = 2
        return out


# -- the shared ranges ---------------------------------------------------------------------------

BUDGET = Range(0.0, 16.0, low_open=True)  # key bits per element: 16 is the unquantized cache
SEED = Range(0, INT32_MAX, integer=True)
HEAD_DIM = Range(2, 1024, integer=True, even=True)  # RoPE rotates channel pairs
COUNT = Range(1, INT32_MAX, integer=True)  # tokens, sequences, lengths
NEW_TOKENS = Range(1, 1 << 20, integer=True)  # tokens one command generates
# -- parsers of the command line's options -------------------------------------------------------


class Parser:
    """Turns an option's text into its value or raises `InputError`. Typer also hands it the
    option's default, already typed; a default is checked like any value."""

    __name__ = "value"  # what typer and click call the type

    def __call__(self, text: Any) -> Any:
        raise NotImplementedError

    def refuse(self, text: Any, allowed: str) -> InputError:
        return InputError("value", text, allowed)


_INT = re.compile(r"[+-]?[0-9]{1,30}")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")


class Int(Parser):
    """ASCII digits (no `1_000`, no other scripts' digits, no thousands of digits) in `range`, or
    one of `values` where only some integers are allowed."""

    __name__ = "integer"

    def __init__(self, range_: Range | None = None, values: Sequence[int] = ()) -> None:
        self.values = tuple(values)
        self.range = range_ or Range(min(self.values), max(self.values), integer=True)

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(map(str, self.values)) if self.values else self.range.allowed

    def __call__(self, text: Any) -> int:
        if isinstance(text, int) and not isinstance(text, bool):
            value = text
        elif isinstance(text, str) and _INT.fullmatch(text):
            value = int(text)
        else:
            raise self.refuse(text, self.allowed)
        if not self.range.contains(value) or (self.values and value not in self.values):
            raise self.refuse(text, self.allowed)
        return value


class Number(Parser):
    """A decimal number in `range`: no nan, inf or values that overflow to it."""

    __name__ = "number"

    def __init__(self, range_: Range) -> None:
        self.range = range_

    def __call__(self, text: Any) -> float:
        if isinstance(text, int | float) and not isinstance(text, bool):
            value = float(text)
        elif isinstance(text, str) and len(text) <= 40 and _FLOAT.fullmatch(text):
            value = float(text)
        else:
            raise self.refuse(text, self.range.allowed)
        if not self.range.contains(value):
            raise self.refuse(text, self.range.allowed)
        return value


class Choice(Parser):
    """One of a set of names (given, or computed on first use where the set lives in a heavier module)."""

    __name__ = "name"

    def __init__(self, names: Sequence[str] | Callable[[], Sequence[str]]) -> None:
        self._names = names

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names() if callable(self._names) else self._names)

    def __call__(self, text: Any) -> str:
        if text not in self.names:
            raise self.refuse(text, "one of " + ", ".join(self.names))
        return str(text)


class Names(Choice):
    """A comma-separated list of distinct names of a set, at least one (`a,b`; spaces around names
    ignored). `with_arguments`: names that may carry an argument, `name:ARGUMENT` (checked where used)."""

    __name__ = "names"

    def __init__(self, names: Sequence[str] | Callable[[], Sequence[str]], must_include: Sequence[str] = (),
                 with_arguments: Sequence[str] = ()) -> None:
        super().__init__(names)
        self.must_include = tuple(must_include)
        self.with_arguments = tuple(with_arguments)

    def _known(self, part: str) -> bool:
        name, colon, argument = part.partition(":")
        return part in self.names or bool(colon and argument.strip() and name in self.with_arguments)

    def __call__(self, text: Any) -> str:
        allowed = "distinct names among " + ", ".join(self.names) + ", comma-separated"
        if self.with_arguments:
            allowed += " (" + ", ".join(f"{n}:ARGUMENT" for n in self.with_arguments) + " too)"
        if self.must_include:
            allowed += ", including " + " and ".join(self.must_include)
        if not isinstance(text, str):
            raise self.refuse(text, allowed)
        parts = [part.strip() for part in text.split(",")]
        if (not all(self._known(p) for p in parts) or len(set(parts)) != len(parts)
                or not set(self.must_include) <= set(parts)):
            raise self.refuse(text, allowed)
        return ",".join(parts)


class Text(Parser):
    """Free text of `min_length` to `max_length` characters; control characters refused unless `lines`."""

    __name__ = "text"

    def __init__(self, min_length: int = 1, max_length: int = MAX_NAME, lines: bool = False) -> None:
        self.min_length, self.max_length, self.lines = min_length, max_length, lines

    @property
    def allowed(self) -> str:
        what = "text" if self.lines else "text without control characters"
        return f"{what}, {self.min_length} to {self.max_length} characters"

    def __call__(self, text: Any) -> str:
        if not isinstance(text, str) or not self.min_length <= len(text) <= self.max_length or "\x00" in text:
            raise self.refuse(text, self.allowed)
        if not self.lines and any(ord(c) < 32 or ord(c) == 127 for c in text):
            raise self.refuse(text, self.allowed)
        return text


class ModelName(Text):
    """A model: a registry name, a local checkpoint directory or a hub id (what exists is checked
    where the model is used: `pnmix.models.resolve`)."""

    __name__ = "model"

    def __init__(self) -> None:
        super().__init__(1, MAX_NAME)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a device, pipe or socket"


def _lstat(path: Path, shown: object, allowed: str) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a name too long, a file where a folder should be, no permission
        raise InputError("path", shown, f"{allowed} ({exc.strerror})") from None


def _writable_folder(folder: Path, shown: object, allowed: str, create: bool) -> None:
    """The folder (or, with `create`, its nearest existing ancestor) is a directory a file can be made in.
    Tried for real (a file made and removed at once): permissions, read-only mounts and /proc all say no."""
    probe = folder
    if create:
        while _lstat(probe, shown, allowed) is None and probe != probe.parent:
            probe = probe.parent
    st = _lstat(probe, shown, allowed)
    if st is None:
        raise InputError("path", shown, f"{allowed} (its folder {str(folder)[:80]} does not exist)")
    if not stat.S_ISDIR(os.stat(probe).st_mode):
        raise InputError("path", shown, f"{allowed} ({str(probe)[:80]} is not a directory)")
    try:
        fd, name = tempfile.mkstemp(prefix=".pnmix-probe-", dir=probe)
    except OSError as exc:
        raise InputError("path", shown, f"{allowed} (cannot write in {str(probe)[:80]}: {exc.strerror})") from None
    os.close(fd)
    os.unlink(name)


def _path_text(text: Any, allowed: str) -> Path:
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_PATH or "\x00" in text or not text.strip():
        raise InputError("path", text, allowed)
    return Path(text).expanduser().absolute()


class OutputFile(Parser):
    """A file to write: a regular file or a new one, never a directory, symbolic link or device.
    `create_folders`: its folder may be missing (made when the file is written)."""

    __name__ = "file"

    def __init__(self, create_folders: bool = False) -> None:
        self.create_folders = create_folders

    def __call__(self, text: Any) -> str:
        allowed = "a regular file, or a new file" + (" (folders are made)" if self.create_folders
                                                      else " in an existing folder")
        path = _path_text(text, allowed)
        st = _lstat(path, text, allowed)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise InputError("path", text, f"{allowed}, not {_kind(st.st_mode)}")
        _writable_folder(path.parent, text, allowed, self.create_folders)
        return str(text)


class OutputFolder(Parser):
    """A folder to write into: an existing directory, or a new one under a writable folder."""

    __name__ = "folder"

    def __call__(self, text: Any) -> str:
        allowed = "a directory, or a new one in a writable folder"
        path = _path_text(text, allowed)
        st = _lstat(path, text, allowed)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            kind = "a file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
            raise InputError("path", text, f"{allowed}, not {kind}")
        _writable_folder(path if st is not None else path.parent, text, allowed, create=True)
        return str(text)


class InputFile(Parser):
    """An existing, readable regular file (a symbolic link to one is followed)."""

    __name__ = "file"

    def __call__(self, text: Any) -> str:
        allowed = "an existing, readable file"
        path = _path_text(text, allowed)
        try:
            st = path.stat()
        except OSError as exc:
            raise InputError("path", text, f"{allowed} ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise InputError("path", text, f"{allowed}, not {_kind(st.st_mode)}")
        if not os.access(path, os.R_OK):
            raise InputError("path", text, f"{allowed} (no permission to read it)")
        return str(text)
