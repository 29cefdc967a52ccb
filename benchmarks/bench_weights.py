"""Weight updates of a one-worker pool per source, beside the raw limit of each medium measured in the same run.

Sources: a checkpoint directory (`pool.update_weights(path)`, page cache warm), a trainer's GPU tensors sent
through an open `pool.weight_sender()`, a CUDA state dict passed to `pool.update_weights(state_dict)` (a sender
opened and closed per call), and the same state dict copied to host memory (a trainer that offloads). The pool has
the defaults unless --local-copy says otherwise; options that differ from the defaults go into the JSON and table.
With two GPUs the trainer holds GPU 0 and the worker GPU 1 (NCCL); with one they share
it (CUDA IPC). Raw limits: a plain torch copy of the same bytes from GPU 0 to GPU 1 (or within the one GPU), an NCCL
broadcast of the same bytes over the sender's own group (two GPUs), and, for the checkpoint, the page-cache read rate
of its shards (8 threads, into pinned memory) and the pinned host-to-device copy rate, both in the worker's process.

  python benchmarks/bench_pool.py --save-random /tmp/q7
  python benchmarks/bench_weights.py --model /tmp/q7 --out weights.json     # nvidia-h200-x2
  python benchmarks/bench_weights.py --model /tmp/q7 --checkpoint-only    # the checkpoint alone
  python benchmarks/bench_weights.py                                        # CPU dry run: tiny, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch
from bench_model import timed  # the same directory
from bench_ppo_step import LOCAL_COPY, Trainer, local_copy_flag, non_defaults

from ppo_logprobs.workers import WorkerPool


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn, reps: int) -> float:
    """Median seconds of `reps` calls of fn after one, with no warm-up beyond it (copies and broadcasts: their links,
    not the SM clock, set the rate)."""
    return timed(fn, "cuda" if torch.cuda.is_available() else "cpu", reps)[0]


def receive_raw(worker, group: str, nbytes: int, reps: int) -> None:
    """Runs in the worker's process (`__ray_call__`): the receiving side of the raw broadcasts."""
    spec, pg = worker.worker.weights._groups[group]
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if spec.backend == "nccl" else "cpu")
    for _ in range(reps + 1):
        pg.broadcast(buffer, 0).wait()
    sync()


def broadcast_raw(trainer, nbytes: int, reps: int) -> float:
    """Runs in the trainer's process: the same bytes as one flat buffer over the sender's group."""
    device = trainer.sender.transport.device
    buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    return median_seconds(lambda: (trainer.sender.transport.group.broadcast(buffer, 0).wait(), sync()), reps)


def disk_and_pcie(worker, path: str, reps: int) -> dict:
    """Runs in the worker's process: page-cache read rate of the shards and pinned host-to-device rate."""
    files = sorted(Path(path).glob("*.safetensors"))
    cuda = torch.cuda.is_available()
    chunk = 64 << 20
    buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(8)]
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]

    def read_all():
        def read(i_job):
            i, (f, off) = i_job
            with open(f, "rb") as fh:
                fh.seek(off)
                fh.readinto(memoryview(buffers[i % 8].numpy()))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(read, enumerate(jobs)))

    nbytes = sum(f.stat().st_size for f in files)
    out = dict(read_gib_per_s=nbytes / median_seconds(read_all, reps) / 2**30)
    if cuda:
        host = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8).pin_memory()
        device = torch.empty_like(host, device="cuda")
        out["h2d_gib_per_s"] = 1 / median_seconds(lambda: (device.copy_(host, non_blocking=True), sync()), reps)
    return out


def load_as_before(worker, path: str, reps: int) -> float:
    """Runs in the worker's process: the previous way, a whole model built on the CPU then load_state_dict."""
    from transformers import AutoModelForCausalLM

    dtype = next(worker.worker.model.parameters()).dtype

    def load():
        state = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).state_dict()
        worker.worker.model.load_state_dict(state)
        sync()

    return median_seconds(load, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, help="default: the sender's (512 MiB buckets over NCCL, one by IPC)")
    parser.add_argument("--checkpoint-only", action="store_true")
    local_copy_flag(parser)
    parser.add_argument("--out")
    args = parser.parse_args()
    changed = non_defaults(args, dict(bucket_mib=None, local_copy="default"))
    tiny = args.model == "tiny"
    gpus = torch.cuda.device_count()
    share = 0.5 if gpus == 1 else 1  # one GPU: the trainer and the worker share it
    options = dict(backend="torch") if tiny else dict(dtype=torch.bfloat16)
    path = args.model
    if tiny:  # a checkpoint of the tiny model to read
        from ppo_logprobs.workers import load_model

        model, path = load_model("tiny"), tempfile.mkdtemp()
        del model.forward
        model.save_pretrained(path)

    ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    if not args.checkpoint_only:
        dtype = None if tiny else "bfloat16"
        trainer = ray.remote(Trainer).options(num_gpus=share if gpus else 0).remote(args.model, dtype)
        ray.get(trainer.__ray_ready__.remote())
    pool = WorkerPool.create(path, 1, num_gpus_per_worker=share if gpus else 0, max_tokens_per_batch=4096,
                             local_copy=LOCAL_COPY[args.local_copy], **options)
    worker = pool.workers[0]
    nbytes = ray.get(worker.__ray_call__.remote(lambda w: sum(p.nbytes for p in w.worker.model.parameters())))
    results = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(0) if gpus else "cpu",
                   model=args.model, weight_bytes=nbytes, reps=args.reps, options=changed, sources={}, raw={})

    def rate(seconds: float) -> dict:
        return dict(seconds=seconds, gib_per_s=nbytes / seconds / 2**30)

    results["sources"]["checkpoint"] = rate(median_seconds(lambda: pool.update_weights(path), args.reps))
    results["raw"]["checkpoint_media"] = ray.get(worker.__ray_call__.remote(disk_and_pcie, path, args.reps))
    results["before"] = dict(checkpoint=rate(ray.get(worker.__ray_call__.remote(load_as_before, path, args.reps))))
    if not args.checkpoint_only:
        stream(results, rate, trainer, pool, worker, nbytes, args)
    pool.shutdown()
    report(results, args.out)


def stream(results: dict, rate, trainer, pool: WorkerPool, worker, nbytes: int, args) -> None:
    """The trainer's sources and the raw limits of GPU-to-GPU transfer."""
    ray.get(trainer.connect.remote(pool, args.bucket_mib))
    results["sender"] = ray.get(trainer.__ray_call__.remote(lambda t: t.sender.backend))
    sends = [ray.get(trainer.step.remote())[1] for _ in range(args.reps + 1)][1:]
    results["sources"]["trainer_stream"] = rate(statistics.median(sends))
    dicts = [ray.get(trainer.update_with_state_dict.remote(pool)) for _ in range(args.reps + 1)][1:]
    results["sources"]["state_dict"] = rate(statistics.median(dicts))
    dicts = [ray.get(trainer.update_with_state_dict.remote(pool, True)) for _ in range(args.reps + 1)][1:]
    results["sources"]["host_state_dict"] = rate(statistics.median(dicts))

    gpus = torch.cuda.device_count()
    if results["sender"] != "ipc":
        group = ray.get(trainer.__ray_call__.remote(lambda t: t.sender.transport.spec.name))
        receiving = worker.__ray_call__.remote(receive_raw, group, nbytes, args.reps)
        results["raw"]["broadcast"] = rate(ray.get(trainer.__ray_call__.remote(broadcast_raw, nbytes, args.reps)))
        ray.get(receiving)
    if gpus:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(src, device=f"cuda:{min(gpus, 2) - 1}")  # to the other GPU, or within the one
        copy = rate(median_seconds(lambda: (dst.copy_(src), torch.cuda.synchronize(dst.device)), args.reps))
        results["raw"]["gpu_copy"] = copy
        del src, dst
    ray.get(trainer.close.remote())


def report(results: dict, out: str | None) -> None:
    print(json.dumps(results), flush=True)
    print("options:", json.dumps(results["options"]) if results["options"] else "defaults")
    print(f"{'source':<16}{'seconds':>9}{'GiB/s':>9}")
    for name, r in {**results["sources"], **{f"raw {k}": v for k, v in results["raw"].items()
                                             if "seconds" in v}}.items():
        print(f"{name:<16}{r['seconds']:>9.3f}{r['gib_per_s']:>9.1f}")
    print("checkpoint media:", results["raw"]["checkpoint_media"])
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
