# Sourced by the GPU campaign scripts (gpu_campaign.sh, gpu_budgets.sh, gpu_allocation.sh): the
# interpreter, thread counts, the full profile prepared once, and queuing a campaign.
#
# The project must be installed where the scripts run (its packages are pnmix.kernels, pnmix.tuner,
# ... only once installed): on a machine without network, build its wheel beside the others it
# needs (`pip wheel --no-deps -w .whl .`) and install them together (`pip install --no-index
# --no-deps --target DIR .whl/*.whl`, DIR on PYTHONPATH).
PY=${PYTHON:-python3}
# Each worker is mostly host work: two threads apiece keep the workers from crowding the cores.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} MKL_NUM_THREADS=${MKL_NUM_THREADS:-2}

# Model conversion, fp16 filtering, trajectories and the proxy trace once (cached under
# PNMIX_CACHE_DIR), before the workers start.
prepare_full_profile() {
  $PY - <<'PYEOF' 2>&1 | grep -v Warning | tail -3
from pnmix.config import preset
from pnmix.tuner.scoring.evaluate import Evaluator
from pnmix.tuner.scoring.profiles import profile
ev = Evaluator("smollm2-135m", profile("full"), 0, device="cuda")
data = ev.prepare()
ev.proxy(preset("pnmix-paper"))
print("prepared:", {k: len(v) for k, v in data["items"].items()}, len(data["trajectories"]), "trajectories")
PYEOF
}

# queue_campaign DB_URL TRIALS "BUDGETS" "OPTIONS" -> prints the campaign id (found again on a rerun)
queue_campaign() {
  local flags="" b
  for b in $3; do flags="$flags --budgets $b"; done
  # shellcheck disable=SC2086
  $PY -P -m pnmix.api.cli tune --model smollm2-135m $flags --trials "$2" --profile full $4 --storage "$1" --enqueue \
    | sed -n 's/^campaign \([0-9][0-9]*\) queued.*/\1/p'
}
