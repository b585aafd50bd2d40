"""Tuner commands. `pnmix run` is the main job of `make run`.

Until the campaign engine lands, the main job prints the model's bit-budget table, then scores
fp16, KIVI-2 and the paper's PN-Mix config by passkey retrieval with real generation, side by
side with the bytes each cache held.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pnmix.cli import budget_table, console


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
    from tuner.passkey import passkey_accuracy, passkey_items

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
        acc = passkey_accuracy(loaded.model, loaded.tokenizer, cfg, suite)
        table.add_row(name, f"{key_bits(cfg, d).total:.3f}", f"{acc:.2f}", f"{time.perf_counter() - start:.1f}")
        console.print(f"{name}: passkey accuracy {acc:.2f}")
    console.print(table)
