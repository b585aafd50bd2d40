"""Item 6: corrupt inputs are refused with one clear line (CLI: exit code 2, no traceback).

A malformed PNMixConfig JSON (what `pnmix export` writes and `pnmix eval --config` or
`PNMixConfig.from_json` reads, before a `PNMixCache` is built), a GGUF file cut short, a database
at a schema revision this pnmix does not know (a newer one), and a file that is no database.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rel_helpers import PNMIX, error_line, worker_env
from sqlalchemy import text

from pnmix import models
from pnmix.config import ConfigError, PNMixConfig
from pnmix.storage import Database, display_url, head_revision, upgrade
from pnmix.storage.migrations import VERSION_TABLE
from pnmix.storage.testing import sqlite_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import tiny_model  # noqa: E402


def pnmix(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PNMIX, *args], capture_output=True, text=True, timeout=timeout, env=env or worker_env())


BAD_CONFIGS = [
    ('{"b_high": 3,', "invalid config='{\"b_high\": 3,': allowed valid JSON (Expecting property name enclosed in "
                      "double quotes at char 13)"),
    ("", "invalid config='': allowed valid JSON (Expecting value at char 0)"),
    ("[3, 1]", "invalid config='list': allowed a JSON object of PNMixConfig fields"),
    ('{"b_high": "3"}', "invalid b_high='3': allowed an integer"),
    ('{"b_high": 3, "b_low": 4}', "invalid b_low=4: allowed at most b_high=3"),
    ('{"salient_ratio": NaN}', "invalid salient_ratio=nan: allowed a number in [0, 1]"),
    ('{"group_size": 48}', "invalid group_size=48: allowed one of 32, 64, 128"),
    ('{"bits": 2}', "invalid bits=2: allowed a field among b_high, b_low, criterion, group_size, n_sink, "
                    "residual_len, salient_ratio, seed, value_bits, value_group_size"),
    ('{"b_high": 5, "b_high": 3}', "invalid config=\"'b_high' given twice\": allowed each key once in a JSON object"),
]


@pytest.mark.parametrize(("text_", "message"), BAD_CONFIGS)
def test_malformed_config_json_is_refused_before_any_cache(text_, message):
    with pytest.raises(ConfigError) as caught:
        PNMixConfig.from_json(text_)
    assert str(caught.value) == message


def test_malformed_config_file_on_the_command_line_is_one_line(tmp_path):
    cases = {**{f"bad{i}.json": (t, m) for i, (t, m) in enumerate(BAD_CONFIGS[:4])},
             "deep.json": ("[" * 100_000,
                           "invalid config='" + "[" * 40 + "': allowed a flat JSON object of PNMixConfig fields"),
             "binary.json": (None, "cannot read config file PATH: 'utf-8' codec can't decode byte 0xff in "
                                   "position 0: invalid start byte"),
             "missing.json": (..., "invalid --config 'PATH': allowed an existing, readable file (No such file or "
                                   "directory)")}
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is None:
            path.write_bytes(b"\xff\xfe{}")
        elif content is not ...:
            path.write_text(content)
        out = pnmix("eval", "--config", str(path))
        assert out.returncode == 2, (name, out.stderr)
        assert error_line(out.stderr) == "error: " + message.replace("PATH", str(path)), name


def test_pnmix_cache_refuses_a_config_that_does_not_fit_the_model():
    from pnmix.cache import PNMixCache

    model = tiny_model("llama")  # head_dim 16
    config = PNMixConfig.from_json('{"value_group_size": 32}')
    with pytest.raises(ConfigError) as caught:
        PNMixCache(model.config, config)
    assert str(caught.value) == "invalid value_group_size=32: allowed a positive divisor of head_dim=16"


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return models.find_gguf(models.EMBEDDED["smollm2-135m"]).read_bytes()


@pytest.mark.parametrize("keep", [16, 1 << 20, 0.5], ids=["header", "metadata", "half"])
def test_truncated_gguf_is_refused_and_leaves_no_conversion(tmp_path, monkeypatch, gguf_bytes, keep):
    size = int(len(gguf_bytes) * keep) if isinstance(keep, float) else (keep % len(gguf_bytes))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_bytes[:size])
    monkeypatch.setenv("PNMIX_SMOLLM2_GGUF", str(cut))
    monkeypatch.setenv("PNMIX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(models.ModelError) as caught:
        models.load("smollm2-135m")
    message = str(caught.value)
    assert message.startswith(f"cannot read GGUF file {cut}: ") and "\n" not in message
    assert not list((tmp_path / "cache" / "models").glob("*smollm2*")), "a half-written conversion was left"
    digests = tmp_path / "cache" / "models" / models.DIGESTS
    assert not digests.exists() or str(cut.resolve()) not in digests.read_text(), "its digest entry was left"


def test_truncated_gguf_on_the_command_line_is_one_line(tmp_path, gguf_bytes):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_bytes[:-1000])  # only the end of the last tensor is missing
    env = worker_env(PNMIX_SMOLLM2_GGUF=str(cut), PNMIX_CACHE_DIR=str(tmp_path / "cache"))
    out = pnmix("generate", "--prompt", "hi", "--max-new-tokens", "2", env=env, timeout=300)
    assert out.returncode == 2
    assert error_line(out.stderr).startswith(f"error: cannot read GGUF file {cut}: ")


def newer_database(url: str, revision: str) -> None:
    db = Database(url)
    upgrade(db)
    with db.engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = :rev"), {"rev": revision})
    db.dispose()


def version_row(url: str) -> list[str]:
    db = Database(url)
    with db.engine.connect() as conn:
        rows = [r[0] for r in conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))]
    db.dispose()
    return rows


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_unknown_newer_schema_revision_is_refused_by_every_command(tmp_path, backend, request):
    url = sqlite_url(tmp_path) if backend == "sqlite" else request.getfixturevalue("pg_url")
    newer_database(url, "0999")
    refusal = (f"error: database {display_url(url)} is at schema revision 0999, newer than this pnmix (head "
               f"{head_revision()}, which does not know it): upgrade pnmix, or use another database")
    commands = [("db", "upgrade", "--database-url", url), ("serve", "--port", "1", "--database-url", url),
                ("worker", "--storage", url), ("fronts", "--storage", url)]
    if backend == "postgresql":
        commands = commands[:1] + commands[2:3]  # the same code path; keep the PostgreSQL run short
    for args in commands:
        out = pnmix(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert error_line(out.stderr) == refusal, args
    current = pnmix("db", "current", "--database-url", url)
    assert current.returncode == 0
    assert current.stdout.strip() == (f"{display_url(url)}: revision 0999 (head {head_revision()}, unknown to this "
                                      "pnmix: written by a newer pnmix; upgrade pnmix)")
    assert version_row(url) == ["0999"]  # nothing tried to "fix" it


def test_a_file_that_is_no_database_is_one_line(tmp_path):
    path = tmp_path / "pnmix.db"
    path.write_bytes(b"definitely not SQLite\n" * 500)
    url = sqlite_url(tmp_path)
    out = pnmix("fronts", "--storage", url)
    assert out.returncode == 2
    assert error_line(out.stderr) == f"error: cannot open {display_url(url)}: the file is not a SQLite database"
    assert path.read_bytes() == b"definitely not SQLite\n" * 500
