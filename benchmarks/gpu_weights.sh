#!/usr/bin/env bash
# Issue 11 on nvidia-h200-x2: the CUDA weight tests, then the weight-sync and PPO-step benchmarks on a random
# Qwen2.5-7B-shaped checkpoint. STAGES picks some of "tests weights step" (default: all). Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-tests weights step}
export PYTHONUNBUFFERED=1
nvidia-smi -L
if [[ $STAGES == *tests* ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/workers/pool/test_weights_cuda.py tests/workers/weights \
    2>&1 | tee "$OUT/tests.log" | tail -4
fi
cd benchmarks
if [[ $STAGES == *weights* || $STAGES == *step* ]]; then
  start=$(date +%s)
  timeout 120 python3 bench_pool.py --save-random /tmp/q7 > "$OUT/save.log" 2>&1
  echo "checkpoint written in $(( $(date +%s) - start )) s: $(du -sh /tmp/q7 | cut -f1)"
fi
if [[ $STAGES == *weights* ]]; then
  timeout 220 python3 bench_weights.py --model /tmp/q7 --out "$OUT/weights.json" 2>&1 | tee "$OUT/weights.log" \
    | grep -v -i "warn\|info" | tail -9
fi
if [[ $STAGES == *step* ]]; then
  timeout 300 python3 bench_ppo_step.py --model /tmp/q7 --steps "${STEPS:-3}" --out "$OUT/step.json" 2>&1 \
    | tee "$OUT/step.log" | grep -v -i "warn\|info" | tail -7
fi
