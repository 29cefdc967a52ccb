"""A PPO step as the service sees it: score N rollouts with a policy pool and a reference pool (at once), then a
trainer process sends the policy's new weights; the step's time split into scoring and weight sync.

Layout on a two-GPU machine: the trainer is a Ray actor holding the policy (bf16) on GPU 0; the policy and the
reference workers share GPU 1 (half a GPU each in Ray's accounting, so they score concurrently on one device).
The trainer nudges every parameter in place each step (an optimizer step's worth of change) and streams them
over NCCL through `pool.weight_sender()`; the policy worker stages them beside its weights and commits. On one
GPU the three share it (a third each) and the weights go by CUDA IPC.

  python benchmarks/bench_pool.py --save-random /tmp/q7                 # a random Qwen2.5-7B-shaped checkpoint
  python benchmarks/bench_ppo_step.py --model /tmp/q7 --out step.json   # nvidia-h200-x2
  python benchmarks/bench_ppo_step.py                                   # CPU dry run: tiny model, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ray
import torch
from bench_pool import rollouts  # the same directory

from ppo_logprobs.workers import WorkerPool, load_model
from ppo_logprobs.workers.request import MAX_TOKENS_PER_BATCH


class Trainer:
    """Stands in for a trainer process: the policy's parameters on its GPU, changed in place and streamed."""

    def __init__(self, model: str, dtype: str | None) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        options = dict(dtype=getattr(torch, dtype)) if dtype else dict(backend="torch")
        self.model = load_model(model, device=device, **options)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.sender = None
        self.host_state = None  # a copy of the state dict in host memory, made at its first use

    def connect(self, pool: WorkerPool, bucket_mib: int | None) -> int:
        self.sender = pool.weight_sender(bucket_bytes=bucket_mib and bucket_mib << 20)
        return self.nbytes

    @torch.no_grad()
    def step(self, scale: float = 1e-3) -> tuple[int, float]:
        """An optimizer step's worth of change, then the update: (version, seconds of the send alone)."""
        for p in self.model.parameters():
            p.mul_(1 + scale)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        version = self.sender.send(self.model.named_parameters())
        return version, time.perf_counter() - start

    def update_with_state_dict(self, pool: WorkerPool, host: bool = False) -> float:
        """`pool.update_weights(state_dict)` (the call that took 58-61 s for a 7B model through the object store);
        `host`: of a copy of the state dict in host memory, as a trainer offloading to the CPU holds it."""
        state = self.model.state_dict()
        if host:
            if self.host_state is None:
                self.host_state = {k: v.cpu() for k, v in state.items()}
            state = self.host_state
        start = time.perf_counter()
        pool.update_weights(state)
        return time.perf_counter() - start

    def close(self) -> None:
        self.sender.close()


LOCAL_COPY = {"default": None, "on": True, "off": False}  # --local-copy: WorkerPool.create's local_copy


def local_copy_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-copy", choices=list(LOCAL_COPY), default="default",
                        help="the pools' local_copy (default: the pool's default, as users get it)")


def non_defaults(args, defaults: dict) -> dict:
    """The options of this run that differ from the benchmark's defaults (written into its JSON and table)."""
    return {k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def make_pools(model: str, options: dict, gpus: int, max_tokens: int,
               local_copy: bool | None = None) -> tuple[WorkerPool, WorkerPool]:
    share = {0: 0, 1: 1 / 3}.get(gpus, 0.5)  # both pools on the GPU the trainer does not hold, or beside it
    return tuple(
        WorkerPool.create(model, 1, num_gpus_per_worker=share, max_tokens_per_batch=max_tokens, name=name,
                          local_copy=local_copy, **options)
        for name in ("policy", "reference")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS_PER_BATCH)
    parser.add_argument("--bucket-mib", type=int, help="default: the sender's (512 MiB buckets over NCCL, one by IPC)")
    local_copy_flag(parser)
    parser.add_argument("--out")
    args = parser.parse_args()
    changed = non_defaults(args, dict(max_tokens=MAX_TOKENS_PER_BATCH, bucket_mib=None, local_copy="default"))
    tiny = args.model == "tiny"
    gpus = torch.cuda.device_count()
    options = dict(backend="torch") if tiny else dict(dtype=torch.bfloat16)
    seqs = rollouts(8, 16, 8, 40, 503) if tiny else rollouts(args.rollouts, 512, 64, 4000, 152064)
    starts = [16 if tiny else 512] * len(seqs)
    tokens = sum(len(s) for s in seqs)

    ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    trainer_gpus = {0: 0, 1: 1 / 3}.get(gpus, 1)
    trainer = ray.remote(Trainer).options(num_gpus=trainer_gpus).remote(args.model, None if tiny else "bfloat16")
    ray.get(trainer.__ray_ready__.remote())  # the trainer takes its GPU first; the workers share the other
    policy, reference = make_pools(args.model, options, gpus, args.max_tokens, LOCAL_COPY[args.local_copy])
    nbytes = ray.get(trainer.connect.remote(policy, args.bucket_mib))

    steps = []
    for step in range(args.steps + 1):  # the first is a warm-up (compilation, NCCL set-up)
        start = time.perf_counter()
        scored = ray.get([p.compute_log_probs_async(seqs, starts) for p in (policy, reference)])
        scoring = time.perf_counter() - start
        version, send = ray.get(trainer.step.remote())
        total = time.perf_counter() - start
        assert {r.weights_version for r in scored[0]} == {version - 1}, "scored with another policy version"
        if step:
            steps.append(dict(scoring_s=scoring, sync_s=total - scoring, send_s=send, total_s=total))
        print(f"step {step}: scoring {scoring:.3f} s, weight sync {total - scoring:.3f} s", flush=True)
    state_dict_s = ray.get(trainer.update_with_state_dict.remote(policy))
    host_state_dict_s = [ray.get(trainer.update_with_state_dict.remote(policy, True)) for _ in range(2)][-1]

    median = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    results = dict(
        date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(0) if gpus else "cpu", gpus=gpus,
        model=args.model, rollouts=len(seqs), tokens=tokens, weight_bytes=nbytes, steps=steps, median=median,
        scoring_tokens_per_s=2 * tokens / median["scoring_s"], sync_gib_per_s=nbytes / median["send_s"] / 2**30,
        sync_share=median["sync_s"] / median["total_s"], state_dict_update_s=state_dict_s,
        host_state_dict_update_s=host_state_dict_s, host_state_dict_gib_per_s=nbytes / host_state_dict_s / 2**30,
        options=changed,
        layout={0: "CPU, gloo", 1: "trainer, policy and reference workers on one GPU (CUDA IPC)"}.get(
            gpus, "trainer on GPU 0; policy and reference workers on GPU 1, half a GPU each (NCCL)"),
    )
    ray.get(trainer.close.remote())
    for p in (policy, reference):
        p.shutdown()
    print(json.dumps({k: v for k, v in results.items() if k != "steps"}), flush=True)
    print(f"{'options':<24}{'scoring s':>10}{'sync s':>8}{'sync %':>8}{'tok/s':>10}{'host dict s':>12}")
    print(f"{json.dumps(changed) if changed else 'defaults':<24}{median['scoring_s']:>10.3f}{median['sync_s']:>8.3f}"
          f"{100 * results['sync_share']:>8.1f}{results['scoring_tokens_per_s']:>10.0f}{host_state_dict_s:>12.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
