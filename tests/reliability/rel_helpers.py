"""Helpers of the reliability suite (fixtures are in conftest.py): subprocess bookkeeping, the
worker environment, the stub worker (stub_worker.py) and one-line error checks.

Workers run with short heartbeats (1 s, grace 3 s) and short database retry waits, so a fault
plays out in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STUB = str(Path(__file__).with_name("stub_worker.py"))
PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]

WORKER_ENV = {"PNMIX_HEARTBEAT_S": "1", "PNMIX_GRACE_S": "3", "PNMIX_DB_RETRY_S": "0.5", "PYTHONUNBUFFERED": "1"}


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker subprocess: no PNMIX_* setting of the developer leaks in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PNMIX_", "STUB_")) or k == "PNMIX_CACHE_DIR"}
    return {**env, **WORKER_ENV, **extra}


def error_line(stderr: str) -> str:
    """The one line a failed command printed; fails the test on a traceback or several lines."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Procs:
    """Subprocesses of one test; all are killed and reaped at the end, whatever happened."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        out = open(self.folder / f"{name}.out", "w")
        err = open(self.folder / f"{name}.err", "w")
        proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=err, text=True)
        proc.name = name  # type: ignore[attr-defined]
        self.started.append(proc)
        return proc

    def stderr(self, proc: subprocess.Popen) -> str:
        return (self.folder / f"{proc.name}.err").read_text()  # type: ignore[attr-defined]

    def stdout(self, proc: subprocess.Popen) -> str:
        return (self.folder / f"{proc.name}.out").read_text()  # type: ignore[attr-defined]

    def finish(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.name} did not finish in {timeout:g} s:\n{self.stderr(proc)[-3000:]}") from None  # type: ignore[attr-defined]

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def stub_campaign(url: str, budgets: tuple[float, ...], n_trials: int, status: str = "queued",
                  **spec_extra: Any) -> int:
    """A campaign of the registry model smollm2-135m (head_dim 64), as `pnmix tune --enqueue` makes it."""
    from pnmix.storage import Database, upgrade
    from pnmix.tuner.search.campaign import optuna_storage
    from pnmix.tuner.search.session import find_or_create_campaign
    from pnmix.tuner.search.spec import CampaignSpec

    db = Database(url)
    try:
        upgrade(db)
        spec = CampaignSpec(model="smollm2-135m", budgets=budgets, n_trials=n_trials, profile="smoke", **spec_extra)
        campaign_id = find_or_create_campaign(db, spec, status=status)
    finally:
        db.dispose()
    optuna_storage(url).engine.dispose()  # Optuna's tables exist before workers race to create them
    return campaign_id


def stub_worker_args(url: str, *extra: str) -> list[str]:
    return [sys.executable, STUB, "worker", "--storage", url, *extra]
