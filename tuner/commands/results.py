"""Commands on stored results: `pnmix fronts`, `pnmix recommend`, `pnmix export` and `pnmix dashboard`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pnmix.cli import (
    console,
)
from pnmix.inputs import Choice, Int, Number, OutputFile
from pnmix.recipes import EngineRecipe
from pnmix.recipes import export as export_recipe
from pnmix.storage import vocabulary
from pnmix.storage.vocabulary import Host
from pnmix.tuner.commands.options import (
    BitsOfOpt,
    BitsOpt,
    DbModelOpt,
    EngineOpt,
    ReadStorageOpt,
    optimize_names,
    write_regular_file,
)
from pnmix.tuner.commands.render import holdout_line, pm, print_fronts, print_ties


def fronts(
    model: DbModelOpt = "smollm2-135m",
    campaign: Annotated[int | None, typer.Option(help="only this campaign", parser=Int(vocabulary.CAMPAIGN_ID))] = None,
    storage: ReadStorageOpt = None,
) -> None:
    """Print the stored Pareto fronts of a model."""
    from pnmix.tuner.search.session import open_db

    print_fronts(open_db(storage), model, campaign)


def recommend(
    model: DbModelOpt = "smollm2-135m",
    bits: BitsOpt = 2.25,
    bits_of: BitsOfOpt = "key",
    optimize: Annotated[str, typer.Option(help="accuracy, throughput or memory", parser=Choice(optimize_names))
                        ] = "accuracy",
    min_accuracy: Annotated[float | None, typer.Option(
        help="minimum accuracy (default: none for accuracy; for throughput and memory, "
             "90% of the best accuracy within the budget)", parser=Number(vocabulary.ACCURACY))] = None,
    storage: ReadStorageOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    engine: EngineOpt = None,
) -> None:
    """Recommend the best stored config within a bit budget, with the points statistically tied with it.

    The best stored config within a bit budget (key bits, or KV bits with --bits-of kv), with the
    points statistically tied with it.

    optimize=accuracy: the most accurate point and every point whose accuracy is within 2 standard
    errors of the difference from it are tied; the recommendation is the tied point with the fewest
    bits, then the highest measured throughput. optimize=throughput or memory: the fastest or
    smallest point whose accuracy is at least --min-accuracy, by default 90% of the best accuracy
    within the budget (a cache that saves memory by losing the answers is no recommendation).

    --format ENGINE: only the engine recipes that engine loads as they are (vLLM: one quantized
    dtype and bf16 skip layers; ik_llama.cpp: other types for the first and last layers only),
    and the answer in its syntax.
    """
    import json

    from pnmix.storage import recommend_with_ties
    from pnmix.tuner.search.session import open_db

    db = open_db(storage)
    with db.session(readonly=True) as s:
        rec = recommend_with_ties(s, model, bits, optimize, min_accuracy, bits_of=bits_of, engine=engine)
        p, config = rec.point, rec.point.config

        def row_of(q: Any) -> dict[str, Any]:
            return {"config": q.config.to_dict(), "key_bits": q.key_bits, "kv_bits": q.kv_bits, "accuracy": q.accuracy,
                    "accuracy_se": q.accuracy_se, "accuracy_parts": q.accuracy_parts, "kv_bytes": q.kv_bytes,
                    "throughput": q.throughput, "campaign": q.campaign_id, "trial": q.trial_number}

        served = export_recipe(config, engine) if isinstance(config, EngineRecipe) and engine else None
        row = {"model": model, "budget": bits, "bits_of": bits_of, "min_accuracy": rec.floor, **row_of(p),
               "holdout": p.holdout_summary(), "ties": [row_of(q) for q in rec.ties], "format": engine,
               "engine_config": served}
        held = holdout_line(p)
        if as_json:
            print(json.dumps(row))
            return
        console.print(f"best for {model} at <= {bits:g} {bits_of} bits ({optimize}): {config.label} -> key bits "
                      f"{row['key_bits']:.3f}, KV bits {row['kv_bits']:.3f}, accuracy "
                      f"{pm(row['accuracy'], row['accuracy_se'])} "
                      f"(campaign {row['campaign']}, trial {row['trial']})"
                      + (f"; accuracy floor {rec.floor:.3f}" if rec.floor else ""))
        console.print(held)
        print_ties(rec)
    console.print(config.to_json())
    if served is not None:
        print(served)


def export(
    model: DbModelOpt = "smollm2-135m",
    bits: BitsOpt = 2.25,
    bits_of: BitsOfOpt = "key",
    output: Annotated[str | None, typer.Option("-o", "--output", help="file to write (a regular file); default "
                                               "pnmix-config.json, or, with --format, standard output only",
                                               parser=OutputFile())] = None,
    storage: ReadStorageOpt = None,
    engine: EngineOpt = None,
) -> None:
    """Write the recommended config as JSON, or as a serving engine loads it.

    Write the recommended config as JSON: a PNMixConfig, a layer-wise config where the best point
    is one (`pnmix.layerwise.load_config`, `pnmix eval --config` and `pnmix bits --config` read
    either), or an engine recipe. With --format ENGINE, the best engine recipe that engine loads as
    it is, in its syntax: vllm (--kv-cache-dtype with --kv-cache-dtype-skip-layers), modelopt (the
    mixed-precision KV JSON), trtllm (KvCacheConfig.dtype), sglang (--kv-cache-per-layer-dtype),
    llamacpp (ik_llama.cpp's --cache-type-k-first/-last flags)."""

    from pnmix.storage import recommend as best_point
    from pnmix.tuner.search.session import open_db

    db = open_db(storage)
    with db.session(readonly=True) as s:
        config = best_point(s, model, bits, bits_of=bits_of, engine=engine).config
    if engine is not None and isinstance(config, EngineRecipe):
        text = export_recipe(config, engine)
        print(text)
        if output is not None:
            write_regular_file(Path(output), text + "\n")
            console.print(f"wrote {output}")
        return
    output = output or "pnmix-config.json"
    write_regular_file(Path(output), config.to_json() + "\n")
    console.print(f"wrote {output}: {config.to_json()}")


def dashboard(
    storage: ReadStorageOpt = None,
    host: Annotated[str, typer.Option(help="bind address", parser=Host())] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port", parser=Int(vocabulary.PORT))] = 8080,
) -> None:
    """Serve optuna-dashboard on the campaigns' storage."""
    from pnmix.storage.vocabulary import check_bind
    from pnmix.tuner.search.session import open_db

    db = open_db(storage)
    check_bind(host, port)  # before the dashboard's (slow) import: a refusal is quick
    from optuna_dashboard import run_server

    from pnmix.tuner.search.campaign import optuna_storage

    console.print(f"optuna-dashboard on http://{host}:{port} for {db.display_url}")
    run_server(optuna_storage(db.url), host=host, port=port)
