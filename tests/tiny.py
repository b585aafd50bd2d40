"""Tiny randomly initialised models of each supported family, for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512,
              initializer_range=0.2,  # peaked logits, so greedy choices are not near-ties
              tie_word_embeddings=False)
    config = AutoConfig.for_model(family, **{**kw, **overrides})
    if family == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def save_tiny_llama(folder, tokenizer) -> str:  # type: ignore[no-untyped-def]
    """A tiny random Llama (2 layers, head_dim 64) saved with `tokenizer` as a checkpoint in `folder`.

    Campaign tests, the reliability suite and the GPU probe's smoke campaign all use this one
    checkpoint shape: trials on it take about a second on the CPU, and what they score is
    meaningless, which is fine for testing the machinery around the model.
    """
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=len(tokenizer),
                                  max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.2,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_gemma3(seed: int = 0, dtype: torch.dtype = torch.float32, window: int = 8, **overrides):
    """A tiny random Gemma 3 text decoder: 6 layers, the sixth full-attention and the five before it
    sliding-window layers of `window` tokens (Gemma 3's own pattern), QK-norm, its query scaling and
    a RoPE base per layer kind, head_dim 16, one KV head."""
    from transformers import Gemma3TextConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=512,
              sliding_window=window, initializer_range=0.2, tie_word_embeddings=False)
    config = Gemma3TextConfig(**{**kw, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
