"""PN-Mix inside EleutherAI's lm-evaluation-harness: the model `pnmix`.

    python -m pnmix.lm_eval --model pnmix --model_args pretrained=smollm2-135m,config=pnmix-paper \\
        --tasks gsm8k --limit 50 --batch_size 8

`python -m pnmix.lm_eval` is the harness's own command line (`lm_eval ...`, every argument the same)
with this module imported first, so that `--model pnmix` is registered: the harness's command does
not load models from other packages. From Python, `import pnmix.lm_eval` registers it as well, and
`PNMixLM(...)` can be passed to `lm_eval.simple_evaluate(model=...)` directly.

`PNMixLM` is the harness's Hugging Face model (`HFLM`) whose every generation runs with a fresh
`PNMixCache` of the given config, batched (left padding, as the harness pads). Model arguments:
- `pretrained`: a `pnmix.models` name (`smollm2-135m`), a local checkpoint or a Hugging Face id, all
  loaded by `pnmix.models.load`; or an already loaded model (with `tokenizer=`).
- `config`: a preset name (`pnmix-paper`, `kivi2`, `fp16`, ...) or a PNMixConfig JSON file, e.g.
  from `pnmix export` (default `pnmix-paper`).
- `device` (default: `cuda` when available, else `cpu`), `dtype` (default bfloat16 on CUDA,
  float32 on the CPU), and the harness's own HFLM arguments (`batch_size`, `max_length`, ...).

Loglikelihood tasks (multiple choice, perplexity) score a whole sequence in one forward pass and
never decode, so the quantized cache takes no part in them: they run, with one warning saying so.
Only generation tasks (`generate_until`) measure the cache.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pnmix.config import PRESETS, PNMixConfig, preset
from pnmix.errors import PNMixError

EXTRA_HINT = "pip install -e '.[lm-eval]'"
LOGLIKELIHOOD_WARNING = (
    "pnmix: loglikelihood requests score whole sequences in one forward pass and never decode, so they do "
    "not exercise the PN-Mix cache; only generation tasks (generate_until) measure it"
)

log = logging.getLogger("pnmix.lm_eval")


class ExtraMissing(PNMixError):
    """An optional dependency is not installed; the message names the pip command that installs it."""


try:
    import torch
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError:  # the core install has no lm-eval
    _missing = ExtraMissing(f"the lm-evaluation-harness model needs the lm-eval extra: {EXTRA_HINT}")
    if __name__ == "__main__":  # `python -m pnmix.lm_eval` without the extra: one line, no traceback
        import sys

        print(f"error: {_missing}", file=sys.stderr)
        sys.exit(2)
    raise _missing from None


def resolve_config(config: str | PNMixConfig | None) -> PNMixConfig:
    """A PNMixConfig from a preset name, a JSON file (what `pnmix export` writes) or a config."""
    if config is None:
        return preset("pnmix-paper")
    if isinstance(config, PNMixConfig):
        return config
    if config in PRESETS:
        return preset(config)
    path = Path(config)
    if not path.is_file():
        raise PNMixError(f"config {config!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    try:
        return PNMixConfig.from_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, TypeError) as exc:
        raise PNMixError(f"cannot read config file {config}: {exc}") from None


@register_model("pnmix")
class PNMixLM(HFLM):  # type: ignore[misc]
    """The harness's HF model with a PN-Mix cache in every generation (see the module docstring)."""

    def __init__(self, pretrained: Any, config: str | PNMixConfig | None = None, device: str | None = None,
                 dtype: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        self.pnmix_config = resolve_config(config)
        # Another cache's factory (model -> transformers Cache) instead of PN-Mix's: the tuner's
        # peers (tuner/scoring/peers.py) run the same requests through transformers' quantized caches.
        self.make_cache: Any = None
        self._warned_loglikelihood = False
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(pretrained, str):
            from pnmix import models

            if dtype in (None, "auto"):
                dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
            elif isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            loaded = models.load(pretrained, purpose="accuracy", dtype=dtype, device=device)
            pretrained, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        from pnmix.generation import new_cache

        new_cache(pretrained, self.pnmix_config)  # checks the (model, config) pair before any request runs
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, device=device, **kwargs)

    def _model_generate(self, context: Any, max_length: int, stop: list[str], **generation_kwargs: Any) -> Any:
        from pnmix.generation import cache_kwargs, new_cache

        # a fresh cache per batch
        cache = self.make_cache(self.model) if self.make_cache else new_cache(self.model, self.pnmix_config)
        generation_kwargs.pop("past_key_values", None)
        generation_kwargs.pop("cache", None)
        generation_kwargs.update(cache_kwargs(self.model, cache))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _warn_loglikelihood(self) -> None:
        if not self._warned_loglikelihood:
            self._warned_loglikelihood = True
            log.warning(LOGLIKELIHOOD_WARNING)

    def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
        self._warn_loglikelihood()
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
        self._warn_loglikelihood()
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)


def main() -> None:
    """`python -m pnmix.lm_eval ...`: the harness's command line, with the `pnmix` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
