"""Where a colocated weight sync's time goes: a trainer on the workers' GPU sends its weights by CUDA IPC
(`pool.weight_sender().send(...)`, the defaults of `WorkerPool.create(path, 1)`), timed whole (the first send, which
shares the tensors, apart from the next ones, which the workers read again where they are), with each actor call's
time from Ray's timeline and the parts of one update timed apart: the sender's preparing of its tensors and their
IPC handles, the worker's mapping of them, its finiteness check and its commit.

  python benchmarks/bench_pool.py --save-random /tmp/q15 --shape 1.5b
  python benchmarks/bench_sync.py --model /tmp/q15 --out sync.json          # one GPU
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import ray
import torch

from ppo_logprobs.workers import WorkerPool, load_model
from ppo_logprobs.workers.errors import get
from ppo_logprobs.workers.weights.staging import StagedWeights
from ppo_logprobs.workers.weights.transfer import receive_shared, share_handles, share_sources


def _timed(f):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = f()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def parts_in_worker(actor, shared: list, layout) -> dict:
    """Runs in the worker's process (`__ray_call__`): map the shared tensors, check them, copy them in, let them go."""
    segments, map_s = _timed(lambda: receive_shared(shared))
    staged = StagedWeights.in_place(layout, segments)
    _, first_check_s = _timed(staged.first_non_finite)
    _, check_s = _timed(staged.first_non_finite)  # (as at every update after the first)
    _, first_commit_s = _timed(lambda: staged.commit(actor.worker.model))
    _, commit_s = _timed(lambda: staged.commit(actor.worker.model))
    staged = None  # noqa: F841 (its views of the segments go)

    def release():
        segments.clear()
        torch.cuda.ipc_collect()

    _, release_s = _timed(release)
    return dict(map_s=map_s, first_check_s=first_check_s, check_s=check_s, first_commit_s=first_commit_s,
                commit_s=commit_s, release_s=release_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    pool = WorkerPool.create(args.model, 1)  # (the trainer, this process, on the worker's GPU)
    pool.compute_log_probs([[1, 2, 3, 4, 5] * 50], [1])
    model = load_model(args.model, device="cuda")
    params = dict(model.named_parameters())
    nbytes = sum(p.nbytes for p in params.values())
    sends, parts = [], []
    with pool.weight_sender() as sender:
        for _ in range(args.reps + 1):
            with torch.no_grad():
                next(iter(params.values())).add_(1e-3)  # (a change, as a step makes)
            torch.cuda.synchronize()
            start = time.perf_counter()
            sender.send(params)
            sends.append(time.perf_counter() - start)
    layout = get(pool.owner.plan.remote({n: tuple(p.shape) for n, p in params.items()}))
    for _ in range(3):  # (the sender closed: nothing is mapped in the worker)
        sources, prepare_s = _timed(lambda: share_sources(params, layout, torch.device("cuda", 0), {}))
        shared, handles_s = _timed(lambda: share_handles(sources, layout))
        inside = get(pool.workers[0].__ray_call__.options(concurrency_group="staging").remote(
            parts_in_worker, shared, layout))
        parts.append(dict(prepare_s=prepare_s, handles_s=handles_s, **inside))
    time.sleep(2)
    spans = collections.defaultdict(list)
    for event in ray.timeline():
        if event.get("ph") == "X" and "dur" in event:
            spans[event.get("name", "?").split(".")[-1]].append(event["dur"] / 1e6)
    calls = {name: statistics.median(d) for name, d in spans.items()
             if name in ("update_shared", "stage_shared", "commit", "plan")}
    median = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    result = dict(model=args.model, gib=nbytes / 2**30, gpu=torch.cuda.get_device_name(),
                  send_s=statistics.median(sends[1:]), first_send_s=sends[0], sends_s=sends, actor_calls_s=calls,
                  parts_s=median)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{nbytes / 2**30:.1f} GiB; send {result['send_s']:.4f} s (first {sends[0]:.4f} s)")
    for name, seconds in {**calls, **median}.items():
        print(f"{name:>22} {seconds:.4f} s")
    pool.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
