from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run in its interpreter. Set before any module is imported: a kernel
# decorated without it is compiled for a GPU and fails on call.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Converted models go to one cache per test run unless CI or the user chose one.
os.environ.setdefault("PNMIX_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "pnmix"))

# Under pytest-xdist (`make test` runs `-n auto`), each worker gets an equal share of the cores for
# torch's thread pool: two workers of two threads each on two cores would oversubscribe them.
# Set before torch is imported (this file is read before any test module).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_threads))

# Tests that run several worker processes against one PostgreSQL server run one at a time (one xdist
# worker takes them all, `--dist loadgroup`): side by side they would open more connections than the
# server's default limit of 100.
POSTGRES_WORKERS = ("test_postgres_drops.py", "test_worker_kill.py", "test_two_workers_share_a_campaign_on_postgres")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns the group marks into node-id suffixes
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(part in item.nodeid for part in POSTGRES_WORKERS):
            item.add_marker(pytest.mark.xdist_group("postgres-workers"))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, xdist marks a grouped test by a suffix of its node id; a pytest that
    no longer reads what xdist sets (pytest 9.2 with xdist 3.8) would spread a group over the workers
    unseen: that ends the run in one line instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        pytest.exit(f"xdist_group is ignored by pytest {pytest.__version__} with this pytest-xdist ({lost[0]} has no "
                    "group suffix): install the pins of pyproject.toml's dev extra", returncode=3)


# The suite's time budget: over it, the run fails with one line naming the slowest tests, so that a
# change that makes the suite slow is seen where it lands (README, "Tests").
_durations: dict[str, float] = {}
_started = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    budget = os.environ.get("PNMIX_TEST_BUDGET_S")
    if not budget or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller judges the whole run
        return
    took = time.monotonic() - _started
    if took > float(budget):
        slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:5]
        names = ", ".join(f"{nodeid} ({seconds:.0f} s)" for nodeid, seconds in slowest)
        writer = session.config.get_terminal_writer()
        writer.line()  # off the progress line
        writer.line(
            f"error: the test suite took {took:.0f} s, over its budget of {float(budget):.0f} s "
            f"(PNMIX_TEST_BUDGET_S); slowest: {names}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session (fp32, CPU)."""
    from pnmix import models

    return models.load("smollm2-135m")
