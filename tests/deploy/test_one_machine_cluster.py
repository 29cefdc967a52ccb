"""docs/deploy.md's recipe for trying a cluster on one machine, run as written: a head and a "GPU" node begun with
`ray start` (Ray's token auth on), then `ppo-logprobs serve` joining them through RAY_ADDRESS. Its worker goes to
the node with the worker resource and answers over HTTP on loopback. (Joining a cluster that `ray start` began
used to kill every worker process: they inherit their raylet's environment, which lacked the service's edge.)"""

import os
import subprocess
import sys

import httpx
import numpy as np
import psutil

from ppo_logprobs.workers import load_model

from ..helpers import alone, free_port, stop_service, wait_ready

RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def test_serve_joins_a_cluster_that_ray_start_began(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="token", PYTHONUNBUFFERED="1",
               RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="2",  # (the stop need not drain for 30 s)
               # HAProxy's metrics and statistics on ports of their own, not Ray's fixed 9101 and 8404
               RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()), RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()))
    haproxies = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"}
    gcs, port = free_port(), free_port()
    head = [*RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=1",
            "--include-dashboard=false", "--disable-usage-stats", "--resources={\"head\": 1}"]
    node = [*RAY, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
            "--disable-usage-stats", "--resources={\"gpu_node\": 1}"]
    log = tmp_path / "serve.log"
    proc = None
    try:
        for command in (head, node):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ppo_logprobs.service", "--port", str(port), "--backend", "torch",
                 "--worker-resources", '{"gpu_node": 0.5}', "--ingress-replicas", "1"],
                stdout=out, stderr=subprocess.STDOUT, env={**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"},
                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, log)
        seq = [5, 17, 300, 42, 7]
        r = httpx.post(url + "/logprobs", json={"input_ids": [seq]}, timeout=120)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()["results"][0]["log_probs"], np.float32),
                                   alone(load_model("tiny", backend="torch"), seq)[0], rtol=0, atol=1e-5)
        status = subprocess.run([*RAY, "status", f"--address=127.0.0.1:{gcs}"], env=env, capture_output=True,
                                text=True, timeout=60).stdout
        assert "0.5/1.0 gpu_node" in status, status  # the worker holds its share of the "GPU" node
        assert "KeyError" not in log.read_text()
    finally:
        if proc is not None:
            stop_service(proc)
        subprocess.run([*RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        for p in psutil.process_iter(["name"]):  # (the service stopped and `ray stop` done, its HAProxy still ran)
            if p.info["name"] == "haproxy" and p.pid not in haproxies:
                p.kill()
