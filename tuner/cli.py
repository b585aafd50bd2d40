"""Tuner commands. `pnmix run` is the main job of `make run`.

Until the campaign engine lands, the main job prints the model's bit-budget table, then scores
fp16, KIVI-2 and the paper's PN-Mix config by passkey retrieval with real generation, side by
side with the bytes each cache held.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pnmix.cli import (
    BHighOpt,
    BLowOpt,
    CriterionOpt,
    GroupOpt,
    PresetOpt,
    RatioOpt,
    ResidualOpt,
    SinkOpt,
    VBitsOpt,
    VGroupOpt,
    budget_table,
    config_from_options,
    console,
)


def run_main_job(
    model: Annotated[str, typer.Option(help="model to tune")] = "smollm2-135m",
    items: Annotated[int, typer.Option(help="passkey items per config")] = 5,
    seed: Annotated[int, typer.Option(help="item seed")] = 0,
) -> None:
    """Main job on a model: bit-budget table, then passkey accuracy of fp16, KIVI-2 and PN-Mix."""
    import time

    from pnmix import models
    from pnmix.bits import key_bits
    from pnmix.config import preset
    from tuner.tasks import accuracy, passkey_items

    console.print(budget_table(model))
    loaded = models.load(model, purpose="accuracy")
    d = loaded.shape.head_dim
    suite = passkey_items(items, seed)
    table = Table(title=f"passkey retrieval on {model}, {items} items (CPU torch reference)")
    for col in ("config", "key bits", "accuracy", "seconds"):
        table.add_column(col, justify="right")
    for name in ("fp16", "kivi2", "pnmix-paper"):
        cfg = preset(name)
        start = time.perf_counter()
        acc = accuracy(loaded.model, loaded.tokenizer, cfg, suite)
        table.add_row(name, f"{key_bits(cfg, d).total:.3f}", f"{acc:.2f}", f"{time.perf_counter() - start:.1f}")
        console.print(f"{name}: passkey accuracy {acc:.2f}")
    console.print(table)


def eval_config(
    model: Annotated[str, typer.Option(help="model name, local directory or Hugging Face id")] = "smollm2-135m",
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
    profile_name: Annotated[str, typer.Option("--profile", help="quick or full")] = "quick",
    seed: Annotated[int, typer.Option(help="task seed")] = 0,
    gsm8k: Annotated[str | None, typer.Option(help="JSONL file of {question, answer} to add as a task")] = None,
    tasks: Annotated[str | None, typer.Option(help="comma-separated: passkey, kv_lookup, fidelity, gsm8k")] = None,
    compare: Annotated[str | None, typer.Option(help="comma-separated presets to score side by side")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Score PN-Mix configs by real inference: accuracy parts, key bits, bytes held, decode tokens/s."""
    import json

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pnmix.config import preset
    from tuner.evaluate import Evaluator
    from tuner.profiles import profile

    prof = profile(profile_name)
    if compare:
        configs = {name.strip(): preset(name.strip()) for name in compare.split(",") if name.strip()}
    else:
        cfg = config_from_options(preset_name or "pnmix-paper", b_high, b_low, group_size, salient_ratio, sinks,
                                  residual, value_bits_, value_group, criterion)
        configs = {preset_name or "config": cfg}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=as_json) as bar:
        task = bar.add_task("loading model", total=None)

        def say(message: str) -> None:
            bar.update(task, description=message)

        chosen = tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None
        evaluator = Evaluator(model, prof, seed, gsm8k, progress=say, tasks=chosen)
        evaluator.prepare()
        scores = {}
        for name, cfg in configs.items():
            say(f"{name}: scoring")
            scores[name] = evaluator.evaluate(cfg)
            scores[name].parts["proxy_kl"] = evaluator.proxy(cfg)
    if as_json:
        print(json.dumps({name: s.to_dict() for name, s in scores.items()}))
        return
    table = Table(title=f"{model}, profile {prof.name}, seed {seed} ({evaluator.backend} on {evaluator.device})")
    part_names = sorted({p for s in scores.values() for p in s.parts})
    for col in ("config", "key bits", "accuracy", *part_names, "fid. top-1", "fid. KL", "KV KiB", "decode tok/s",
                "s"):
        table.add_column(col, justify="right")
    for name, s in scores.items():
        table.add_row(name, f"{s.key_bits:.3f}", f"{s.accuracy:.3f}", *[f"{s.parts.get(p, float('nan')):.3f}"
                      for p in part_names], f"{s.fidelity_agreement:.3f}", f"{s.fidelity_kl:.4f}",
                      f"{s.kv_bytes / 1024:.0f}", f"{s.decode_tokens_per_s:.1f}", f"{s.seconds:.0f}")
    console.print(table)
