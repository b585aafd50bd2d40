"""Prefill once, build a cache for any config from it.

PN-Mix prefill attention is exact: the prompt attends over its own unquantized keys and values,
so the prefill's hidden states, its first-token logits and the post-RoPE keys and values it
produces are the same for every config. Only what the cache keeps of them differs. A
`PrefillState` holds what a cache is built from for one sequence; `record_prefill` runs the
model's prefill once through the "pnmix" attention function (the live path's own prefill), and
`build_cache` makes a config's `PNMixCache` for a batch of states: the salient sets from the
scores recorded for each sequence alone, then quantize and pack with the live path's quantizers,
so the cache holds the same bytes as `generate` would.

Bytes kept per sequence of T prompt tokens (L layers, H_kv KV heads, head dim d, vocab V):
    keys + values   2 * L * H_kv * T * d * (bytes of the model dtype)
    saliency scores 4 criteria * L * H_kv * d/2 * 4
    logits          V * 4
The embedded model (L = 30, H_kv = 3, d = 64) keeps 46 KiB a token in fp32, 23 KiB in bf16.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

if TYPE_CHECKING:
    from pnmix.recipe_cache import RecipeBatchCache

from pnmix.cache import BatchWindowLayer, LayerStep, PNMixCache, PNMixLayer, SeenTokensLayer
from pnmix.config import PRESETS, PNMixConfig
from pnmix.families import FULL, check_model, rope_pairing
from pnmix.generation import cache_kwargs, use_pnmix_attention
from pnmix.layerwise import AnyConfig
from pnmix.recipes import EngineRecipe
from pnmix.saliency import Pairing, saliency_scores

# Criteria whose scores depend on the prefill: recorded once per sequence.
RECORDED_CRITERIA = ("qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range")


@dataclass
class PrefillState:
    """One sequence's exact prefill: what every config's cache of it is built from."""

    keys: list[torch.Tensor]  # per layer [H_kv, T, d], post-RoPE, model dtype
    values: list[torch.Tensor]  # per layer [H_kv, T, d]
    # criterion -> per layer [H_kv, d/2]: the saliency scores of this sequence alone (the random
    # criterion needs no record: its scores come from its seed)
    scores: dict[str, list[torch.Tensor]]
    logits: torch.Tensor  # [V] float32: the prediction of the first new token
    # [T] the prompt's ids: an engine recipe's cache prefills the prompt again, since its prefill
    # attends over the stored (quantized) keys and values (pnmix.recipe_cache)
    ids: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])

    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *(t for ts in self.scores.values() for t in ts), self.logits]
        return sum(t.nbytes for t in tensors)

    def to(self, device: torch.device | str) -> PrefillState:
        return PrefillState([k.to(device) for k in self.keys], [v.to(device) for v in self.values],
                            {c: [t.to(device) for t in ts] for c, ts in self.scores.items()}, self.logits.to(device),
                            self.ids)


class _RecordingLayer(SeenTokensLayer):
    """Takes the place of a `PNMixLayer` for one prefill: keeps the states instead of quantizing them."""

    def __init__(self, pairing: Pairing) -> None:
        super().__init__()
        self.pairing = pairing
        self.prefilled = False
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.prefilled:
            raise RuntimeError("a recorded prefill takes one forward pass")
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        step = LayerStep(self, key_states, value_states)  # type: ignore[arg-type]
        return step, step

    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, token_mask: torch.Tensor) -> None:
        # Called by the "pnmix" attention function after its exact prefill attention, as for
        # PNMixLayer; the scores are PNMixLayer.prefill's, each row's over its own real tokens.
        self.scores = {c: saliency_scores(c, query, key, token_mask, self.pairing) for c in RECORDED_CRITERIA}
        self.recorded = (key, value)
        self.prefilled = True



class _RecordingCache(Cache):
    def __init__(self, model_config: Any) -> None:
        text = model_config.get_text_config(decoder=True)
        pairing = rope_pairing(model_config)
        # Every layer records its states, a sliding-window one too: its prefill attention ran
        # under the model's sliding mask, and `build_cache` keeps its window of them.
        super().__init__(layers=[_RecordingLayer(pairing) for _ in range(text.num_hidden_layers)])


@torch.inference_mode()
def record_prefill(model: Any, input_ids: torch.Tensor) -> PrefillState:
    """The exact prefill of one prompt, input_ids [1, T] (no padding), kept on the model's device."""
    return record_prefills(model, [input_ids], batch_tokens=0)[0]


@torch.inference_mode()
def record_prefills(model: Any, prompts: list[torch.Tensor], batch_tokens: int,
                    batch_rows: int = 32) -> list[PrefillState]:
    """`record_prefill` of each prompt (ids [1, T_i]), several in one forward pass: the prompts
    right-padded to the longest of a batch of at most `batch_tokens` padded tokens and
    `batch_rows` prompts (the kept logits grow with rows times distinct lengths). A causal
    prompt's real tokens never attend to the padding after them, so each state is its prompt's
    prefill (the same up to the batched matrix products' rounding); saliency scores are taken
    over each row's real tokens. One forward pass for many prompts is what makes this pay on a
    GPU, where a prefill of a short prompt costs mostly launches. batch_tokens <= 0: one at a time."""
    for ids in prompts:
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"input_ids of shape {tuple(ids.shape)}: allowed [1, tokens] with tokens >= 1")
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].shape[1])  # like lengths together
    out: list[PrefillState | None] = [None] * len(prompts)
    start = 0
    while start < len(order):
        longest = prompts[order[start]].shape[1]
        size = max(1, min(len(order) - start, batch_rows, batch_tokens // longest)) if batch_tokens > 0 else 1
        rows = order[start : start + size]
        for i, state in zip(rows, _record_batch(model, [prompts[i][0] for i in rows]), strict=True):
            out[i] = state
        start += size
    return [s for s in out if s is not None]


def _record_batch(model: Any, prompts: list[torch.Tensor]) -> list[PrefillState]:
    """One forward pass over `prompts` (1-D ids), right-padded; one state per prompt."""
    use_pnmix_attention(model)
    cache = _RecordingCache(model.config)
    lengths = [int(p.shape[0]) for p in prompts]
    longest = max(lengths)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : lengths[b]] = p.cpu()
        mask[b, : lengths[b]] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    # As `generate` runs a prefill, keeping only the logits at each row's last real token.
    last = sorted({n - 1 for n in lengths})
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        keep: dict[str, Any] = {"logits_to_keep": 1 if len(prompts) == 1 else torch.tensor(last, device=model.device)}
        column = [-1] if len(prompts) == 1 else [last.index(n - 1) for n in lengths]
    else:
        keep, column = {}, [n - 1 for n in lengths]
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache), **keep)
    layers = [layer for layer in cache.layers if isinstance(layer, _RecordingLayer)]
    states = []
    for b, n in enumerate(lengths):
        states.append(PrefillState([la.recorded[0][b, :, :n].clone() for la in layers],
                                   [la.recorded[1][b, :, :n].clone() for la in layers],
                                   {c: [la.scores[c][b] for la in layers] for c in RECORDED_CRITERIA},
                                   out.logits[b, column[b]].float(), prompts[b].detach().cpu().clone()))
    return states


def build_cache(model: Any, config: AnyConfig, states: list[PrefillState], multi_token: bool = False) -> PNMixCache:
    """`config`'s cache of a batch of recorded prefills, as if each had been prefilled alone.

    Sequence b holds states[b]'s tokens from slot 0 (no padding); the next token of sequence b
    sits at position states[b].length. A sliding-window layer (a hybrid model) becomes a
    `BatchWindowLayer` holding each sequence's window of its states.
    """
    if not states:
        raise ValueError("build_cache needs at least one prefill state")
    check_model(model.config, config)
    use_pnmix_attention(model)
    cache = PNMixCache(model.config, config, multi_token=multi_token)
    window = cache.plan.window or 0
    for li, layer in enumerate(cache.layers):
        if isinstance(layer, PNMixLayer):
            _load_layer(layer, layer.config, states, li)  # a layer-wise config: each layer its own
        else:
            cache.layers[li] = BatchWindowLayer(window, [s.keys[li] for s in states], [s.values[li] for s in states])
    return cache


def build_recipe_cache(model: Any, recipe: EngineRecipe, states: list[PrefillState],
                       multi_token: bool = False) -> RecipeBatchCache:
    """An engine recipe's cache of a batch of prompts (`pnmix.recipe_cache`), sequence b's next
    token at position states[b].length, as in `build_cache`. An engine's prefill attends over
    what it stores, so each prompt (`PrefillState.ids`) is prefilled again, alone, into the
    recipe's `RecipeCache`; what that stored, and its scales, fill the batch's layers, and its
    last logits predict the first new token (`RecipeBatchCache.first_logits`)."""
    from pnmix.recipe_cache import BatchFormatLayer, BatchFormatWindowLayer, RecipeBatchCache, RecipeCache

    if not states:
        raise ValueError("build_recipe_cache needs at least one prefill state")
    pairing, head_dim = check_model(model.config, PRESETS["fp16"])
    recipe.check_head_dim(head_dim)
    alone, logits = [], []
    for s in states:
        if s.ids is None:
            raise ValueError("an engine recipe's batch prefills each prompt again: its state needs the prompt's ids")
        cache = RecipeCache(model.config, recipe)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        with torch.no_grad():  # not inference mode: the batch's tensors are used as `build_cache`'s are
            out = model(input_ids=s.ids[None].to(model.device), use_cache=True, **cache_kwargs(model, cache), **keep)
        alone.append(cache)
        logits.append(out.logits[0, -1].float())
    use_pnmix_attention(model)  # the batch attends through the "pnmix" attention function
    layers: list[Any] = []
    plan = alone[0].plan  # what each layer holds, read once by every RecipeCache
    for li, (formats, kind) in enumerate(zip(recipe.layers, plan.kinds, strict=True)):
        held: list[Any] = [c.layers[li] for c in alone]  # FormatLayer or FormatWindowLayer
        scales = [h.scales for h in held]
        keys, values = [h.keys[0] for h in held], [h.values[0] for h in held]
        if kind == FULL:
            layer: Any = BatchFormatLayer(formats, pairing, li, keys, values, scales)
            layer.multi_token = multi_token
        else:  # the window's stored tokens at their positions, the dropped ones (never attended) as zeros
            keys = [_at_positions(k, s.length) for k, s in zip(keys, states, strict=True)]
            values = [_at_positions(v, s.length) for v, s in zip(values, states, strict=True)]
            layer = BatchFormatWindowLayer(formats, plan.window or 0, keys, values, scales)
        layers.append(layer)
    return RecipeBatchCache(layers, recipe, torch.stack(logits))


def _at_positions(held: torch.Tensor, length: int) -> torch.Tensor:
    """[H, kept, d] of a window's last `kept` positions as [H, length, d], zeros before them."""
    out = held.new_zeros((held.shape[0], length, held.shape[2]))
    out[:, length - held.shape[1]:] = held
    return out


def build_layer(model: Any, config: PNMixConfig, states: list[PrefillState], layer_idx: int = 0) -> PNMixLayer:
    """Layer `layer_idx` of `build_cache`'s cache alone: every layer holds the same token counts in
    the same format, so one layer gives the bytes of all at a thirtieth of the work."""
    if not states:
        raise ValueError("build_layer needs at least one prefill state")
    pairing, _ = check_model(model.config, config)
    layer = PNMixLayer(config, pairing, layer_idx)
    _load_layer(layer, config, states, layer_idx)
    return layer


def _load_layer(layer: PNMixLayer, config: PNMixConfig, states: list[PrefillState], li: int) -> None:
    scores = None
    if config.salient_pairs(states[0].keys[li].shape[-1]):
        if config.criterion == "random":  # as saliency_scores draws it for one sequence, for each
            k = states[0].keys[li][None]  # shapes only: the draw depends on the seed alone
            one = saliency_scores("random", k, k, torch.ones(k.shape[:1] + k.shape[2:3], dtype=torch.bool),
                                  "rotate_half", config.seed + li)
            scores = one.expand(len(states), -1, -1)
        else:
            scores = torch.stack([s.scores[config.criterion][li] for s in states])
    layer.load_prefill([s.keys[li] for s in states], [s.values[li] for s in states], scores)
