"""Requests/s and tokens/s through the HTTP gateway against calling the pool directly, same sequences.

The gateway is saturated by concurrent clients; the pool is called with the same sequences in calls of the
gateway's batch size, which is the best the gateway could do. Both pack rows of at most --row-tokens tokens,
so the model does the same work either way. HTTP runs once per response encoding (JSON text, and the binary
body the Python client asks for), each reporting the bytes of its answers per scored token.

  python benchmarks/bench_gateway.py                           # CPU, the built-in tiny model
  python benchmarks/bench_gateway.py --model /ckpt --dtype bfloat16 --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import httpx
import numpy as np
import ray
from ray import serve
from transformers import AutoConfig

from ppo_logprobs.service import Settings, build_app
from ppo_logprobs.service.wire import BINARY
from ppo_logprobs.workers import WorkerPool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def huge(url: str, vocab: int, longest: int) -> dict:
    """The request that used to wedge the gateway, beside a small one, and the same tokens as the longest
    sequences the workers take."""
    g = np.random.default_rng(1)
    short = g.integers(0, vocab, (131072, 2)).tolist()
    long = g.integers(0, vocab, (262144 // longest, longest)).tolist()
    async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
        async def timed(body):
            start = time.perf_counter()
            r = await client.post("/logprobs", json=body)
            r.raise_for_status()
            return time.perf_counter() - start, r

        out = {}
        out["long_s"], _ = await timed({"input_ids": long, "return_entropy": False})
        out["short_s"], _ = await timed({"input_ids": short, "return_entropy": False})
        big = asyncio.create_task(timed({"input_ids": short, "return_entropy": False}))
        await asyncio.sleep(0.2)
        out["small_beside_s"], r = await timed({"input_ids": short[:4]})
        out["small_calls_waited"] = int(r.headers["X-Calls-Waited"])
        out["short_beside_s"], _ = await big
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype")
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--sequences", type=int, default=4, help="per request")
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per pool call (both paths)")
    parser.add_argument("--row-tokens", type=int, default=1024, help="max_tokens_per_batch of the workers")
    parser.add_argument("--huge", action="store_true",
                        help="also: 131,072 sequences of 2 tokens in one request, alone and beside a small request")
    parser.add_argument("--out")
    args = parser.parse_args()
    backend = "torch" if args.model == "tiny" else "auto"
    vocab = 503 if args.model == "tiny" else AutoConfig.from_pretrained(args.model).vocab_size
    g = np.random.default_rng(0)
    requests = [
        [g.integers(0, vocab, g.integers(args.min_len, args.max_len + 1)).tolist() for _ in range(args.sequences)]
        for _ in range(args.requests)
    ]
    tokens = sum(len(s) for r in requests for s in r)
    ray.init(include_dashboard=False, log_to_driver=False)
    out = dict(date=time.strftime("%Y-%m-%d"), model=args.model, requests=args.requests, tokens=tokens,
               clients=args.clients, batch_tokens=args.batch_tokens, row_tokens=args.row_tokens)

    # The gateway's pool is named, so the direct calls below go to the very same (warm) worker.
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = Settings(models={"policy": args.model}, backend=backend, batch_tokens=args.batch_tokens,
                        max_tokens_per_batch=args.row_tokens, max_queue=args.requests, pool_name="bench",
                        **({"dtype": args.dtype} if args.dtype else {}))
    serve.run(build_app(settings), name="bench", route_prefix="/")
    pool = WorkerPool.connect("bench:policy")

    async def run(accept: str) -> tuple[float, int]:
        limits = httpx.Limits(max_connections=args.clients)
        headers = {"Accept": accept}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits,
                                     headers=headers) as client:
            sem = asyncio.Semaphore(args.clients)
            received = 0

            async def one(r):
                nonlocal received
                async with sem:
                    resp = await client.post("/logprobs", json={"input_ids": r})
                    resp.raise_for_status()
                    received += len(resp.content)

            start = time.perf_counter()
            await asyncio.gather(*(one(r) for r in requests))
            return time.perf_counter() - start, received

    warm_s, _ = asyncio.run(run("application/json"))  # compiles whatever the worker compiles for these shapes
    flat = [s for r in requests for s in r]
    calls, call, size = [], [], 0
    for s in flat:
        if size + len(s) > args.batch_tokens and call:
            calls.append(call)
            call, size = [], 0
        call.append(s)
        size += len(s)
    calls.append(call)
    start = time.perf_counter()
    for c in calls:
        pool.compute_log_probs(c)
    direct_s = time.perf_counter() - start
    start = time.perf_counter()
    pool.compute_log_probs(flat)  # everything in one call: the worker packs it all at once
    one_call_s = time.perf_counter() - start
    out.update(warmup_http_s=warm_s, direct_tokens_per_s=tokens / direct_s,
               direct_one_call_tokens_per_s=tokens / one_call_s)
    scored = tokens - args.requests * args.sequences  # score_from = 1
    for name, accept in (("json", "application/json"), ("binary", BINARY)):
        http_s, received = asyncio.run(run(accept))
        out[name] = dict(http_tokens_per_s=tokens / http_s, http_requests_per_s=args.requests / http_s,
                         http_over_direct=direct_s / http_s, http_over_best_direct=min(direct_s, one_call_s) / http_s,
                         bytes_per_scored_token=received / scored)
    if args.huge:
        out["huge"] = asyncio.run(huge(f"http://127.0.0.1:{port}", vocab, args.row_tokens))
    serve.shutdown()
    print(json.dumps(out), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
