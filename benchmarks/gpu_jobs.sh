#!/usr/bin/env bash
# Several studies at once on one GPU machine without network, in calls of at most 10 minutes that
# carry one part each of the stream `STEP=pack benchmarks/gpu_engine_study.sh` writes (.carry/part.X
# and .carry/manifest; MODELS="smollm2-135m gemma3-270m" puts SmolLM2 whole after part b):
#
#   there:  PART=.carry/part.X WAIT=S JOBS="..." benchmarks/gpu_jobs.sh > $OUT/log 2>&1
#           carry: .carry/part.X, .carry/manifest, and .pnw (the project's wheel) on the first call
#
# Each call keeps its part, unpacks the members the parts so far hold whole (checked against the
# manifest), installs the wheel sets and the project's wheel once, starts (in their own process
# sessions, so that they outlive the call while the machine stays up) the JOBS whose model is whole
# and whose turn has come, waits up to WAIT seconds (while any job runs) and, with OUT set, writes
# OUT/results.tgz: every job's outputs and log so far. Chain the calls: the machine goes back 30 s
# after one. The small models leave the GPU idle between their launches, so a few jobs at once
# finish sooner than one after another; timings measured so are not a campaign's alone.
#
# JOBS (default all), in this order:
#   alloc0 alloc1 alloc2  the allocation study (key part at campaign seeds 0, 1, 2; seed 0 also the
#                         KV part and the comparison); then, here, `allocation_study.py --merge`
#   maxb                  the largest batches of alloc0's picks (static path, 40 GiB): alone on the GPU
#                         only, since it measures memory
#   engS engG             the engine study of SmolLM2 (after alloc1 and alloc2, when they run) and Gemma 3
#   modelG                the model study of Gemma 3 (budgets 2.5 and 3.0 weighted key bits)
#   hybS                  the scoring engine's decode step on Gemma 3 270M's shape with random weights
#                         (`hybrid_step.py`: pnmix-paper with its windows quantized, fp16, pnmix-paper); it
#                         times steps, so it runs first and every other job waits until it has finished
#   hybE                  `static_study.py --part equality` on Gemma 3 270M (tokens against `generate`)
#   hybT                  serving a hybrid: `static_study.py --model gemma3-12b-shape --part
#                         maxbatch,throughput` at 8K, then 32K generated tokens, for fp16, pnmix-paper and
#                         pnmix-paper with its windows quantized; it times steps and measures memory, so it
#                         starts once every other job asked for has finished
set -u
K=/tmp/pnmix-jobs
JOBS=${JOBS:-hybS alloc0 alloc1 alloc2 maxb engS engG modelG hybE hybT}
mkdir -p "$K/parts" "$K/files" "$K/jobs" "$K/out" "$K/logs"
[ -n "${PART:-}" ] && cp "$PART" "$K/parts/"
cp .carry/manifest "$K/manifest"
complete() {  # whether every member of the manifest under $1 is unpacked
  ! grep -E "  $1" "$K/manifest" | while read -r _ n; do [ -e "$K/files/$n" ] || echo missing; done | grep -q missing
}
if ! complete ""; then
  tmp=$K/unpack; rm -rf "$tmp"; mkdir -p "$tmp"
  cat "$K"/parts/part.* | tar xf - -C "$tmp" 2>/dev/null  # the cut member is caught by the manifest
  while read -r sum name; do
    [ -e "$K/files/$name" ] || [ ! -f "$tmp/$name" ] && continue
    echo "$sum  $tmp/$name" | sha256sum -c --quiet >/dev/null 2>&1 || continue
    mkdir -p "$(dirname "$K/files/$name")" && mv "$tmp/$name" "$K/files/$name"
  done < "$K/manifest"
  rm -rf "$tmp"
fi
for set in base tf525; do
  if [ ! -e "$K/site-$set/.done" ] && complete "$set/"; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$K/site-$set" \
      "$K/files/$set"/*.whl && touch "$K/site-$set/.done"
  fi
done
if [ ! -e "$K/site-pnw/.done" ] && ls .pnw/*.whl >/dev/null 2>&1; then  # once: running jobs import it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$K/site-pnw" .pnw/*.whl \
    && touch "$K/site-pnw/.done"
fi
if [ ! -e "$K/repo/.done" ]; then  # the benchmarks as the first call carried them
  mkdir -p "$K/repo" && tar cf - --exclude=./.carry --exclude=./.pnw . | tar xf - -C "$K/repo" && touch "$K/repo/.done"
fi

launch() {  # NAME MODEL COMMAND...: start a job once, when it is asked for and its model is whole ("-": none)
  local name=$1 model=$2 path; shift 2
  case " $JOBS " in *" $name "*) ;; *) return ;; esac
  [ -e "$K/jobs/$name" ] && return
  [ "$name" = hybS ] || finished hybS || return  # the step timings run alone, first
  [ "$name" != hybT ] || others_done || return  # the serving figures alone, last
  { [ "$model" = - ] || [ -e "$K/files/$model.gguf" ]; } && [ -e "$K/site-base/.done" ] && [ -e "$K/site-pnw/.done" ] \
    || return
  path=$K/site-pnw:$K/site-base
  if [ "$model" = gemma3-270m ]; then  # transformers 5.25: the image's 5.17 cuts Gemma 3's tokenizer
    [ -e "$K/site-tf525/.done" ] || return
    path=$K/site-pnw:$K/site-tf525:$K/site-base
  fi
  touch "$K/jobs/$name"
  (cd "$K/repo" && PYTHONPATH=$path PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 PNMIX_CACHE_DIR=$K/cache-$name \
    PNMIX_SMOLLM2_GGUF=$K/files/smollm2-135m.gguf PNMIX_GEMMA3_GGUF=$K/files/gemma3-270m.gguf \
    setsid nohup bash -c "$*; echo \"exit \$?\" > $K/jobs/$name.rc") > "$K/logs/$name.log" 2>&1 < /dev/null &
  echo "started $name"
}
finished() { [ -e "$K/jobs/$1.rc" ] || case " $JOBS " in *" $1 "*) false ;; *) true ;; esac; }
others_done() {  # every job asked for but hybT has finished
  local j
  for j in $JOBS; do [ "$j" = hybT ] || finished "$j" || return 1; done
}
launch_all() {
  local p="python3 -P" a="benchmarks/allocation_study.py --device cuda --trials 5" picks=$K/out/alloc0/picks n args
  launch alloc0 smollm2-135m $p $a --parts key,kv,compare --seeds 0 --out "$K/out/alloc0"
  launch alloc1 smollm2-135m $p $a --parts key --seeds 1 --out "$K/out/alloc1"
  launch alloc2 smollm2-135m $p $a --parts key --seeds 2 --out "$K/out/alloc2"
  if [ -e "$K/out/alloc0/allocation_study.md" ]; then
    args=""
    for n in key-2.25 key-2.5 kv-2.5 key-1.5 key-2 key-2.263 key-3 kv-2.25 kv-2.64; do
      [ -f "$picks/$n.json" ] && args="$args --config $n=$picks/$n.json"
    done
    launch maxb smollm2-135m $p benchmarks/static_study.py --part maxbatch $args --out "$K/out/alloc0/static"
  fi
  finished alloc1 && finished alloc2 && launch engS smollm2-135m $p benchmarks/engine_study.py \
    --model smollm2-135m --device cuda --profile full --trials 6 --pnmix-trials 3 --out "$K/out/engine"
  launch engG gemma3-270m $p benchmarks/engine_study.py --model gemma3-270m --device cuda --profile full \
    --trials 6 --pnmix-trials 3 --out "$K/out/engine"
  launch modelG gemma3-270m $p benchmarks/model_study.py --model gemma3-270m --device cuda --profile full \
    --trials 8 --budgets 2.5,3.0 --out "$K/out/model"
  local h=$K/out/hybrid s="$p benchmarks/static_study.py --model gemma3-12b-shape --part maxbatch,throughput \
--methods fp16,pnmix-paper --batches 1 --windows pnmix-paper-windows=pnmix-paper"
  launch hybS - "mkdir -p $h && for c in 'pnmix-paper --windows' fp16 pnmix-paper; do \
$p benchmarks/hybrid_step.py --config \$c; done > $h/hybrid_step.log 2>&1"
  launch hybT - "$s --out $h/8k; $s --generated 32768 --out $h/32k"
  launch hybE gemma3-270m "mkdir -p $h && $p benchmarks/static_study.py --part equality --equality-model gemma3-270m \
--gguf $K/files/gemma3-270m.gguf --out $h/equality > $h/equality.log 2>&1"
}

start=$(date +%s)
while true; do
  launch_all
  running=0
  for j in "$K"/jobs/*; do case $j in *.rc) ;; *) [ -e "$j.rc" ] || running=1 ;; esac; done
  [ $running = 0 ] || [ $(($(date +%s) - start)) -ge "${WAIT:-0}" ] && break
  sleep 15
done
ls "$K/parts" "$K"/site-*/.done 2>/dev/null
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
for log in "$K"/logs/*.log; do
  [ -e "$log" ] || continue
  name=$(basename "$log" .log)
  echo "== $name $(cat "$K/jobs/$name.rc" 2>/dev/null || echo running)"
  grep -v -e Warning -e warnings.warn -e "it/s\]" "$log" | tail -n "${TAIL:-4}" | cut -c1-300
done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$K" out logs && ls -la "$OUT"; fi
