"""The method's own CLI commands (`pnmix bits`, `pnmix generate`); the root app lives in api/cli.py.

Heavy dependencies (torch, transformers) are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from pnmix import inputs
from pnmix.bits import KVBytes, LayerPlan, ModelShape, key_bits, kv_cache_bytes, value_bits
from pnmix.config import CRITERIA, GROUP_SIZES, KEY_BITS, PRESETS, UNQUANTIZED_BITS, VALUE_BITS, PNMixConfig, preset
from pnmix.inputs import INT32_MAX, Choice, InputFile, Int, ModelName, Number, Range, Text
from pnmix.layerwise import LayerwiseConfig, as_layerwise, load_config
from pnmix.models import chat_ids
from pnmix.names import FULL

if TYPE_CHECKING:
    import torch

# Tables are wide: without a terminal (logs, CI) rich would wrap them at 80 columns.
console = Console() if sys.stdout.isatty() else Console(width=160)


def config_from_options(
    preset_name: str | None,
    b_high: int | None = None,
    b_low: int | None = None,
    group_size: int | None = None,
    salient_ratio: float | None = None,
    n_sink: int | None = None,
    residual_len: int | None = None,
    value_bits: int | None = None,
    value_group_size: int | None = None,
    criterion: str | None = None,
) -> PNMixConfig:
    """A preset (default `pnmix-paper`) with every explicitly given knob applied on top."""
    base = preset(preset_name) if preset_name else PNMixConfig()
    changes = {
        k: v
        for k, v in dict(
            b_high=b_high, b_low=b_low, group_size=group_size, salient_ratio=salient_ratio, n_sink=n_sink,
            residual_len=residual_len, value_bits=value_bits, value_group_size=value_group_size,
            criterion=criterion,
        ).items()
        if v is not None
    }
    # A lone --b-high 16 (or --b-low) means "unquantized keys": set both so the pair is valid.
    if changes.get("b_high") == 16 and "b_low" not in changes:
        changes["b_low"] = 16
    return PNMixConfig(**{**base.to_dict(), **changes})


# Every option parses through a checker of pnmix.inputs: a value is refused while the command line is
# parsed, before any model loads. The config's knobs take the sets the config itself allows; what
# depends on two knobs (b_low <= b_high, residual a multiple of G) is the config's own check.
_KEY_BITS = (*KEY_BITS, UNQUANTIZED_BITS)
_INT32 = Range(0, INT32_MAX, integer=True)
_POSITIVE = Range(1, INT32_MAX, integer=True)
PresetOpt = Annotated[str | None, typer.Option("--preset", help=f"one of {', '.join(PRESETS)}",
                                               parser=Choice(tuple(PRESETS)))]
BHighOpt = Annotated[int | None, typer.Option("--b-high", help="bits of salient channels (1..4, 16 = fp16)",
                                              parser=Int(values=_KEY_BITS))]
BLowOpt = Annotated[int | None, typer.Option("--b-low", help="bits of other channels (1..4)",
                                             parser=Int(values=_KEY_BITS))]
GroupOpt = Annotated[int | None, typer.Option("--group-size", "-G", help="key token group: 32, 64, 128",
                                              parser=Int(values=GROUP_SIZES))]
RatioOpt = Annotated[float | None, typer.Option("--salient-ratio", "-r", help="salient pair fraction in [0, 1]",
                                                parser=Number(Range(0.0, 1.0)))]
SinkOpt = Annotated[int | None, typer.Option("--sinks", help="fp16 attention-sink tokens", parser=Int(_INT32))]
ResidualOpt = Annotated[int | None, typer.Option("--residual", help="fp16 residual buffer length",
                                                 parser=Int(_POSITIVE))]
VBitsOpt = Annotated[int | None, typer.Option("--value-bits", help="1, 2, 4, 8, 16", parser=Int(values=VALUE_BITS))]
VGroupOpt = Annotated[int | None, typer.Option("--value-group", help="value channel group size",
                                               parser=Int(_POSITIVE))]
CriterionOpt = Annotated[str | None, typer.Option("--criterion", help="saliency criterion", parser=Choice(CRITERIA))]
ModelOpt = Annotated[str, typer.Option(help="model name, local directory or Hugging Face id", parser=ModelName())]


def bits(
    preset_name: PresetOpt = None,
    b_high: BHighOpt = None,
    b_low: BLowOpt = None,
    group_size: GroupOpt = None,
    salient_ratio: RatioOpt = None,
    sinks: SinkOpt = None,
    residual: ResidualOpt = None,
    value_bits_: VBitsOpt = None,
    value_group: VGroupOpt = None,
    head_dim: Annotated[int | None, typer.Option(help="head dim (default: the model's, else 128)",
                                                 parser=Int(inputs.HEAD_DIM))] = None,
    tokens: Annotated[int, typer.Option(help="quantized tokens T_q in the formula", parser=Int(inputs.COUNT))] = 32768,
    model: Annotated[str | None, typer.Option(help="also report KV bytes for this model's shape",
                                              parser=ModelName())] = None,
    batch: Annotated[int, typer.Option(help="batch for the KV byte total", parser=Int(inputs.COUNT))] = 1,
    seq_len: Annotated[int, typer.Option(help="sequence length for the KV byte total",
                                         parser=Int(inputs.COUNT))] = 8192,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    config_file: Annotated[str | None, typer.Option(
        "--config", help="a JSON file holding a PNMixConfig or a layer-wise config (docs/layerwise.md); "
                         "replaces the knob options", parser=InputFile())] = None,
    layers: Annotated[int | None, typer.Option(help="layers of the model, for a layer-wise --config without "
                                                    "--model", parser=Int(_POSITIVE))] = None,
) -> None:
    """Bit-width breakdown of one PN-Mix config (docs/design.md, "Bit-width accounting").

    For a layer-wise config, each layer's key bits and the model's average."""
    shape, plan = _model_layout(model)
    config = load_config(Path(config_file).read_bytes()) if config_file else config_from_options(
        preset_name, b_high, b_low, group_size, salient_ratio, sinks, residual, value_bits_, value_group
    )
    d = head_dim if head_dim is not None else (shape.head_dim if shape else 128)
    config.check_head_dim(d)
    report, table = _config_bits(config, shape, layers, d, tokens)
    kv, held_table = _model_bits(report, config, model, shape, plan, d, batch, seq_len)
    if as_json:
        print(json.dumps(report))
        return
    console.print(table)
    if held_table is not None:
        console.print(held_table)
    if kv is not None:
        console.print(
            f"{model}: batch {batch} x {seq_len} tokens -> {kv.total / 2**20:.2f} MiB "
            f"(fp16 {kv.fp16_total / 2**20:.2f} MiB, {kv.fp16_total / max(kv.total, 1):.2f}x smaller)"
        )


def _model_layout(model: str | None) -> tuple[ModelShape | None, LayerPlan | None]:
    """`pnmix bits --model`: the model's shape and layer plan; (None, None) without a model."""
    if model is None:
        return None, None
    from pnmix.models import layer_plan, model_shape

    return model_shape(model), layer_plan(model)


def _config_bits(config: PNMixConfig | LayerwiseConfig, shape: ModelShape | None, layers: int | None, d: int,
                 tokens: int) -> tuple[dict[str, Any], Table]:
    """`pnmix bits` for either kind of config (report, table); a layer-wise one needs the layer count,
    from the model's shape or --layers."""
    if not isinstance(config, LayerwiseConfig):
        return _single_bits(config, d, tokens)
    n_layers = shape.num_layers if shape is not None else layers
    if n_layers is None:
        raise inputs.InputError("--layers", "(missing)", "the model's layer count (or --model) for a layer-wise config")
    return _layerwise_bits(config, n_layers, d, tokens)


def _model_bits(report: dict[str, Any], config: PNMixConfig | LayerwiseConfig, model: str | None,
                shape: ModelShape | None, plan: LayerPlan | None, d: int, batch: int,
                seq_len: int) -> tuple[KVBytes | None, Table | None]:
    """`pnmix bits --model`: adds the model's KV bytes to `report` and, for a model with sliding-window
    layers, what each layer holds (`_held_bits`). Returns the KV bytes and that table (None without them)."""
    kv = kv_cache_bytes(config, shape, batch, seq_len, plan) if shape is not None else None
    held_table = None
    if kv is not None:
        report["model"] = model
        report["kv_bytes"] = kv.as_dict()
        report["batch"], report["seq_len"] = batch, seq_len
    if shape is not None and plan is not None and plan.hybrid:
        held_report, held_table = _held_bits(config, shape, plan, d, batch, seq_len)
        report.update(held_report)
    return kv, held_table


def _single_bits(config: PNMixConfig, d: int, tokens: int) -> tuple[dict[str, Any], Table]:
    """`pnmix bits` for one config: the formula term by term (report, table)."""
    kb = key_bits(config, d, tokens)
    report: dict[str, Any] = {"config": config.to_dict(), "key_bits": asdict(kb), "value_bits": value_bits(config)}
    table = Table(title=f"PN-Mix key bits, d={d}, T_q={tokens}")
    table.add_column("term")
    table.add_column("bits / element", justify="right")
    for name in ("payload", "sinks", "scales", "key_bits", "metadata", "total"):
        table.add_row(name, f"{getattr(kb, name):.5f}")
    table.add_row("value bits", f"{value_bits(config):.5f}")
    return report, table


def _runs(values: Sequence[Any]) -> list[tuple[str, int]]:
    """Runs of equal consecutive values (layers that share a table row): each run's layers as "3" or
    "0-4", and its first index."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((str(start) if i - 1 == start else f"{start}-{i - 1}", start))
            start = i
    return out


def _held_bits(config: Any, shape: ModelShape, plan: LayerPlan, d: int, batch: int,
               seq_len: int) -> tuple[dict[str, Any], Table]:
    """`pnmix bits --model` for a model with sliding-window layers: per layer, its kind, the tokens it
    holds after `seq_len` and its bytes; the model's key and KV bits weighted by the elements each
    layer holds (pnmix.bits, `weighted_key_bits`) after the same `seq_len` tokens."""
    from pnmix.bits import held_key_bits, layer_bytes

    per_layer = as_layerwise(config).held_configs(plan.kinds)  # None: a window in the model's dtype
    held = plan.held(seq_len)
    layer_kv = layer_bytes(config, shape, batch, seq_len, plan)
    weighted = held_key_bits(config, plan, d, seq_len)
    report: dict[str, Any] = {
        "layer_kinds": list(plan.kinds), "window": plan.window, "weighted_key_bits": weighted,
        "layers_held": [{"layer": i, "kind": k, "tokens": t, "config": c.label if c is not None else "fp16 (window)",
                         "bytes": b.total} for i, (k, t, c, b) in enumerate(zip(plan.kinds, held, per_layer, layer_kv,
                                                                                  strict=True))]}
    table = Table(title=f"what each layer holds after {seq_len} tokens (batch {batch}); window {plan.window}")
    for col in ("layers", "kind", "tokens held", "config", "KiB a layer"):
        table.add_column(col, justify="right" if col in ("tokens held", "KiB a layer") else "left")
    rows = list(zip(plan.kinds, held, per_layer, [b.total for b in layer_kv], strict=True))
    for name, first in _runs(rows):
        kind, n, c, nbytes = rows[first]
        table.add_row(name, kind, str(n), c.label if c is not None else "fp16 (window)", f"{nbytes / 1024:.1f}")
    table.add_row("model key bits", "", "", f"layers weighted by the key elements they hold after {seq_len} tokens",
                  f"{weighted:.3f}")
    return report, table


def _layerwise_bits(config: Any, n_layers: int, d: int, tokens: int) -> tuple[dict[str, Any], Table]:
    """`pnmix bits` for a layer-wise config: key bits per layer and the model's average (report, table)."""
    from pnmix.bits import key_bits_by_layer, mean_key_bits

    per_layer = config.per_layer(n_layers)
    kbs = key_bits_by_layer(config, n_layers, d, tokens)
    report: dict[str, Any] = {
        "config": config.to_dict(), "head_dim": d, "layers": n_layers,
        "key_bits_by_layer": [{"layer": i, "config": c.label, "total": kb.total, "key_bits": kb.key_bits}
                              for i, (c, kb) in enumerate(zip(per_layer, kbs, strict=True))],
        "mean_key_bits": mean_key_bits(config, n_layers, d, tokens),
        "value_bits": value_bits(config.default),
    }
    table = Table(title=f"PN-Mix key bits by layer, d={d}, T_q={tokens}: {config.label}")
    table.add_column("layers")
    table.add_column("config")
    table.add_column("key bits (total)", justify="right")
    for name, first in _runs(per_layer):
        table.add_row(name, per_layer[first].label, f"{kbs[first].total:.5f}")
    table.add_row("model average", "", f"{report['mean_key_bits']:.5f}")
    return report, table


def budget_table(model: str, seq_len: int = 8192) -> Table:
    """Key bits and KV bytes of the presets and a small grid, for one model: what a budget buys."""
    from pnmix.bits import held_key_bits, weighted_key_bits
    from pnmix.models import layer_plan, model_shape

    shape, plan = model_shape(model), layer_plan(model)
    d = shape.head_dim
    rows: list[tuple[str, PNMixConfig]] = list(PRESETS.items())
    for b_high, b_low in ((2, 1), (3, 1), (3, 2), (4, 1), (4, 2)):
        for r in (0.25, 0.5):
            rows.append((f"{b_high}/{b_low} r={r}", PNMixConfig(b_high=b_high, b_low=b_low, salient_ratio=r)))
    table = Table(title=f"PN-Mix bit budgets for {model} (d={d}, {seq_len} tokens, batch 1)"
                  + (f"; {plan.kinds.count(FULL)} of {len(plan.kinds)} layers full attention, the rest hold a "
                     f"window of {plan.window} in fp16" if plan.hybrid else ""))
    columns = ["config", "b_H/b_L", "G", "r", "sinks", "key bits", "total", "value bits", "KV MiB", "vs fp16"]
    if plan.hybrid:  # the model's figure: layers weighted by the key elements they hold at seq_len, and
        # at 32K tokens, the figure a budget bounds
        columns[7:7] = [f"model key bits @{seq_len}", "@32K (budgets)"]
    for col in columns:
        table.add_column(col, justify="right")
    for name, cfg in sorted(rows, key=lambda row: key_bits(row[1], d).total):
        kb = key_bits(cfg, d)
        kv = kv_cache_bytes(cfg, shape, 1, seq_len, plan)
        cells = [name, f"{cfg.b_high}/{cfg.b_low}", str(cfg.group_size), f"{cfg.salient_ratio:g}", str(cfg.n_sink),
                 f"{kb.key_bits:.3f}", f"{kb.total:.3f}", f"{value_bits(cfg):.2f}", f"{kv.total / 2**20:.2f}",
                 f"{kv.fp16_total / kv.total:.2f}x"]
        if plan.hybrid:
            cells[7:7] = [f"{held_key_bits(cfg, plan, d, seq_len):.3f}", f"{weighted_key_bits(cfg, plan, d):.3f}"]
        table.add_row(*cells)
    return table


def list_models() -> None:
    """Models the registry knows by name (plus any local checkpoint or Hugging Face id)."""
    from pnmix.models import EMBEDDED, SHAPE_MODELS

    table = Table(title="registered models")
    for col in ("name", "kind", "layers", "heads", "KV heads", "head dim"):
        table.add_column(col)
    for name, spec in EMBEDDED.items():
        s = spec.shape
        table.add_row(name, "embedded", str(s.num_layers), str(s.num_heads), str(s.num_kv_heads), str(s.head_dim))
    for name, shape_model in SHAPE_MODELS.items():
        s = shape_model.shape
        table.add_row(
            name, "shape (random weights, performance only)", str(s.num_layers), str(s.num_heads),
            str(s.num_kv_heads), str(s.head_dim),
        )
    console.print(table)


def generate(
    prompt: Annotated[str, typer.Option(help="user message (the model's chat template is applied)",
                                        parser=Text(1, 1 << 20, lines=True))],
    model: ModelOpt = "smollm2-135m",
    preset_name: PresetOpt = "pnmix-paper",
    b_high: BHighOpt = None,
    b_low: BLowOpt = None,
    group_size: GroupOpt = None,
    salient_ratio: RatioOpt = None,
    sinks: SinkOpt = None,
    residual: ResidualOpt = None,
    value_bits_: VBitsOpt = None,
    value_group: VGroupOpt = None,
    criterion: CriterionOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate", parser=Int(inputs.NEW_TOKENS))] = 64,
    device: Annotated[str, typer.Option(help="cpu, or cuda (bf16 weights, Triton kernels)",
                                        parser=Choice(("cpu", "cuda")))] = "cpu",
    static: Annotated[bool, typer.Option("--static", help="static cache; on CUDA each step is a CUDA graph")] = False,
) -> None:
    """Greedy generation with a PN-Mix cache; prints the text and the bytes the cache held."""
    config = config_from_options(
        preset_name, b_high, b_low, group_size, salient_ratio, sinks, residual, value_bits_, value_group, criterion
    )
    _check_generation(model, config, static)
    import torch

    from pnmix import models

    if device == "cuda" and not torch.cuda.is_available():
        raise inputs.InputError("--device", device, "cpu (no CUDA device is visible)")
    loaded = models.load(model, purpose="accuracy", dtype=torch.bfloat16 if device == "cuda" else None, device=device)
    tok = loaded.tokenizer
    ids = chat_ids(tok, prompt)
    run = _generate_static if static else _generate_dynamic
    out, seconds, path, summary = run(loaded.model, config, ids, max_new_tokens, device)
    console.print(tok.decode(out[0], skip_special_tokens=True))
    console.print(f"[dim]{out.shape[1]} tokens in {seconds:.1f} s ({path}) | prompt {ids['input_ids'].shape[1]} "
                  f"tokens | {summary}[/dim]", soft_wrap=True)  # one line, however long: logs grep it


def _check_generation(model: str, config: PNMixConfig, static: bool) -> None:
    """What `pnmix generate` refuses before torch and the weights load: an unknown model, a config that
    does not fit the model's head dim, or one the static cache cannot run."""
    from pnmix import models

    models.resolve(model, purpose="accuracy")  # an unknown model: one line before torch loads
    # What depends on the model's shape or the path is refused before the weights load.
    config.check_head_dim(models.model_shape(model).head_dim)
    if static and (config.keys_quantized or config.values_quantized):
        from pnmix.static import method_config

        method_config(config)


def _generate_static(model: Any, config: PNMixConfig, ids: Any, max_new_tokens: int,
                     device: str) -> tuple[torch.Tensor, float, str, str]:
    """`pnmix generate --static`: greedy tokens on the static cache (CUDA graphs on CUDA), the seconds
    they took, the path that ran and the cache's capacity."""
    import time

    import torch

    start = time.perf_counter()
    from pnmix.static import StaticGenerator

    method = config if (config.keys_quantized or config.values_quantized) else "fp16"
    gen = StaticGenerator(model, method, max_len=ids["input_ids"].shape[1] + max_new_tokens)
    out = gen.generate(ids["input_ids"], ids["attention_mask"], max_new_tokens).cpu()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert gen.cache is not None
    path = "static cache, CUDA graphs" if gen.graphs_on else "static cache, eager"
    return out, seconds, path, f"static cache capacity {gen.cache.nbytes() / 2**20:.2f} MiB"


def _generate_dynamic(model: Any, config: PNMixConfig, ids: Any, max_new_tokens: int,
                      device: str) -> tuple[torch.Tensor, float, str, str]:
    """`pnmix generate`: greedy tokens on the PN-Mix cache, the seconds they took, the path that ran and
    the bytes the cache held, by region, with how many of its tokens are quantized."""
    import time

    from pnmix import generation

    start = time.perf_counter()
    out, cache = generation.generate(model, ids["input_ids"], config, ids["attention_mask"], max_new_tokens)
    seconds = time.perf_counter() - start
    held = cache.nbytes()
    path = "CPU torch reference" if device == "cpu" else "generate, Triton kernels"
    summary = f"cache {held['total'] / 2**20:.2f} MiB: " + ", ".join(
        f"{k} {v / 2**10:.0f} KiB" for k, v in held["regions"].items() if v)
    summary += " | " + _quantized_note(cache, config, ids["input_ids"].shape[1] + out.shape[1] - 1)
    return out, seconds, path, summary


def _quantized_note(cache: Any, config: PNMixConfig, tokens: int) -> str:
    """How many of the tokens the cache holds are quantized: a short generation may hold none."""
    if not (config.keys_quantized or config.values_quantized):
        return f"{tokens} tokens, none quantized (fp16 cache)"
    # The first PN-Mix layer (a quantized window stores every token too; an exact one has no groups).
    layer = next((la for la in getattr(cache, "layers", []) if hasattr(la, "n_groups")), None)
    quantized = int(layer.n_groups[0]) * config.group_size if layer is not None else 0
    if quantized:
        return f"{quantized} of {tokens} tokens quantized"
    return (f"{tokens} tokens, none quantized yet: the first {config.n_sink} are sinks, and the rest stay in fp16 "
            f"until {config.residual_len} have filled the residual buffer (generate more tokens to see it)")


ANALYZE_PROMPT = (
    "Write a long, detailed essay on how lighthouses were built and kept in the nineteenth century: "
    "the engineering, the lenses, the keepers' daily work, and the storms they faced."
)


def analyze(
    model: ModelOpt = "smollm2-135m",
    new_tokens: Annotated[int, typer.Option(help="generated tokens to trace (>= 512 for the paper's setup)",
                                            parser=Int(inputs.NEW_TOKENS))] = 512,
    group_size: Annotated[int, typer.Option("--group-size", "-G", help="key token group: 32, 64, 128",
                                            parser=Int(values=GROUP_SIZES))] = 64,
    out: Annotated[str, typer.Option(help="output folder", parser=inputs.OutputFolder())] = "out/analyze",
) -> None:
    """Saliency simulation on real post-RoPE traces: key MSE, attention KL, Jaccard, importance share."""
    import time
    from pathlib import Path

    from pnmix import analysis, models
    from pnmix.families import rope_pairing

    models.resolve(model, purpose="accuracy")  # an unknown model: one line before torch loads
    start = time.perf_counter()

    def say(message: str) -> None:  # plain lines, so that a log shows progress as well as a terminal
        console.print(f"[dim]{time.perf_counter() - start:5.0f} s  {message}[/dim]")

    say(f"loading {model}")
    loaded = models.load(model, purpose="accuracy")
    pairing = rope_pairing(loaded.model.config)
    ids = chat_ids(loaded.tokenizer, ANALYZE_PROMPT)["input_ids"]
    say(f"generating {new_tokens} tokens after a {ids.shape[1]}-token prompt, then recording Q/K")
    trace = analysis.record_trace(loaded.model, ids, new_tokens, progress=say)
    say(f"traced {trace.keys[0].shape[1]} tokens ({trace.prefill_len} prefill)")
    result = analysis.analyze(trace, pairing, group=group_size, progress=say)
    paths = analysis.write_report(result, Path(out) / model.replace("/", "_"), model)
    console.print(paths[1].read_text())
    console.print("wrote " + ", ".join(str(p) for p in paths) + f" ({time.perf_counter() - start:.0f} s)")
