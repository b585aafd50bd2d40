"""What a queued campaign must be for a worker to run it: the checks that run where a campaign is
enqueued (`pnmix tune --enqueue`, `POST /v1/campaigns`) and again in the worker that claims it.

A campaign passes through three hands: the one that enqueues it, the database, and a worker,
perhaps on another machine and a later version. Each checks what it can know:
- the campaign's own fields (budgets, trial count, objectives, method, profile, backend, seed,
  tasks): `tuner.search.spec.CampaignSpec` on the command line and in the worker, the same checks
  (`storage.write.check_budgets`, ..., `tuner.scoring.parts.check_entries`) in the service's request body;
- its model: a model the storage knows, and not a random-weight shape model (a campaign scores
  accuracy), checked by `storage.write.create_campaign` for every enqueue; where the model is
  (GGUF, checkpoint, hub cache) only the worker can tell, with `check_runnable`;
- the worker's machine: a worker takes only campaigns of the backends it has (`runnable_backends`:
  `triton` needs a GPU), so the others wait for a worker that can run them.
A worker that still cannot run a campaign it took marks it `failed` with the reason and takes the
next one (`pnmix worker`, tuner/commands/campaigns.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pnmix.inputs import shorten
from pnmix.names import BACKENDS
from pnmix.tuner.errors import CannotRunHere, EvalError


def runnable_backends() -> tuple[str, ...]:
    """The backends this machine runs: `triton` only with a CUDA GPU."""
    import torch

    return BACKENDS if torch.cuda.is_available() else tuple(b for b in BACKENDS if b != "triton")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise EvalError(f"unknown backend {shorten(backend)}: allowed {', '.join(BACKENDS)}")
    if backend not in runnable_backends():
        raise CannotRunHere(f"backend {backend} needs a CUDA GPU, and this machine has none; use --backend torch "
                            "(or auto) here, or a worker on a GPU host")


def check_budgets_reachable(space: Any, budgets: Sequence[float], head_dim: int, model: str) -> None:
    """Every budget can be met by some config of the campaign's space on a model of `head_dim`; else
    one line with the smallest budget that can (checked where a campaign is enqueued or started)."""
    floor = space.min_bits(head_dim)
    below = [b for b in budgets if b < floor - 1e-9]
    if below:
        raise EvalError(f"invalid budget {below[0]:g}: no config of the {space.method} space on {shorten(model)} "
                        f"fits it; allowed budgets >= {floor:.5f} {space.budget_on} bits, the smallest that can be met")


def check_layer_kinds(space: Any, model: str) -> None:
    """pnmix-layers on a model with sliding-window layers: one line (its groups are cut from every
    layer's sensitivity, windows included; pnmix-alloc allocates the full-attention layers alone)."""
    from pnmix import models

    if space.layered and not space.allocated and models.layer_plan(model).hybrid:
        raise EvalError(f"method {space.method} groups the layers, for full-attention models only: "
                        f"{shorten(model)} has sliding-window layers; use --method pnmix-alloc (the default: a "
                        "config per full-attention layer) or --method pnmix")


def check_runnable(spec: Any) -> None:
    """What a worker checks before it loads anything: its backend, that the model can be loaded
    here for accuracy and that the campaign's method serves its layer kinds (cheap: no weights are
    read)."""
    from pnmix import models

    check_backend(spec.backend)
    models.resolve(spec.model, purpose="accuracy")
    check_layer_kinds(spec.space, spec.model)
