"""Requests/s, tokens/s and latency through the HTTP gateway, for each ingress mode and number of ingress replicas,
beside the pool called directly with the same requests in the same run.

Each ingress mode runs in a process of its own (Serve's HAProxy mode is chosen when Ray starts): Ray, Serve with a
proxy on every node, and the gateway as `ppo-logprobs serve` would run it, with the settings a user gets unless a
flag below says otherwise (every such option is in the JSON and the table). Each replica count is an application of
its own (`/r<N>/logprobs`), all deployed up front over the same named pool (their PoolKeepers attach to it: same
workers), so that no redeploy is timed; one at a time is loaded by several
client processes, closed loop, at each request size; then at half that peak rate, open loop, for latency. Per run:
requests/s, tokens/s, latency p50/p99, the mean tokens a worker's step carried over what a full step would (fill),
the HTTP requests a call reaching a worker's line carried (joined: the replicas' hand-over joins small requests
that arrive together; also at half rate, and the workers' steps a second there), and the CPU time the ingress
replicas and the proxy (Python proxy, or HAProxy) spent per request. "Direct" is the pool fed calls of
DIRECT_TOKENS tokens (the same requests joined) from the driver, DIRECT_IN_FLIGHT at once: what the gateway could at
best do with the same workers.

  python benchmarks/bench_gateway.py --replicas 1 2 --requests 400          # CPU, the built-in tiny model
  python benchmarks/bench_gateway.py --workers 4 --replicas 1 2 4 8 --ingress python haproxy --out gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import numpy as np

from ppo_logprobs.service.config import Settings

DEFAULTS = Settings()
TIMEOUT_S = 60.0  # a request not answered by then is a failure (the benchmark never hangs on one)


def requests_of(size: int, n: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """n requests of about `size` tokens: max(1, size // 256) sequences of lengths uniform in [0.5, 1.5] x their
    share."""
    g = np.random.default_rng(seed)
    k = max(1, size // 256)
    lo, hi = max(2, size // k // 2), max(3, 3 * size // k // 2)
    return [[g.integers(0, vocab, g.integers(lo, hi + 1)).tolist() for _ in range(k)] for _ in range(n)]


class Connection:
    """One keep-alive HTTP/1.1 connection writing requests and reading answers by hand: a load generator in
    Python that costs a small part of what an HTTP library does per request, so that the clients are not the
    limit being measured."""

    def __init__(self, address: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address, self.reader, self.writer = address, reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        return cls((host, port), *await asyncio.open_connection(host, port))

    async def post(self, path: bytes, body: bytes) -> tuple[int, int]:
        """(status, answer bytes); status 0 when the connection broke or no answer came in TIMEOUT_S (it is opened
        again for the next request)."""
        try:
            async with asyncio.timeout(TIMEOUT_S):
                return await self._post(path, body)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, TimeoutError):
            await self.reopen()
            return 0, 0

    async def _post(self, path: bytes, body: bytes) -> tuple[int, int]:
        host = b"%s:%d" % (self.address[0].encode(), self.address[1])  # (a loopback service checks the Host)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path, host, len(body), body))
        status = int((await self.reader.readline()).split()[1])
        length, close = None, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            length = int(value) if name == b"content-length" else length
            close |= name == b"connection" and value.strip().lower() == b"close"
        if length is None:
            raise ValueError("an answer without Content-Length")
        size = len(await self.reader.readexactly(length))
        if close:
            await self.reopen()
        return status, size

    async def reopen(self) -> None:
        self.writer.close()
        self.reader, self.writer = await asyncio.open_connection(*self.address)


def client(url: str, bodies: list[bytes], connections: int, rate: float, out, go) -> None:
    """One client process: opens its connections, says so on `out` and waits for `go`; then sends `bodies` with
    `connections` at once (closed loop), or at `rate` requests/s (open loop over those connections, a request that
    finds none free waiting for one, its wait counted in its latency); puts (latencies, failures, answer bytes) on
    `out`."""
    address, _, prefix = url.removeprefix("http://").partition("/")
    host, port = address.split(":")
    path = f"/{prefix}/logprobs".replace("//", "/").encode()

    async def run():
        latencies, failures, size = [], 0, 0
        idle = asyncio.Queue()  # (only these `connections`: HAProxy refuses a client address holding too many)
        for _ in range(connections):
            idle.put_nowait(await Connection.open(host, int(port)))
        out.put("ready")
        await asyncio.to_thread(go.wait)

        async def one(body, connection=None):
            nonlocal failures, size
            start = time.perf_counter()
            taken = connection is None  # (the open loop's: a free one from `idle`, given back after)
            connection = await idle.get() if taken else connection
            status, received = await connection.post(path, body)
            latencies.append(time.perf_counter() - start)
            failures += status != 200
            size += received
            if taken:
                idle.put_nowait(connection)

        if rate:
            start, tasks = time.perf_counter(), []
            for i, body in enumerate(bodies):
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
                tasks.append(asyncio.create_task(one(body)))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(bodies))

            async def loop(connection):
                while queue:
                    await one(queue.pop(), connection)
                idle.put_nowait(connection)  # (to be closed below, once)

            await asyncio.gather(*(loop(idle.get_nowait()) for _ in range(connections)))
        while not idle.empty():
            idle.get_nowait().writer.close()
        return latencies, failures, size

    try:
        out.put(asyncio.run(run()))
    except BaseException as e:  # the parent waits for every client's answer
        out.put(([], len(bodies), 0))
        raise e


def load(url: str, bodies: list[bytes], procs: int, connections: int, rate: float = 0.0) -> dict:
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=client, args=(url, bodies[i::procs], max(1, connections // procs), rate / procs,
                                                 out, go)) for i in range(procs)]
    for w in workers:
        w.start()
    for _ in workers:  # the clock starts once every client process is up with its connections open
        if out.get(timeout=120) != "ready":
            for w in workers:  # (the others wait for `go`: end them, or this process never exits)
                w.terminate()
            raise RuntimeError(f"a client process could not open its {connections // procs} connections")
    start = time.perf_counter()
    go.set()
    parts = [out.get(timeout=TIMEOUT_S * len(bodies)) for _ in workers]
    end = time.perf_counter()
    for w in workers:
        w.join()
    latencies = np.concatenate([p[0] for p in parts]) * 1000
    return dict(start=start, end=end, seconds=end - start, requests_per_s=len(bodies) / (end - start),
                failures=sum(p[1] for p in parts),
                p50_ms=float(np.percentile(latencies, 50)), p99_ms=float(np.percentile(latencies, 99)),
                answer_bytes=sum(p[2] for p in parts))


def note(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def cpu_seconds(app: str) -> dict[str, float]:
    """CPU time so far of the application's ingress replicas and of the HTTP proxies (Serve's, or HAProxy)."""
    import psutil

    out = {"replicas": 0.0, "proxy": 0.0}
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        line = " ".join(p.info["cmdline"] or ())
        kind = ("replicas" if f"ServeReplica:{app}:LogProbsIngress" in line else
                "proxy" if "ProxyActor" in line or line.split(" ")[0].endswith("haproxy") else None)
        if kind and p.info["cpu_times"]:
            out[kind] += p.info["cpu_times"].user + p.info["cpu_times"].system
    return out


def worker_calls(pool) -> tuple[int, int, int]:
    """The workers' steps, tokens and requests (pool calls reaching their lines) so far."""
    health = pool.health()
    return (sum(h["calls"] for h in health), sum(h["tokens"] for h in health),
            sum(h.get("requests", h["calls"]) for h in health))


DIRECT_TOKENS, DIRECT_IN_FLIGHT = 65536, 2  # the floor's calls: as the gateway made them before workers scheduled


def direct(pool, requests: list) -> float:
    """Tokens/s of the pool fed calls of DIRECT_TOKENS tokens, DIRECT_IN_FLIGHT at once."""
    from ppo_logprobs.workers.request import ScoreRequest

    flat = [s for r in requests for s in r]
    calls, call, size = [], [], 0
    for s in flat:
        if size + len(s) > DIRECT_TOKENS and call:
            calls.append(call)
            call, size = [], 0
        call.append(s)
        size += len(s)
    calls.append(call)
    built = [ScoreRequest.build(c, vocab_size=pool.vocab_size, max_length=pool.max_tokens_per_batch) for c in calls]

    async def run():
        slots = asyncio.Semaphore(DIRECT_IN_FLIGHT)

        async def one(request):
            async with slots:
                await pool.score(request)

        await asyncio.gather(*(one(r) for r in built))

    start = time.perf_counter()
    asyncio.run(run())
    return sum(map(len, flat)) / (time.perf_counter() - start)


TRAINER_SEQUENCES, TRAINER_PROMPT = 64, 128  # a trainer's call: 64 rollouts of 256-1024 tokens, scored after 128


def trainer_calls(pool, batch: list[list[int]], stop, spans: list) -> None:
    """A trainer beside the HTTP load: `pool.compute_log_probs(batch)` one call after another until `stop` is set,
    each call's (start, end) appended to `spans`."""
    while not stop.is_set():
        start = time.perf_counter()
        pool.compute_log_probs(batch, score_from=TRAINER_PROMPT)
        spans.append((start, time.perf_counter()))


def trainer_rate(spans: list, tokens: int, start: float | None = None, end: float | None = None) -> float:
    """Tokens/s of the trainer's calls between start and end (by default from its first call's start to its last's
    end), each call's tokens spread evenly over its time."""
    start, end = (spans[0][0], spans[-1][1]) if start is None else (start, end)
    return sum(tokens * max(0.0, min(b, end) - max(a, start)) / (b - a) for a, b in spans) / (end - start)


def run_mode(args) -> list[dict]:
    """One ingress mode, in this process: every replica count and request size, with Ray and Serve started as
    `ppo-logprobs serve` starts them on loopback (service/__main__.py)."""
    from ppo_logprobs.service.edge import Edge

    options = dict(models={"policy": args.model}, workers_per_model=args.workers, pool_name="bench",
                   **({"dtype": args.dtype} if args.dtype else {}))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # (Ray's listeners on loopback, as serve does)
    if args.ingress == "haproxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    for name, value in Edge.of(Settings(**options)).environment().items():  # (read when Ray is imported)
        os.environ.setdefault(name, value)
    import ray
    import torch
    from ray import serve

    from ppo_logprobs.service import build_app
    from ppo_logprobs.service.__main__ import haproxy_files
    from ppo_logprobs.workers import WorkerPool

    if args.ingress == "haproxy":
        import tempfile

        os.environ.update(haproxy_files(tempfile.mkdtemp(prefix="ppl-")))
    gpu = torch.cuda.is_available()
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "ppo_logprobs.service.edge.setup_worker"})
    url = f"http://127.0.0.1:{args.port}"
    serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": args.port})
    options.update({"gpus_per_worker": 1 / args.workers} if gpu and args.workers > 1 else {},
                   **({"backend": "torch"} if not gpu else {}))
    settings = Settings(**options)
    apps = {}
    for replicas in args.replicas:  # the first makes the pool, the others attach to it
        apps[replicas] = f"r{replicas}"
        serve.run(build_app(settings.model_copy(update={"ingress_replicas": replicas})), name=apps[replicas],
                  route_prefix=f"/r{replicas}")
        note(f"deployed {apps[replicas]}")
    pool = WorkerPool.connect("bench:policy")
    step_tokens = pool.health()[0]["step_tokens"]  # a worker's step: its line's budget
    per_client = settings.max_connections_per_client * 3 // 4  # every client is 127.0.0.1: HAProxy refuses more
    if max(args.connections) > per_client:
        raise SystemExit(f"--connections {max(args.connections)}: over {per_client}, 3/4 of max_connections_per_client")
    rows = []
    sizes = {size: requests_of(size, n, pool.vocab_size, seed=size) for size, n in zip(args.sizes, args.requests,
                                                                                         strict=True)}
    bodies = {size: [json.dumps({"input_ids": r}).encode() for r in reqs] for size, reqs in sizes.items()}
    for size, reqs in sizes.items():  # warm-up: whatever the workers compile for these shapes
        warm = load(f"{url}/r{args.replicas[0]}", bodies[size][: len(reqs) // 4], args.client_procs,
                    max(args.connections))
        direct(pool, reqs)
        note(f"warmed up {size} tokens a request: {warm['requests_per_s']:.0f} requests/s, {warm['failures']} failed")
    base = {size: direct(pool, reqs) for size, reqs in sizes.items()}
    if args.trainer:  # the trainer alone first (one untimed call: its shapes' first look)
        g = np.random.default_rng(7)
        batch = [g.integers(0, pool.vocab_size, g.integers(256, 1025)).tolist() for _ in range(TRAINER_SEQUENCES)]
        batch_tokens = sum(map(len, batch))
        pool.compute_log_probs(batch, score_from=TRAINER_PROMPT)
        spans = []
        for _ in range(6):
            start = time.perf_counter()
            pool.compute_log_probs(batch, score_from=TRAINER_PROMPT)
            spans.append((start, time.perf_counter()))
        trainer_alone = trainer_rate(spans, batch_tokens)
        note(f"the trainer alone: {trainer_alone:.0f} tokens/s")
    for (replicas, app), (size, reqs), connections in itertools.product(apps.items(), sizes.items(), args.connections):
        tokens = sum(len(s) for r in reqs for s in r)
        calls0, cpu0 = worker_calls(pool), cpu_seconds(app)
        peak = load(f"{url}/{app}", bodies[size], args.client_procs, connections)
        calls1, cpu1 = worker_calls(pool), cpu_seconds(app)
        half = load(f"{url}/{app}", bodies[size][: len(reqs) // 2], args.client_procs,
                    min(4 * connections, per_client // 2), rate=peak["requests_per_s"] / 2)
        calls2 = worker_calls(pool)
        per_call = (calls1[1] - calls0[1]) / max(1, calls1[0] - calls0[0])
        beside = {}
        if args.trainer:  # the same closed loop with the trainer's calls beside it
            spans, stop = [], threading.Event()
            thread = threading.Thread(target=trainer_calls, args=(pool, batch, stop, spans))
            thread.start()
            mixed = load(f"{url}/{app}", bodies[size] * 2, args.client_procs, connections)  # (twice as long)
            stop.set()
            thread.join()
            beside = dict(trainer_alone_tokens_per_s=trainer_alone,
                          trainer_tokens_per_s=trainer_rate(spans, batch_tokens, mixed["start"], mixed["end"]),
                          with_trainer_requests_per_s=mixed["requests_per_s"], with_trainer_p99_ms=mixed["p99_ms"],
                          failures_with_trainer=mixed["failures"])
        rows.append(dict(
            ingress=args.ingress, replicas=replicas, request_tokens=size, connections=connections,
            requests=len(reqs),
            tokens_per_s=tokens / peak["seconds"], requests_per_s=peak["requests_per_s"],
            direct_tokens_per_s=base[size], over_direct=tokens / peak["seconds"] / base[size],
            p50_ms=peak["p50_ms"], p99_ms=peak["p99_ms"], half_rate_p50_ms=half["p50_ms"],
            half_rate_p99_ms=half["p99_ms"], failures=peak["failures"] + half["failures"],
            half_rate_requests_per_line_request=len(reqs) // 2 / max(1, calls2[2] - calls1[2]),
            half_rate_steps_per_s=(calls2[0] - calls1[0]) / half["seconds"],
            tokens_per_worker_call=per_call, fill=per_call / step_tokens,
            requests_per_line_request=len(reqs) / max(1, calls1[2] - calls0[2]),
            replica_cpu_ms=1000 * (cpu1["replicas"] - cpu0["replicas"]) / len(reqs),
            proxy_cpu_ms=1000 * (cpu1["proxy"] - cpu0["proxy"]) / len(reqs), **beside,
        ))
        print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()  # the Ray this process started, with everything in it (Serve's own shutdown drains for 30 s or more)
    return rows


def answer_sizes(out: str | None) -> None:
    """Bytes per scored token of /logprobs answers, JSON and BINARY, plain and with top-k or candidates: real
    answers of a model with a 151,936-token vocabulary (ids as long as a Qwen's; random weights, small body, the
    torch head on the CPU) encoded as the route encodes them, 8 sequences of 512 tokens."""
    import torch
    import transformers

    from ppo_logprobs.workers import LogProbWorker, patch_model
    from ppo_logprobs.workers.request import ScoreRequest
    from ppo_logprobs.workers.wire import encode_binary, encode_json

    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    worker = LogProbWorker(patch_model(transformers.Qwen2ForCausalLM(config).eval(), backend="torch"))
    seqs = requests_of(4096, 1, config.vocab_size, seed=5)[0][:8]
    candidates = np.random.default_rng(6).integers(0, config.vocab_size, 16).tolist()
    rows = []
    for case, extra in (("plain", {}), ("top-1", dict(top_k=1)), ("top-20", dict(top_k=20)),
                        ("top-64", dict(top_k=64)), ("16 candidate ids", dict(token_ids=candidates))):
        request = ScoreRequest.build(seqs, 1, 1.0, True, vocab_size=config.vocab_size, max_length=4096, **extra)
        result = worker.score_request(request)
        header = {"model": "policy", "weights_version": 0, "usage": {"sequences": len(seqs)}}
        scored = int(result.offsets[-1])
        sizes = {name: len(encode(header, result.log_probs, result.entropy, result.offsets, result.extras,
                                  request.candidate_counts())) / scored
                 for name, encode in (("json", encode_json), ("binary", encode_binary))}
        rows.append(dict(case=case, scored_tokens=scored, json_bytes_per_token=sizes["json"],
                         binary_bytes_per_token=sizes["binary"]))
        print(f"{case:>18} {sizes['json']:9.1f} {sizes['binary']:9.1f}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answer-sizes", action="store_true",
                        help="only bytes per scored token of answers (JSON, BINARY; plain, top-k, candidates)")
    parser.add_argument("--model", default=DEFAULTS.models["policy"])
    parser.add_argument("--dtype")
    parser.add_argument("--workers", type=int, default=DEFAULTS.workers_per_model,
                        help="workers in the pool (on a GPU they share it: gpus_per_worker 1/N)")
    parser.add_argument("--ingress", nargs="+", default=[DEFAULTS.ingress], choices=["python", "haproxy"])
    parser.add_argument("--replicas", type=int, nargs="+", default=[DEFAULTS.ingress_replicas])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024], help="tokens per request")
    parser.add_argument("--requests", type=int, nargs="+", default=[2000],
                        help="per run: one for every size, or one per size")
    parser.add_argument("--connections", type=int, nargs="+", default=[64],
                        help="clients' connections in all (closed loop; each a run of its own)")
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--trainer", action="store_true",
                        help=f"each run again with a trainer beside it (WorkerPool.compute_log_probs of "
                             f"{TRAINER_SEQUENCES} rollouts of 256-1024 tokens, one call after another)")
    parser.add_argument("--out")
    args = parser.parse_args()
    args.requests *= len(args.sizes) if len(args.requests) == 1 else 1
    if len(args.requests) != len(args.sizes):
        parser.error(f"--requests: one count, or one per size ({len(args.sizes)}); got {len(args.requests)}")
    if args.answer_sizes:
        answer_sizes(args.out)
        return
    if len(args.ingress) == 1 and os.environ.get("_BENCH_GATEWAY_CHILD"):
        args.ingress = args.ingress[0]
        print("ROWS " + json.dumps(run_mode(args)), flush=True)
        return
    rows = []
    for mode in args.ingress:  # each mode in a process of its own
        child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--ingress", mode], text=True,
                                 stdout=subprocess.PIPE, env={**os.environ, "_BENCH_GATEWAY_CHILD": "1"})
        found = None
        for line in child.stdout:  # each run's row as it ends
            if line.startswith("ROWS "):
                found = json.loads(line[5:])
            elif line.startswith("{"):
                print(line, end="", flush=True)
        if child.wait() or found is None:
            raise SystemExit(f"the {mode} run failed")
        rows += found
    options = {k: v for k, v in dict(model=args.model, dtype=args.dtype, workers_per_model=args.workers).items()
               if v != dict(model=DEFAULTS.models["policy"], dtype=DEFAULTS.dtype,
                            workers_per_model=DEFAULTS.workers_per_model)[k]}
    if args.workers > 1:
        options["gpus_per_worker"] = f"1/{args.workers} on a GPU"
    out = dict(date=time.strftime("%Y-%m-%d"), host_cpus=os.cpu_count(), non_default_options=options,
               connections=args.connections, client_procs=args.client_procs, trainer_beside=args.trainer, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"non-default options: {options or 'none'}; {args.client_procs} client processes; requests a run: "
          f"{dict(zip(args.sizes, args.requests, strict=True))}")
    print(f"{'ingress':8} {'repl':>4} {'tok/req':>7} {'conns':>5} {'req/s':>7} {'tok/s':>9} {'/direct':>7} "
          f"{'p99 ms':>7} {'p99@half':>8} {'fill':>5} {'joined':>6} {'j@half':>6} {'replica ms':>10} {'proxy ms':>8} "
          f"{'fail':>4}")
    for r in rows:
        print(f"{r['ingress']:8} {r['replicas']:>4} {r['request_tokens']:>7} {r['connections']:>5} "
              f"{r['requests_per_s']:>7.0f} "
              f"{r['tokens_per_s']:>9.0f} {r['over_direct']:>7.2f} {r['p99_ms']:>7.1f} {r['half_rate_p99_ms']:>8.1f} "
              f"{r['fill']:>5.2f} {r['requests_per_line_request']:>6.1f} "
              f"{r['half_rate_requests_per_line_request']:>6.1f} {r['replica_cpu_ms']:>10.2f} "
              f"{r['proxy_cpu_ms']:>8.2f} {r['failures']:>4}")
    if args.trainer:
        print("with a trainer beside the HTTP load (closed loop), against each alone:")
        print(f"{'ingress':8} {'repl':>4} {'tok/req':>7} {'conns':>5} {'req/s':>7} {'alone':>7} {'p99 ms':>7} "
              f"{'alone':>7} {'trainer tok/s':>13} {'alone':>9}")
        for r in rows:
            print(f"{r['ingress']:8} {r['replicas']:>4} {r['request_tokens']:>7} {r['connections']:>5} "
                  f"{r['with_trainer_requests_per_s']:>7.0f} {r['requests_per_s']:>7.0f} "
                  f"{r['with_trainer_p99_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['trainer_tokens_per_s']:>13.0f} "
                  f"{r['trainer_alone_tokens_per_s']:>9.0f}")


if __name__ == "__main__":
    main()
