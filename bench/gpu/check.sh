#!/usr/bin/env bash
# The GPU check, one run of at most ~8 minutes, for the device machine (`run`):
#   the CUDA tests, then `specd bench gpu` (random weights with the real shapes) and a
#   profile of a decode step. Results land in $OUT (gpu.json, goals.md: the issue's
#   goals met or missed, *.log).
# Here, first: bash bench/gpu/wheels.sh (the packages the machine's image lacks, into
# .whl/), then run with carry [".whl"]:  bash bench/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/specd-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
status=0
SPECD_REQUIRE_CUDA=1 SPECD_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -ra -p no:cacheprovider \
  tests/cuda tests/unit/test_gpu_kernels.py tests/unit/test_gpu_step.py 2>&1 | tee "$OUT/tests.log" \
  || status=1
timeout 300 python3 -m launcher bench gpu --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log" \
  || status=1
# the issue's goals, from what the bench saved (also where it was cut short)
python3 -m bench.gpu.goals "$OUT/gpu.json" | tee "$OUT/goals.md" || status=1
timeout 60 python3 -m bench.gpu.profile 2>&1 | tee "$OUT/profile.log" || status=1
exit $status
