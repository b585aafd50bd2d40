"""Benchmark of `GET /v1/recommend` on a real `pnmix serve` (uvicorn) on 127.0.0.1.

    .venv/bin/python benchmarks/bench_api.py                      # SQLite, 200 req/s, 6000 requests
    .venv/bin/python benchmarks/bench_api.py --postgres           # a throwaway database on 127.0.0.1:5432

1. Builds a database of 20 models x 5 budgets x 50 front points (synthetic metrics: storage and
   service load only, nothing about PN-Mix) and starts `python -P -m pnmix.api.cli serve` on a free port.
2. From a second process, sends `--requests` recommendations at a fixed rate (open loop: request i
   is due at i / rate; its latency counts from when it was due, so a stalled server is charged for
   the queue it causes). Random model, target bits in [2.0, 3.2], optimize cycling over the three.
3. Then saturates the server with `--concurrency` closed-loop clients, for recommend and for a
   plain model lookup (`GET /v1/models/{name}`): their throughput ratio is the cost of the
   recommendation query relative to the cheapest database-backed route, measured in the same run.

The last line printed is one JSON object with every figure, the date, the machine and versions.
Traffic goes to 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (3.0, 2.75, 2.5, 2.25, 2.0)
OPTIMIZE = ("accuracy", "throughput", "memory")


def build_database(url: str, n_models: int, n_points: int) -> list[str]:
    from pnmix.storage import Database, create_campaign, replace_front, upgrade, upsert_model
    from pnmix.storage.testing import synthetic_front, synthetic_model

    db = Database(url)
    upgrade(db)
    names = []
    for i in range(n_models):
        model = synthetic_model(i)
        with db.session() as s:
            upsert_model(s, model)
            campaign = create_campaign(s, model.name, list(BUDGETS), n_trials=n_points, status="running")
            for j, budget in enumerate(BUDGETS):
                points = synthetic_front(model.head_dim, budget, n_points, seed=i * 10 + j)
                replace_front(s, campaign.id, budget, points)
        names.append(model.name)
    db.dispose()
    return names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(url: str, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PNMIX_")}
    env["PNMIX_DATABASE_URL"] = url
    proc = subprocess.Popen(
        [*PNMIX, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
         "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready within 60 s")


# -- the load generator (runs in its own process) ----------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def summarize(latencies_s: list[float], wall_s: float, errors: int, statuses: dict[str, int]) -> dict:
    ms = sorted(x * 1000 for x in latencies_s)
    return {
        "requests": len(latencies_s) + errors,
        "ok": len(latencies_s),
        "errors": errors,
        "statuses": statuses,
        "wall_s": round(wall_s, 3),
        "rps": round(len(latencies_s) / wall_s, 1),
        "p50_ms": round(percentile(ms, 0.50), 3),
        "p90_ms": round(percentile(ms, 0.90), 3),
        "p99_ms": round(percentile(ms, 0.99), 3),
        "max_ms": round(ms[-1], 3) if ms else None,
    }


def recommend_params(rng: random.Random, models: list[str], i: int) -> dict[str, str]:
    return {
        "model": rng.choice(models),
        "target_bits": f"{rng.uniform(2.0, 3.2):.3f}",
        "optimize": OPTIMIZE[i % len(OPTIMIZE)],
    }


class Connection:
    """A minimal HTTP/1.1 keep-alive client on one socket: the load generator must use little CPU,
    since it shares the machine's cores with the server (httpx costs about as much per request as the server)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    reconnects = 0  # stale keep-alive connections replaced (uvicorn closes them after 5 s idle)

    async def get(self, target: str) -> int:
        reused = self.writer is not None
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {target} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError):
            if not reused:
                raise
            # The server closed this idle connection; like any HTTP client, retry the GET on a new one.
            Connection.reconnects += 1
            self.close()
            self.reader = self.writer = None
            return await self.get(target)
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Pool:
    def __init__(self, base: str, size: int) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.free = [Connection(host, int(port)) for _ in range(size)]
        self.available = asyncio.Semaphore(size)

    async def get(self, target: str) -> int:
        async with self.available:
            conn = self.free.pop()
            try:
                return await conn.get(target)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                conn.close()
                conn = Connection(conn.host, conn.port)
                raise
            finally:
                self.free.append(conn)

    def close(self) -> None:
        for conn in self.free:
            conn.close()


def target(path: str, params: dict[str, str]) -> str:
    from urllib.parse import urlencode

    return f"{path}?{urlencode(params)}" if params else path


async def fixed_rate(base: str, models: list[str], n: int, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    requests = [target("/v1/recommend", recommend_params(rng, models, i)) for i in range(n)]
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = 0
    pool = Pool(base, 64)

    async def one(url: str, due: float) -> None:
        nonlocal errors
        try:
            status = await pool.get(url)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            statuses["transport"] = statuses.get("transport", 0) + 1
            return
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if status == 200:
            latencies.append(time.perf_counter() - due)
        else:
            errors += 1

    start = time.perf_counter()
    tasks = []
    for i, url in enumerate(requests):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(url, due)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=n / rate + 120)
    wall = time.perf_counter() - start
    pool.close()
    return summarize(latencies, wall, errors, statuses)


async def saturate(base: str, urls: list[str], concurrency: int) -> dict:
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = 0
    queue = list(reversed(urls))
    pool = Pool(base, concurrency)

    async def worker() -> None:
        nonlocal errors
        while queue:
            url = queue.pop()
            t = time.perf_counter()
            try:
                status = await pool.get(url)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors += 1
                continue
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 200:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout=300)
    wall = time.perf_counter() - start
    pool.close()
    return summarize(latencies, wall, errors, statuses)


def run_load(args: argparse.Namespace) -> None:
    models = args.model_names.split(",")
    rng = random.Random(args.seed + 1)
    warm = [target("/v1/recommend", recommend_params(rng, models, i)) for i in range(300)]
    asyncio.run(saturate(args.base, warm, 4))
    result = {"fixed_rate": asyncio.run(fixed_rate(args.base, models, args.requests, args.rate, args.seed))}
    rec = [target("/v1/recommend", recommend_params(rng, models, i)) for i in range(args.saturate_requests)]
    lookup = [f"/v1/models/{rng.choice(models)}" for _ in range(args.saturate_requests)]
    result["saturated_recommend"] = asyncio.run(saturate(args.base, rec, args.concurrency))
    result["saturated_model_lookup"] = asyncio.run(saturate(args.base, lookup, args.concurrency))
    result["reconnects"] = Connection.reconnects
    print(json.dumps(result))


# -- driver ------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def versions() -> dict[str, str]:
    import sqlite3

    out = {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version}
    for pkg in ("fastapi", "starlette", "uvicorn", "pydantic", "sqlalchemy", "httpx", "psycopg2-binary"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - a missing optional package is just not reported
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000, help="fixed-rate requests (30 s at 200 req/s)")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second in the fixed-rate phase")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients when saturating")
    parser.add_argument("--saturate-requests", type=int, default=3000)
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--points", type=int, default=50, help="front points per (model, budget)")
    parser.add_argument("--postgres", action="store_true", help="use a throwaway database on the local PostgreSQL")
    parser.add_argument("--seed", type=int, default=0)
    # internal: the load-generator process
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--model-names", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        run_load(args)
        return

    with ExitStack() as stack:
        if args.postgres:
            from pnmix.storage.testing import temporary_postgres_url

            url = stack.enter_context(temporary_postgres_url())
        else:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="pnmix-bench-"))
            url = f"sqlite:///{folder}/pnmix.db"
        t = time.perf_counter()
        names = build_database(url, args.models, args.points)
        build_s = time.perf_counter() - t
        port = free_port()
        server = start_server(url, port)
        stack.callback(server.wait, 20)
        stack.callback(server.terminate)
        print(f"database: {args.models} models x {len(BUDGETS)} budgets x {args.points} points in {build_s:.1f} s; "
              f"server on 127.0.0.1:{port}", file=sys.stderr)
        load = subprocess.run(
            [sys.executable, __file__, "--load", "--base", f"http://127.0.0.1:{port}", "--model-names",
             ",".join(names), "--requests", str(args.requests), "--rate", str(args.rate), "--concurrency",
             str(args.concurrency), "--saturate-requests", str(args.saturate_requests), "--seed", str(args.seed)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )
        if load.returncode != 0:
            raise SystemExit(f"load generator failed: {load.stderr}")
        result = json.loads(load.stdout.strip().splitlines()[-1])

    fixed, rec, lookup = result["fixed_rate"], result["saturated_recommend"], result["saturated_model_lookup"]
    report = {
        "benchmark": "api_recommend",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "backend": "postgresql" if args.postgres else "sqlite",
        "database": {"models": args.models, "budgets": len(BUDGETS), "points_per_front": args.points,
                     "front_points": args.models * len(BUDGETS) * args.points},
        "target_rate": args.rate,
        **result,
        "recommend_vs_lookup_throughput": round(rec["rps"] / lookup["rps"], 3),
    }
    print(f"fixed rate {args.rate:g} req/s, {fixed['requests']} requests: p50 {fixed['p50_ms']:.2f} ms, "
          f"p99 {fixed['p99_ms']:.2f} ms, max {fixed['max_ms']:.2f} ms, achieved {fixed['rps']:.1f} req/s, "
          f"errors {fixed['errors']}")
    print(f"saturated ({args.concurrency} clients): recommend {rec['rps']:.0f} req/s (p50 {rec['p50_ms']:.2f} ms, "
          f"p99 {rec['p99_ms']:.2f} ms); model lookup {lookup['rps']:.0f} req/s; ratio "
          f"{report['recommend_vs_lookup_throughput']:.3f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
