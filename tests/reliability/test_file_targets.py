"""What a command writes, and what it never touches.

`pnmix export -o` writes only regular files: a symbolic link, a device (as root, `-o /dev/full`
would otherwise have been replaced by a JSON file), a pipe or a directory gets one line and is
left as it was, also when the target turns into one between the check and the write. Commands that
only read (`fronts`, `recommend`, `export`, `serve`, `db current`) never create a file or a folder:
a database that is not there is one line.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from rel_helpers import PNMIX, error_line, worker_env

from pnmix.config import preset
from pnmix.storage import Database, FrontPointIn, create_campaign, replace_front, upgrade
from pnmix.storage.testing import sqlite_url
from pnmix.tuner.commands.options import write_regular_file
from pnmix.tuner.errors import EvalError


def pnmix(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PNMIX, *args], env=env or worker_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture
def stored(tmp_path: Path) -> str:
    url = sqlite_url(tmp_path)
    db = Database(url)
    upgrade(db)
    with db.session() as s:
        campaign = create_campaign(s, "smollm2-135m", [3.0], n_trials=2, status="running", worker_id="test")
        replace_front(s, campaign.id, 3.0, [FrontPointIn(preset("pnmix-paper"), 0.9, 2000, 20.0, 0, "torch", "cpu")])
    db.dispose()
    return url


def test_export_writes_regular_files_only_and_leaves_the_rest_as_it_was(tmp_path, stored):
    target = tmp_path / "kept.json"
    target.write_text("keep me\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = {link: "a symbolic link", Path("/dev/full"): "a device, pipe or socket", fifo: "a device, pipe or socket",
             folder: "a directory"}
    for path, kind in cases.items():
        out = pnmix("export", "--bits", "3", "-o", str(path), "--storage", stored)
        assert out.returncode == 2, out.stderr
        assert error_line(out.stderr).endswith(f"not {kind}"), out.stderr
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "keep me\n"
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode) and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert folder.is_dir() and not list(folder.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "kept.json", "link.json", "pnmix.db"]
    # A regular file is replaced, atomically.
    out = pnmix("export", "--bits", "3", "-o", str(target), "--storage", stored)
    assert out.returncode == 0, out.stderr
    assert preset("pnmix-paper").to_json() in target.read_text()


def test_a_target_that_turns_special_before_the_write_is_refused(tmp_path):
    """The command line's check runs first; the write checks again (a link made in between is not followed)."""
    real = tmp_path / "real.json"
    real.write_text("keep me\n")
    for make in (lambda p: p.symlink_to(real), lambda p: p.mkdir(), lambda p: os.mkfifo(p)):
        target = tmp_path / "target"
        make(target)
        with pytest.raises(EvalError, match=f"cannot write {target}: it is a"):
            write_regular_file(target, "{}\n")
        assert real.read_text() == "keep me\n"
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        target.rmdir() if target.is_dir() and not target.is_symlink() else target.unlink()
    write_regular_file(tmp_path / "new.json", "{}\n")
    assert (tmp_path / "new.json").read_text() == "{}\n"


@pytest.mark.parametrize("command", [["fronts"], ["recommend"], ["export", "-o", "cfg.json"], ["db", "current"],
                                     ["serve", "--port", "1"]])
def test_reads_never_create_a_database_or_its_folder(tmp_path, command):
    missing = tmp_path / "no" / "such" / "pnmix.db"
    url_option = "--database-url" if command[0] in ("db", "serve") else "--storage"
    # Given on the command line ...
    out = pnmix(*command, url_option, f"sqlite:///{missing}", env={**worker_env(), "HOME": str(tmp_path)})
    assert out.returncode == 2 and "existing SQLite file" in error_line(out.stderr)
    # ... and as the default database (no option: PNMIX_DB_PATH).
    env = {**worker_env(), "PNMIX_DB_PATH": str(missing), "HOME": str(tmp_path)}
    out = subprocess.run([*PNMIX, *command], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "does not exist" in error_line(out.stderr), out.stderr
    assert not (tmp_path / "no").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
