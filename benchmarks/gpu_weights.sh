#!/usr/bin/env bash
# Issue 11 on nvidia-h200-x2, in one call: the CUDA weight tests, then the weight-sync and PPO-step benchmarks on a
# random Qwen2.5-7B-shaped checkpoint. Logs and JSON go to $OUT (default: /tmp/out). Each stage has its own limit.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/workers/pool/test_weights_cuda.py tests/workers/weights \
  2>&1 | tee "$OUT/tests.log" | tail -4
cd benchmarks
start=$(date +%s)
timeout 150 python3 bench_pool.py --save-random /tmp/q7 > "$OUT/save.log" 2>&1
echo "checkpoint written in $(( $(date +%s) - start )) s: $(du -sh /tmp/q7 | cut -f1)"
timeout 220 python3 bench_weights.py --model /tmp/q7 --out "$OUT/weights.json" 2>&1 | tee "$OUT/weights.log" \
  | grep -v -i "warn\|info" | tail -9
timeout 300 python3 bench_ppo_step.py --model /tmp/q7 --steps ${STEPS:-3} --out "$OUT/step.json" 2>&1 \
  | tee "$OUT/step.log" | grep -v -i "warn\|info" | tail -7
