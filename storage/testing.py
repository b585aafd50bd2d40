"""Helpers for tests and benchmarks: throwaway databases on each backend and synthetic fronts.

Like `optuna.testing`, this ships with the package so that one storage test suite can run against
every backend. The fronts made here are synthetic (made-up accuracy and throughput): they exercise
storage and the service, and mean nothing about PN-Mix.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pnmix.config import PNMixConfig
from pnmix.storage.engine import Database
from pnmix.storage.write import FrontPointIn, ModelIn

RATIOS = [i / 10 for i in range(1, 10)]
POSTGRES_ADMIN_URL = os.environ.get("PNMIX_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


def postgres_available(admin_url: str = POSTGRES_ADMIN_URL) -> str | None:
    """None if the server answers, else why not (one line)."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import SQLAlchemyError

    engine = create_engine(admin_url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return None
    except SQLAlchemyError as exc:
        return str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    finally:
        engine.dispose()


def postgres_skip_reason(admin_url: str = POSTGRES_ADMIN_URL) -> str | None:
    """None when the PostgreSQL test server answers, else why PostgreSQL tests may skip.

    With `PNMIX_REQUIRE_POSTGRES` set (CI sets it) a silent server is an error, not a skip.
    """
    why = postgres_available(admin_url)
    if why is None:
        return None
    if os.environ.get("PNMIX_REQUIRE_POSTGRES"):
        raise RuntimeError(f"PNMIX_REQUIRE_POSTGRES is set but PostgreSQL at {admin_url} does not answer: {why}")
    return f"no PostgreSQL server at {admin_url} ({why}); set PNMIX_REQUIRE_POSTGRES=1 to make this an error"


def truncate_all(db: Database) -> None:
    """Empties pnmix's tables (ids restart at 1 on PostgreSQL)."""
    tables = ("pnmix_front_points", "pnmix_campaigns", "pnmix_models")
    with db.engine.begin() as conn:
        if db.backend == "postgresql":
            conn.exec_driver_sql(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
        else:
            for table in tables:
                conn.exec_driver_sql(f"DELETE FROM {table}")


@contextmanager
def temporary_postgres_url(admin_url: str = POSTGRES_ADMIN_URL) -> Iterator[str]:
    """A fresh, empty database on the server of `admin_url`, dropped afterwards (with its connections)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    name = f"pnmix_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def sqlite_url(folder: Path, name: str = "pnmix.db") -> str:
    return f"sqlite:///{folder / name}"


def synthetic_model(index: int) -> ModelIn:
    """Model `index` of a made-up family of shapes (layers and heads vary with the index)."""
    head_dim = (64, 128)[index % 2]
    kv_heads = (2, 4, 8)[index % 3]
    return ModelIn(f"synthetic-{index:03d}", "llama", "hub", 16 + index % 17, kv_heads * 4, kv_heads, head_dim)


def synthetic_front(head_dim: int, budget: float, n_points: int, seed: int) -> list[FrontPointIn]:
    """`n_points` feasible configs under `budget` with made-up, seeded metrics (distinct trial numbers)."""
    from pnmix.bits import key_bits

    rng = random.Random(seed)
    out: list[FrontPointIn] = []
    attempts = 0
    while len(out) < n_points:
        attempts += 1
        if attempts > 100_000:
            raise ValueError(f"budget {budget} admits fewer than {n_points} points")
        b_low = rng.choice((1, 2, 3))
        b_high = rng.choice([b for b in (1, 2, 3, 4) if b >= b_low])
        group = rng.choice((32, 64, 128))
        config = PNMixConfig(
            b_high=b_high, b_low=b_low, group_size=group, salient_ratio=rng.choice([0.0, *RATIOS]),
            n_sink=rng.choice((0, 8, 16, 32, 64)), residual_len=128, value_bits=2, value_group_size=32,
        )
        bits = key_bits(config, head_dim).total
        if bits > budget:
            continue
        accuracy = max(0.0, min(1.0, 0.3 + 0.25 * bits + rng.uniform(-0.05, 0.05)))
        out.append(
            FrontPointIn(
                config=config, accuracy=round(accuracy, 4), kv_bytes=int(bits * 1_000_000),
                throughput=round(rng.uniform(10, 60), 2), trial_number=len(out), backend="torch", device="synthetic",
                accuracy_parts={"passkey": round(accuracy, 4)}, versions={"pnmix": "synthetic"},
            )
        )
    return out
