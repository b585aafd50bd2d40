"""Opening the database and the campaign a command works on (shared by tune, worker and run)."""

from __future__ import annotations

from typing import Any

from pnmix.tuner.errors import EvalError
from pnmix.tuner.search.spec import CampaignSpec


def open_db(storage: str | None, upgrade: bool = False, create: bool = False, create_folder: bool = True) -> Any:
    """The project database (settings, or `storage` URL); checks the schema revision first.

    `create=True` (commands that write: tune, worker) creates the tables of a database that has
    none of ours yet at the head revision, as Optuna creates its own; a database at an older
    revision still asks for `pnmix db upgrade`. `upgrade=True` (the main job) migrates it too.
    Otherwise (commands that only read) nothing is created: a SQLite file that is not there is
    one line. `create_folder=False` (a worker, an enqueued campaign) refuses a SQLite file whose folder
    does not exist instead of creating it.
    """
    from pnmix.storage import Database, check_schema, load_storage_settings
    from pnmix.storage import upgrade as upgrade_schema
    from pnmix.storage.migrations import has_no_pnmix_tables

    settings = load_storage_settings(**({"database_url": storage} if storage else {}))
    db = Database(settings.url, busy_timeout_s=settings.db_busy_timeout_s, create=upgrade or create,
                  create_folder=create_folder)
    if upgrade or (create and has_no_pnmix_tables(db)):
        upgrade_schema(db)
    check_schema(db)
    return db


def ensure_model(session: Any, name: str, model_config: Any | None = None) -> None:
    """Registers the model in our tables (embedded and shape models from the registry, others from config)."""
    from pnmix import models
    from pnmix.storage import ModelIn, registry_model, upsert_model

    entry = registry_model(name)
    if entry is None:
        source = models.resolve(name)
        if model_config is None:
            model_config = models.auto_config(source)
        from pnmix.families import plan_of_config, shape_of_config

        shape, plan = shape_of_config(model_config), plan_of_config(model_config)
        entry = ModelIn(name, str(model_config.model_type), source.kind, shape.num_layers, shape.num_heads,
                        shape.num_kv_heads, shape.head_dim, location=source.location,
                        layer_kinds=plan.kinds, sliding_window=plan.window)
    upsert_model(session, entry)


def find_or_create_campaign(db: Any, spec: CampaignSpec, status: str = "running") -> int:
    """The campaign of this spec (resumed when it exists, whatever its trial count), else a new one."""
    from pnmix.storage import create_campaign, list_campaigns, update_campaign_progress

    with db.session() as s:
        ensure_model(s, spec.model)
        page = list_campaigns(s, model=spec.model, limit=500)
        for row in page.items:
            if (row.options or {}).get("spec_key") == spec.key():
                if row.n_trials != spec.n_trials:
                    raise EvalError(f"campaign {row.id} has this spec with {row.n_trials} trials per budget; "
                                    f"rerun with --trials {row.n_trials} to resume it, or change the spec")
                if row.status == "queued" and status == "running":
                    update_campaign_progress(s, row.id, status=status)
                return int(row.id)
        row = create_campaign(s, spec.model, list(spec.budgets), spec.n_trials, method=spec.method,
                              profile=spec.profile, objectives=list(spec.objectives), backend=spec.backend,
                              budget_on=spec.space.budget_on, search_space=spec.space.to_dict(),
                              options=spec.options(), status=status)
        return int(row.id)
