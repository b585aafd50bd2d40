"""Fixtures of the reliability suite: throwaway databases, subprocesses that are always reaped, and a
tiny real model.

Every subprocess is started through `procs` and killed (by its own pid) when the test ends, pass or
fail; every PostgreSQL database is dropped with its connections.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rel_helpers import Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database (dropped afterwards with its connections). CI requires the server."""
    from pnmix.storage.testing import postgres_skip_reason, temporary_postgres_url

    reason = postgres_skip_reason()  # raises instead when PNMIX_REQUIRE_POSTGRES is set
    if reason:
        pytest.skip(reason)
    with temporary_postgres_url() as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (2 layers, head_dim 64) with the embedded model's tokenizer, as a checkpoint.

    Trials on it take about a second on the CPU; what they score is meaningless, which is fine here.
    """
    from transformers import AutoTokenizer

    from pnmix import models

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import save_tiny_llama

    tok = AutoTokenizer.from_pretrained(models._converted_dir(models.resolve("smollm2-135m")))
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tok)


