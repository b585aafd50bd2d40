"""What scoring a config yields: a `Score` (accuracy parts with standard errors, bits, bytes,
throughput), a racing `Rung` (what a race has scored so far), and which units were scored (`Split`)."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import stats


class Split(StrEnum):
    """Which of a part's units a score covers (tuner/scoring/holdout.py)."""

    SEARCH = "search"  # what trials see
    HOLDOUT = "holdout"  # held back until the campaign is done


@dataclass
class Score:
    config: dict[str, Any]
    accuracy: float  # weighted mean of the parts, in [0, 1]
    parts: dict[str, float]  # each part's score in [0, 1]
    fidelity_agreement: float
    fidelity_kl: float
    key_bits: float  # formula, metadata included (the budget's number)
    kv_bytes: int  # measured: bytes the cache held after the fixed workload
    decode_tokens_per_s: float
    peak_memory_bytes: int | None  # CUDA only
    backend: str
    device: str
    versions: dict[str, str]
    seconds: float
    profile: str
    items: dict[str, int] = field(default_factory=dict)
    accuracy_se: float | None = None  # standard error of `accuracy` (tuner/scoring/stats.py)
    parts_se: dict[str, float | None] = field(default_factory=dict)
    # Per-unit outcomes: each item's 1/0, each trajectory's mean KL (what SEs and paired differences use).
    units: dict[str, list[float]] = field(default_factory=dict)
    # Seconds by part and "cost"; on CUDA also "kernel_compile", the compiler's share of those seconds,
    # and "kernels_compiled", the kernel specialisations this score compiled (first uses).
    timings: dict[str, float] = field(default_factory=dict)
    texts_kl: float = float("nan")  # the texts part's mean KL(p_fp16 || p_quant) per token (its score: agreement)

    @classmethod
    def from_units(cls, units: dict[str, list[float]], agreements: list[float], timings: dict[str, float],
                   cost: tuple[int, float, int | None], text_kls: list[float] | None = None, **fields: Any) -> Score:
        """The Score of per-unit outcomes: the parts, the combined accuracy, their standard errors and
        the fidelity means all follow from `units` (and `agreements`, `text_kls`); `cost` is (bytes held, decode
        tokens/s, peak device bytes); `fields` the rest (config, key_bits, backend, device, versions,
        seconds, profile). PN-Mix configs and transformers' peers are scored into it alike."""
        if not units:
            raise EvalError("no task produced a score (every item was filtered out); use more items or other tasks")
        parts = {name: stats.part_score(name, u) for name, u in units.items()}
        kls = units.get("fidelity", [])
        kv_bytes, tok_s, peak = cost
        return cls(
            accuracy=stats.combine(parts),
            parts=parts,
            fidelity_agreement=sum(agreements) / len(agreements) if agreements else float("nan"),
            fidelity_kl=sum(kls) / len(kls) if kls else float("nan"),
            kv_bytes=kv_bytes,
            decode_tokens_per_s=tok_s,
            peak_memory_bytes=peak,
            items={name: len(u) for name, u in units.items()},
            accuracy_se=stats.combined_se(units),
            parts_se={name: stats.part_se(name, u) for name, u in units.items()},
            units=units,
            timings=timings,
            texts_kl=sum(text_kls) / len(text_kls) if text_kls else float("nan"),
            **fields,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Rung:
    """What a race has scored of a config so far: per-unit outcomes, fidelity agreements, seconds."""

    units: dict[str, list[float]]
    agreements: list[float]
    seconds: float
    text_kls: list[float] = field(default_factory=list)  # each scored document's mean KL (texts part)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
