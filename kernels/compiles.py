"""How many kernel specialisations this process compiled, and the seconds they took.

Triton compiles a kernel once per specialisation (its compile-time constants and what it
specialises its arguments on) and keeps the result in memory and in its disk cache. The first use
of a specialisation in a process either compiles it or reads it back from the disk cache; later
uses cost nothing. `watch()` installs Triton's compilation listener once per process, so that a
caller reads the counters before and after a piece of work (a trial, a campaign) and reports the
difference (`Compiles.since`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Compiles:
    compiled: int = 0  # specialisations compiled (not in Triton's disk cache)
    seconds: float = 0.0  # the compiler's seconds on them
    loaded: int = 0  # specialisations read back from the disk cache

    def __call__(self, *, times: Any, cache_hit: bool, **_: Any) -> None:
        if cache_hit:
            self.loaded += 1
        else:
            self.compiled += 1
            self.seconds += times.total / 1e6  # Triton's CompileTimes count microseconds

    def copy(self) -> Compiles:
        return dataclasses.replace(self)

    def since(self, before: Compiles) -> Compiles:
        """What was compiled and loaded after `before` (a `copy` taken earlier)."""
        return Compiles(self.compiled - before.compiled, self.seconds - before.seconds, self.loaded - before.loaded)


_LOG: Compiles | None = None


def watch() -> Compiles | None:
    """The process's counters, listening from the first call on; None where the installed Triton has
    no compilation listener (the counts are then unknown, not zero). A listener already installed
    by someone else keeps being called."""
    global _LOG
    if _LOG is not None:
        return _LOG
    try:
        import triton

        knobs = triton.knobs.compilation
        previous = knobs.listener
    except (ImportError, AttributeError):
        return None
    log = Compiles()

    def listener(**kwargs: Any) -> None:
        log(**kwargs)
        if previous is not None:
            previous(**kwargs)

    knobs.listener = listener
    _LOG = log
    return log
