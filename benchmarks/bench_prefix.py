"""Shared prefixes (GRPO groups): LogProbWorker.score with its defaults (sequences sharing at least 128 tokens
compute them once) against the same worker with sharing off (min_shared_prefix=None), in one run, on the same
sequences. Tokens/s count each sequence's whole length. Also: how many sequences' log-probs and entropies differ
between the two (the invariant mode promises none).

Cases: G responses of R tokens to each of two prompts of P tokens (G/P/R = 8/4096/1024, 16/1024/512,
4/8192/2048); mixed GRPO groups (P in 256..8192, R in 64..4096, G in 4..16); and nothing shared (random sequences
of the mixed case's lengths), where sharing must cost nothing.

  python benchmarks/bench_prefix.py --out prefix.json     # Qwen2.5-7B shape, random bf16 weights, one GPU
  python benchmarks/bench_prefix.py --pool /tmp/q7 --out prefix_pool.json   # the same through WorkerPool.create
  python benchmarks/bench_prefix.py --tiny                # a dry run on the CPU, tiny config

With --pool PATH (a checkpoint: `bench_pool.py --save-random /tmp/q7`), the sequences go through two pools of one
worker at their defaults, `WorkerPool.create(PATH, 1)` and the same with min_shared_prefix=None, each given half
of the GPU (num_gpus_per_worker=0.5, so both fit on one).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from bench_model import QWEN25_7B, TINY, build, timed

from ppo_logprobs.workers import LogProbWorker, patch_model
from ppo_logprobs.workers.prefixes import MIN_SHARED_PREFIX
from ppo_logprobs.workers.request import MAX_TOKENS_PER_BATCH


def groups(rng, vocab: int, shapes: list[tuple[int, int, int]]) -> tuple[list[list[int]], list[int]]:
    """For each (G, P, R): G sequences of one prompt of P tokens and a response of R; and where responses start."""
    seqs, starts = [], []
    for g, p, r in shapes:
        prompt = rng.integers(0, vocab, p).tolist()
        for _ in range(g):
            seqs.append(prompt + rng.integers(0, vocab, r).tolist())
            starts.append(p)
    return seqs, starts


def scored(score, seqs, starts, device: str, reps: int, warmup: float) -> tuple[float, list, int]:
    """Median seconds of `reps` calls of score(seqs, starts), after calls for `warmup` seconds (bench_model's
    timed); the last call's results; and how many calls there were."""
    last, calls = [], []

    def call():
        last[:] = [score(seqs, starts)]
        calls.append(1)

    seconds, _ = timed(call, device, reps, warmup)
    return seconds, last[0], len(calls)


def computed_tokens(scorer) -> int:
    """Tokens a LogProbWorker, or a pool's workers, computed so far."""
    if isinstance(scorer, LogProbWorker):
        return scorer.stats["computed_tokens"]
    return sum(h["computed_tokens"] for h in scorer.health())


def pools(args, options: dict) -> tuple:
    """Two pools of one worker, at their defaults but for sharing, with half the GPU each; and the vocabulary."""
    import ray

    from ppo_logprobs.workers import WorkerPool

    ray.init(include_dashboard=False, log_to_driver=False)
    extra = dict(num_gpus_per_worker=0.5) if torch.cuda.is_available() else dict(backend="torch")
    if args.fast:
        extra["invariant"] = False
    options["pool_options"] = {k: str(v) for k, v in extra.items()}
    shared = WorkerPool.create(args.pool, 1, **extra)
    plain = WorkerPool.create(args.pool, 1, min_shared_prefix=None, **extra)
    return shared, plain, shared.health()[0]["vocab_size"]


def differing(a: list, b: list) -> int:
    return sum(not (np.array_equal(x.log_probs, y.log_probs) and np.array_equal(x.entropy, y.entropy))
               for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with a tiny config")
    parser.add_argument("--fast", action="store_true", help="the fast mode (patch_model(invariant=False))")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS_PER_BATCH, help="a worker's max_tokens_per_batch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                        help="each case is called for this long before it is timed (one call at least)")
    parser.add_argument("--pool", metavar="PATH", help="through two pools of this checkpoint, not a LogProbWorker")
    parser.add_argument("--out")
    args = parser.parse_args()
    defaults = dict(fast=False, max_tokens=MAX_TOKENS_PER_BATCH, reps=3, warmup=3.0, pool=None)
    options = {k: getattr(args, k) for k in defaults if getattr(args, k) != defaults[k]}
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    reps, warmup = (1, 0) if args.tiny else (args.reps, args.warmup)
    scale = 32 if args.tiny else 1  # the tiny run: lengths / 32, and a minimum shared of 128 / 32
    if args.pool:
        shared, plain, vocab = pools(args, options)
        score_shared, score_plain = shared.compute_log_probs, plain.compute_log_probs
    else:
        model = build(TINY if args.tiny else QWEN25_7B, device, dtype)
        patch_model(model, backend="torch" if args.tiny else "auto", invariant=not args.fast)
        vocab = model.config.vocab_size
        shared = LogProbWorker(model, max_tokens_per_batch=args.max_tokens // scale, layout="packed",
                               min_shared_prefix=MIN_SHARED_PREFIX // scale)
        plain = LogProbWorker(model, max_tokens_per_batch=args.max_tokens // scale, layout="packed",
                              min_shared_prefix=None)
        score_shared, score_plain = shared.score, plain.score
    rng = np.random.default_rng(0)
    mixed = [(int(rng.integers(4, 17)), int(rng.integers(256, 8193)), int(rng.integers(64, 4097))) for _ in range(6)]
    cases = {f"G={g} P={p} R={r}": [(g, p, r)] * 2 for g, p, r in ((8, 4096, 1024), (16, 1024, 512), (4, 8192, 2048))}
    cases["mixed GRPO groups"] = mixed
    rows = []
    meta = dict(model=args.pool or ("tiny" if args.tiny else "Qwen2.5-7B shape, random bf16"), device=str(device),
                torch=torch.__version__, gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                min_shared_prefix=MIN_SHARED_PREFIX // scale, options=options,
                timing=dict(warmup_s=warmup, reps=reps))
    for name, shapes in [("nothing shared", None), *cases.items()]:
        if shapes is None:  # the mixed case's lengths, every sequence its own
            seqs = [rng.integers(0, vocab, (p + r) // scale).tolist() for g, p, r in mixed for _ in range(g)]
            starts = [1] * len(seqs)
        else:
            seqs, starts = groups(rng, vocab, [(g, p // scale, r // scale) for g, p, r in shapes])
        tokens = sum(map(len, seqs))
        before = computed_tokens(shared)
        t_shared, got, calls = scored(score_shared, seqs, starts, device, reps, warmup)
        computed = (computed_tokens(shared) - before) // calls
        t_plain, expected, _ = scored(score_plain, seqs, starts, device, reps, warmup)
        rows.append(dict(case=name, sequences=len(seqs), tokens=tokens, computed_tokens=computed,
                         shared_tokens_per_s=tokens / t_shared, unshared_tokens_per_s=tokens / t_plain,
                         speedup=t_plain / t_shared, token_ratio=tokens / computed,
                         sequences_differing=differing(got, expected)))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:  # (after each case: a run cut short keeps what it measured)
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"options: {options or 'defaults'}")
    print(f"{'case':>24}{'seqs':>6}{'tokens':>9}{'computed':>10}{'shared tok/s':>14}{'unshared':>10}{'speedup':>9}"
          f"{'differ':>8}")
    for r in rows:
        print(f"{r['case']:>24}{r['sequences']:>6}{r['tokens']:>9}{r['computed_tokens']:>10}"
              f"{r['shared_tokens_per_s']:>14.0f}{r['unshared_tokens_per_s']:>10.0f}{r['speedup']:>9.2f}"
              f"{r['sequences_differing']:>8}")


if __name__ == "__main__":
    main()
