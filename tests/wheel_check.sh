#!/usr/bin/env bash
# The installed wheel, used the way a user uses it: run from a directory outside the checkout, with
# the `pnmix` of a fresh virtualenv first on PATH (Makefile: `make test-wheel` builds both).
#
#   PATH=VENV/bin:$PATH bash tests/wheel_check.sh
set -euo pipefail
work=$(mktemp -d)
cd "$work"
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT

pnmix bits --preset pnmix-paper | grep -q "2.2634[0-9]" || { echo "pnmix bits: no pnmix-paper key bits"; exit 1; }

export PNMIX_DATABASE_URL="sqlite:///$work/new.db"
pnmix db upgrade
pnmix db current | grep -q "(head .*, current)" || { echo "pnmix db current: not at head"; exit 1; }

port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
pnmix serve --port "$port" > serve.log 2>&1 &
server=$!
for _ in $(seq 1 120); do
  code=$(python -c "import urllib.request, sys
try:
    print(urllib.request.urlopen('http://127.0.0.1:$port/v1/health', timeout=2).status)
except Exception:
    print(0)")
  [ "$code" = 200 ] && break
  sleep 0.5
done
[ "$code" = 200 ] || { echo "pnmix serve: /v1/health did not answer 200"; cat serve.log; exit 1; }

# One top-level name: pnmix; `kernels` is Hugging Face's package, installed beside it.
python - <<'PY'
import importlib.util

import kernels
import pnmix
import pnmix.kernels

assert "site-packages/kernels" in kernels.__file__.replace("\\", "/"), kernels.__file__
assert pnmix.kernels.__file__.replace("\\", "/").endswith("site-packages/pnmix/kernels/__init__.py"), pnmix.kernels.__file__
for name in ("api", "storage", "tuner"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable: {importlib.util.find_spec(name).origin}"
print("wheel check: bits, db upgrade, serve /v1/health, import pnmix beside Hugging Face's kernels: ok")
PY
