"""The real thing: `pnmix db upgrade` and `pnmix serve` as subprocesses, spoken to over HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_api import AUTH, TOKEN
from test_storage import CONFIGS, FRONT_3, FRONT_225

from pnmix.config import PNMixConfig
from pnmix.storage import Database, create_campaign, replace_front
from pnmix.storage.testing import sqlite_url

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PNMIX_") or k == "PNMIX_CACHE_DIR"}
    return {**env, **extra}


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early with {proc.returncode}: {proc.stderr.read()}")
        try:
            r = httpx.get(f"{base}/v1/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become ready")


def test_serve_refuses_an_unmigrated_database_in_one_line(tmp_path):
    out = subprocess.run(
        [*PNMIX, "serve", "--port", str(free_port()), "--database-url", sqlite_url(tmp_path)],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "run `pnmix db upgrade`" in lines[0] and "Traceback" not in out.stderr


def test_serve_answers_over_http(tmp_path):
    url = sqlite_url(tmp_path)
    up = subprocess.run([*PNMIX, "db", "upgrade", "--database-url", url], capture_output=True, text=True, timeout=60,
                        env=clean_env())
    assert up.returncode == 0, up.stderr
    assert "upgraded empty -> 0009" in up.stdout
    db = Database(url)
    with db.session() as s:
        campaign = create_campaign(s, "smollm2-135m", [3.0, 2.25], n_trials=8, status="running")
        replace_front(s, campaign.id, 3.0, FRONT_3)
        replace_front(s, campaign.id, 2.25, FRONT_225)
    db.dispose()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*PNMIX, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=clean_env(PNMIX_DATABASE_URL=url, PNMIX_API_TOKEN=TOKEN),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        health = wait_ready(base, proc)
        assert health["ready"] and health["schema_revision"] == "0009" and health["database"] == url
        with httpx.Client(base_url=base, timeout=10) as client:
            r = client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": 2.3})
            assert r.status_code == 200
            assert PNMixConfig.from_json(r.json()["pnmix_config"]) == CONFIGS["paper"]
            r = client.get("/v1/recommend", params={"model": "smollm2-135m", "target_bits": "abc"})
            assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
            assert client.get("/v1/models/smollm2-135m/fronts", params={"budget": 2.25}).json()["total"] == 4
            r = client.post("/v1/campaigns", json={"model": "smollm2-135m", "budgets": [2.0]})
            assert r.status_code == 401
            r = client.post("/v1/campaigns", json={"model": "smollm2-135m", "budgets": [2.0]}, headers=AUTH)
            assert r.status_code == 201 and r.json()["status"] == "queued"
            assert client.get(r.headers["location"]).json()["id"] == r.json()["id"]
            assert client.get("/docs").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("server did not stop on SIGINT")
    assert proc.returncode == 0, proc.stderr.read()
