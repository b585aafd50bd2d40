"""Storage errors. Each subclasses `PNMixError`, so the CLI prints its one-line message (exit 2)."""

from __future__ import annotations

from pnmix.errors import PNMixError
from pnmix.storage.vocabulary import BudgetOn


class StorageError(PNMixError, RuntimeError):
    """A database operation failed. The message is one line and never shows a password."""


class SchemaError(StorageError):
    """The database schema is missing, older or newer than this code; the message names the fix."""


class NotFoundError(StorageError, LookupError):
    """A named model or a campaign id does not exist."""


class InvalidValueError(StorageError, ValueError):
    """A value was refused before touching the database (bad argument, broken invariant)."""


class NoFeasiblePointError(NotFoundError):
    """No front point of a model satisfies a recommendation's constraints.

    `smallest_bits` is the smallest key bits (KV bits for `bits_of="kv"`) among the model's points
    that meet `min_accuracy` (None when the model has no such point at all), so the caller can say
    what would fit.
    """

    def __init__(self, model: str, target_bits: float, min_accuracy: float, smallest_bits: float | None,
                 bits_of: str = "key") -> None:
        self.model = model
        self.target_bits = target_bits
        self.min_accuracy = min_accuracy
        self.smallest_bits = smallest_bits
        figure = "KV bits" if bits_of == BudgetOn.KV else "key bits"
        cond = f"{figure} <= {target_bits:g}" + (f" and accuracy >= {min_accuracy:g}" if min_accuracy > 0 else "")
        if smallest_bits is None:
            hint = "it has no front points" + (f" with accuracy >= {min_accuracy:g}" if min_accuracy > 0 else "")
        else:
            hint = f"the smallest feasible {figure} is {smallest_bits:.5f}"
        super().__init__(f"no front point of model {model!r} has {cond}: {hint}")
