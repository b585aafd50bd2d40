"""Peers: transformers' QuantizedCache (quanto, HQQ) scored beside PN-Mix configs (tuner/scoring/peers.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("optimum.quanto", reason="needs the peers extra: pip install -e '.[peers]'")
pytest.importorskip("hqq", reason="needs the peers extra: pip install -e '.[peers]'")

from pnmix.tuner.scoring import peers  # noqa: E402

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path


def test_key_bits_by_the_formula_where_groups_are_per_token():
    assert peers.PEERS["hf-quanto-2"].key_bits(64) == pytest.approx(2.5)  # 2 bits + fp16 scale and shift per 64
    assert peers.PEERS["hf-quanto-4"].key_bits(128) == pytest.approx(4.5)
    assert math.isnan(peers.PEERS["hf-hqq-2"].key_bits(64))  # axis-0 groups are not per token: n/a


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-quanto-2", "hf-hqq-2"])
def test_both_backends_run_on_the_cpu_and_their_bytes_are_counted(embedded, name):
    p = peers.peer(name)
    text = peers.answer(embedded.model, embedded.tokenizer, p, "Name a colour.", 4)
    assert isinstance(text, str)
    cache = p.new_cache(embedded.model)
    ids = torch.randint(100, 4000, (1, 200))
    embedded.model(input_ids=ids, use_cache=True, past_key_values=cache)
    held = peers.cache_bytes(cache)
    fp32 = 2 * 30 * 3 * 200 * 64 * 4  # keys and values of 30 layers, 3 KV heads, d = 64, as float32
    # 2-bit codes (a quarter byte) and a float32 scale and offset per 64 elements: 0.25 + 8/64 bytes each.
    assert held == pytest.approx(fp32 / 4 * (0.25 + 8 / 64), rel=0.02)


@pytest.mark.slow
def test_a_peer_row_in_compare(embedded):
    """`pnmix eval --compare` scores a peer on the same items: its row, its label, its paired difference."""
    out = subprocess.run([*PNMIX, "eval", "--compare", "fp16,hf-quanto-2", "--profile",
                          "smoke", "--tasks", "passkey"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "hf-quanto-2 │" in line]
    assert len(rows) == 2  # the scores' table and the paired differences' table
    cells = [c.strip() for c in rows[0].split("│")[1:-1]]
    assert cells[0] == "hf-quanto-2" and cells[1] == "2.500"  # key bits by the formula
    assert "+-" in cells[2] and float(cells[-3]) > 0 and float(cells[-2]) > 0  # accuracy +- SE, KV KiB, tok/s
    assert "transformers QuantizedCache (optimum-quanto" in out.stdout


def test_a_missing_extra_is_one_line(monkeypatch, capsys):
    from pnmix.api import cli

    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["pnmix", "eval", "--compare", "fp16,hf-hqq-2", "--profile", "smoke"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "error: peer hf-hqq-2 needs hqq: pip install -e '.[peers]'"
