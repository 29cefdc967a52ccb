"""The top-k combine's settings (the first look from lists of width W, among the first H entries of each list):
top-20, top-64 and top-256 against plain on one GPU, and which of the default's ids, log-probs and tail each gives
to the bit (the tail's sum is grouped by H).

  cd benchmarks && python sweep_top_k_combine.py
"""

import torch
from bench_head import make_inputs  # the same directory
from triton.testing import do_bench

import ppo_logprobs.workers.head.triton_log_probs_forward as F
from ppo_logprobs.workers import fused_log_probs

SETTINGS = [(F.FIRST_LOOK_WIDTH, F.COMBINE_HEAD), (2, 1), (2, 2), (2, 4), (2, 8), (10**9, 8)]  # (width, head)
hidden, weight, labels = make_inputs(32768, 4096, 151936, device="cuda")
plain = do_bench(lambda: fused_log_probs(hidden, weight, labels, backend="triton"), warmup=25, rep=100)
print(f"plain {plain:.2f} ms", flush=True)
ref = {}
for width, head in SETTINGS:
    F.FIRST_LOOK_WIDTH, F.COMBINE_HEAD = width, head
    row = []
    for k in (20, 64, 256):
        def fn(k=k):
            return fused_log_probs(hidden, weight, labels, backend="triton", top_k=k)
        out = fn()
        ref.setdefault(k, out)
        differ = [name for name in ("top_ids", "top_log_probs", "tail_log_prob")
                  if not torch.equal(getattr(out, name), getattr(ref[k], name))]
        said = "differ: " + ",".join(differ) if differ else "same"
        row.append(f"top-{k} {do_bench(fn, warmup=10, rep=60) / plain:.3f}x {said}")
    print(f"first look from {width}, head {head}:", *row, flush=True)
