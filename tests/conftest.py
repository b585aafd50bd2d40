from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run in its interpreter. Set before any module is imported: a kernel
# decorated without it is compiled for a GPU and fails on call.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Converted models go to one cache per test run unless CI or the user chose one.
os.environ.setdefault("PNMIX_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "pnmix"))


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session (fp32, CPU)."""
    from pnmix import models

    return models.load("smollm2-135m")
