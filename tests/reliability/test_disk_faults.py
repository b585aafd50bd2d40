"""Item 4: a full disk and a read-only database file.

The disk fills up under a running worker (SQLite's page limit, which is how SQLite sees a full
disk, and a file size limit, RLIMIT_FSIZE with SIGXFSZ ignored, which fails the write itself).
The worker stops with one line and exit code 2; the stored front is the whole front of the
trials before the failed write, never a part of a newer one (`replace_front` is one transaction);
after space is freed, rerunning finishes the campaign. A read-only database file refuses every
write in one line and is left unchanged; reads still work.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest
from rel_helpers import PNMIX, error_line, stub_campaign, stub_worker_args, worker_env
from sqlalchemy import text

from pnmix.storage import Database, display_url, get_campaign, list_front_points
from pnmix.storage.testing import sqlite_url
from pnmix.tuner.search.fronts import front_trials
from pnmix.tuner.search.studies import finished, study_name

BUDGET = 3.0
TRIALS = 8


def prefix_fronts(study: optuna.Study) -> list[set[int]]:
    """The front `front_trials` gives after each COMPLETE trial (in order), the empty one first."""
    complete = sorted(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)), key=lambda t: t.number)
    fronts: list[set[int]] = [set()]
    for k in range(len(complete)):
        feasible = [t for t in complete[: k + 1] if t.user_attrs.get("key_bits", 99) <= BUDGET]
        pareto = [t for t in feasible if not any(
            o.values[0] >= t.values[0] and o.values[1] <= t.values[1] and o.values != t.values for o in feasible)]
        kept: dict[str, int] = {}  # like front_trials: scored here, first trial of each config
        for t in sorted(pareto, key=lambda t: t.number):
            if "accuracy" in t.user_attrs and "reused_from" not in t.user_attrs:
                kept.setdefault(json.dumps(t.user_attrs["config"], sort_keys=True), t.number)
        fronts.append(set(kept.values()))
    return fronts


def stored_front(db: Database, campaign_id: int) -> set[int]:
    with db.session(readonly=True) as s:
        return {p.trial_number for p in list_front_points(s, "smollm2-135m", campaign_id=campaign_id).items}


def integrity(db: Database) -> str:
    with db.engine.connect() as conn:
        return str(conn.exec_driver_sql("PRAGMA integrity_check").scalar())


def sizes(path: Path) -> int:
    return max(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


@pytest.mark.parametrize("how", ["page-limit", "file-size-limit"])
def test_full_disk_stops_in_one_line_without_a_partial_front(tmp_path, procs, how):
    url = sqlite_url(tmp_path)
    campaign_id = stub_campaign(url, (BUDGET,), TRIALS)
    db = Database(url)
    with db.engine.connect() as conn:
        pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar() or 0)
    if how == "page-limit":
        limits = {"STUB_MAX_PAGES": str(pages + 30)}  # ~120 KiB more: a few fronts of 16 KiB points
        expected = "the disk is full (database or disk is full)"
    else:
        limits = {"STUB_FSIZE_BYTES": str(sizes(tmp_path / "pnmix.db") + (96 << 10))}
        expected = "disk I/O error (disk full, a file size limit, or a failing disk)"
    env = worker_env(STUB_PAYLOAD_BYTES=str(16 << 10), **limits)
    full = procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), env, "full")
    assert procs.finish(full, 120) == 2, procs.stderr(full)[-3000:]
    line = error_line(procs.stderr(full))
    assert line == (f"error: cannot write {display_url(url)}: {expected}; nothing was written by the failed "
                    "transaction"), line

    study = optuna.load_study(study_name=study_name(campaign_id, BUDGET), storage=url)
    assert len(finished(study)) < TRIALS  # it really stopped early
    stored = stored_front(db, campaign_id)
    assert stored in prefix_fronts(study), f"stored front {stored} is no whole front of the trials"
    assert integrity(db) == "ok"

    rerun = procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), worker_env(), "rerun")  # space freed
    assert procs.finish(rerun, 120) == 0, procs.stderr(rerun)[-3000:]
    study = optuna.load_study(study_name=study_name(campaign_id, BUDGET), storage=url)
    assert len(finished(study)) == TRIALS
    assert stored_front(db, campaign_id) == {t.number for t in front_trials(study)}
    with db.session(readonly=True) as s:
        assert get_campaign(s, campaign_id).status == "done"
    db.dispose()


def test_export_to_an_unwritable_place_is_one_line(tmp_path, procs):
    """`pnmix export` writes beside the target and renames, so a failed write leaves nothing behind."""
    url = sqlite_url(tmp_path)
    campaign_id = stub_campaign(url, (BUDGET,), 4)
    assert procs.finish(procs.start(stub_worker_args(url, "--campaign", str(campaign_id)), worker_env(), "w"), 60) == 0
    target = tmp_path / "missing" / "cfg.json"
    out = subprocess.run([*PNMIX, "export", "--model", "smollm2-135m", "--bits", "3.0", "-o", str(target),
                          "--storage", url], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    line = error_line(out.stderr)  # refused while the command line is parsed, before the database is read
    assert line.startswith(f"error: invalid --output '{target}': allowed a regular file") and "does not exist" in line
    assert not (tmp_path / "missing").exists()


@contextmanager
def read_only(path: Path):
    """The file as a user sees a read-only file: mode 0444, and immutable when we are root (root
    ignores modes). Restored afterwards whatever happens."""
    os.chmod(path, 0o444)
    immutable = False
    try:
        try:
            with open(path, "r+b"):
                writable = True
        except PermissionError:
            writable = False
        if writable:
            made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
            if made.returncode != 0:
                pytest.fail(f"cannot make {path} read-only for uid {os.getuid()}: chattr: {made.stderr.strip()}")
            immutable = True
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        os.chmod(path, 0o644)


def dump(db: Database) -> list[tuple]:
    with db.engine.connect() as conn:
        return [tuple(r) for table in ("pnmix_models", "pnmix_campaigns", "pnmix_front_points", "trials")
                for r in conn.execute(text(f"SELECT * FROM {table} ORDER BY 1"))]


def test_read_only_database_refuses_writes_in_one_line(tmp_path, procs):
    url = sqlite_url(tmp_path)
    done = stub_campaign(url, (BUDGET,), 4)
    assert procs.finish(procs.start(stub_worker_args(url, "--campaign", str(done)), worker_env(), "w"), 60) == 0
    queued = stub_campaign(url, (2.3,), 4)
    db = Database(url)
    before = dump(db)
    db.dispose()
    with read_only(tmp_path / "pnmix.db"):
        worker = procs.start(stub_worker_args(url), worker_env(), "ro-worker")  # claims the queued campaign
        assert procs.finish(worker, 60) == 2
        line = error_line(procs.stderr(worker))
        assert line == (f"error: cannot write {display_url(url)}: the database file is read-only (attempt to write "
                        "a readonly database); nothing was written by the failed transaction"), line
        fronts = subprocess.run([*PNMIX, "fronts", "--model", "smollm2-135m", "--storage", url], env=worker_env(),
                                capture_output=True, text=True, timeout=60)
        assert fronts.returncode == 0, fronts.stderr  # reading still works
        assert "Pareto fronts of smollm2-135m" in fronts.stdout
    db = Database(url)
    assert dump(db) == before
    with db.session(readonly=True) as s:
        assert get_campaign(s, queued).status == "queued"
    db.dispose()
