"""The README's Python examples run as written, and show what they say.

They run in order in one namespace, as a reader would paste them into one session (the static
example continues from the first), against a database of the test's own (the "Writing fronts"
example uses the default database of the settings: PNMIX_DB_PATH points it here).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.mark.slow
def test_readme_python_examples_run_as_written(tmp_path, monkeypatch):
    from pnmix.storage import list_front_points

    blocks = python_blocks()
    assert len(blocks) >= 3
    for name in ("PNMIX_DATABASE_URL", "PNMIX_DB_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PNMIX_DB_PATH", str(tmp_path / "pnmix.db"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    # "past the 32 sinks, whole groups of 128 are packed": the example's prompt is long enough.
    regions = namespace["cache"].nbytes()["regions"]
    assert regions["packed_keys"] > 0 and regions["packed_values"] > 0, regions
    assert str(regions) in out.getvalue()
    # The static path gives the same greedy tokens as the first example.
    assert namespace["tokens"].shape == (1, 32) and torch.equal(namespace["tokens"], namespace["new_tokens"])
    # The writing example stored its campaign's front.
    with namespace["db"].session(readonly=True) as s:
        (point,) = list_front_points(s, "smollm2-135m").items
    assert (point.budget, point.trial_number, point.accuracy) == (2.25, 17, 0.91)
    namespace["db"].dispose()
