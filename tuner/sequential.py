"""The scoring engine's interface, one sequence at a time through the live path: for the models
whose caches the batched engine (tuner/engine.py) cannot build from recorded prefills.

The batched engine records each prompt's prefill once and builds every config's cache from it;
its caches are PN-Mix layers only. A model with sliding-window layers (Gemma 3) keeps those
layers' windows in transformers' own layer beside the quantized full-attention layers
(`pnmix.cache.WindowLayer`), which `generate` builds and masks but a recorded prefill does not.
For such a model the evaluator takes this engine: every item is answered by `generate` with the
config's cache (`tuner.tasks.answer`), every trajectory is teacher-forced through a fresh cache
(`tuner.fidelity.replay`), and the cost workload is decoded step by step on the live cache. The
outcomes are the same kind of units as the batched engine's (each item's correctness, each
trajectory's mean KL and top-1 agreement), so scores, standard errors and paired differences
read the same; a trial costs a prefill per item and per trajectory instead of one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pnmix.layerwise import AnyConfig
from pnmix.tuner import fidelity as fidelity_module
from pnmix.tuner import tasks as tasks_module
from pnmix.tuner.engine import Progress, Trajectory, check_context, context_of, live_cost
from pnmix.tuner.profiles import EvalError
from pnmix.tuner.tasks import Item


@dataclass
class _Sequence:
    prompt_ids: list[int]
    tokens: torch.Tensor  # [n] on the host
    ref_logp: torch.Tensor  # [n, V] float32: fp16's next-token log-probabilities


class SequentialEngine:
    """`ScoringEngine`'s interface (items, replays, outcomes, fidelity, continuations, cost) on the
    live path, one sequence at a time (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, progress: Progress | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        self.progress = progress or (lambda message: None)
        self.context = context_of(model)
        self.items: dict[str, list[Item]] = {}
        self.replays: dict[str, list[_Sequence]] = {}

    def _check_fits(self, what: str, tokens: int) -> None:
        check_context(self.context, what, tokens)

    # -- items -----------------------------------------------------------------------------------

    def add_items(self, task: str, items: list[Item], prompt_ids: list[list[int]] | None = None) -> None:
        if prompt_ids is not None:
            raise EvalError("synthetic prompts need the batched engine")
        self.items.setdefault(task, []).extend(items)

    def keep_items(self, task: str, indices: list[int]) -> None:
        self.items[task] = [self.items[task][i] for i in indices]

    def outcomes(self, config: AnyConfig, task: str, start: int = 0) -> list[float]:
        return self.all_outcomes(config, {task: range(start, len(self.items[task]))})[task]

    @torch.inference_mode()
    def all_outcomes(self, config: AnyConfig, spans: Mapping[str, Sequence[int]]) -> dict[str, list[float]]:
        return {task: [float(self.items[task][i].is_correct(
            tasks_module.answer(self.model, self.tokenizer, config, self.items[task][i]))) for i in span]
            for task, span in spans.items()}

    # -- teacher-forced sequences ----------------------------------------------------------------

    @property
    def trajectories(self) -> list[_Sequence]:
        return self.replays.get("fidelity", [])

    def add_trajectories(self, trajectories: list[Trajectory], part: str = "fidelity") -> None:
        have = len(self.replays.get(part, []))
        for i, traj in enumerate(trajectories):
            self._check_fits(f"{part} sequence {have + i}", len(traj.prompt_ids) + len(traj.tokens))
        self.replays.setdefault(part, []).extend(
            _Sequence(traj.prompt_ids, torch.tensor(traj.tokens), traj.reference_logits.float().log_softmax(-1))
            for traj in trajectories)

    @torch.inference_mode()
    def continuations(self, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
        for i, p in enumerate(prompts):
            self._check_fits(f"trajectory {i}", len(p) + n_tokens)
        return [fidelity_module.trajectory(self.model, torch.tensor([p]), n_tokens) for p in prompts]

    @torch.inference_mode()
    def fidelity(self, config: AnyConfig, chunk: int | None = None, rows: Sequence[int] | None = None,
                 part: str = "fidelity") -> list[tuple[float, float]]:
        every = self.replays.get(part, [])
        chosen = every if rows is None else [every[i] for i in rows]
        out = []
        for seq in chosen:
            # replay() takes logits (it log-softmaxes them again: log-probabilities are their own logits)
            got = fidelity_module.replay(self.model, torch.tensor([seq.prompt_ids]), seq.tokens.tolist(), config,
                                         seq.ref_logp, **({"chunk": chunk} if chunk else {}))
            out.append((got.agreement, got.mean_kl))
        return out

    # -- cost ------------------------------------------------------------------------------------

    def measure_cost(self, config: AnyConfig, seed: int = 0) -> tuple[int, float, int | None]:
        """(bytes the cache holds, decode tokens/s, peak device bytes) on the batched engine's fixed
        workload, on the live cache (`tuner.engine.live_cost`): the bytes are `cache.nbytes()`, the
        windows of sliding layers included."""
        from pnmix.generation import new_cache

        return live_cost(self.model, lambda: new_cache(self.model, config), lambda c: int(c.nbytes()["total"]), seed)
