"""Where a worker's time goes when its work comes as many small requests (issue 36): one step's wall time against
its forwards' GPU time (CUDA events around them), the host's launch of them, and the kernels' own time (profiled),
for a step of one long sequence and for the same tokens as many small requests joined the way the worker's line
joins them; then the line itself (`Scheduler`) fed by many threads at once, in this process; then the Ray actor
(`WorkerPool.create(model, 1)`) fed by many callers at once, with the actor process's CPU time per request, and a
py-spy profile of that process (which functions hold the GIL) when py-spy is installed.

  python benchmarks/bench_worker_step.py                          # CPU, the built-in tiny model (a dry run)
  python benchmarks/bench_worker_step.py --model /tmp/q15 --dtype bfloat16 --out step.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import torch


def sequences(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, g.integers(lo, hi + 1)).tolist() for _ in range(n)]


def timed_forwards(worker) -> list:
    """Wraps the worker's forward so that each one's GPU time is recorded (CUDA events), as (start, end) pairs."""
    events, forward = [], worker._forward

    def timed(**inputs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(**inputs)
        end.record()
        events.append((start, end))
        return out

    worker._forward = timed
    return events


def steps(worker, tokens: int, repeats: int) -> list[dict]:
    """One step's wall and GPU time: one sequence of `tokens`, and `tokens` as requests of 64, 256 and 1024 tokens
    joined as the worker's line joins them (ScoreRequest.concat of each request's span)."""
    from bench_model import profile

    from ppo_logprobs.workers.request import ScoreRequest

    vocab, cuda = worker.model.config.vocab_size, str(worker.device).startswith("cuda")
    events = timed_forwards(worker) if cuda else []
    rows = []
    for size in (tokens, 1024, 256, 64):
        n = max(1, tokens // size)
        requests = [worker.request(sequences(1, size // 2, 3 * size // 2, vocab, seed=i)) for i in range(n)]
        walls, gpus, joins, launches = [], [], [], []
        for r in range(repeats + 2):  # (the first two: warm-up, whatever compiles for these shapes)
            events.clear()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            joined = ScoreRequest.concat([q.span(0, len(q)) for q in requests])
            t1 = time.perf_counter()
            collect = worker.start(joined)  # (the host's launch of the step's forwards: nothing waits for the device)
            launched = time.perf_counter()
            result = collect()
            start = 0
            for q in requests:  # each request's span, as Line.answer hands them out
                result.span(start, start + len(q)).fit(q)
                start += len(q)
            t2 = time.perf_counter()
            if r >= 2:
                walls.append(t2 - t0)
                joins.append(t1 - t0)
                launches.append(launched - t1)
                gpus.append(sum(s.elapsed_time(e) for s, e in events) / 1000 if cuda else float("nan"))
        wall, gpu = float(np.median(walls)), float(np.median(gpus))
        # the kernels' own time (the events above also count the device waiting for a slow launch)
        kernels = profile(lambda: worker.score_request(joined), "cuda")["total_ms"] if cuda else float("nan")
        rows.append(dict(part="step", request_tokens=size, requests=n, tokens=int(joined.offsets[-1]),
                         wall_ms=1000 * wall, gpu_ms=1000 * gpu, join_ms=1000 * float(np.median(joins)),
                         launch_ms=1000 * float(np.median(launches)), kernel_ms=kernels,
                         host_gap_ms=1000 * (wall - gpu), tokens_per_s=joined.offsets[-1] / wall))
        print(json.dumps(rows[-1]), flush=True)
    worker._forward = type(worker)._forward.__get__(worker)
    return rows


def launch(worker, tokens: int, out: str | None) -> list[dict]:
    """Where the host's launch of a step goes: `worker.start` of one sequence of `tokens` and of the same tokens as
    64-token requests, under cProfile (the 30 functions of most own time printed, the whole profile written beside
    `out`), and the CUDA kernel launches and torch operators it makes (torch.profiler's CPU side)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ppo_logprobs.workers.request import ScoreRequest

    vocab, rows = worker.model.config.vocab_size, []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for size in (tokens, 64):
        n = max(1, tokens // size)
        requests = [worker.request(sequences(1, size // 2, 3 * size // 2, vocab, seed=i)) for i in range(n)]
        joined = ScoreRequest.concat([q.span(0, len(q)) for q in requests])
        for _ in range(3):
            worker.start(joined)()
        sync()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        collect = worker.start(joined)
        profiler.disable()
        profiled_ms = 1000 * (time.perf_counter() - t0)
        collect()
        stats = pstats.Stats(profiler)
        if out:
            stats.dump_stats(f"{out}.launch_{size}.pstats")
        print(f"# launch of {n} x {size} tokens under cProfile: {profiled_ms:.1f} ms", flush=True)
        stats.sort_stats("tottime").print_stats(30)
        sync()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            collect = worker.start(joined)
        collect()
        events = prof.key_averages()
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        top = sorted(((e.key, e.count, e.self_cpu_time_total / 1e3) for e in events), key=lambda x: -x[2])[:15]
        rows.append(dict(part="launch", request_tokens=size, requests=n, profiled_ms=profiled_ms,
                         kernel_launches=launches, aten_ops=ops, top_self_cpu_ms=top))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def line(worker, threads: int, seconds: float, size: int, pipelined: bool) -> dict:
    """The worker's line in this process: `threads` threads, each submitting requests of about `size` tokens one
    after another for `seconds`; `pipelined`: each step launched before the one before is collected (as a
    PoolWorker runs it on CUDA), else scored one after another."""
    from ppo_logprobs.workers.pool.pool_worker import LINE_TOKENS
    from ppo_logprobs.workers.pool.scheduler import Scheduler

    scheduler = Scheduler(worker.score_request, start=worker.start if pipelined else None,
                          step_tokens=worker.max_tokens_per_batch, max_tokens=LINE_TOKENS,
                          min_shared_prefix=worker.min_shared_prefix, name="bench-line")
    vocab = worker.model.config.vocab_size
    pool = [worker.request(sequences(1, size // 2, 3 * size // 2, vocab, seed=1000 + i)) for i in range(256)]
    done, stop = [0] * threads, time.perf_counter() + seconds

    def feed(i: int) -> None:
        k = i
        while time.perf_counter() < stop:
            scheduler.submit(pool[k % len(pool)])
            done[i] += 1
            k += threads

    steps0, tokens0 = scheduler.line.steps, worker.stats["tokens"]
    t0 = time.perf_counter()
    feeders = [threading.Thread(target=feed, args=(i,)) for i in range(threads)]
    for t in feeders:
        t.start()
    for t in feeders:
        t.join()
    elapsed = time.perf_counter() - t0
    steps = scheduler.line.steps - steps0
    row = dict(part="line", threads=threads, request_tokens=size, pipelined=pipelined,
               requests_per_s=sum(done) / elapsed,
               tokens_per_step=(worker.stats["tokens"] - tokens0) / max(1, steps), steps_per_s=steps / elapsed)
    print(json.dumps(row), flush=True)
    return row


def actor(args, size: int, callers: int, per_call: int, out: str | None) -> dict:
    """The Ray actor fed by `callers` callers at once, each sending calls of `per_call` requests of about `size`
    tokens (as an ingress replica's hand-over joins them), for args.seconds; the actor process's CPU per request;
    py-spy's record of the process (GIL holders only) meanwhile, when it is installed."""
    import psutil
    import ray

    from ppo_logprobs.workers import WorkerPool

    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    pool = getattr(actor, "pool", None) or WorkerPool.create(args.model, 1, **({"dtype": args.dtype} if args.dtype
                                                                              else {}))
    actor.pool = pool
    calls = [pool.request(sequences(per_call, size // 2, 3 * size // 2, pool.vocab_size, seed=2000 + i))
             for i in range(256)]
    process = psutil.Process(pool.health()[0]["pid"])

    async def run(seconds: float) -> int:
        stop, done = time.perf_counter() + seconds, [0]

        async def caller(i: int) -> None:
            k = i
            while time.perf_counter() < stop:
                await pool.score(calls[k % len(calls)])
                done[0] += per_call
                k += callers

        await asyncio.gather(*(caller(i) for i in range(callers)))
        return done[0]

    asyncio.run(run(3.0))  # warm-up
    spy = None
    if out and shutil.which("py-spy"):
        spy = subprocess.Popen(["py-spy", "record", "--gil", "--nonblocking", "-r", "100", "-d",
                                str(int(args.seconds)), "--format", "raw", "-p", str(process.pid), "-o",
                                f"{out}.actor_{size}x{per_call}_c{callers}.pyspy"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    health0, cpu0, t0 = pool.health()[0], sum(process.cpu_times()[:2]), time.perf_counter()
    requests = asyncio.run(run(args.seconds))
    elapsed, cpu1, health1 = time.perf_counter() - t0, sum(process.cpu_times()[:2]), pool.health()[0]
    if spy:
        spy.wait()
    steps = health1["steps"] - health0["steps"]
    idle = health1.get("idle_s", float("nan")) - health0.get("idle_s", float("nan"))
    row = dict(part="actor", callers=callers, request_tokens=size, requests_per_call=per_call,
               idle_share=idle / elapsed,
               requests_per_s=requests / elapsed, actor_cpu_ms_per_request=1000 * (cpu1 - cpu0) / requests,
               actor_cpu_share=(cpu1 - cpu0) / elapsed, steps_per_s=steps / elapsed,
               tokens_per_step=(health1["tokens"] - health0["tokens"]) / max(1, health1["calls"] - health0["calls"]))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tokens", type=int, default=4096, help="one step's tokens in the first part")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=8.0, help="each run of the line and of the actor")
    parser.add_argument("--parts", nargs="+", default=["step", "line", "actor"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from ppo_logprobs.workers import LogProbWorker

    rows = []
    if {"step", "line", "launch"} & set(args.parts):
        worker = LogProbWorker(args.model, **({"dtype": args.dtype} if args.dtype else {}))
        if "step" in args.parts:
            rows += steps(worker, args.tokens, args.repeats)
        if "launch" in args.parts:
            rows += launch(worker, args.tokens, args.out)
        if "line" in args.parts:
            rows += [line(worker, threads, args.seconds, 64, pipelined) for threads in (64, 512)
                     for pipelined in (False, True)]
        del worker
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "actor" in args.parts:
        rows += [actor(args, 64, callers, per_call, args.out) for callers, per_call in ((64, 1), (256, 1), (64, 4))]
    options = {k: v for k, v in dict(model=args.model, dtype=args.dtype).items() if v not in (None, "tiny")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name() if torch.cuda.is_available()
                           else None, non_default_options=options, rows=rows), f, indent=1)
    print(f"{'part':>6} {'piped':>5} {'req tok':>7} {'reqs':>5} {'per call':>8} {'wall ms':>8} {'gpu ms':>7} "
          f"{'launch ms':>9} {'kernel ms':>9} {'gap ms':>7} {'req/s':>7} {'tok/step':>8} {'cpu ms/req':>10} "
          f"{'idle':>5}")
    for r in rows:
        get = lambda name: r.get(name, float("nan"))  # noqa: E731
        who = r.get("requests", r.get("threads", r.get("callers")))
        print(f"{r['part']:>6} {str(r.get('pipelined', '')):>5} {r['request_tokens']:>7} {who:>5} "
              f"{r.get('requests_per_call', 1):>8} {get('wall_ms'):>8.2f} {get('gpu_ms'):>7.2f} "
              f"{get('launch_ms'):>9.2f} {get('kernel_ms'):>9.2f} "
              f"{get('host_gap_ms'):>7.2f} {get('requests_per_s'):>7.0f} {get('tokens_per_step'):>8.0f} "
              f"{get('actor_cpu_ms_per_request'):>10.2f} {get('idle_share'):>5.2f}")


if __name__ == "__main__":
    main()
