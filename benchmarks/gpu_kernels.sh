#!/usr/bin/env bash
# The decode kernel study on one GPU host: bench_decode.py and static_study.py on the same code,
# each step sized for one 10-minute call; the static steps extend one JSON (MERGE: the previous
# step's static_study.json, carried back into the working tree).
#
#   OUT=out/k PART=decode benchmarks/gpu_kernels.sh       # 4 shapes: gluon, gluon-168, gluon-3slot,
#                                                         # triton, SDPA; correctness sweep; pack
#   OUT=out/k PART=memory benchmarks/gpu_kernels.sh       # peak memory by length and batch
#   OUT=out/k PART=maxbatch MERGE=... benchmarks/gpu_kernels.sh    # + the allocator's pick (PICK)
#   OUT=out/k PART=throughput MERGE=... benchmarks/gpu_kernels.sh  # presets and PICK, bytes bounds
#   OUT=out/k PART=latency,layerwise MERGE=... benchmarks/gpu_kernels.sh
#
# Needs a CUDA GPU and the project installed (gpu_common.sh says how). Run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"
OUT=${OUT:-out/kernels}
: "${PART:=decode}" "${MERGE:=}"
PICK=${PICK:-key-2.25=benchmarks/results/allocation/picks/key-2.25.json}
mkdir -p "$OUT"
if [ "$PART" = decode ]; then
  $PY -P benchmarks/bench_decode.py --out "$OUT" --kernels gluon,gluon-168,gluon-3slot,triton 2>&1 \
    | grep -v -e Warning -e "warnings.warn" | tee -a "$OUT/decode.log" | tail -40
else
  $PY -P benchmarks/static_study.py --part "$PART" --config "$PICK" --out "$OUT" ${MERGE:+--merge "$MERGE"} 2>&1 \
    | grep -v -e Warning -e "warnings.warn" | tee -a "$OUT/static.log" | tail -40
fi
