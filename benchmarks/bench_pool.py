"""Tokens/s through WorkerPool against calling the worker in-process, on the same mixed-length rollouts.

  python benchmarks/bench_pool.py --model DIR --workers 1     # overhead of the pool on one GPU
  python benchmarks/bench_pool.py --model DIR --workers 1 2   # and scaling, on a two-GPU machine
  python benchmarks/bench_pool.py --save-random DIR           # writes a random Qwen2.5-7B-shaped model to DIR
  python benchmarks/bench_pool.py --save-random DIR --shape 1.5b                     # Qwen2.5-1.5B-shaped
  python benchmarks/bench_pool.py --tiny                      # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import ray
import torch
from bench_model import QWEN25_1_5B, QWEN25_7B, timed  # the same directory

from ppo_logprobs.workers import LogProbWorker, WorkerPool
from ppo_logprobs.workers.request import MAX_TOKENS_PER_BATCH


def rollouts(n: int, prompt: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, prompt + int(g.integers(lo, hi + 1))).tolist() for _ in range(n)]


def save_random(path: str, shape: str = "7b") -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**{"7b": QWEN25_7B, "1.5b": QWEN25_1_5B}[shape]))
    model.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--save-random")
    parser.add_argument("--shape", choices=["7b", "1.5b"], default="7b", help="of --save-random's Qwen2.5 model")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS_PER_BATCH)
    parser.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                        help="each way is called for this long before it is timed (one call at least)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.save_random:
        save_random(args.save_random, args.shape)
        return
    tiny = args.tiny or args.model == "tiny"
    options = dict(backend="torch") if tiny else dict(dtype=torch.bfloat16)
    seqs = rollouts(6, 16, 8, 40, 503) if tiny else rollouts(args.rollouts, 512, 64, 4000, 152064)
    tokens = sum(len(s) for s in seqs)
    starts = [16 if tiny else 512] * len(seqs)
    reps, warmup = (1, 0) if tiny else (3, args.warmup)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    median_seconds = lambda fn: timed(fn, device, reps, warmup)[0]  # noqa: E731
    results = dict(date=time.strftime("%Y-%m-%d"), sequences=len(seqs), tokens=tokens, max_tokens=args.max_tokens,
                   timing=dict(warmup_s=warmup, reps=reps))
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()

    direct = LogProbWorker(args.model, max_tokens_per_batch=args.max_tokens, **options)
    s = median_seconds(lambda: direct.score(seqs, starts))
    results["direct_tokens_per_s"] = tokens / s
    reference = direct.score(seqs, starts)
    direct = None  # free the in-process model before the pool's actors load theirs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    ray.init(include_dashboard=False, log_to_driver=False)
    for n in args.workers:
        pool = WorkerPool.create(args.model, n, max_tokens_per_batch=args.max_tokens, **options)
        s = median_seconds(lambda: pool.compute_log_probs(seqs, starts))  # noqa: B023
        got = pool.compute_log_probs(seqs, starts)
        pool.shutdown()
        diff = max(float(np.abs(a.log_probs - b.log_probs).max()) for a, b in zip(got, reference, strict=True))
        results[f"pool{n}"] = dict(tokens_per_s=tokens / s, over_direct=tokens / s / results["direct_tokens_per_s"],
                                   max_diff_vs_direct=diff)
    if len(args.workers) > 1:
        lo, hi = min(args.workers), max(args.workers)
        results["scaling"] = results[f"pool{hi}"]["tokens_per_s"] / results[f"pool{lo}"]["tokens_per_s"]
    print(json.dumps(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
