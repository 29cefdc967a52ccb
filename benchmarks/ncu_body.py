"""The 7B forward's body kernels on Hopper, one launch each at the shapes of 8 x 4096 tokens, for Nsight Compute:
hopper_gated's gate/up middle, down and o projections (residual added) and q/k/v (biases, rotary), and
hopper_attention's persistent kernel (28 / 4 heads of 128). Warmed up first, then launched once each between
cudaProfilerStart and cudaProfilerStop; --time prints each one's do_bench median instead (the same launches back to
back, where the 700 W cap sets lower clocks than in ncu's single replays).

  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
      --section SourceCounters -o body python benchmarks/ncu_body.py     # then: ncu -i body.ncu-rep --page details
  python benchmarks/ncu_body.py --time
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_attention import row_of  # the same directory
from bench_mlp import rope

from ppo_logprobs.workers.models import causal_attention as ca
from ppo_logprobs.workers.models import hopper_gated as hg

ROWS, HIDDEN, MIDDLE, KV = 32768, 3584, 18944, 512  # (Qwen2.5-7B: 28 query and 4 key-value heads of 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time", action="store_true", help="do_bench medians, no profiler range")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * std).to(torch.bfloat16)

    x, residual, middle = rand(ROWS, HIDDEN), rand(ROWS, HIDDEN), rand(ROWS, MIDDLE)
    gate, up, down = rand(MIDDLE, HIDDEN, std=0.02), rand(MIDDLE, HIDDEN, std=0.02), rand(HIDDEN, MIDDLE, std=0.02)
    wo, wq, wk, wv = (rand(n, HIDDEN, std=0.02) for n in (HIDDEN, HIDDEN, KV, KV))
    biases = rand(HIDDEN), rand(KV), rand(KV)
    cos, sin = rope(ROWS, "cuda", torch.bfloat16)
    q, k, v, cu = row_of([4096] * (ROWS // 4096), 28, 4, 128, "cuda", torch.bfloat16)
    tiles = ca._tiles(128, torch.bfloat16)
    calls = {
        "gate/up": lambda: hg.middle(x, gate, up),
        "down": lambda: hg.plus(middle, down, residual),
        "o": lambda: hg.plus(x, wo, residual),
        "q/k/v": lambda: hg.qkv(x, (wq, wk, wv), biases, cos, sin),
        "attention": lambda: ca._launch(q, k, v, cu, cu, 4096, 128**-0.5, None, tiles),
    }
    for f in calls.values():
        f()
    torch.cuda.synchronize()
    if args.time:
        for name, f in calls.items():
            print(f"{name:>10} {triton.testing.do_bench(f, warmup=100, rep=500, return_mode='median'):8.3f} ms")
        return
    torch.cuda.cudart().cudaProfilerStart()
    for f in calls.values():
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
