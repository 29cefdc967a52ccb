#!/usr/bin/env bash
# Issues 20-24 on one H200: the PPO loop at its defaults. STAGES picks some of "tests loop15 weights step loop7"
# (the default) and "big15 model sync prefix prefixpool invariance topk attention moe moesweep moeinv gputests" (by name). FAST15=0 skips the
# 1.5B loop's fast-mode run. Random Qwen2.5-shaped checkpoints at /tmp/q15 and /tmp/q7. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests loop15 weights step loop7}  # and big15: the 1.5B loop at 256 rollouts
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
has() { [[ " $STAGES " == *" $1 "* ]]; }
quiet() { grep -v -i "warn\|info\|object store\|^\s*$\|core_worker\|raylet"; }
if has tests; then
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/workers/pool/test_weights_cuda.py ${TESTS:-tests/workers/weights} \
    2>&1 | tee "$OUT/tests.log" | tail -3
fi
[[ -d /tmp/q15 || ! " $STAGES " =~ \ (loop15|big15|sync)\  ]] || python3 benchmarks/bench_pool.py --save-random /tmp/q15 --shape 1.5b
[[ -d /tmp/q7 || ! " $STAGES " =~ \ (weights|step|loop7|prefixpool|invariance)\  ]] || python3 benchmarks/bench_pool.py --save-random /tmp/q7
if has loop15; then
  timeout 200 python3 examples/ppo_loop.py --model /tmp/q15 --steps 4 --out "$OUT/ppo_loop_q15.json" 2>&1 \
    | tee "$OUT/ppo_loop_q15.log" | quiet | tail -8
  [[ ${FAST15:-1} == 0 ]] || timeout 150 python3 examples/ppo_loop.py --model /tmp/q15 --steps 2 --fast --out "$OUT/ppo_loop_q15_fast.json" 2>&1 \
    | tee "$OUT/ppo_loop_q15_fast.log" | quiet | tail -5
fi
if has big15; then  # a larger step: the sync's fixed cost against more scoring and training
  timeout 240 python3 examples/ppo_loop.py --model /tmp/q15 --steps 3 --rollouts 256 --minibatches 16 --out "$OUT/ppo_loop_q15_256.json" \
    2>&1 | tee "$OUT/ppo_loop_q15_256.log" | quiet | tail -6
fi
if has weights; then
  timeout 240 python3 benchmarks/bench_weights.py --model /tmp/q7 --reps 3 --out "$OUT/weights.json" 2>&1 \
    | tee "$OUT/weights.log" | quiet | tail -10
fi
if has step; then
  for copy in default off; do
    timeout 240 python3 benchmarks/bench_ppo_step.py --model /tmp/q7 --steps 3 --local-copy $copy \
      --out "$OUT/step_$copy.json" 2>&1 | tee "$OUT/step_$copy.log" | quiet | tail -3
  done
fi
if has loop7; then
  timeout ${LOOP7_S:-400} python3 examples/ppo_loop.py --model /tmp/q7 --steps 3 --rollouts 32 --prompt 128 --response 512 \
    --minibatches 8 --lr 1e-5 --out "$OUT/ppo_loop_q7.json" 2>&1 | tee "$OUT/ppo_loop_q7.log" | quiet | tail -8
fi
if has model; then  # issue 21: the worker's scoring after the actor's restructuring (7B shape); MODEL_ARGS="--top-k 20": issue 23
  timeout ${MODEL_S:-200} python3 benchmarks/bench_model.py --skip-naive --skip-fixed --worker-only ${MODEL_ARGS:-} --out "$OUT/model.json" \
    2>&1 | tee "$OUT/model.log" | quiet | tail -6
fi
if has sync; then  # issue 20: where a colocated sync's time goes (1.5B)
  timeout ${SYNC_S:-200} python3 benchmarks/bench_sync.py --model /tmp/q15 --out "$OUT/sync.json" 2>&1 \
    | tee "$OUT/sync.log" | quiet | tail -10
fi
if has prefix; then  # issue 22: shared prefixes, shared against unshared (7B shape)
  (cd benchmarks && timeout ${PREFIX_S:-300} python3 bench_prefix.py --reps 2 --out "$OUT/prefix.json") 2>&1 \
    | tee "$OUT/prefix.log" | quiet | tail -8
fi
if has prefixpool; then  # issue 22: the same through two pools of one worker
  (cd benchmarks && timeout ${PREFIXPOOL_S:-200} python3 bench_prefix.py --pool /tmp/q7 --reps 2 --out "$OUT/prefix_pool.json") \
    2>&1 | tee "$OUT/prefix_pool.log" | quiet | tail -8
fi
if has invariance; then  # issue 22: shared prefixes against alone, invariant and fast modes (7B shape)
  timeout ${INVARIANCE_S:-240} python3 benchmarks/bench_invariance.py --model /tmp/q7 --sequences ${SEQS:-40} \
    --out "$OUT/invariance.json" 2>&1 | tee "$OUT/invariance.log" | quiet | tail -14
fi
if has topk; then  # issue 23: top-k and candidates from the fused head against plain, the GEMM floor beside
  timeout ${TOPK_S:-200} python3 benchmarks/bench_head.py --top-k --out "$OUT/topk.json" 2>&1 | tee "$OUT/topk.log" \
    | quiet | tail -9
fi
if has attention; then  # issue 24: our causal attention kernel against FlashAttention's, its tilings first
  timeout ${ATTENTION_S:-200} python3 benchmarks/bench_attention.py --sweep 2>&1 | tee "$OUT/attention_sweep.log" | quiet | tail -9
  timeout ${ATTENTION_S:-200} python3 benchmarks/bench_attention.py --out "$OUT/attention.json" 2>&1 \
    | tee "$OUT/attention.log" | quiet | tail -4
fi
if has moe; then  # issue 24: the Qwen3-30B-A3B shape against HF's experts
  timeout ${MOE_S:-400} python3 benchmarks/bench_moe.py --out "$OUT/moe.json" 2>&1 | tee "$OUT/moe.log" | quiet | tail -5
fi
if has moesweep; then  # issue 24: one expert layer's kernels under several tilings, beside torch._grouped_mm
  timeout ${MOESWEEP_S:-150} python3 benchmarks/bench_moe.py --sweep 2>&1 | tee "$OUT/moe_sweep.log" | quiet | tail -20
fi
if has moeinv; then  # issue 24: the invariance study on the MoE shape (invariant mode; no pool, no 61 GB checkpoint:
  # the second worker runs in a process of its own that builds the same model)
  timeout ${MOEINV_S:-500} python3 benchmarks/bench_invariance.py --model qwen3-30b-a3b --modes invariant \
    --sequences ${SEQS:-200} --out "$OUT/invariance_moe.json" 2>&1 | tee "$OUT/invariance_moe.log" | quiet | tail -8
fi
if has gputests; then  # every GPU-marked test
  timeout ${GPUTESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gputests.log" | tail -4
fi
