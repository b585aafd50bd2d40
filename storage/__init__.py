"""SQL storage of models, campaigns and Pareto fronts (SQLAlchemy 2.0 ORM, Alembic migrations).

The write API (`upsert_model`, `create_campaign`, `claim_next_queued_campaign`,
`update_campaign_progress`, `replace_front`) and the read helpers (`recommend`,
`list_front_points`, ...) all take a `Session` from `Database.session()`.

`import pnmix.storage` stays light: its names (and SQLAlchemy with them) load on first use, so
that the command line reads the shared vocabulary (`pnmix.storage.vocabulary`) without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pnmix.storage.engine import Database, display_url, make_engine
    from pnmix.storage.errors import InvalidValueError, NoFeasiblePointError, NotFoundError, SchemaError, StorageError
    from pnmix.storage.faults import describe as describe_database_error
    from pnmix.storage.faults import is_transient
    from pnmix.storage.migrations import check_schema, current_revision, head_revision, upgrade
    from pnmix.storage.orm import Base, Campaign, FrontPoint, Model
    from pnmix.storage.read import (
        OPTIMIZE,
        ModelSummary,
        Page,
        Recommendation,
        get_campaign,
        get_model,
        list_campaigns,
        list_front_points,
        list_models,
        recommend,
        recommend_with_ties,
    )
    from pnmix.storage.settings import StorageSettings, load_storage_settings
    from pnmix.storage.write import (
        OBJECTIVES,
        FrontPointIn,
        HoldoutIn,
        ModelIn,
        check_budgets,
        check_objectives,
        claim_next_queued_campaign,
        create_campaign,
        registry_model,
        replace_front,
        set_holdout,
        touch_campaign,
        update_campaign_progress,
        upsert_model,
    )

# Public name -> (module, attribute), imported when first asked for.
_MODULES = {
    "engine": ("Database", "display_url", "make_engine"),
    "errors": ("InvalidValueError", "NoFeasiblePointError", "NotFoundError", "SchemaError", "StorageError"),
    "faults": ("is_transient",),
    "migrations": ("check_schema", "current_revision", "head_revision", "upgrade"),
    "orm": ("Base", "Campaign", "FrontPoint", "Model"),
    "read": ("OPTIMIZE", "ModelSummary", "Page", "Recommendation", "get_campaign", "get_model", "list_campaigns",
             "list_front_points",
             "list_models", "recommend", "recommend_with_ties"),
    "settings": ("StorageSettings", "load_storage_settings"),
    "write": ("OBJECTIVES", "FrontPointIn", "HoldoutIn", "ModelIn", "check_budgets", "check_objectives",
              "claim_next_queued_campaign", "create_campaign", "registry_model", "replace_front", "set_holdout",
              "touch_campaign", "update_campaign_progress", "upsert_model"),
}
_LAZY = {name: (f"pnmix.storage.{module}", name) for module, names in _MODULES.items() for name in names}
_LAZY["describe_database_error"] = ("pnmix.storage.faults", "describe")

__all__ = ["OBJECTIVES", "OPTIMIZE", "Base", "Campaign", "Database", "FrontPoint", "FrontPointIn", "HoldoutIn",
           "InvalidValueError", "Model", "ModelIn", "ModelSummary", "NoFeasiblePointError", "NotFoundError",
           "Page", "SchemaError", "StorageError", "StorageSettings", "check_budgets", "check_objectives",
           "check_schema", "claim_next_queued_campaign", "create_campaign", "current_revision",
           "describe_database_error", "display_url", "get_campaign", "get_model", "head_revision", "is_transient",
           "list_campaigns", "list_front_points", "list_models", "load_storage_settings", "make_engine",
           "Recommendation", "recommend", "recommend_with_ties", "registry_model", "replace_front", "set_holdout",
           "touch_campaign", "update_campaign_progress", "upgrade", "upsert_model"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pnmix.storage' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if __name__ == "storage":  # the checkout root on sys.path: the installed `storage` is meant (pnmix/shadow.py)
    from pnmix.shadow import stand_aside

    stand_aside(__name__, __file__)
