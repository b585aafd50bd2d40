"""Scoring commands: `pnmix eval`, `pnmix validate` and `pnmix layers` (real inference, no database)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pnmix import inputs
from pnmix.cli import (
    BHighOpt,
    BLowOpt,
    CriterionOpt,
    GroupOpt,
    ModelOpt,
    PresetOpt,
    RatioOpt,
    ResidualOpt,
    SinkOpt,
    VBitsOpt,
    VGroupOpt,
    config_from_options,
    console,
)
from pnmix.config import PRESETS
from pnmix.inputs import InputFile, Names, Number, OutputFile
from pnmix.storage.vocabulary import TIE_Z
from pnmix.tuner.commands.options import (
    ItemsOpt,
    LmEvalLimitOpt,
    LmEvalTaskOpt,
    ProfileOpt,
    SeedOpt,
    TaskListOpt,
    TextPrefixOpt,
    TextsOpt,
    TextTokensOpt,
    compare_names,
    load_config_file,
    named_tasks,
    texts_task,
    write_regular_file,
)
from pnmix.tuner.commands.render import num, pm, signed
from pnmix.tuner.errors import EvalError

CompareOpt = Annotated[str | None, typer.Option(
    help="comma-separated presets or peers (hf-quanto-2, hf-quanto-4, hf-hqq-2, hf-hqq-4; engine recipes "
         "engine:KEY or engine:KEY/VALUE, with +bf16@L.L for bf16 layers, e.g. engine:fp8+bf16@0.29) to score "
         "side by side",
    parser=Names(compare_names, with_arguments=("engine",)))]


def eval_config(
    model: ModelOpt = "smollm2-135m",
    preset_name: PresetOpt = None,
    b_high: BHighOpt = None,
    b_low: BLowOpt = None,
    group_size: GroupOpt = None,
    salient_ratio: RatioOpt = None,
    sinks: SinkOpt = None,
    residual: ResidualOpt = None,
    value_bits_: VBitsOpt = None,
    value_group: VGroupOpt = None,
    criterion: CriterionOpt = None,
    profile_name: ProfileOpt = "quick",
    seed: SeedOpt = 0,
    items: ItemsOpt = None,
    texts: TextsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
    tasks: TaskListOpt = None,
    compare: CompareOpt = None,
    lm_eval_task: LmEvalTaskOpt = None,
    lm_eval_limit: LmEvalLimitOpt = None,
    config_file: Annotated[str | None, typer.Option(
        "--config", help="PNMixConfig JSON file, e.g. from `pnmix export`, or a layer-wise config",
        parser=InputFile())] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Score PN-Mix configs by real inference: accuracy parts, key bits, bytes held, decode tokens/s."""
    import json

    from pnmix import models
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.scoring.stats import paired

    prof = profile(profile_name)
    models.resolve(model, purpose="accuracy")  # an unknown model: one line before torch loads
    text_task = texts_task(texts, text_prefix, text_tokens)
    if config_file and compare:
        raise EvalError("give --config or --compare, not both")
    elif config_file:
        configs = {config_file: load_config_file(config_file)}
    elif compare:
        configs = _compared(compare)
    else:
        cfg = config_from_options(preset_name or "pnmix-paper", b_high, b_low, group_size, salient_ratio, sinks,
                                  residual, value_bits_, value_group, criterion)
        configs = {preset_name or "config": cfg}
    evaluator, scores = _score_configs(configs, as_json, model, prof, seed, items, named_tasks(tasks), lm_eval_task,
                                       lm_eval_limit, text_task)
    names = list(scores)
    diffs = {name: paired(scores[name].units, scores[names[0]].units) for name in names[1:]}
    if as_json:
        out = {name: s.to_dict() for name, s in scores.items()}
        for name, d in diffs.items():
            out[name]["paired_vs_" + names[0]] = {k: {"diff": v, "se": se} for k, (v, se) in d.items()}
        print(json.dumps(out))
    else:
        _print_scores(model, prof.name, seed, evaluator, configs, scores, diffs)


def _compared(compare: str) -> dict[str, Any]:
    """--compare's presets and peers (transformers' quantized caches, tuner/scoring/peers.py), by name."""
    from pnmix.config import preset
    from pnmix.tuner.scoring.peers import is_peer, peer

    names = [name.strip() for name in compare.split(",") if name.strip()]
    return {name: peer(name) if is_peer(name) else preset(name) for name in names}


def _score_configs(configs: dict[str, Any], quiet: bool, model: str, prof: Any, seed: int, items: str | None,
                   tasks: tuple[str, ...] | None, lm_eval_task: str | None, lm_eval_limit: int | None,
                   text_task: Any) -> tuple[Any, dict[str, Any]]:
    """The evaluator and each config's score on its items (peers scored beside the presets on the same ones)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pnmix.tuner.scoring import peers
    from pnmix.tuner.scoring.evaluate import Evaluator  # torch: only once the configs are known to be good

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=quiet) as bar:
        task = bar.add_task("loading model", total=None)

        def say(message: str) -> None:
            bar.update(task, description=message)

        evaluator = Evaluator(model, prof, seed, items, progress=say, tasks=tasks, lm_eval_task=lm_eval_task,
                              lm_eval_limit=lm_eval_limit, texts=text_task)
        evaluator.prepare()
        scores = {}
        for name, cfg in configs.items():
            say(f"{name}: scoring")
            if isinstance(cfg, peers.Peer | peers.RecipePeer):
                scores[name] = peers.score(evaluator, cfg)
                scores[name].parts["proxy_kl"] = float("nan")  # the proxy models PN-Mix's quantizer only
                continue
            scores[name] = evaluator.evaluate(cfg)
            scores[name].parts["proxy_kl"] = evaluator.proxy(cfg)
    return evaluator, scores


def _print_scores(model: str, profile_name: str, seed: int, evaluator: Any, configs: dict[str, Any],
                  scores: dict[str, Any], diffs: dict[str, Any]) -> None:
    from pnmix.tuner.scoring import peers
    names = list(scores)
    table = Table(title=f"{model}, profile {profile_name}, seed {seed} ({evaluator.backend} on {evaluator.device}); "
                        "mean +- standard error")
    part_names = [p for p in ("passkey", "kv_lookup", "items", "lm_eval", "fidelity", "texts")
                  if any(p in s.parts for s in scores.values())]
    for col in ("config", "key bits", "accuracy", *part_names, "fid. top-1", "fid. KL", "proxy KL", "KV KiB",
                "decode tok/s", "s"):
        table.add_column(col, justify="right")
    for name, s in scores.items():
        table.add_row(name, num(s.key_bits, ".3f"), pm(s.accuracy, s.accuracy_se),
                      *[pm(s.parts[p], s.parts_se.get(p)) if p in s.parts else "-" for p in part_names],
                      f"{s.fidelity_agreement:.3f}", f"{s.fidelity_kl:.4f}", num(s.parts["proxy_kl"], ".4f"),
                      f"{s.kv_bytes / 1024:.0f}", f"{s.decode_tokens_per_s:.1f}", f"{s.seconds:.1f}")
    console.print(table)
    console.print("items: " + ", ".join(f"{k} {v}" for k, v in scores[names[0]].items.items())
                  + (f" (lm_eval: {evaluator.harness.task})" if evaluator.harness is not None else ""))
    for name, cfg in configs.items():
        if isinstance(cfg, peers.RecipePeer):
            console.print(f"{name}: {cfg.label}, {cfg.kv_bits(evaluator.plan):.3f} effective KV bits; scored item "
                          "by item through generate; no tokens/s (the emulation's speed is not the engine's)")
        elif isinstance(cfg, peers.Peer):
            console.print(f"{name}: {cfg.label}; scored item by item through generate, tokens/s from its dynamic "
                          "decode" + ("; key bits n/a (its groups are not per token)"
                                      if math.isnan(scores[name].key_bits) else ""))
    if diffs:
        paired_table = Table(title=f"paired difference to {names[0]} (same items): diff +- SE; * where |diff| > 2 SE")
        for col in ("config", "accuracy", *part_names):
            paired_table.add_column(col, justify="right")
        for name, d in diffs.items():
            paired_table.add_row(name, *[signed(*d[p]) if p in d else "-" for p in ("accuracy", *part_names)])
        console.print(paired_table)


def validate(
    config_file: Annotated[str, typer.Option("--config", help="the config to check: a PNMixConfig, layer-wise or "
                                             "engine recipe JSON file, e.g. from `pnmix export`", parser=InputFile())],
    against: Annotated[str, typer.Option(help="comma-separated presets to compare with, paired on the same units",
                                         parser=Names(tuple(PRESETS)))] = "fp16,pnmix-paper",
    texts: TextsOpt = None,
    items: ItemsOpt = None,
    text_prefix: TextPrefixOpt = None,
    text_tokens: TextTokensOpt = None,
    tasks: TaskListOpt = None,
    model: ModelOpt = "smollm2-135m",
    profile_name: ProfileOpt = "quick",
    seed: SeedOpt = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Check a config on your data against the baselines, with standard errors and paired differences.

    Check a config on your data: it and the baselines scored on the same texts and items, with
    standard errors and paired differences. With --texts or --items only those parts run (else the
    built-in tasks of the profile). Exits 0 whatever the verdict."""
    import json

    from pnmix.config import preset

    text_task = texts_task(texts, text_prefix, text_tokens)
    from pnmix import models

    models.resolve(model, purpose="accuracy")
    config = load_config_file(config_file)
    baselines = {name: preset(name) for name in against.split(",")}
    named = named_tasks(tasks)
    if named is None and (items or text_task):
        named = (*(("items",) if items else ()), *(("texts",) if text_task else ()))
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.scoring.stats import paired

    def say(message: str) -> None:
        if not as_json:
            console.print(f"[dim]{message}[/dim]")

    evaluator = Evaluator(model, profile(profile_name), seed, items, progress=say, tasks=named, texts=text_task)
    config.check_head_dim(evaluator.head_dim)
    scores = {"config": evaluator.evaluate(config, measure=False)}
    for name, cfg in baselines.items():
        scores[name] = evaluator.evaluate(cfg, measure=False)
    diffs = {name: paired(scores["config"].units, scores[name].units) for name in baselines}
    if as_json:
        print(json.dumps(_validation_json(model, config, evaluator, scores, diffs)))
    else:
        _print_validation(config_file, model, evaluator, scores, diffs)


def _validation_json(model: str, config: Any, evaluator: Any, scores: dict[str, Any],
                     diffs: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "config": config.to_dict(), "tasks": list(evaluator.tasks),
            "units": scores["config"].items,
            "scores": {name: {"key_bits": sc.key_bits, "accuracy": sc.accuracy, "accuracy_se": sc.accuracy_se,
                              "parts": sc.parts, "parts_se": sc.parts_se,
                              "texts_kl": None if math.isnan(sc.texts_kl) else sc.texts_kl}
                       for name, sc in scores.items()},
            "config_minus": {name: {part: {"diff": v, "se": se, "beyond_2se": se is not None and abs(v) > TIE_Z * se}
                                    for part, (v, se) in d.items()} for name, d in diffs.items()}}


def _print_validation(config_file: str, model: str, evaluator: Any, scores: dict[str, Any],
                      diffs: dict[str, Any]) -> None:
    parts = list(scores["config"].parts)
    units = ", ".join(f"{n} {k}" for k, n in scores["config"].items.items())
    table = Table(title=f"{config_file} on {model} ({units}; {evaluator.backend}): mean +- standard error; last "
                        "column: config minus that row, paired on the same units, * where beyond 2 SE")
    for col in ("", "key bits", "accuracy", *parts, *(("texts KL",) if "texts" in parts else ()), "config minus it"):
        table.add_column(col, justify="right")
    for name, sc in scores.items():
        table.add_row(name, num(sc.key_bits, ".3f"), pm(sc.accuracy, sc.accuracy_se),
                      *[pm(sc.parts[p], sc.parts_se.get(p)) for p in parts],
                      *((f"{sc.texts_kl:.4f}",) if "texts" in parts else ()),
                      signed(*diffs[name]["accuracy"]) if name in diffs else "")
    console.print(table)
    for name, d in diffs.items():
        diff, se = d["accuracy"]
        verdict = ("above it" if diff > 0 else "below it") if se is not None and abs(diff) > TIE_Z * se else (
            "not distinguishable from it (within 2 SE)")
        console.print(f"against {name}: {verdict}")


def layers(
    model: ModelOpt = "smollm2-135m",
    bits: Annotated[float | None, typer.Option(
        help="key-bit budget, weighted by what each layer holds (default: the base config's own bits)",
        parser=Number(inputs.BUDGET))] = None,
    preset_name: PresetOpt = None,
    config_file: Annotated[str | None, typer.Option(
        "--config", help="the base PNMixConfig as a JSON file (default: --preset, else pnmix-paper)",
        parser=InputFile())] = None,
    profile_name: ProfileOpt = "quick",
    output: Annotated[str | None, typer.Option("-o", "--output", help="write the layer-wise config here (JSON)",
                                               parser=OutputFile())] = None,
    plot: Annotated[str | None, typer.Option(help="draw the per-layer KL and bits here (PNG)",
                                             parser=OutputFile())] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Measure each layer's sensitivity and allocate a layer-wise config within --bits.

    Each layer's attention KL (the proxy) under the base config, then every layer's bit pair and
    salient ratio chosen so that the summed KL is least with the model's key bits within --bits (on
    a hybrid model: its full-attention layers, the windows at 16 bits; docs/layerwise.md)."""
    import json

    from pnmix.bits import weighted_key_bits
    from pnmix.config import PNMixConfig, preset
    from pnmix.layerwise import LayerwiseConfig, simplest
    from pnmix.tuner.scoring.evaluate import Evaluator
    from pnmix.tuner.scoring.profiles import profile
    from pnmix.tuner.search.layers import candidates_like, layerwise_for_budget, spread
    from pnmix.tuner.search.space import SearchSpace

    base = load_config_file(config_file) if config_file else preset(preset_name or "pnmix-paper")
    if not isinstance(base, PNMixConfig):
        raise EvalError(f"--config {config_file}: give a single PNMixConfig as the base, not a layer-wise one")
    ev = Evaluator(model, profile(profile_name), tasks=("fidelity",))
    d, plan = ev.head_dim, ev.plan
    budget = bits if bits is not None else weighted_key_bits(base, plan, d)
    space = SearchSpace()
    with console.status("proxy KL of every candidate, layer by layer"):
        kl_of = {c: ev.proxy_by_layer(c) for c in candidates_like(base, space)}  # the full-attention layers'
    # The full-attention layers share what the budget leaves beside the windows (16 bits).
    allocated = layerwise_for_budget(base, plan.full_layer_budget(budget, base.n_sink), d, space, kl_of)
    chosen = allocated.per_layer(len(plan.full_layers))
    lw = simplest(LayerwiseConfig.from_layers(spread(chosen, plan)))
    layer_kl = [kl_of[c][i] for i, c in enumerate(chosen)]
    report: dict[str, Any] = {
        "model": model, "base": base.to_dict(), "budget": budget, "base_key_bits": weighted_key_bits(base, plan, d),
        "key_bits": weighted_key_bits(lw, plan, d), "layers": plan.full_layers, "sensitivity": kl_of[base],
        "layer_kl": layer_kl, "config": lw.to_dict()}
    if output:
        write_regular_file(Path(output), lw.to_json() + "\n")
    if plot:
        _plot_layers(report, base, chosen, d, Path(plot))
    if as_json:
        print(json.dumps(report))
    else:
        _print_layers(report, base, lw, chosen, kl_of, output, plot)


def _plot_layers(report: dict[str, Any], base: Any, chosen: list[Any], head_dim: int, path: Path) -> None:
    from pnmix.tuner.commands.plot import layers_plot

    layers_plot(report["sensitivity"], chosen, report["layer_kl"], head_dim, path,
                f"{report['model']}: base {base.label} ({report['base_key_bits']:.3f} bits) -> layer-wise "
                f"({report['key_bits']:.3f} bits)", report["layers"])


def _print_layers(report: dict[str, Any], base: Any, lw: Any, chosen: list[Any], kl_of: dict[Any, list[float]],
                  output: str | None, plot: str | None) -> None:
    table = Table(title=f"{report['model']}: per-layer attention KL (proxy), base {base.label}")
    for col in ("layer", "base KL", "chosen", "its KL"):
        table.add_column(col, justify="right")
    for i, c in enumerate(chosen):
        table.add_row(str(report["layers"][i]), f"{kl_of[base][i]:.4f}", f"{c.b_high}/{c.b_low} r{c.salient_ratio:g}",
                      f"{kl_of[c][i]:.4f}")
    console.print(table)
    console.print(f"layer-wise: {lw.label}")
    console.print(f"key bits {report['key_bits']:.3f} (budget {report['budget']:.3f}; base "
                  f"{report['base_key_bits']:.3f}); summed KL {sum(report['layer_kl']):.3f} "
                  f"(base {sum(kl_of[base]):.3f})"
                  + (f"; wrote {output}" if output else "") + (f"; plot {plot}" if plot else "")
                  + f"; score it: pnmix eval --config {output or 'FILE'}")
