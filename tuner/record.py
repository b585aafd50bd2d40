"""A campaign trial's record: what one Optuna trial is and holds, read and written in one place.

A trial's state lives in its Optuna user attributes (the dashboard shows them, and every worker
reads them through the shared database). Which kind of trial it is follows from the attributes it
carries and its Optuna state; this module is the only code that knows the attribute names:
`read` decodes a trial into a `TrialRecord` (campaigns stored before this module read the same
way: the names are unchanged) and the `write_*` / `mark_*` functions set them.

Kinds:
  scored   its config was evaluated by real inference in its own study
  reused   its config had been scored in the campaign already: that score is copied (takes a slot)
  shared   another budget's score, copied into this study because the config fits it (no slot)
  skipped  over the budget: no inference (no slot; the sampler learns it is infeasible)
  surplus  a worker's trial past the requested count (no slot)
  pruned   screened out by the proxy or stopped by racing (takes a slot)
  failed   raised (out of memory, ...), with the reason
  pending  waiting or running
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import optuna

from pnmix.layerwise import AnyConfig, config_from_dict

# What a full evaluation leaves on its trial, and what a copy of its score carries along.
# "units" (each item's 1/0, each trajectory's KL) make scores comparable item by item across trials.
SCORE_ATTRS = ("accuracy", "parts", "kv_bytes", "decode_tokens_per_s", "backend", "device", "versions",
               "fidelity_kl", "fidelity_agreement", "seconds", "accuracy_se", "parts_se", "units", "timings",
               "proxy_kl")
BITS_ATTRS = ("config", "bits", "key_bits", "kv_bits")


class Kind(StrEnum):
    SCORED = "scored"
    REUSED = "reused"
    SHARED = "shared"
    SKIPPED = "skipped"
    SURPLUS = "surplus"
    PRUNED = "pruned"
    FAILED = "failed"
    PENDING = "pending"


@dataclass(frozen=True)
class TrialRecord:
    number: int
    kind: Kind
    config_dict: dict[str, Any] | None  # the config as stored (`config` parses it)
    bits: float | None  # the figure the budget bounds (key bits, or KV bits under a KV budget)
    key_bits: float | None
    kv_bits: float | None
    accuracy: float | None
    accuracy_se: float | None
    units: dict[str, list[float]] | None
    origin: str | None  # pnmix-alloc: allocation, proposal or move
    source: str | None  # reused or shared: "study#trial" of the original score ("#trial": this study)
    error: str | None
    warm_start: bool
    attrs: dict[str, Any]  # everything else the trial holds (parts, timings, ...), read-only

    @property
    def config(self) -> AnyConfig | None:
        return config_from_dict(self.config_dict) if self.config_dict is not None else None

    @property
    def counts(self) -> bool:
        """Whether it takes one of the requested slots (`takes_slot`)."""
        return self.kind not in NO_SLOT

    @property
    def has_score(self) -> bool:
        return self.accuracy is not None and self.kind in (Kind.SCORED, Kind.REUSED, Kind.SHARED)

    @property
    def original(self) -> bool:
        """Its score is its own evaluation, not a copy (what a front keeps and what sharing spreads)."""
        return self.kind == Kind.SCORED and self.accuracy is not None


def kind_of(trial: optuna.trial.FrozenTrial) -> Kind:
    attrs, state = trial.user_attrs, trial.state
    # The kinds that take no slot first: a running trial already marked surplus or over budget is one.
    if attrs.get("surplus"):
        return Kind.SURPLUS
    if "skipped" in attrs:
        return Kind.SKIPPED
    if attrs.get("shared"):
        return Kind.SHARED
    if state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING):
        return Kind.PENDING
    if state == optuna.trial.TrialState.FAIL:
        return Kind.FAILED
    if state == optuna.trial.TrialState.PRUNED:
        return Kind.PRUNED
    if "reused_from" in attrs or "score_from" in attrs:
        return Kind.REUSED
    return Kind.SCORED


NO_SLOT = (Kind.SURPLUS, Kind.SKIPPED, Kind.SHARED)


def takes_slot(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial takes one of its budget's requested slots: every kind but surplus, skipped and
    shared. A pending trial does (another worker's running trial holds its slot while it runs); among
    finished trials, the scored, reused and pruned ones do."""
    return kind_of(trial) not in NO_SLOT


def stands_for_its_config(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial's score stands for its config in its study: its own evaluation, or a score
    from another budget's study; not a copy of a twin in the same study (the twin stands)."""
    return "accuracy" in trial.user_attrs and "reused_from" not in trial.user_attrs


def read(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    """The record of a trial (any campaign this product stored: trials recorded before KV budgets
    hold their budget's figure as `key_bits` only)."""
    a = trial.user_attrs
    bits = a.get("bits", a.get("key_bits"))
    source = a.get("score_from") or (f"#{a['reused_from']}" if "reused_from" in a else None)
    return TrialRecord(
        number=trial.number, kind=kind_of(trial), config_dict=a.get("config"),
        bits=None if bits is None else float(bits), key_bits=a.get("key_bits"), kv_bits=a.get("kv_bits"),
        accuracy=a.get("accuracy"), accuracy_se=a.get("accuracy_se"), units=a.get("units"), origin=a.get("origin"),
        source=source, error=a.get("error"), warm_start=bool(a.get("warm_start")), attrs=dict(a))


# -- writing -------------------------------------------------------------------------------------


def write_config(trial: optuna.Trial, config: AnyConfig, bits: float, key_bits: float, kv_bits: float,
                 origin: str | None = None) -> None:
    """What a trial is about to score: its config (and label, for the dashboard) and its bit figures."""
    trial.set_user_attr("config", config.to_dict())
    trial.set_user_attr("label", config.label)
    trial.set_user_attr("bits", bits)
    trial.set_user_attr("key_bits", key_bits)
    trial.set_user_attr("kv_bits", kv_bits)
    if origin is not None:
        trial.set_user_attr("origin", origin)


def mark_skipped(trial: optuna.Trial) -> None:
    trial.set_user_attr("skipped", "over budget: no inference run")


def mark_surplus(trial: optuna.Trial) -> None:
    trial.set_user_attr("surplus", True)


def mark_failed(trial: optuna.Trial, reason: str) -> None:
    trial.set_user_attr("error", reason)


def write_score(trial: optuna.Trial, score: Any) -> None:
    """A full evaluation's results (a `tuner.evaluate.Score`)."""
    for name in SCORE_ATTRS:
        if name != "proxy_kl":
            trial.set_user_attr(name, getattr(score, name))


def copy_score(trial: optuna.Trial, twin: optuna.trial.FrozenTrial, source: str | None) -> None:
    """`twin`'s score on `trial`: reused from this study (`source` None: the twin stands on the
    front) or from another budget's study `source` (the score belongs on this front too)."""
    for name in SCORE_ATTRS:
        if name in twin.user_attrs:
            trial.set_user_attr(name, twin.user_attrs[name])
    if source is None:
        trial.set_user_attr("reused_from", twin.number)
    else:
        trial.set_user_attr("score_from", f"{source}#{twin.number}")


def shared_attrs(trial: optuna.trial.FrozenTrial, source: str) -> dict[str, Any]:
    """The attributes of `trial`'s score copied into another budget's study (a `shared` trial)."""
    attrs = {name: trial.user_attrs[name] for name in (*SCORE_ATTRS, *BITS_ATTRS, "label", "origin")
             if name in trial.user_attrs}
    return {**attrs, "score_from": f"{source}#{trial.number}", "shared": True}


def config_key(config: AnyConfig | dict[str, Any]) -> str:
    """A config (or its dict) as one comparable string: what identifies a config across trials,
    studies and sweep files."""
    return json.dumps(config if isinstance(config, dict) else config.to_dict(), sort_keys=True)


def scored_configs(study: optuna.Study) -> set[str]:
    """Keys of the configs with a score in `study` (its own evaluations, reused and shared ones)."""
    return {config_key(t.user_attrs["config"]) for t in study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if "accuracy" in t.user_attrs}


def running_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
