#!/usr/bin/env bash
# The engine study (benchmarks/engine_study.py) of both embedded models on one GPU machine without
# network. A call carries at most 64 MiB and runs at most 10 minutes; the machine goes back 30 s after
# a call, so the calls chain, each carrying one part of a single stream of everything the study needs:
#
#   here:   STEP=pack benchmarks/gpu_engine_study.sh
#           .carry/part.a, .b, ... (57 MiB each: with the working tree and the wheel, under the 64 MiB
#           a call carries) of one tar stream: base/ (the wheels the GPU image lacks, as .whl/ holds
#           them), tf525/ (transformers 5.25 and the packages it needs newer: the image's 5.17 cuts
#           Gemma 3's GGUF tokenizer into characters), the Gemma 3 GGUF, then the SmolLM2 GGUF (from
#           .model/'s parts), so that Gemma's study can run while the last parts ride along;
#           .carry/manifest holds every member's sha256. Add /.carry/ to .git/info/exclude.
#   there:  PART=.carry/part.X MODEL=smollm2-135m benchmarks/gpu_engine_study.sh
#           carry: .carry/part.X, .carry/manifest, .pnw (the project's wheel: `pip wheel --no-deps -w .pnw .`)
#           keeps the part, unpacks whatever members the parts so far hold whole (checked against the
#           manifest), and runs or resumes MODEL's study when its GGUF is whole (nothing when MODEL is empty)
#
# SmolLM2 runs on the image's transformers (5.17), Gemma 3 on 5.25 (tf525/ before base/ on the path).
# What must survive between calls lives under /tmp/pnmix-engine; OUT (default out/engine_study) gets
# the study's JSON, table, plot and log at the end of every call. PROFILE (full), TRIALS (6),
# PNMIX_TRIALS (3), BUDGETS and DEADLINE_S (540) as engine_study.py takes them. MODELS (pack: the
# models whose GGUF the stream carries, in order; default "gemma3-270m smollm2-135m") and SCRIPT
# (run: a command run instead of the engine study, with MODEL's packages and GGUF paths set, e.g.
# `STUDY=/tmp/alloc PARTS=key,compare SEEDS=0,1,2 MAXBATCH= benchmarks/gpu_allocation.sh`). OUT also gets the
# campaigns' database and the other scores, so that a study cut off with its machine resumes on the
# next one: RESUME=DIR (a carried copy of those files) seeds a machine that has no study of MODEL.
set -uo pipefail
KEEP=/tmp/pnmix-engine
case "${STEP:-run}" in
pack)
  [ -d .whl ] && [ -f .model/sha256 ] || { echo "needs .whl/ (the wheels the GPU image lacks) and .model/ (the SmolLM2 GGUF in parts, with its sha256)"; exit 1; }
  models=${MODELS:-gemma3-270m smollm2-135m}  # in the stream's order
  case " $models " in *" gemma3-270m "*) gemma=${GEMMA_GGUF:?GEMMA_GGUF=the Gemma 3 270M .gguf file} ;; esac
  stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/base" "$stage/tf525"
  cp .whl/*.whl "$stage/base/"
  cat .model/part.* > "$stage/smollm2-135m.gguf"
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$stage/dl" transformers==5.25.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
    kernels==0.19.1 hf-xet==1.8.0 2>&1 | grep -v "is ignored" || true
  # only what the image lacks or holds too old (its numpy, torch and the rest stay the ones imported)
  for w in transformers huggingface_hub tokenizers safetensors kernels hf_xet httpx2 httpcore2 click tomlkit \
    truststore regex; do mv "$stage"/dl/"$w"-*.whl "$stage/tf525/"; done
  rm -rf "$stage/dl"
  members="base"
  for m in $models; do
    [ "$m" = gemma3-270m ] && { cp "$gemma" "$stage/gemma3-270m.gguf"; members="$members tf525"; }
    members="$members $m.gguf"
  done
  # shellcheck disable=SC2086
  (cd "$stage" && find $members -type f | xargs sha256sum) > "$stage/manifest"
  rm -rf .carry && mkdir -p .carry && mv "$stage/manifest" .carry/
  # shellcheck disable=SC2086
  (cd "$stage" && tar cf - $members) | split -b 57M -a 1 - .carry/part.
  ls -la .carry ;;
run)
  mkdir -p "$KEEP/parts" "$KEEP/files" "$KEEP/out"
  manifest=$PWD/.carry/manifest
  [ -n "${PART:-}" ] && cp "$PART" "$KEEP/parts/"
  # the stream's prefix: members before the cut unpack whole, the cut one is caught by the manifest
  cat "$KEEP"/parts/part.* | tar xf - -C "$KEEP/files" 2>/dev/null
  whole() { (cd "$KEEP/files" && grep -E "  ($1)\$" "$manifest" | sha256sum -c --quiet >/dev/null 2>&1); }
  for set in base tf525; do
    if [ ! -e "$KEEP/site-$set/.done" ] && whole "$set/.*"; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$KEEP/site-$set" \
        "$KEEP/files/$set"/*.whl && touch "$KEEP/site-$set/.done"
    fi
  done
  if ls .pnw/*.whl >/dev/null 2>&1; then  # the project's code as this call carries it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$KEEP/site-pnw" .pnw/*.whl
  fi
  ls "$KEEP/parts"; ls "$KEEP"/site-*/.done 2>/dev/null
  MODEL=${MODEL:-}
  [ -n "$MODEL" ] || exit 0
  whole "$MODEL.gguf" || { echo "$MODEL.gguf is not whole yet"; exit 0; }
  path=$KEEP/site-pnw:$KEEP/site-base
  [ "$MODEL" = gemma3-270m ] && path=$KEEP/site-pnw:$KEEP/site-tf525:$KEEP/site-base
  export PYTHONPATH=$path PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PNMIX_CACHE_DIR=$KEEP/cache
  export PNMIX_SMOLLM2_GGUF=$KEEP/files/smollm2-135m.gguf PNMIX_GEMMA3_GGUF=$KEEP/files/gemma3-270m.gguf
  if [ -n "${SCRIPT:-}" ]; then  # another study on what the stream installed (MODEL's packages on the path)
    bash -c "$SCRIPT"
    exit $?
  fi
  OUT=${OUT:-out/engine_study}
  mkdir -p "$OUT"
  # a study begun on another machine: its campaigns' database and scores, as an earlier call's OUT held them
  if [ -n "${RESUME:-}" ] && [ ! -e "$KEEP/out/engine-$MODEL.db" ]; then cp "$RESUME"/* "$KEEP/out/"; fi
  timeout "${DEADLINE_S:-540}" python3 -P benchmarks/engine_study.py --model "$MODEL" --device cuda \
    --profile "${PROFILE:-full}" --trials "${TRIALS:-6}" --pnmix-trials "${PNMIX_TRIALS:-3}" \
    ${BUDGETS:+--budgets "$BUDGETS"} --out "$KEEP/out" 2>&1 \
    | grep -v -e Warning -e "warnings.warn" -e "it/s\]" | tee -a "$KEEP/out/study-$MODEL.log" | tail -30
  cp "$KEEP/out/engine_study-$MODEL".* "$KEEP/out/study-$MODEL.log" "$KEEP/out/engine-$MODEL.db" \
    "$KEEP/out/scores-$MODEL"-*.json "$OUT"/ 2>/dev/null
  ls "$OUT" ;;
esac
