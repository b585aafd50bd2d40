import pytest
import torch

from pnmix import models
from pnmix.models import chat_ids


def test_registry_resolves_every_kind(tmp_path):
    assert models.resolve("smollm2-135m").kind == "embedded"
    assert models.resolve("qwen3-8b-shape").kind == "shape"
    assert models.resolve("Qwen/Qwen3-8B").kind == "hub"
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve(str(tmp_path)).kind == "local"
    with pytest.raises(models.ModelError, match="unknown model"):
        models.resolve("not a model")


def test_shape_models_are_refused_for_accuracy():
    with pytest.raises(models.ModelError, match="performance work only"):
        models.load("qwen3-8b-shape", purpose="accuracy")
    shape = models.model_shape("qwen3-8b-shape")
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (36, 32, 8, 128)


def test_missing_gguf_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PNMIX_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(models.ModelError, match="PNMIX_SMOLLM2_GGUF"):
        models.resolve("smollm2-135m")


def test_gguf_path_from_environment(monkeypatch):
    path = models.find_gguf(models.EMBEDDED["smollm2-135m"])
    monkeypatch.setenv("PNMIX_SMOLLM2_GGUF", str(path))
    assert models.resolve("smollm2-135m").location == str(path)


def test_truncated_gguf_is_refused(monkeypatch, tmp_path):
    path = models.find_gguf(models.EMBEDDED["smollm2-135m"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: 1 << 20])
    monkeypatch.setenv("PNMIX_SMOLLM2_GGUF", str(cut))
    monkeypatch.setenv("PNMIX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(models.ModelError, match="cannot read GGUF"):
        models.load("smollm2-135m")
    assert not list((tmp_path / "cache" / "models").glob("smollm2*")), "no half-written conversion left"


def test_embedded_model_generates_text(embedded):
    config = embedded.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    ids = chat_ids(embedded.tokenizer, "What is the capital of France?")
    with torch.inference_mode():
        out = embedded.model.generate(**ids, max_new_tokens=32, do_sample=False)
    text = embedded.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text
