"""Tiny randomly initialised models of each supported family, for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    config = AutoConfig.for_model(
        family,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaked logits, so greedy choices are not near-ties
        tie_word_embeddings=False,
        **overrides,
    )
    if family == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
