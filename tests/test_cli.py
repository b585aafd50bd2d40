import json
import subprocess
import sys

import pytest

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PNMIX, *args], capture_output=True, text=True, timeout=120)


def test_bits_json_matches_the_formula():
    out = run("bits", "--b-high", "3", "--b-low", "1", "-G", "128", "-r", "0.5", "--sinks", "32", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["key_bits"]["key_bits"] == pytest.approx(2.26341, abs=5e-6)
    assert report["config"]["b_high"] == 3 and report["value_bits"] == 3.0


def test_bits_preset_prints_the_breakdown():
    out = run("bits", "--preset", "pnmix-paper")
    assert out.returncode == 0, out.stderr
    for term in ("payload", "sinks", "scales", "metadata", "2.26341"):
        assert term in out.stdout


def test_bits_with_model_reports_kv_bytes():
    out = run("bits", "--preset", "kivi2", "--model", "smollm2-135m", "--json", "--seq-len", "1000")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["key_bits"]["head_dim"] == 64
    assert 0 < report["kv_bytes"]["total"] < report["kv_bytes"]["fp16_total"]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("--b-high", "1", "--b-low", "3"), "b_low"),
        (("-G", "48"), "--group-size"),
        (("-r", "1.5"), "--salient-ratio"),
        (("--preset", "nope"), "preset"),
        (("--model", "no-such-model"), "no-such-model"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, field):
    out = run("bits", *args)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert field in lines[0] and "Traceback" not in out.stderr


def test_cli_starts_without_torch():
    code = "import sys, pnmix.api.cli; assert 'torch' not in sys.modules, 'torch imported eagerly'"
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=60)


def test_the_command_line_and_the_service_accept_the_same_values(tmp_path):
    """One definition per range (pnmix.inputs): what `pnmix recommend` refuses, GET /v1/recommend refuses."""
    from fastapi.testclient import TestClient

    from pnmix import inputs
    from pnmix.api.app import create_app
    from pnmix.api.settings import Settings
    from pnmix.storage import Database, upgrade, vocabulary
    from pnmix.storage.testing import sqlite_url

    url = sqlite_url(tmp_path)
    db = Database(url)
    upgrade(db)
    db.dispose()
    options = {"target_bits": inputs.Number(inputs.BUDGET), "min_accuracy": inputs.Number(vocabulary.ACCURACY),
               "campaign_id": inputs.Int(vocabulary.CAMPAIGN_ID)}
    values = ["0", "1e-9", "1", "2.3", "16", "16.000001", "-1", "nan", "inf", "1e309", "2147483647", "2147483648"]
    with TestClient(create_app(Settings(database_url=url))) as client:
        for field, parser in options.items():
            for value in values:
                params = {"model": "smollm2-135m", "target_bits": "2.3", field: value}
                refused_here = client.get("/v1/recommend", params=params).status_code == 422
                try:
                    parser(value)
                    refused_there = False
                except inputs.InputError:
                    refused_there = True
                assert refused_here == refused_there, (field, value)


@pytest.mark.parametrize("command", ["serve", "dashboard"])
def test_a_server_that_cannot_bind_is_one_line(tmp_path, command):
    import socket

    from pnmix.storage import Database, upgrade
    from pnmix.storage.testing import sqlite_url

    url = sqlite_url(tmp_path)
    db = Database(url)
    upgrade(db)
    db.dispose()
    option = "--database-url" if command == "serve" else "--storage"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = run(command, option, url, "--port", port)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: invalid address '127.0.0.1:{port}': allowed an address this machine can bind (Address already in use)"]
    out = run(command, option, url, "--host", "no-such-host.invalid")
    assert out.returncode == 2 and "the host does not resolve" in out.stderr and len(out.stderr.splitlines()) == 1
