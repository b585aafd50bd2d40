"""`pnmix worker` (the real CLI: claim, campaign runner, Optuna, storage) with a stub evaluator.

Used by the reliability tests where the fault, not the model, is under test: a trial costs
milliseconds instead of seconds, and a fault can be placed exactly. The stub scores a config by
a fixed formula of its key bits, so runs are reproducible. Run as a script:

    python tests/reliability/stub_worker.py worker --campaign 1 --storage sqlite:///...

Environment knobs (all optional):
    STUB_EVAL_S           seconds each evaluation sleeps (default 0.02)
    STUB_LOG              file to append one JSON line per finished evaluation to
    STUB_PAYLOAD_BYTES    size of an extra string in each score's `versions` (makes front writes big)
    STUB_OOM_CALLS        comma-separated evaluation call numbers (1-based) that run out of memory
    STUB_RLIMIT_AS_MB     cap the address space at (current + this many MiB, from the first evaluation
                          on, when every library is loaded); an OOM call then
                          allocates twice that, so the allocation itself fails (a real MemoryError)
    STUB_FSIZE_BYTES      RLIMIT_FSIZE for this process, SIGXFSZ ignored (writes past it fail)
    STUB_MAX_PAGES        PRAGMA max_page_count on every SQLite connection (a full disk, to SQLite)
    STUB_RUNG_S           seconds each racing rung sleeps (default 0); STUB_LOG gets a line as a rung
                          starts and as it ends
    STUB_CRASH            set: making the evaluator raises a RuntimeError (a bug, as the worker sees it)
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from types import SimpleNamespace
from typing import Any

from pnmix.bits import LayerPlan

HEAD_DIM = 64  # smollm2-135m, the registry model the stub campaigns name
UNITS = 64  # per-unit outcomes of the stub's one part (what racing pairs)


class StubEvaluator:
    head_dim = HEAD_DIM
    num_layers = 30  # the embedded model's; uniform configs cost the same bits at any layer count
    plan = LayerPlan.full(30)  # every layer full attention: the figures are the layers' mean

    def __init__(self) -> None:
        self.calls = 0
        self.sleep_s = float(os.environ.get("STUB_EVAL_S", "0.02"))
        self.log = os.environ.get("STUB_LOG")
        self.payload = "x" * int(os.environ.get("STUB_PAYLOAD_BYTES", "0"))
        self.oom_calls = {int(c) for c in os.environ.get("STUB_OOM_CALLS", "").split(",") if c.strip()}
        self.oom_bytes = 2 * int(os.environ.get("STUB_RLIMIT_AS_MB", "0")) << 20

    def proxy(self, config: Any) -> float:
        from pnmix.bits import key_bits

        return 1.0 / key_bits(config, HEAD_DIM).total

    def _accuracy(self, config: Any) -> float:
        from pnmix.bits import key_bits

        bits = key_bits(config, HEAD_DIM).total
        # Deterministic and config-specific: more bits score higher, sinks and ratio break ties.
        return round(min(1.0, 0.15 + 0.2 * bits + 0.001 * config.n_sink + 0.01 * config.salient_ratio), 6)

    @staticmethod
    def _outcomes(accuracy: float) -> list[float]:
        """UNITS 0/1 outcomes whose every prefix answers about `accuracy` of its items."""
        return [1.0 if (i * 0.6180339887) % 1.0 < accuracy else 0.0 for i in range(UNITS)]

    def _log(self, **row: Any) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), **row}) + "\n")

    def unit_counts(self, which: str = "search") -> dict[str, int]:
        return {"passkey": UNITS} if which == "search" else {}  # no held-out units: nothing scored at the end

    def rung(self, config: Any, upto: dict[str, int], have: Any = None) -> Any:
        from pnmix.tuner.scoring.score import Rung

        held = len(have.units["passkey"]) if have else 0
        self._log(event="rung_start", config=config.to_dict(), held=held, upto=upto["passkey"])
        time.sleep(float(os.environ.get("STUB_RUNG_S", "0")))
        self._log(event="rung_done", config=config.to_dict(), held=held, upto=upto["passkey"])
        return Rung({"passkey": self._outcomes(self._accuracy(config))[: upto["passkey"]]}, [], 0.0)

    def evaluate(self, config: Any, have: Any = None) -> Any:
        from pnmix.bits import key_bits

        self.calls += 1
        if self.calls == 1:
            _cap_address_space()  # now, when every library the run needs is loaded
        time.sleep(self.sleep_s)
        if self.calls in self.oom_calls:
            if self.oom_bytes:
                block = bytearray(self.oom_bytes)  # fails under the RLIMIT_AS cap: MemoryError
                del block
            raise MemoryError("stub: allocation refused")
        bits = key_bits(config, HEAD_DIM).total
        accuracy = self._accuracy(config)
        versions = {"stub": "1", **({"payload": self.payload} if self.payload else {})}
        score = SimpleNamespace(accuracy=accuracy, parts={"stub": accuracy}, kv_bytes=int(bits * 1000),
                                decode_tokens_per_s=100.0 / bits, backend="stub", device="stub", versions=versions,
                                fidelity_kl=0.0, fidelity_agreement=1.0, seconds=self.sleep_s, accuracy_se=0.01,
                                parts_se={"stub": 0.01}, units={"passkey": self._outcomes(accuracy)},
                                timings={"stub": self.sleep_s})
        self._log(config=config.to_dict(), accuracy=accuracy, **({"from_rung": len(have.units["passkey"])} if have
                                                                 else {}))
        return score


def _cap_address_space() -> None:
    if os.environ.get("STUB_RLIMIT_AS_MB"):
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        cap = vm + (int(os.environ["STUB_RLIMIT_AS_MB"]) << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _limit_resources() -> None:
    if os.environ.get("STUB_FSIZE_BYTES"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
        limit = int(os.environ["STUB_FSIZE_BYTES"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if os.environ.get("STUB_MAX_PAGES"):
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        pages = int(os.environ["STUB_MAX_PAGES"])

        @event.listens_for(Engine, "connect")
        def _cap(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA max_page_count = {pages}")
            cursor.close()


def main() -> None:
    from pnmix.api import cli
    from pnmix.tuner.commands import campaigns

    evaluator = StubEvaluator()

    def make(spec: Any, progress: Any) -> StubEvaluator:
        if os.environ.get("STUB_CRASH"):
            raise RuntimeError("stub: a bug")
        return evaluator

    campaigns._evaluator = make  # type: ignore[assignment]
    _limit_resources()
    sys.argv = ["pnmix", *sys.argv[1:]]
    cli.main()


if __name__ == "__main__":
    main()
