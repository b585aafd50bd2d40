"""A campaign trial's record: what one Optuna trial is and holds, read and written in one place.

A trial's state lives in its Optuna user attributes (the dashboard shows them, and every worker
reads them through the shared database). Which kind of trial it is follows from the attributes it
carries and its Optuna state. This module is the only code that names those attributes, or touches
`user_attrs`, `set_user_attr` and `system_attrs` of a trial or a study (tests/test_record.py keeps it
so): `read` decodes a trial into a typed `TrialRecord` (campaigns stored before this module read the
same way: the names are unchanged), `campaign_view` reads a starting trial's campaign once,
decisions are made on the records' fields, and a `RunningTrial`'s methods write them.

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

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import optuna

from pnmix.configs import Answer, answer_from_dict
from pnmix.layerwise import config_key

# What a full evaluation leaves on its trial, and what a copy of its score carries along.
# "units" (each item's 1/0, each trajectory's KL) make scores comparable item by item across trials.
SCORE_ATTRS = ("accuracy", "parts", "kv_bytes", "decode_tokens_per_s", "backend", "device", "versions",
               "fidelity_kl", "fidelity_agreement", "seconds", "accuracy_se", "parts_se", "units", "timings",
               "proxy_kl")
BITS_ATTRS = ("config", "bits", "key_bits", "kv_bits")
FINISHED_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


class Kind(StrEnum):
    SCORED = "scored"
    REUSED = "reused"
    SHARED = "shared"
    SKIPPED = "skipped"
    SURPLUS = "surplus"
    PRUNED = "pruned"
    FAILED = "failed"
    PENDING = "pending"

    @property
    def takes_slot(self) -> bool:
        """Whether a trial of this kind takes one of its budget's requested slots: every kind but
        surplus, skipped and shared. A pending trial does (another worker's running trial holds its
        slot while it runs); among finished trials, the scored, reused and pruned ones do.
        Over-budget proposals cost no inference, so they take none (the sampler still sees them as
        infeasible), and neither do the surplus trials of a racing worker nor the scores another
        budget's study shared."""
        return self not in (Kind.SURPLUS, Kind.SKIPPED, Kind.SHARED)


class Origin(StrEnum):
    """Where a pnmix-alloc trial's layer-wise config came from (tuner/search/allocation.py)."""

    ALLOCATION = "allocation"  # the allocator's config for the budget at the trial's shared fields
    PROPOSAL = "proposal"  # a warm start's config, queued with the trial
    MOVE = "move"  # a local move from the best config scored at those shared fields


@dataclass(frozen=True)
class TrialRecord:
    """One Optuna trial as the campaign sees it. Every field is None (or empty) where the trial
    does not hold it: a pending trial has no score, a skipped one no inference, and so on."""

    number: int
    kind: Kind
    state: optuna.trial.TrialState
    started: datetime | None  # when a worker started it (None: still waiting)
    params: dict[str, Any]  # its Optuna parameters; a waiting or running trial's as they were queued
    config_dict: dict[str, Any] | None  # the config as stored (`config` parses it)
    label: str | None  # the config's short label (the dashboard shows it)
    bits: float | None  # the figure the budget bounds (key bits, or KV bits under a KV budget)
    key_bits: float | None
    kv_bits: float | None
    accuracy: float | None
    accuracy_se: float | None
    parts: dict[str, float] | None  # each part's score
    units: dict[str, list[float]] | None  # each part's per-unit outcomes: what pairs two scores
    kv_bytes: int | None  # the measured cache bytes of the evaluation
    throughput: float | None  # decode tokens/s of the evaluation
    backend: str | None
    device: str | None
    versions: dict[str, str] | None  # library versions the evaluation ran under
    seconds: float | None  # the evaluation's wall time (a pruned race: its rungs')
    timings: dict[str, float]  # where the evaluation's seconds went (kernel compiles, ...)
    proxy_kl: float | None  # multi-fidelity: the proxy's attention KL
    rung: dict[str, Any] | None  # racing: the last finished rung (a retried trial resumes after it)
    pruned_at: float | None  # racing: the share of the items at which the trial was stopped
    partial_accuracy: float | None  # racing: the accuracy on that share, with its SE
    partial_accuracy_se: float | None
    origin: Origin | None  # pnmix-alloc only
    proposal: dict[str, Any] | None  # pnmix-alloc warm start: the config queued with the trial
    neighbour_of: str | None  # queued as a neighbour of the config with this label
    sensitivity_s: float  # seconds this trial spent on the allocator's sensitivity tables
    source: str | None  # reused or shared: "study#trial" of the original score ("#trial": this study)
    error: str | None
    warm_start: bool

    @property
    def config(self) -> Answer | None:
        return answer_from_dict(self.config_dict) if self.config_dict is not None else None

    @property
    def has_score(self) -> bool:
        return self.accuracy is not None and self.kind in (Kind.SCORED, Kind.REUSED, Kind.SHARED)

    @property
    def original(self) -> bool:
        """Its score is its own evaluation, not a copy (what a front keeps and what sharing spreads)."""
        return self.kind == Kind.SCORED and self.accuracy is not None

    @property
    def copied_from_twin(self) -> bool:
        """A copy of a twin's score in the same study (the twin stands for the config, not this one)."""
        return self.source is not None and self.source.startswith("#")

    @property
    def copied_from_another_study(self) -> bool:
        """A score another budget's study holds the original of (a shared or cross-budget reused copy)."""
        return self.source is not None and not self.source.startswith("#")

    @property
    def stands_for_its_config(self) -> bool:
        """Its score stands for its config in its study: its own evaluation, or a score from another
        budget's study; not a copy of a twin in the same study (the twin stands)."""
        return self.accuracy is not None and not self.copied_from_twin


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


def takes_slot(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial takes one of its budget's requested slots (`Kind.takes_slot`)."""
    return kind_of(trial).takes_slot


def _bits(attrs: dict[str, Any]) -> float | None:
    """The figure the budget bounds (key bits, or KV bits under a KV budget); trials recorded before
    KV budgets hold it as their key bits."""
    bits = attrs.get("bits", attrs.get("key_bits"))
    return None if bits is None else float(bits)


def budget_bits(trial: optuna.trial.FrozenTrial) -> float:
    """A trial's `_bits`; KeyError for a trial that holds no config yet."""
    bits = _bits(trial.user_attrs)
    if bits is None:
        raise KeyError("bits")
    return bits


def stored_config(trial: optuna.trial.FrozenTrial) -> dict[str, Any] | None:
    """The config a trial stores, as its dict, read without decoding the rest of the record."""
    return trial.user_attrs.get("config")


def read(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    """The record of a trial (any campaign this product stored: trials recorded before KV budgets
    hold their budget's figure as `key_bits` only)."""
    a = trial.user_attrs
    source = a.get("score_from") or (f"#{a['reused_from']}" if "reused_from" in a else None)
    pending = trial.state in (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)
    # A queued trial holds its parameters in `fixed_params` until a worker starts it.
    params = dict(trial.system_attrs.get("fixed_params", trial.params) if pending else trial.params)
    return TrialRecord(
        number=trial.number, kind=kind_of(trial), state=trial.state, started=trial.datetime_start, params=params,
        config_dict=a.get("config"), label=a.get("label"),
        bits=_bits(a), key_bits=a.get("key_bits"), kv_bits=a.get("kv_bits"), accuracy=a.get("accuracy"),
        accuracy_se=a.get("accuracy_se"), parts=a.get("parts"), units=a.get("units"), kv_bytes=a.get("kv_bytes"),
        throughput=a.get("decode_tokens_per_s"), backend=a.get("backend"), device=a.get("device"),
        versions=a.get("versions"), seconds=a.get("seconds"), timings=a.get("timings") or {},
        proxy_kl=a.get("proxy_kl"), rung=a.get("rung"), pruned_at=a.get("pruned_at"),
        partial_accuracy=a.get("partial_accuracy"), partial_accuracy_se=a.get("partial_accuracy_se"),
        origin=Origin(a["origin"]) if a.get("origin") else None, proposal=a.get("proposal"),
        neighbour_of=a.get("neighbour_of"), sensitivity_s=float(a.get("sensitivity_s", 0.0)), source=source,
        error=a.get("error"), warm_start=bool(a.get("warm_start")))


@dataclass(frozen=True)
class Scored:
    """A full evaluation (or a copy of one) that a study of the campaign holds."""

    study: str  # the study's name
    trial: optuna.trial.FrozenTrial  # what a copy of the score copies
    record: TrialRecord


@dataclass(frozen=True)
class CampaignView:
    """What a trial sees of its campaign when it starts, read once: its own study's trials as
    records, and the scored trials of the campaign's studies (its own study first)."""

    study: str  # the trial's own study
    trials: list[TrialRecord]  # its trials, in trial order
    scored: list[Scored]  # its own study's first
    scored_keys: frozenset[str]  # `config_key` of every scored config (evaluations, reused and shared scores)


def campaign_view(studies: Sequence[optuna.Study]) -> CampaignView:
    """The view of a trial of `studies[0]`, the campaign's studies with the trial's own first."""
    own = [(t, read(t)) for t in studies[0].get_trials(deepcopy=False)]
    complete = optuna.trial.TrialState.COMPLETE
    scored = [Scored(studies[0].study_name, t, r) for t, r in own if r.state == complete]
    for st in studies[1:]:
        scored += [Scored(st.study_name, t, read(t)) for t in st.get_trials(deepcopy=False, states=(complete,))]
    scored = [s for s in scored if s.record.accuracy is not None and s.record.config_dict is not None]
    return CampaignView(studies[0].study_name, [r for _, r in own], scored,
                        frozenset(config_key(s.record.config_dict or {}) for s in scored))


# -- the trial being run -------------------------------------------------------------------------


class RunningTrial:
    """The trial a worker runs, as the record sees it: what it was queued with, read once when it
    starts, and the writes of its lifetime. Each write is stored at once: other workers read a
    running trial's config (so that two never score the same one), the dashboard shows its
    progress, and a retry of a dead worker's trial resumes after its last finished rung."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial
        attrs = trial.user_attrs
        self.warm_start = bool(attrs.get("warm_start"))  # queued as a warm start
        self.saved_rung: dict[str, Any] | None = attrs.get("rung")  # racing: inherited by a retry
        proposal = attrs.get("proposal")  # pnmix-alloc warm start: the config queued with it
        self.proposal: Answer | None = answer_from_dict(proposal) if proposal is not None else None

    def write_config(self, config: Answer, bits: float, key_bits: float, kv_bits: float,
                     origin: Origin | None = None) -> None:
        """What the trial is about to score: its config (and label, for the dashboard) and its bit figures."""
        self._set(config=config.to_dict(), label=config.label, bits=bits, key_bits=key_bits, kv_bits=kv_bits)
        if origin is not None:
            self._set(origin=str(origin))

    def mark_skipped(self) -> None:
        self._set(skipped="over budget: no inference run")

    def mark_surplus(self) -> None:
        self._set(surplus=True)

    def mark_failed(self, reason: str) -> None:
        self._set(error=reason)

    def write_proxy(self, proxy_kl: float) -> None:
        self._set(proxy_kl=proxy_kl)

    def write_rung(self, rung: dict[str, Any]) -> None:
        """A finished racing rung (`tuner.scoring.score.Rung.to_dict()`): a retry resumes after it."""
        self._set(rung=rung)

    def mark_raced_out(self, share: float, accuracy: float, accuracy_se: float | None, seconds: float) -> None:
        """Racing stopped the trial at `share` of the items, with its partial score there."""
        self._set(pruned_at=share, partial_accuracy=accuracy, partial_accuracy_se=accuracy_se, seconds=seconds)

    def add_sensitivity_seconds(self, seconds: float) -> None:
        self._set(sensitivity_s=seconds + self.trial.user_attrs.get("sensitivity_s", 0.0))

    def write_score(self, score: Any) -> None:
        """A full evaluation's results (a `tuner.scoring.score.Score`)."""
        self._set(**{name: getattr(score, name) for name in SCORE_ATTRS if name != "proxy_kl"})

    def copy_score(self, twin: optuna.trial.FrozenTrial, source: str | None) -> None:
        """`twin`'s score: reused from this study (`source` None: the twin stands on the front) or
        from another budget's study `source` (the score belongs on this front too)."""
        self._set(**{name: twin.user_attrs[name] for name in SCORE_ATTRS if name in twin.user_attrs})
        if source is None:
            self._set(reused_from=twin.number)
        else:
            self._set(score_from=f"{source}#{twin.number}")

    def _set(self, **attrs: Any) -> None:
        for name, value in attrs.items():
            self.trial.set_user_attr(name, value)


def shared_attrs(trial: optuna.trial.FrozenTrial, source: str) -> dict[str, Any]:
    """The attributes of `trial`'s score copied into another budget's study (a `shared` trial)."""
    attrs = {name: trial.user_attrs[name] for name in (*SCORE_ATTRS, *BITS_ATTRS, "label", "origin")
             if name in trial.user_attrs}
    return {**attrs, "score_from": f"{source}#{trial.number}", "shared": True}


def enqueue_warm_start(study: optuna.Study, params: dict[str, Any], proposal: Answer | None = None) -> None:
    """Queues a warm start (pnmix-alloc: with the config it proposes, which the trial takes)."""
    attrs: dict[str, Any] = {"warm_start": True}
    if proposal is not None:
        attrs["proposal"] = proposal.to_dict()
    study.enqueue_trial(params, user_attrs=attrs)


def enqueue_neighbour(study: optuna.Study, params: dict[str, Any], of: Answer) -> None:
    """Queues a trial of a neighbour of config `of` (it carries `of`'s label)."""
    study.enqueue_trial(params, user_attrs={"neighbour_of": of.label})


def add_shared(study: optuna.Study, trial: optuna.trial.FrozenTrial, source: str,
               distributions: dict[str, Any], constraints: dict[str, float]) -> None:
    """Adds `trial`'s score, from study `source`, to `study` as a COMPLETE `shared` trial."""
    study.add_trial(optuna.trial.create_trial(
        values=list(trial.values), params=trial.params, distributions=distributions,
        user_attrs=shared_attrs(trial, source), constraints=constraints))


# -- studies -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyInfo:
    """What a campaign's study says of itself (the dashboard shows it)."""

    budget: float | None
    campaign_id: int | None
    model: str | None
    method: str | None


def write_study_info(study: optuna.Study, info: StudyInfo) -> None:
    study.set_user_attr("budget", info.budget)
    study.set_user_attr("campaign_id", info.campaign_id)
    study.set_user_attr("model", info.model)
    study.set_user_attr("method", info.method)


def study_info(study: optuna.Study) -> StudyInfo:
    a = study.user_attrs
    return StudyInfo(budget=a.get("budget"), campaign_id=a.get("campaign_id"), model=a.get("model"),
                     method=a.get("method"))


def scored_configs(study: optuna.Study) -> set[str]:
    """Keys of the configs with a score in `study` (its own evaluations, reused and shared ones)."""
    return {config_key(t.user_attrs["config"]) for t in study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if "accuracy" in t.user_attrs}


def running_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))


def records(study: optuna.Study, states: tuple[optuna.trial.TrialState, ...] | None = None) -> list[TrialRecord]:
    """Every trial of `study` (of `states`, when given) as a record, in trial order."""
    return [read(t) for t in study.get_trials(deepcopy=False, states=states)]
