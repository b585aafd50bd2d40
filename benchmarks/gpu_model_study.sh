#!/usr/bin/env bash
# The model study (model_study.py) on one GPU machine without network, in calls of at most 10 minutes:
# the Gemma 3 GGUF arrives in parts (a call carries at most 64 MiB), the wheels once, and the study
# resumes from its database in a later call while the machine stays up.
#
#   GGUF=path/to.gguf STEP=split benchmarks/gpu_model_study.sh   # here: .gemma/part.a, .b, ... (58 MiB
#                                                   # each), its name and sha256 (add /.gemma/ to .git/info/exclude)
#   STEP=part PART=.gemma/part.a benchmarks/gpu_model_study.sh   # there: keep one part (and install .whl/)
#   STEP=study benchmarks/gpu_model_study.sh                     # there: assemble, check, run or resume
# A call carries at most 64 MiB with the working tree: the wheels (.whl/, about 28 MiB with
# transformers 5.25 and what it needs) go in a call of their own or beside a smaller part, the
# project's wheel (.pnw/) beside any part. Chain the calls: the machine goes back 30 s after one.
#
# STEP=study: MODEL (gemma3-270m), PROFILE (full), TRIALS (8), FULL_BITS (2.0,paper,2.5), OUT.
# What must survive between calls lives under /tmp/pnmix-study (parts, wheels, cache, database);
# the results (JSON, table, plot, log) are copied to $OUT at the end of every call.
set -uo pipefail
KEEP=/tmp/pnmix-study
mkdir -p "$KEEP/parts" "$KEEP/site"
# .whl/: the packages the image lacks (and transformers 5.25: the image's 5.17 converts Gemma 3's GGUF
# tokenizer into characters), installed once; .pnw/: the project's own wheel (`pip wheel --no-deps -w
# .pnw .`), installed again whenever a call carries it.
for d in .whl .pnw; do
  if ls $d/*.whl >/dev/null 2>&1 && { [ $d = .pnw ] || [ ! -e "$KEEP/site/.installed" ]; }; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$KEEP/site" \
      $d/*.whl && touch "$KEEP/site/.installed"
  fi
done
export PYTHONPATH=$KEEP/site PYTHONUNBUFFERED=1
case "${STEP:-study}" in
split)
  mkdir -p .gemma && rm -f .gemma/part.*
  split -b 58M -a 1 "${GGUF:?GGUF=the .gguf file to split}" .gemma/part.
  basename "$GGUF" > .gemma/name && sha256sum "$GGUF" | cut -c1-64 > .gemma/sha256 && ls -la .gemma ;;
part)
  cp "$PART" "$KEEP/parts/" && ls -la "$KEEP/parts" ;;
study)
  MODEL=${MODEL:-gemma3-270m}
  OUT=${OUT:-out/model_study}
  mkdir -p "$OUT" "$KEEP/out"
  if [ "$MODEL" = gemma3-270m ]; then
    gguf=$KEEP/$(cat .gemma/name)
    if [ ! -f "$gguf" ]; then
      cat "$KEEP"/parts/part.* > "$gguf"
      [ "$(sha256sum "$gguf" | cut -c1-64)" = "$(cat .gemma/sha256)" ] || { echo "GGUF sha256 mismatch"; rm -f "$gguf"; exit 1; }
    fi
    export PNMIX_GEMMA3_GGUF=$gguf
  fi
  export PNMIX_CACHE_DIR=$KEEP/cache
  timeout "${STUDY_SECONDS:-540}" python3 -P benchmarks/model_study.py --model "$MODEL" --device cuda \
    --profile "${PROFILE:-full}" --trials "${TRIALS:-8}" --full-bits "${FULL_BITS:-2.0,paper,2.5}" \
    --out "$KEEP/out" 2>&1 | grep -v -e Warning -e "warnings.warn" -e "it/s\]" | tee -a "$KEEP/out/study.log" | tail -40
  cp "$KEEP"/out/*.json "$KEEP"/out/*.md "$KEEP"/out/*.png "$KEEP"/out/study.log "$OUT"/ 2>/dev/null
  ls "$OUT" ;;
esac
