"""The top-k combine's settings (first look from lists of width W, among the first H entries of each list): top-64
and top-256 against plain on one GPU, and whether each gives the default's ids and log-probs.

  cd benchmarks && python sweep_top_k_combine.py
"""

import torch
from bench_head import make_inputs  # the same directory
from triton.testing import do_bench

import ppo_logprobs.workers.head.triton_log_probs_forward as F
from ppo_logprobs.workers import fused_log_probs

hidden, weight, labels = make_inputs(32768, 4096, 151936, device="cuda")
plain = do_bench(lambda: fused_log_probs(hidden, weight, labels, backend="triton"), warmup=25, rep=100)
ref = {k: fused_log_probs(hidden, weight, labels, backend="triton", top_k=k) for k in (64, 256)}
print(f"plain {plain:.2f} ms", flush=True)
for width, head in [(64, 8), (128, 8), (64, 16), (64, 4), (128, 4), (10**9, 8)]:
    F.FIRST_LOOK_WIDTH, F.COMBINE_HEAD = width, head
    row = []
    for k in (64, 256):
        def fn(k=k):
            return fused_log_probs(hidden, weight, labels, backend="triton", top_k=k)
        out = fn()
        same = torch.equal(out.top_ids, ref[k].top_ids) and torch.equal(out.top_log_probs, ref[k].top_log_probs)
        row.append(f"top-{k} {do_bench(fn, warmup=10, rep=60) / plain:.3f}x {'same' if same else 'DIFFERENT'}")
    print(f"first look from {width}, head {head}:", *row, flush=True)
