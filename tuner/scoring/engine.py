"""The scoring engine: a trial pays only for decode, in batches, from prefills recorded once.

Preparation (once per evaluator): every item's chat prompt and every fidelity trajectory's prompt
is prefilled once, unquantized (`pnmix.prefill.record_prefills`: exact attention, so the same for
every config; on CUDA many prompts in one right-padded forward pass). A trial then builds its
config's caches from those states (saliency, quantize, pack: the live prefill's code) and decodes:
- item tasks: all items of a task answer greedily in one batch, split only where memory needs
  it. On CUDA the decode runs on the static CUDA-graph path (`pnmix.static.StaticGenerator.start`,
  graphs without torch.compile) for the configs it covers (fp16, and keys and values both
  quantized), else on the batched
  dynamic cache, which is also the CPU path. Rows stop at the end-of-sequence token, as `generate`
  does for one item. A model with sliding-window layers (Gemma 3) builds its windows per sequence
  (`pnmix.cache.BatchWindowLayer`), and the static path takes them over as rings
  (`pnmix.static.StaticWindowLayer`).
- fidelity and texts: all trajectories (fp16 continuations, or the user's documents: tuner/scoring/texts.py)
  of a part are teacher-forced together, the whole trajectory in one forward
  pass where the logits fit (`replay_chunk`), through caches that keep their dequantized view up
  to date as groups are packed (on CUDA the kernels pack; the view is never rebuilt from the
  bytes). A multi-token step attends exactly as token-by-token decode (`pnmix.cache.Flushed`).
Outcomes stay per unit (each item's correctness, each trajectory's mean KL), which is what
tuner/scoring/stats.py turns into standard errors and paired differences.

Where the states live: on the model's device when they take at most STATE_DEVICE_SHARE of its
free memory, else on the host (moved to the device a batch at a time). They are recomputed in
each process rather than cached on disk: on the embedded model a prefill costs about as much as
reading its states back (46 KiB a token in fp32), and the items' text is what the disk cache holds.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pnmix.bits import LayerPlan
from pnmix.configs import Answer, batch_cache
from pnmix.families import plan_of_config, shape_of_config
from pnmix.generation import cache_kwargs
from pnmix.prefill import PrefillState, record_prefill, record_prefills
from pnmix.recipe_cache import RecipeBatchCache
from pnmix.recipes import EngineRecipe
from pnmix.static import StaticGenerator
from pnmix.tuner.errors import EvalError
from pnmix.tuner.scoring import cost
from pnmix.tuner.scoring.tasks import Item

STATE_DEVICE_SHARE = 0.4  # of the device's free memory that the recorded states may take
BATCH_MEMORY_SHARE = 0.5  # of the free memory (after the states) that one decode batch may take
DECODE_BYTES_FACTOR = 3  # a decode batch holds about this many times its states' bytes (view, packed, work)
EOS_CHECK_EVERY = 4  # static decode steps between looks at whether every row has ended
LOGIT_COPIES = 4  # a replay's logits are held about this many times (float32, log-softmax, KL terms)
# Prompts prefilled together (right-padded) on CUDA, where a short prompt's prefill costs mostly
# launches; on the CPU one at a time, where batching buys nothing and each state stays bit-exact.
PREFILL_BATCH_TOKENS = {"cuda": 32768, "cpu": 0}

Progress = Callable[[str], None]


@dataclass
class Trajectory:
    """An fp16 greedy continuation of a prompt, and the fp16 next-token distribution along it."""

    prompt_ids: list[int]
    tokens: list[int]
    reference_logits: torch.Tensor  # [len(tokens), V] float32


@dataclass
class _PreparedTrajectory:
    state: PrefillState
    tokens: torch.Tensor  # [n] on the host
    ref_logp: torch.Tensor  # [n, V] float32: fp16's next-token log-probabilities
    ref_top: torch.Tensor  # [n] fp16's argmax
    prompt_ids: list[int]  # what `state` is the prefill of (the one-sequence reference replays it)


def free_bytes(device: torch.device) -> int:
    """Memory a scoring batch may still use on `device`: free CUDA memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def context_of(model: Any) -> int | None:
    """The model's context in tokens (`max_position_embeddings`), or None where it states none."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_context(context: int | None, what: str, tokens: int) -> None:
    """One line, before any work, for a sequence longer than the model's context."""
    if context is not None and tokens > context:
        raise EvalError(f"{what} needs {tokens} tokens, more than the model's context of {context}: "
                        "use a profile with shorter contexts")


class ScoringEngine:
    """Scores configs on fixed items and trajectories of one model (see the module docstring).

        engine = ScoringEngine(model, tokenizer)
        engine.add_items("passkey", items)          # one exact prefill per item
        engine.add_trajectories(trajectories)       # one exact prefill per trajectory prompt
        engine.outcomes(config, "passkey")          # [1.0, 0.0, ...], one per item
        engine.fidelity(config)                     # [(top-1 agreement, mean KL), ...]
    """

    def __init__(self, model: Any, tokenizer: Any, progress: Progress | None = None,
                 memory_bytes: int | None = None, plan: LayerPlan | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        eos = model.config.eos_token_id  # an id, a list of ids, or None (random-weight shape models)
        self.eos: list[int] = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        self.progress = progress or (lambda message: None)
        self.context = context_of(model)
        # What each layer holds (kinds, sliding window): the loaded model's, or read from its config.
        self.plan = plan if plan is not None else plan_of_config(model.config)
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._last_only: dict[str, int] = {"logits_to_keep": 1} if keeps else {}
        self._budget = memory_bytes if memory_bytes is not None else free_bytes(self.device)
        self.items: dict[str, list[Item]] = {}
        self.states: dict[str, list[PrefillState]] = {}
        # Teacher-forced sequences by part: "fidelity" (fp16 trajectories), "texts" (the user's documents).
        self.replays: dict[str, list[_PreparedTrajectory]] = {}
        self._cost_state: PrefillState | None = None

    def _check_fits(self, what: str, tokens: int) -> None:
        """One line, before any work, for a prompt the model or the memory cannot take."""
        check_context(self.context, what, tokens)
        need = tokens * self._state_bytes_per_token() * DECODE_BYTES_FACTOR
        if need > self._budget * BATCH_MEMORY_SHARE:
            raise EvalError(f"{what} needs {need / 2**20:.0f} MiB to decode, more than the "
                            f"{self._budget * BATCH_MEMORY_SHARE / 2**20:.0f} MiB available: use a smaller profile")

    def _prefill(self, prompts: list[torch.Tensor]) -> list[PrefillState]:
        """`record_prefills` of the prompts, batched as the device wants (`PREFILL_BATCH_TOKENS`)."""
        return record_prefills(self.model, prompts, PREFILL_BATCH_TOKENS.get(self.device.type, 0))

    def _record(self, prompts: list[torch.Tensor]) -> list[PrefillState]:
        """The prompts' prefill states (`_prefill`), each kept on the GPU while the states take
        little of it, else on the host."""
        states = self._prefill(prompts)
        if self.device.type == "cuda":
            used = self.state_bytes()
            for i, state in enumerate(states):
                used += state.nbytes()
                if used > STATE_DEVICE_SHARE * self._budget:
                    states[i] = state.to("cpu")
        return states

    def add_items(self, task: str, items: list[Item], prompt_ids: list[list[int]] | None = None) -> None:
        """Prefills every item's chat prompt once (exactly, unquantized) and adds it to `task`'s items.

        prompt_ids, if given, are the token ids to prefill instead of the tokenized chat prompts
        (synthetic timing workloads on models without a tokenizer).
        """
        from pnmix.models import chat_ids

        have = len(self.items.get(task, []))
        if prompt_ids is not None:
            prompts = [torch.tensor([ids]) for ids in prompt_ids]
        else:
            prompts = [chat_ids(self.tokenizer, item.prompt)["input_ids"] for item in items]
        for i, (item, ids) in enumerate(zip(items, prompts, strict=True)):
            self._check_fits(f"{task} item {have + i}", ids.shape[1] + item.max_new_tokens)
        self.progress(f"prefilling {len(items)} {task} items once")
        states = self._record(prompts)
        self.items[task] = self.items.get(task, []) + list(items)
        self.states[task] = self.states.get(task, []) + states

    def keep_items(self, task: str, indices: list[int]) -> None:
        """Keeps only these items of `task` (e.g. those the unquantized model answers)."""
        self.items[task] = [self.items[task][i] for i in indices]
        self.states[task] = [self.states[task][i] for i in indices]

    @property
    def trajectories(self) -> list[_PreparedTrajectory]:
        """The fidelity part's trajectories."""
        return self.replays.get("fidelity", [])

    def add_trajectories(self, trajectories: list[Trajectory], part: str = "fidelity") -> None:
        """Prefills every trajectory's prompt once and keeps its fp16 next-token distributions."""
        have = len(self.replays.get(part, []))
        for i, traj in enumerate(trajectories):
            self._check_fits(f"{part} sequence {have + i}", len(traj.prompt_ids) + len(traj.tokens))
        states = self._record([torch.tensor([traj.prompt_ids]) for traj in trajectories])
        for traj, state in zip(trajectories, states, strict=True):
            ref = traj.reference_logits.to(self.device).float()
            self.replays.setdefault(part, []).append(_PreparedTrajectory(
                state, torch.tensor(traj.tokens), ref.log_softmax(-1), ref.argmax(-1), list(traj.prompt_ids)))

    @torch.inference_mode()
    def continuations(self, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
        """The unquantized model's greedy continuations of `prompts`, exactly n_tokens each (no stop),
        in one batch: the fidelity trajectories."""
        from pnmix.config import preset

        for i, p in enumerate(prompts):
            self._check_fits(f"trajectory {i}", len(p) + n_tokens)
        states = self._prefill([torch.tensor([p]) for p in prompts])
        out: list[list[int]] = []
        for rows in self._batches(states, n_tokens):
            tokens = self.greedy(preset("fp16"), [states[i] for i in rows], n_tokens, stop=False)
            out.extend(tokens.tolist())
        return out

    # -- memory ----------------------------------------------------------------------------------

    def _state_bytes_per_token(self) -> int:
        text = self.model.config.get_text_config(decoder=True)
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return 2 * text.num_hidden_layers * kv_heads * head_dim * self.model.dtype.itemsize

    def state_bytes(self) -> int:
        """Bytes the recorded states hold (items and trajectory prompts)."""
        return sum(s.nbytes() for ss in self.states.values() for s in ss) + sum(
            t.state.nbytes() for ts in self.replays.values() for t in ts)

    def _batches(self, states: list[PrefillState], new_tokens: int) -> list[range]:
        """Consecutive index ranges whose decode fits the memory budget."""
        per_token = self._state_bytes_per_token() * DECODE_BYTES_FACTOR
        room = BATCH_MEMORY_SHARE * self._budget
        out, start, used = [], 0, 0.0
        for i, s in enumerate(states):
            need = (s.length + new_tokens) * per_token
            if i > start and used + need > room:
                out.append(range(start, i))
                start, used = i, 0.0
            used += need
        out.append(range(start, len(states)))
        return out

    def _on_device(self, states: list[PrefillState]) -> list[PrefillState]:
        return [s if s.logits.device == self.device else s.to(self.device) for s in states]

    # -- item tasks ------------------------------------------------------------------------------

    @torch.inference_mode()
    def answers(self, config: Answer, task: str, start: int = 0) -> list[str]:
        """The greedy answer under `config` of every item of `task` from index `start` on, decoded."""
        return self._answers(config, {task: range(start, len(self.items[task]))})[task]

    def outcomes(self, config: Answer, task: str, start: int = 0) -> list[float]:
        """1.0 for every item (from index `start` on) answered correctly under `config`, else 0.0."""
        return self.all_outcomes(config, {task: range(start, len(self.items[task]))})[task]

    def all_outcomes(self, config: Answer, spans: Mapping[str, Sequence[int]]) -> dict[str, list[float]]:
        """`outcomes` of several tasks (task -> the item indices to answer), all those items in one
        batch: one cache build and one captured decode graph for the lot."""
        answers = self._answers(config, spans)
        return {task: [float(self.items[task][i].is_correct(text)) for i, text in zip(span, answers[task],
                                                                                       strict=True)]
                for task, span in spans.items()}

    @torch.inference_mode()
    def _answers(self, config: Answer, spans: Mapping[str, Sequence[int]]) -> dict[str, list[str]]:
        items = [self.items[task][i] for task, span in spans.items() for i in span]
        states = [self.states[task][i] for task, span in spans.items() for i in span]
        texts: list[str] = []
        if items:
            new = max(item.max_new_tokens for item in items)
            for rows in self._batches(states, new):
                tokens = self.greedy(config, self._on_device([states[i] for i in rows]), new)
                for row, i in enumerate(rows):
                    ended = self._until_eos(tokens[row, : items[i].max_new_tokens].tolist())
                    texts.append(str(self.tokenizer.decode(ended, skip_special_tokens=True)) if self.tokenizer else "")
        out: dict[str, list[str]] = {}
        for task, span in spans.items():
            out[task], texts = texts[: len(span)], texts[len(span):]
        return out

    def _until_eos(self, seq: list[int]) -> list[int]:
        for j, t in enumerate(seq):
            if t in self.eos:
                return seq[: j + 1]
        return seq

    def greedy(self, config: Answer, states: list[PrefillState], new_tokens: int,
                stop: bool = True) -> torch.Tensor:
        """Greedy tokens [B, new_tokens] after each state's prompt (the first from its logits).

        stop=False never ends a row and never picks the end-of-sequence token (as `generate` with
        min_new_tokens does), for trajectories of an exact length.
        """
        head_dim = states[0].keys[0].shape[-1]
        eos = torch.tensor(self.eos, dtype=torch.long, device=self.device)
        method = cost.static_path_of(self.model, self.plan, config, head_dim)
        cache = batch_cache(self.model, config, states)
        logits0 = _first_logits(cache, states)
        if not stop:
            logits0[:, eos] = float("-inf")
        first = logits0.argmax(-1)
        if method is not None:
            # Graphs without torch.compile: a trial decodes a few dozen steps per batch, and compiling the
            # step costs 20-30 s for each new batch size class, far more than it would save here.
            gen = StaticGenerator(self.model, method, max_len=max(s.length for s in states) + new_tokens,
                                  compile=False)
            if not stop and self.eos:
                gen.ban(self.eos)
            gen.start(cache, first)
            del cache
            steps = [first]
            done = torch.isin(first, eos)
            for i in range(new_tokens - 1):
                steps.append(gen.step().clone())
                done |= torch.isin(steps[-1], eos)
                # Replays run ahead of the host; a look every few steps ends the batch soon after
                # its last row has, without waiting on every step.
                if stop and i % EOS_CHECK_EVERY == EOS_CHECK_EVERY - 1 and bool(done.all()):
                    break
            ended = first.new_full(first.shape, int(eos[0])) if len(self.eos) else first
            steps += [ended] * (new_tokens - len(steps))  # cut off by the end of sequence anyway
            return torch.stack(steps, dim=1)
        kw = cache_kwargs(self.model, cache)
        ids = first[:, None]
        pos = torch.tensor([[s.length] for s in states], device=self.device)
        steps = [first]
        done = torch.isin(first, eos) & stop
        for _ in range(new_tokens - 1):
            if stop and bool(done.all()):  # every row has ended: what follows is cut off anyway
                steps.append(first.new_full(first.shape, int(eos[0])))
                continue
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=True, **self._last_only, **kw).logits
            last = logits[:, -1]
            if not stop:
                last[:, eos] = float("-inf")
            nxt = last.argmax(-1)
            steps.append(nxt)
            done |= torch.isin(nxt, eos)
            ids, pos = nxt[:, None], pos + 1
        return torch.stack(steps, dim=1)

    # -- fidelity --------------------------------------------------------------------------------

    @torch.inference_mode()
    def fidelity(self, config: Answer, chunk: int | None = None, rows: Sequence[int] | None = None,
                 part: str = "fidelity") -> list[tuple[float, float]]:
        """(top-1 agreement, mean KL(p_fp16 || p_quant)) of every sequence of `part` (or those of
        `rows`) under `config`.

        chunk: tokens a forward pass (default `replay_chunk`); any size gives the same scores."""
        every = self.replays.get(part, [])
        trajs = every if rows is None else [every[i] for i in rows]
        if not trajs:
            return []
        n = int(trajs[0].tokens.numel())
        out: list[tuple[float, float]] = []
        for rows in self._batches([t.state for t in trajs], n):
            batch = [trajs[i] for i in rows]
            states = self._on_device([t.state for t in batch])
            cache = batch_cache(self.model, config, states, multi_token=True)
            kw = cache_kwargs(self.model, cache)
            lengths = torch.tensor([s.length for s in states], device=self.device)
            tokens = torch.stack([t.tokens for t in batch]).to(self.device)  # [B, n]
            pieces = [_first_logits(cache, states)[:, None]]  # [B, 1, V]: predicts token 0
            step = chunk or self.replay_chunk(len(batch), n)
            for start in range(0, n - 1, step):
                ids = tokens[:, start : min(start + step, n - 1)]
                pos = lengths[:, None] + start + torch.arange(ids.shape[1], device=self.device)
                pieces.append(self.model(input_ids=ids, position_ids=pos, use_cache=True, **kw).logits.float())
            del cache
            logits = torch.cat(pieces, dim=1)  # [B, n, V]
            for row, traj in enumerate(batch):
                log_p, log_q = traj.ref_logp, logits[row].log_softmax(-1)
                kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0)  # as tuner.scoring.fidelity.replay
                agree = (logits[row].argmax(-1) == traj.ref_top).float()
                out.append((float(agree.mean()), float(kl.mean())))
        return out

    def replay_chunk(self, batch: int, n_tokens: int) -> int:
        """Tokens a replay forward pass takes: the whole trajectory when its logits fit in
        BATCH_MEMORY_SHARE of the budget, else as many as do (at least one)."""
        vocab = int(self.model.config.get_text_config(decoder=True).vocab_size)
        per_token = batch * vocab * 4 * LOGIT_COPIES
        return max(1, min(n_tokens - 1, int(BATCH_MEMORY_SHARE * self._budget) // per_token))

    # -- cost ------------------------------------------------------------------------------------

    def measure_cost(self, config: Answer, seed: int = 0) -> tuple[int, float, int | None]:
        """(bytes the cache holds, decode tokens/s, peak device bytes) on the fixed cost workload
        (tuner/scoring/cost.py), from its prompt's prefill, recorded once."""
        if isinstance(config, EngineRecipe):
            shape = shape_of_config(self.model.config)
            return cost.recipe_bytes(config, self.plan, shape.num_kv_heads, shape.head_dim), 0.0, None
        if self._cost_state is None:
            self._cost_state = record_prefill(self.model, cost.prompt_ids(seed))
        state = self._on_device([self._cost_state])[0]
        return cost.measure(self.model, self.plan, config, state, self._last_only)


def _first_logits(cache: Any, states: list[PrefillState]) -> torch.Tensor:
    """[B, V]: each prompt's prediction of its first new token; an engine recipe's prefill attends
    over its stored formats, so its own (`RecipeBatchCache.first_logits`), else the recorded ones."""
    if isinstance(cache, RecipeBatchCache):
        return cache.first_logits.clone()
    return torch.stack([s.logits for s in states])
