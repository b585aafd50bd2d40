"""Scoring one PN-Mix config on one model: accuracy parts, bits, measured bytes and throughput.

`Evaluator` loads the model once and prepares, per (model, profile, seed), the task items the
unquantized model answers correctly and the fp16 trajectories for long-output fidelity. Both are
cached on disk under the cache directory, so a second evaluator on the same model starts fast.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pnmix import models
from pnmix.bits import key_bits
from pnmix.config import PNMixConfig, preset
from pnmix.families import rope_pairing
from tuner import fidelity
from tuner import tasks as tasks_module
from tuner.profiles import WEIGHTS, EvalError, Profile

Progress = Callable[[str], None]

TASKS = ("passkey", "kv_lookup", "fidelity", "gsm8k")
DEFAULT_TASKS = ("passkey", "kv_lookup", "fidelity")
# Bump when task generation or filtering changes, so cached preparations are rebuilt.
PREPARATION_VERSION = 2
COST_PROMPT_TOKENS = 512  # fixed workload for measured bytes and decode throughput
COST_NEW_TOKENS = 32


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def combine(parts: dict[str, float]) -> float:
    """Weighted mean of the parts that ran (weights in tuner.profiles.WEIGHTS)."""
    total = sum(WEIGHTS[name] for name in parts)
    return sum(WEIGHTS[name] * value for name, value in parts.items()) / total


def versions() -> dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


class Evaluator:
    def __init__(self, model: str, profile: Profile, seed: int = 0, gsm8k: str | Path | None = None,
                 progress: Progress | None = None, tasks: tuple[str, ...] | None = None,
                 device: str = "cpu") -> None:
        chosen = tuple(tasks) if tasks else (*DEFAULT_TASKS, *(("gsm8k",) if gsm8k else ()))
        for name in chosen:
            if name not in TASKS:
                raise EvalError(f"unknown task {name!r}: allowed {', '.join(TASKS)}")
        if "gsm8k" in chosen and not gsm8k:
            raise EvalError("task gsm8k needs a JSONL file (--gsm8k PATH)")
        self.tasks = chosen
        self._gsm8k = tasks_module.gsm8k_items(gsm8k) if gsm8k else None  # checked before the model loads
        self.model_name = model
        self.profile = profile
        self.seed = seed
        self.progress = progress or (lambda message: None)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.loaded = models.load(model, purpose="accuracy", dtype=dtype, device=device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.pairing = rope_pairing(self.model.config)
        self.head_dim = self.loaded.shape.head_dim
        self.device = str(self.model.device)
        self.backend = self._backend_label()
        self._prepared: dict[str, Any] | None = None
        self._trace: Any = None

    # -- preparation (fp16 runs, cached) ---------------------------------------------------------

    def _cache_file(self) -> Path:
        safe = self.model_name.replace("/", "_")
        name = f"{self.profile.name}-seed{self.seed}-v{PREPARATION_VERSION}.json"
        return models.cache_dir() / "eval" / safe / name

    def prepare(self) -> dict[str, Any]:
        """Filtered items and fp16 trajectories for this (model, profile, seed), from disk if cached."""
        if self._prepared is not None:
            return self._prepared
        path = self._cache_file()
        if path.is_file():
            data = json.loads(path.read_text())
        else:
            data = self._build()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)
        data["items"] = {name: [tasks_module.Item(**it) for it in its] for name, its in data["items"].items()}
        if self._gsm8k is not None:
            data["items"]["gsm8k"] = self._gsm8k
        refs = []
        for traj in data["trajectories"]:
            prompt = torch.tensor([traj["prompt_ids"]])
            refs.append(fidelity.reference_logits(self.model, prompt, traj["tokens"]))
        data["references"] = refs
        self._prepared = data
        return data

    def _build(self) -> dict[str, Any]:
        p, fp16 = self.profile, preset("fp16")
        pools = {
            "passkey": tasks_module.passkey_items(3 * p.passkey_items, self.seed, p.passkey_filler),
            "kv_lookup": tasks_module.kv_lookup_items(4 * p.kv_items, self.seed, p.kv_pairs),
        }
        wanted = {"passkey": p.passkey_items, "kv_lookup": p.kv_items}
        kept: dict[str, list[dict[str, Any]]] = {}
        for name, pool in pools.items():
            # Keep only items the unquantized model gets right, so a miss is the cache's fault.
            kept[name] = []
            for item in pool:
                if len(kept[name]) == wanted[name]:
                    break
                self.progress(f"filtering {name} against fp16")
                if item.is_correct(tasks_module.answer(self.model, self.tokenizer, fp16, item)):
                    kept[name].append(item.to_dict())
        trajectories = []
        from pnmix.cli import chat_ids

        for prompt in fidelity.FIDELITY_PROMPTS[: p.fidelity_prompts]:
            self.progress("generating fp16 trajectory")
            ids = chat_ids(self.tokenizer, prompt)["input_ids"]
            tokens = fidelity.trajectory(self.model, ids, p.fidelity_tokens)
            trajectories.append({"prompt_ids": ids[0].tolist(), "tokens": tokens})
        return {"items": kept, "trajectories": trajectories}

    # -- the proxy -----------------------------------------------------------------------------

    def proxy(self, config: PNMixConfig) -> float:
        """Attention KL on recorded traces (tuner.proxy), milliseconds per layer."""
        from pnmix.analysis import record_trace
        from tuner.proxy import proxy_kl

        if self._trace is None:
            path = self._cache_file().with_name(f"trace-{self.profile.proxy_tokens}.pt")
            if path.is_file():
                self._trace = torch.load(path, weights_only=False)
            else:
                from pnmix.cli import chat_ids

                self.progress("recording the proxy's Q/K trace")
                ids = chat_ids(self.tokenizer, fidelity.FIDELITY_PROMPTS[-1])["input_ids"]
                self._trace = record_trace(self.model, ids, self.profile.proxy_tokens)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(self._trace, path)
        return proxy_kl(self._trace, config, self.pairing)

    # -- full evaluation -----------------------------------------------------------------------

    def evaluate(self, config: PNMixConfig) -> Score:
        config.check_head_dim(self.head_dim)
        start = time.perf_counter()
        data = self.prepare()
        parts: dict[str, float] = {}
        counts: dict[str, int] = {}
        for name, items in data["items"].items():
            if items and name in self.tasks:
                self.progress(f"{name}: {len(items)} items")
                parts[name] = tasks_module.accuracy(self.model, self.tokenizer, config, items)
                counts[name] = len(items)
        agreements, kls = [], []
        use_fidelity = "fidelity" in self.tasks
        for traj, ref in zip(data["trajectories"] if use_fidelity else [], data["references"], strict=False):
            self.progress("long-output fidelity")
            fid = fidelity.replay(self.model, torch.tensor([traj["prompt_ids"]]), traj["tokens"], config, ref)
            agreements.append(fid.agreement)
            kls.append(fid.mean_kl)
        fid_kl = sum(kls) / len(kls) if kls else float("nan")
        fid_agree = sum(agreements) / len(agreements) if agreements else float("nan")
        if kls:
            parts["fidelity"] = fidelity.Fidelity(fid_agree, fid_kl, 0).score
            counts["fidelity"] = len(kls)
        if not parts:
            raise EvalError("no task produced a score (every item was filtered out); use more items or other tasks")
        self.progress("measuring bytes and decode throughput")
        kv_bytes, tok_s, peak = self.measure_cost(config)
        return Score(
            config=config.to_dict(),
            accuracy=combine(parts),
            parts=parts,
            fidelity_agreement=fid_agree,
            fidelity_kl=fid_kl,
            key_bits=key_bits(config, self.head_dim).total,
            kv_bytes=kv_bytes,
            decode_tokens_per_s=tok_s,
            peak_memory_bytes=peak,
            backend=self.backend,
            device=self._device_name(),
            versions=versions(),
            seconds=time.perf_counter() - start,
            profile=self.profile.name,
            items=counts,
        )

    @torch.inference_mode()
    def measure_cost(self, config: PNMixConfig) -> tuple[int, float, int | None]:
        """Bytes held after a fixed workload (512-token prompt, 32 new tokens) and its decode tokens/s.

        On CUDA, throughput and peak memory come from the static path (pnmix/static.py: static
        cache, decode step replayed as a CUDA graph), which is what serving would run; `generate`
        is host-bound there. Configs the static path does not cover, and the CPU, time `generate`.
        """
        from pnmix.generation import generate
        from pnmix.static import decode_cost, static_method

        gen = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(100, 4000, (1, COST_PROMPT_TOKENS), generator=gen).to(self.model.device)
        cuda = self.model.device.type == "cuda"
        method = static_method(config, self.model.device, self.head_dim) if cuda else None
        if method is not None:
            _, cache = generate(self.model, ids, config, max_new_tokens=COST_NEW_TOKENS,
                                min_new_tokens=COST_NEW_TOKENS)
            tok_s, static_peak = decode_cost(self.model, method, ids, COST_NEW_TOKENS)
            return int(cache.nbytes()["total"]), tok_s, static_peak
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        # Time decode alone: a 1-token run measures prefill, subtracted from the full run.
        t0 = time.perf_counter()
        generate(self.model, ids, config, max_new_tokens=1, min_new_tokens=1)
        t1 = time.perf_counter()
        _, cache = generate(self.model, ids, config, max_new_tokens=COST_NEW_TOKENS, min_new_tokens=COST_NEW_TOKENS)
        t2 = time.perf_counter()
        decode_s = max((t2 - t1) - (t1 - t0), 1e-6)
        peak = int(torch.cuda.max_memory_allocated()) if cuda else None
        return int(cache.nbytes()["total"]), (COST_NEW_TOKENS - 1) / decode_s, peak

    def _backend_label(self) -> str:
        """What runs PN-Mix attention here: the kernels on CUDA unless the torch path is forced."""
        from pnmix.backend import backend_name

        if self.model.device.type == "cpu":
            return "torch-reference"
        return "torch-cuda" if backend_name() == "torch" else "triton"

    def _device_name(self) -> str:
        if self.model.device.type == "cuda":
            return torch.cuda.get_device_name(self.model.device)
        return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
