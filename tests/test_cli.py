import json
import subprocess
import sys

import pytest

PNMIX = [sys.executable, "-m", "api.cli"]


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
    code = "import sys, api.cli; assert 'torch' not in sys.modules, 'torch imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
