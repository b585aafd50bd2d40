"""A real `pnmix serve` subprocess for the service tests, logging to files that the tests read."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from rel_helpers import PNMIX, ROOT, worker_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: Path

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def logs(self) -> str:
        return self.log.read_text()


@contextmanager
def serve(folder: Path, url: str, log_level: str = "info", **settings: str) -> Iterator[Server]:
    """`pnmix serve` on a free loopback port until the block ends (SIGINT, then kill if it hangs)."""
    port = free_port()
    log = folder / f"serve-{port}.log"
    env = worker_env(PNMIX_DATABASE_URL=url, **settings)
    with open(log, "w") as sink:
        proc = subprocess.Popen([*PNMIX, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", log_level],
                                env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}: {server.logs()[-2000:]}")
            try:
                if httpx.get(f"{server.base}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("server did not become ready in 60 s")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
