"""Recovery of the gateway from successive worker kills: SIGKILL the model's worker, then time until /readyz says
ready again (a new process with its weights back) and until a request is answered right. The first start is timed
too, from the application's deployment (Ray and Serve already up) to the first answer: the worker started, its model
loaded, its kernels compiled and warmed up.

  python benchmarks/bench_recovery.py --kills 10                  # CPU, the built-in tiny model
  python benchmarks/bench_recovery.py --model /ckpt --dtype bfloat16 --kills 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import time

import httpx
import ray
from ray import serve

from ppo_logprobs.service import Settings, build_app
from ppo_logprobs.service.app import shut_down_serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    start = time.perf_counter()
    settings = Settings(models={"policy": args.model}, backend="torch" if args.model == "tiny" else "auto",
                        **({"dtype": args.dtype} if args.dtype else {}))
    serve.run(build_app(settings), name="recovery", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    body = {"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8]] * 4}
    expected = httpx.post(url + "/logprobs", json=body, timeout=600).json()["results"]
    first = time.perf_counter() - start
    print(f"first start: answered after {first:.2f} s", flush=True)
    rows = []
    for _ in range(args.kills):
        pid = httpx.get(url + "/v1/health").json()["models"]["policy"][0]["pid"]
        start = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while True:
            r = httpx.get(url + "/v1/health", timeout=600)
            if r.status_code == 200 and r.json()["models"]["policy"][0]["pid"] != pid:
                break
            time.sleep(0.05)
        ready = time.perf_counter() - start
        answer = httpx.post(url + "/logprobs", json=body, timeout=600)
        answered = time.perf_counter() - start
        assert answer.status_code == 200 and answer.json()["results"] == expected, answer.text[:300]
        rows.append(dict(ready_s=ready, answered_s=answered))
        print(f"kill {len(rows)}: ready again after {ready:.2f} s, answered right after {answered:.2f} s", flush=True)
    shut_down_serve()
    out = dict(date=time.strftime("%Y-%m-%d"), model=args.model, first_answer_s=first, kills=rows,
               median_ready_s=statistics.median(r["ready_s"] for r in rows),
               max_answered_s=max(r["answered_s"] for r in rows))
    print(json.dumps(out), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
