"""Unsupported models and bad configs fail before any work, with one clear line."""

import subprocess
import sys

import pytest
import torch
from tiny import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from pnmix.config import ConfigError, PNMixConfig, preset
from pnmix.families import UnsupportedModelError
from pnmix.generation import generate, new_cache

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path


def test_model_without_rope_is_refused():
    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="no rotary position embedding"):
        new_cache(model, preset("pnmix-paper"))


def test_unsupported_family_is_refused():
    config = AutoConfig.for_model("gemma", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="allowed llama, qwen2, qwen3, mistral"):
        new_cache(AutoModelForCausalLM.from_config(config), preset("pnmix-paper"))


def test_sliding_window_is_refused():
    model = tiny_model("mistral")
    model.config.sliding_window = 64
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        new_cache(model, preset("pnmix-paper"))


def test_config_that_does_not_fit_the_model_fails_before_generation():
    model = tiny_model("llama")  # head_dim 16
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.ones((1, 8), dtype=torch.long)
    with pytest.raises(ConfigError, match="value_group_size"):
        generate(model, ids, PNMixConfig(value_group_size=32), max_new_tokens=4)
    assert not calls, "the model ran before the config was checked"


def test_cli_generate_with_bad_config_is_one_line():
    out = subprocess.run([*PNMIX, "generate", "--prompt", "hi", "--b-low", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: invalid b_low=4: allowed at most b_high=3"]
