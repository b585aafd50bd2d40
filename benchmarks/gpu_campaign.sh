#!/usr/bin/env bash
# The full-profile campaign on the GPU machine (issue 6), in the two runs the model carry needs.
#
#   preflight   run 1 (carries .whl, .model/part.aa, .gpu/tokenizer): per-forward timings on the
#               embedded model's shape, then a smoke campaign of a tiny model on CUDA with three
#               workers sharing one SQLite database (checks the CUDA/Triton campaign path end to end).
#   campaign    run 2+ (carries .whl, .model/part.ab, .model/sha256): reassembles the GGUF, prepares
#               the full profile once, then runs side by side until DEADLINE_S:
#                 - the PN-Mix campaign (5 budgets, PNMIX_TRIALS each) with PNMIX_WORKERS workers,
#                 - the KIVI campaign (5 budgets, KIVI_TRIALS each) with KIVI_WORKERS workers,
#                 - the multi-fidelity comparison (benchmarks/multifidelity.py) at MF_BUDGET.
#               A campaign cut by the deadline resumes on the next `campaign` run (same machine,
#               back to back: the database lives in /tmp/pnmix-gpu); every run copies the database
#               and logs to $OUT.
# Run from the checkout with PYTHONPATH set to the carried wheels and the checkout; CARRY is the
# folder that holds the carried .gpu/ and .model/ (default: the current directory).
set -uo pipefail
CARRY=${CARRY:-.}
stage=${1:?usage: gpu_campaign.sh preflight|campaign}
OUT=${OUT:-/tmp/pnmix-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
export PNMIX_CACHE_DIR=/tmp/pnmix-cache
PY=python3

case "$stage" in
preflight)
  $PY benchmarks/gpu_probe.py --tokenizer "$CARRY/.gpu/tokenizer" --tiny-out /tmp/tiny-llama --json "$OUT/probe.json" \
    2>&1 | grep -v Warning | tee "$OUT/probe.log" | tail -5
  rm -rf /tmp/smoke && mkdir -p /tmp/smoke
  db=sqlite:////tmp/smoke/campaign.db
  $PY -m api.cli db upgrade --database-url "$db"
  $PY -m api.cli tune --model /tmp/tiny-llama --budgets 3.0 --budgets 2.3 --trials 4 --profile smoke \
    --backend triton --storage "$db" --enqueue
  for w in 1 2 3; do
    $PY -m api.cli worker --campaign 1 --storage "$db" > "$OUT/smoke-worker$w.log" 2>&1 &
  done
  wait
  $PY -m api.cli fronts --model /tmp/tiny-llama --storage "$db" 2>&1 | tail -20
  $PY benchmarks/campaign_summary.py --storage "$db" --json "$OUT/smoke-summary.json"
  for f in "$OUT"/smoke-worker*.log; do tail -n 3 "$f"; done
  ;;
campaign)
  : "${DEADLINE_S:=500}" "${PNMIX_TRIALS:=12}" "${KIVI_TRIALS:=6}" "${PNMIX_WORKERS:=6}" "${KIVI_WORKERS:=2}"
  : "${MF_BUDGET:=2.5}"
  : "${MF_TRIALS:=12}"
  gguf=/tmp/pnmix-model/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$gguf" ]; then
    cat /tmp/pnmix-model/part.aa "$CARRY/.model/part.ab" > "$gguf" || exit 1
    echo "$(cut -d' ' -f1 "$CARRY/.model/sha256")  $gguf" | sha256sum -c || exit 1
  fi
  export PNMIX_SMOLLM2_GGUF=$gguf
  mkdir -p /tmp/pnmix-gpu
  db=sqlite:////tmp/pnmix-gpu/campaign.db
  start=$(date +%s)
  # Conversion, fp16 filtering, trajectories and the proxy trace once, before workers race for them.
  $PY - <<'EOF' 2>&1 | grep -v Warning | tail -3
from pnmix.config import preset
from tuner.evaluate import Evaluator
from tuner.profiles import profile
ev = Evaluator("smollm2-135m", profile("full"), 0, device="cuda")
data = ev.prepare()
ev.proxy(preset("pnmix-paper"))
print("prepared:", {k: len(v) for k, v in data["items"].items()}, len(data["trajectories"]), "trajectories")
EOF
  echo "prepare: $(( $(date +%s) - start )) s"
  if [ ! -f /tmp/pnmix-gpu/campaign.db ]; then
    $PY -m api.cli db upgrade --database-url "$db"
    budgets="--budgets 3.0 --budgets 2.5 --budgets 2.25 --budgets 2.0 --budgets 1.5"
    $PY -m api.cli tune --model smollm2-135m $budgets --trials "$PNMIX_TRIALS" --method pnmix --profile full \
      --backend triton --storage "$db" --enqueue
    $PY -m api.cli tune --model smollm2-135m $budgets --trials "$KIVI_TRIALS" --method kivi --profile full \
      --backend triton --storage "$db" --enqueue
  fi
  left=$(( DEADLINE_S - ($(date +%s) - start) ))
  for w in $(seq 1 "$PNMIX_WORKERS"); do
    timeout "$left" $PY -m api.cli worker --campaign 1 --storage "$db" > "$OUT/pnmix-worker$w.log" 2>&1 &
  done
  for w in $(seq 1 "$KIVI_WORKERS"); do
    timeout "$left" $PY -m api.cli worker --campaign 2 --storage "$db" > "$OUT/kivi-worker$w.log" 2>&1 &
  done
  if [ -n "${MF_TRIALS}" ] && [ "${MF_TRIALS}" != 0 ]; then
    timeout "$left" $PY benchmarks/multifidelity.py --profile full --budget "$MF_BUDGET" --trials "$MF_TRIALS" \
      --device cuda --parallel > "$OUT/multifidelity.log" 2>&1 &
  fi
  wait
  echo "campaign stage: $(( $(date +%s) - start )) s (deadline $DEADLINE_S s)"
  $PY benchmarks/campaign_summary.py --storage "$db" --json "$OUT/campaign-summary.json" --markdown "$OUT/fronts.md"
  $PY -m api.cli fronts --model smollm2-135m --storage "$db" > "$OUT/fronts.txt" 2>&1
  cp /tmp/pnmix-gpu/campaign.db "$OUT/campaign.db"
  tail -n 4 "$OUT/multifidelity.log"
  # Only a few files come back from a device run: the worker logs go back as one.
  for f in "$OUT"/*worker*.log; do echo "== $f"; grep -v "^\s*$" "$f" | tail -n 8; done > "$OUT/workers.txt"
  rm -f "$OUT"/*worker*.log
  grep -ci "error\|traceback" "$OUT/workers.txt"
  ;;
*) echo "unknown stage $stage: allowed preflight, campaign"; exit 2 ;;
esac
