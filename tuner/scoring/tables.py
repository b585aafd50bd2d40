"""The proxy's tables of one model: attention KL and output error on its recorded Q/K/V trace.

The trace is one fp16 greedy continuation recorded once (cached on disk beside the preparation,
its tokens shipped where the preparation is: tuner/scoring/shipped.py). On it, the proxy
(tuner/scoring/proxy.py) weighs a config in milliseconds: its attention KL in all (`proxy`, what
multi-fidelity screening reads), per layer (`proxy_by_layer`), and the allocator's sensitivity
tables (`sensitivity`, `value_sensitivity`), cached on disk per candidate set.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import replace
from typing import Any

import torch

from pnmix.analysis import record_trace
from pnmix.bits import LayerPlan
from pnmix.config import PNMixConfig
from pnmix.kv_formats import KVFormat
from pnmix.layerwise import AnyConfig, LayerwiseConfig, as_layerwise
from pnmix.models import chat_ids
from pnmix.names import FULL
from pnmix.saliency import Pairing
from pnmix.tuner.scoring import fidelity
from pnmix.tuner.scoring.preparation import Preparation
from pnmix.tuner.scoring.proxy import (
    ProxyMeasure,
    proxy_format_table,
    proxy_kl,
    proxy_kl_by_layer,
    proxy_kl_table,
    proxy_value_table,
)


class ProxyTables:
    """The proxy on one model's trace, for a prepared model of `plan` and `pairing`."""

    def __init__(self, preparation: Preparation, plan: LayerPlan, pairing: Pairing, num_layers: int) -> None:
        self.preparation, self.plan, self.pairing, self.num_layers = preparation, plan, pairing, num_layers
        self._trace: Any = None

    def trace(self) -> Any:
        """The proxy's recorded Q/K/V trace of this model (recorded once, cached on disk)."""
        if self._trace is not None:
            return self._trace
        prep, n_tokens = self.preparation, self.preparation.profile.proxy_tokens
        path = prep.cache_file().with_name(f"trace-qkv-{n_tokens}.pt")
        if path.is_file():
            self._trace = torch.load(path, weights_only=False)
            return self._trace
        ids = chat_ids(prep.tokenizer, fidelity.FIDELITY_PROMPTS[-1])["input_ids"]
        # The continuation: shipped (tuner/scoring/shipped.py), or the fp16 greedy one on the engine's
        # decode (CUDA graphs on the GPU), as the trajectories are generated: `generate` takes about a
        # minute for it on an H200. Its tokens are kept beside the trace.
        shipped = prep.shipped()
        tokens = shipped.trace_tokens.get(path.stem) if shipped is not None else None
        if tokens is None or len(tokens) != n_tokens:
            prep.progress("recording the proxy's Q/K/V trace")
            tokens = prep.new_engine(quiet=True).continuations([ids[0].tolist()], n_tokens)[0]
        self._trace = record_trace(prep.model, ids, n_tokens, continuation=tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self._trace, path)
        path.with_suffix(".tokens.json").write_text(json.dumps(tokens))
        return self._trace

    def quantized_trace(self, config: AnyConfig) -> tuple[Any, AnyConfig, list[int | None] | None]:
        """The trace, config and windows the proxy weighs: on a model with sliding-window layers,
        only its quantized layers (the full-attention ones and the windows `config` quantizes; an
        exact window's attention is exact), each window's queries seeing their last window tokens."""
        trace = self.trace()
        if not self.plan.hybrid:
            return trace, config, None
        lw = as_layerwise(config)
        held = lw.held_configs(self.plan.kinds)
        kept_layers = [i for i, c in enumerate(held) if c is not None]
        kept = replace(trace, queries=[trace.queries[i] for i in kept_layers],
                       keys=[trace.keys[i] for i in kept_layers],
                       values=None if trace.values is None else [trace.values[i] for i in kept_layers])
        configs = [c for c in held if c is not None]
        return kept, (config if not isinstance(config, LayerwiseConfig)
                      else LayerwiseConfig.from_layers(configs)), self._windows(kept_layers)  # type: ignore[arg-type]

    def proxy(self, config: AnyConfig) -> float:
        """Attention KL on recorded traces (tuner.scoring.proxy), milliseconds per layer (per quantized layer
        of a hybrid model)."""
        trace, cfg, windows = self.quantized_trace(config)
        return proxy_kl(trace, cfg, self.pairing, windows=windows)

    def proxy_by_layer(self, config: AnyConfig) -> list[float]:
        """The proxy's attention KL of each layer under its own config (tuner.search.layers reads it); for
        a model with sliding-window layers, of its quantized layers."""
        trace, cfg, windows = self.quantized_trace(config)
        return proxy_kl_by_layer(trace, cfg, self.pairing, windows=windows)

    def sensitivity(self, candidates: list[PNMixConfig],
                    measure: ProxyMeasure = ProxyMeasure.KL) -> dict[PNMixConfig, list[float]]:
        """The allocator's table: each candidate's proxy KL per layer (`tuner.scoring.proxy.proxy_kl_table`;
        the candidates share G, sinks, residual and criterion), or with `measure=ProxyMeasure.OUTPUT` its
        relative attention-output error, the unit `value_sensitivity` shares. Cached on disk beside
        the preparation, per model, profile, seed, measure and candidate set, so a campaign's later
        workers and later campaigns of the model read it instead of computing it again."""
        what: list[Any] = ["keys", measure, [c.to_dict() for c in candidates]]
        if self.plan.hybrid:  # a sliding layer's rows under its window (a quantized window's queries see no more)
            what.append({"window": self.plan.window})
        rows = self.cached_table(what, len(candidates), lambda: proxy_kl_table(
            self.trace(), candidates, self.pairing, measure=measure, windows=self._windows()))
        return dict(zip(candidates, rows, strict=True))

    def _windows(self, layers: list[int] | None = None) -> list[int | None]:
        """Each layer's sliding window (of `layers`, default all), None for a full-attention one."""
        return [None if self.plan.kinds[i] == FULL else self.plan.window
                for i in (layers if layers is not None else range(self.num_layers))]

    def value_sensitivity(self, formats: list[tuple[int, int]],
                          shared: PNMixConfig) -> dict[tuple[int, int], list[float]]:
        """Each value format's (bits, group size) relative attention-output error per layer under
        `shared`'s token schedule (`tuner.scoring.proxy.proxy_value_table`; a sliding layer over its
        window), cached like `sensitivity`."""
        schedule = {f: getattr(shared, f) for f in ("n_sink", "group_size", "residual_len")}
        what: list[Any] = ["values", schedule, [list(f) for f in formats]]
        if self.plan.hybrid:  # a sliding layer's rows under its window, as `sensitivity`'s
            what.append({"window": self.plan.window})
        rows = self.cached_table(what, len(formats),
                                  lambda: proxy_value_table(self.trace(), formats, shared, windows=self._windows()))
        return dict(zip(formats, rows, strict=True))

    def format_sensitivity(self, formats: list[KVFormat]) -> tuple[dict[KVFormat, list[float]],
                                                                    dict[KVFormat, list[float]]]:
        """The engine formats' relative attention-output error per layer, every layer (sliding ones
        over their windows), keys and values apart (`tuner.scoring.proxy.proxy_format_table`),
        cached like `sensitivity`."""
        rows = self.cached_table(["formats", [str(f) for f in formats]], 2 * len(formats),
                                  lambda: proxy_format_table(self.trace(), formats, self.plan))
        return dict(zip(formats, rows[:len(formats)], strict=True)), dict(zip(formats, rows[len(formats):],
                                                                              strict=True))

    def cached_table(self, what: Any, n_rows: int, compute: Any) -> list[list[float]]:
        """A proxy table (`n_rows` rows of one figure per layer) read from the disk cache under the
        hash of `what`, or computed and written there."""
        def fits(rows: Any) -> bool:
            return len(rows) == n_rows and all(len(r) == self.num_layers for r in rows)

        key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        path = self.preparation.cache_file().with_name(f"sensitivity-{self.preparation.cache_file().stem}-{key}.json")
        try:
            rows = json.loads(path.read_text())
            if fits(rows):
                return [[float(x) for x in r] for r in rows]
        except (OSError, ValueError, TypeError):
            pass  # absent or unreadable: shipped, or computed again, and rewritten
        shipped = self.preparation.shipped()
        rows = shipped.tables.get(path.name) if shipped is not None else None
        if rows is None or not fits(rows):
            rows = compute()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(path)
        except OSError as exc:  # a read-only or full cache folder costs the next run the seconds, nothing more
            print(f"warning: sensitivity table not cached at {path}: {exc.strerror or exc}", file=sys.stderr)
        return rows
