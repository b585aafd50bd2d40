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
from pnmix.tuner.engine import (
    COST_NEW_TOKENS,
    COST_PROMPT_TOKENS,
    COST_REPEATS,
    COST_STEPS,
    Progress,
    Trajectory,
    median_step_seconds,
)
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
        self.context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.items: dict[str, list[Item]] = {}
        self.replays: dict[str, list[_Sequence]] = {}

    def _check_fits(self, what: str, tokens: int) -> None:
        if self.context is not None and tokens > self.context:
            raise EvalError(f"{what} needs {tokens} tokens, more than the model's context of {self.context}: "
                            "use a profile with shorter contexts")

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

    @torch.inference_mode()
    def measure_cost(self, config: AnyConfig, seed: int = 0) -> tuple[int, float, int | None]:
        """(bytes the cache holds, decode tokens/s, peak device bytes) on the batched engine's fixed
        workload (COST_PROMPT_TOKENS random ids, then COST_NEW_TOKENS new ones), on the live cache:
        the bytes are `cache.nbytes()` after the new tokens (the windows of sliding layers included)."""
        from pnmix.generation import cache_kwargs, new_cache

        cuda = self.device.type == "cuda"
        rng = torch.Generator().manual_seed(seed)
        ids = torch.randint(100, 4000, (1, COST_PROMPT_TOKENS), generator=rng).to(self.device)
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        cache = new_cache(self.model, config)
        kw = cache_kwargs(self.model, cache)
        logits = self.model(input_ids=ids, use_cache=True, **kw).logits[:, -1]
        state = {"ids": logits.argmax(-1, keepdim=True), "pos": COST_PROMPT_TOKENS}

        def step() -> None:
            pos = torch.tensor([[state["pos"]]], device=self.device)
            out = self.model(input_ids=state["ids"], position_ids=pos, use_cache=True, **kw).logits[:, -1]
            state["ids"], state["pos"] = out.argmax(-1, keepdim=True), state["pos"] + 1

        for _ in range(COST_NEW_TOKENS - 1):  # the last new token is never fed back, as in `generate`
            step()
        kv_bytes = int(cache.nbytes()["total"])
        repeats, steps = COST_REPEATS["cuda" if cuda else "cpu"], COST_STEPS["cuda" if cuda else "cpu"]
        step_seconds = median_step_seconds(step, repeats, steps, cuda)
        peak = None
        if cuda:
            weights = sum(p.nbytes for p in self.model.parameters())
            peak = weights + int(torch.cuda.max_memory_allocated(self.device)) - before
        return kv_bytes, 1.0 / step_seconds, peak
