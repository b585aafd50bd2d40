import pytest
import torch

from pnmix import models
from pnmix.models import chat_ids


def test_registry_resolves_every_kind(tmp_path, monkeypatch):
    assert models.resolve("smollm2-135m").kind == "embedded"
    assert models.resolve("qwen3-8b-shape").kind == "shape"
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve(str(tmp_path)).kind == "local"
    with pytest.raises(models.ModelError, match="unknown model"):
        models.resolve("not a model")
    # A hub id in the local hub cache resolves without the hub (here it cannot be reached).
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    snapshot = hub / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (hub / "models--org--cached" / "refs").mkdir()
    (hub / "models--org--cached" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = models.resolve("org/cached")
    assert (source.kind, source.location, source.local_only) == ("hub", "org/cached", True)


def test_a_hub_id_neither_cached_nor_reachable_fails_fast_in_one_line():
    """No minute of retries: one request, whose failure (no network, or no such repository) is one line."""
    import time

    start = time.monotonic()
    with pytest.raises(models.ModelError) as caught:
        models.resolve("pnmix-test-org/not-cached", purpose="accuracy")
    assert time.monotonic() - start < 15
    message = str(caught.value)
    assert "\n" not in message and "pnmix-test-org/not-cached" in message
    assert "not in the local Hugging Face cache" in message or "no model" in message


def test_names_the_file_system_cannot_hold_are_one_line():
    with pytest.raises(models.ModelError, match="1 to 255 characters"):
        models.resolve("a" * 300)
    with pytest.raises(models.ModelError, match="unknown model"):
        models.resolve("b" * 255)  # a file name at the limit of the file system, not a directory


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


def test_the_converted_model_is_keyed_by_the_gguf_content(tmp_path, monkeypatch):
    """A GGUF replaced or changed in place, even at the same size and modification time, is converted
    again; an unchanged one is hashed once and then only looked up by its file identity."""
    import os

    monkeypatch.setenv("PNMIX_CACHE_DIR", str(tmp_path / "cache"))
    converted: list[bytes] = []

    def fake_convert(gguf, out):  # the real conversion takes half a minute; its keying is what is tested
        converted.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(1 << 16))
    source = models.ModelSource("smollm2-135m", "embedded", str(gguf))
    first = models._converted_dir(source)
    hashed: list[str] = []
    real_sha = models.hashlib.sha256
    monkeypatch.setattr(models.hashlib, "sha256", lambda *a: hashed.append("x") or real_sha(*a))
    assert models._converted_dir(source) == first and len(converted) == 1 and not hashed
    # Damaged in place, same size, modification time put back: the content decides.
    stat = gguf.stat()
    data = bytearray(gguf.read_bytes())
    data[1000] ^= 0xFF
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = models._converted_dir(source)
    assert second != first and len(converted) == 2 and converted[1] == bytes(data)
    assert (second / models.SOURCE_DIGEST).read_text().strip() == real_sha(bytes(data)).hexdigest()
    # A conversion whose recorded digest does not match what it claims to be is made again.
    (second / models.SOURCE_DIGEST).write_text("0" * 64)
    assert models._converted_dir(source) == second and len(converted) == 3


def test_a_damaged_gguf_of_the_original_size_is_refused_in_one_line(tmp_path, monkeypatch):
    real = models.find_gguf(models.EMBEDDED["smollm2-135m"])
    damaged = tmp_path / real.name
    with real.open("rb") as f:
        head = f.read(1 << 20)
    # The header and metadata zeroed, the size kept: a cache keyed by size alone took this for the model.
    with damaged.open("wb") as f:
        f.write(b"\0" * len(head))
        f.truncate(real.stat().st_size)
    monkeypatch.setenv("PNMIX_SMOLLM2_GGUF", str(damaged))
    monkeypatch.setenv("PNMIX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(models.ModelError) as caught:
        models.load("smollm2-135m")
    assert str(caught.value).startswith(f"cannot read GGUF file {damaged}: ") and "\n" not in str(caught.value)
    assert not list((tmp_path / "cache" / "models").glob("smollm2*"))


def test_a_gguf_tokenizer_read_as_characters_is_refused_in_one_line():
    """Some transformers releases read Gemma 3's GGUF vocabulary into single characters; such a model
    answers nothing right, so the conversion refuses it (a word-level tokenizer passes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pnmix.models import TOKENIZER_PROBE, ModelError, check_tokenizer

    chars = sorted(set(TOKENIZER_PROBE))
    words = sorted(set(TOKENIZER_PROBE.replace(".", " .").split()))

    def fast(vocab: list[str], split: pre_tokenizers.PreTokenizer) -> PreTrainedTokenizerFast:
        core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", *vocab])}, unk_token="<unk>"))
        core.pre_tokenizer = split
        return PreTrainedTokenizerFast(tokenizer_object=core)

    check_tokenizer(fast(words, pre_tokenizers.WhitespaceSplit()), "model.gguf")  # 10 tokens for 9 words
    by_char = fast(chars, pre_tokenizers.Split("", behavior="isolated"))
    assert len(by_char.encode(TOKENIZER_PROBE)) == len(TOKENIZER_PROBE)
    with pytest.raises(ModelError, match=r"reads the tokenizer of model.gguf into 44 tokens for a 9-word sentence"):
        check_tokenizer(by_char, "model.gguf")
