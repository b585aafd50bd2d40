"""Item 9: a soak of concurrent reads and writes against a real `pnmix serve`.

A fixed number of requests from several client threads, about one in ten a write (enqueue a
campaign), the rest the read routes users call. No request may fail, every write must be stored,
and the server's resident memory at the end must stay within 50 MiB of what it was after warm-up.
The figures (requests, seconds, RSS) are printed so they can be quoted (`pytest -s`).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from serve import serve

from pnmix.storage import Database
from pnmix.storage.testing import sqlite_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_api import AUTH, TOKEN, count_rows, seed  # noqa: E402

REQUESTS = 1500
WARMUP = 150
THREADS = 8
MIB = 1 << 20


def plan(n: int, seed_: int) -> list[tuple[str, str, dict]]:
    rng = random.Random(seed_)
    reads = [
        ("GET", "/v1/recommend", {"params": {"model": "smollm2-135m", "target_bits": 2.3}}),
        ("GET", "/v1/recommend", {"params": {"model": "smollm2-135m", "target_bits": 3.0, "optimize": "memory"}}),
        ("GET", "/v1/models/smollm2-135m/fronts", {"params": {"budget": 2.25}}),
        ("GET", "/v1/models", {}),
        ("GET", "/v1/campaigns", {"params": {"limit": 20}}),
        ("GET", "/v1/campaigns/1", {}),
        ("GET", "/v1/health", {}),
    ]
    write = ("POST", "/v1/campaigns", {"json": {"model": "smollm2-135m", "budgets": [2.0, 2.5], "n_trials": 4},
                                       "headers": AUTH})
    return [write if rng.random() < 0.1 else rng.choice(reads) for _ in range(n)]


def fire(base: str, requests: list[tuple[str, str, dict]]) -> Counter:
    """Sends `requests` from THREADS threads, each with its own keep-alive connection; counts (method, status)."""
    outcome: Counter = Counter()
    lock = threading.Lock()
    chunks = [requests[i::THREADS] for i in range(THREADS)]

    def run(chunk: list[tuple[str, str, dict]]) -> None:
        local: Counter = Counter()
        with httpx.Client(base_url=base, timeout=30) as client:
            for method, path, kwargs in chunk:
                try:
                    local[(method, client.request(method, path, **kwargs).status_code)] += 1
                except httpx.HTTPError as exc:
                    local[(method, type(exc).__name__)] += 1
        with lock:
            outcome.update(local)

    threads = [threading.Thread(target=run, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return outcome


def test_soak_of_concurrent_reads_and_writes(tmp_path):
    db = Database(sqlite_url(tmp_path))
    seed(db)
    campaigns_before = count_rows(db)["pnmix_campaigns"]
    with serve(tmp_path, str(db.url), log_level="warning", PNMIX_API_TOKEN=TOKEN) as server:
        warm = fire(server.base, plan(WARMUP, 1))
        start_rss = server.rss_bytes()
        requests = plan(REQUESTS, 2)
        t0 = time.monotonic()
        outcome = fire(server.base, requests)
        seconds = time.monotonic() - t0
        end_rss = server.rss_bytes()
    writes = sum(1 for m, _, _ in requests if m == "POST") + sum(n for (m, _), n in warm.items() if m == "POST")
    print(f"\nsoak: {REQUESTS} requests ({sum(1 for m, _, _ in requests if m == 'POST')} writes) from {THREADS} "
          f"threads in {seconds:.1f} s ({REQUESTS / seconds:.0f} req/s); server RSS {start_rss / MIB:.1f} MiB after "
          f"{WARMUP} warm-up requests, {end_rss / MIB:.1f} MiB at the end ({(end_rss - start_rss) / MIB:+.1f} MiB)")
    assert outcome == Counter({("GET", 200): REQUESTS - sum(1 for m, _, _ in requests if m == "POST"),
                               ("POST", 201): sum(1 for m, _, _ in requests if m == "POST")}), outcome
    assert set(warm) <= {("GET", 200), ("POST", 201)}, warm
    assert count_rows(db)["pnmix_campaigns"] == campaigns_before + writes  # every write stored, once
    assert end_rss < start_rss + 50 * MIB
    db.dispose()
