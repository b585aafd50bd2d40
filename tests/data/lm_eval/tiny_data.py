"""The tiny task's documents, read from the JSONL file beside this module (no download)."""

import json
from pathlib import Path

import datasets


def load(**kwargs):
    rows = [json.loads(line) for line in (Path(__file__).parent / "tiny.jsonl").read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
