from __future__ import annotations

import os
from pathlib import Path

import pytest

# Converted models go to one cache per test run unless CI or the user chose one.
os.environ.setdefault("PNMIX_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "pnmix"))


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session (fp32, CPU)."""
    from pnmix import models

    return models.load("smollm2-135m")
