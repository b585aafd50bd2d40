#!/usr/bin/env bash
# The engine study (benchmarks/engine_study.py) on one GPU machine without network, in calls of at
# most 10 minutes that chain while the machine stays up (it goes back 30 s after a call):
#
#   STEP=carry benchmarks/gpu_engine_study.sh   # carry: .whl, .model/part.aa: the wheels installed, part kept
#   STEP=study benchmarks/gpu_engine_study.sh   # carry: .pnw, .model/part.ab, .model/sha256: assemble, check,
#                                               # run or resume the study; call again to continue
#
# .whl/ holds wheels of the packages the GPU image lacks, .model/ the embedded GGUF in two parts
# (each under the 64 MiB a call carries); .pnw/ holds the project's own wheel
# (`pip wheel --no-deps -w .pnw .`). What must survive between calls lives under /tmp/pnmix-engine
# (wheels, model, cache, the campaigns' database, scores); OUT (default out/engine_study) gets the
# study's JSON, table, plot and log at the end of every call. MODEL, PROFILE (full), TRIALS (5),
# PNMIX_TRIALS (3), BUDGETS and DEADLINE_S (540) as engine_study.py takes them.
set -uo pipefail
KEEP=/tmp/pnmix-engine
mkdir -p "$KEEP/site" "$KEEP/out"
for d in .whl .pnw; do
  if ls $d/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$KEEP/site" $d/*.whl
  fi
done
export PYTHONPATH=$KEEP/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
case "${STEP:-study}" in
carry)
  cp .model/part.aa "$KEEP/" && ls -la "$KEEP" ;;
study)
  gguf=$KEEP/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$gguf" ]; then
    cat "$KEEP/part.aa" .model/part.ab > "$gguf"
    [ "$(sha256sum "$gguf" | cut -c1-64)" = "$(cut -c1-64 .model/sha256)" ] || { echo "GGUF sha256 mismatch"; rm -f "$gguf"; exit 1; }
  fi
  export PNMIX_SMOLLM2_GGUF=$gguf PNMIX_CACHE_DIR=$KEEP/cache
  OUT=${OUT:-out/engine_study}
  mkdir -p "$OUT"
  timeout "${DEADLINE_S:-540}" python3 -P benchmarks/engine_study.py --model "${MODEL:-smollm2-135m}" --device cuda \
    --profile "${PROFILE:-full}" --trials "${TRIALS:-5}" --pnmix-trials "${PNMIX_TRIALS:-3}" \
    ${BUDGETS:+--budgets "$BUDGETS"} --out "$KEEP/out" 2>&1 \
    | grep -v -e Warning -e "warnings.warn" -e "it/s\]" | tee -a "$KEEP/out/study.log" | tail -40
  cp "$KEEP"/out/*.json "$KEEP"/out/*.md "$KEEP"/out/*.png "$KEEP"/out/study.log "$OUT"/ 2>/dev/null
  ls "$OUT" ;;
esac
