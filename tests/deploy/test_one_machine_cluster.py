"""docs/deploy.md's recipe for trying a cluster on one machine, run as written: a head and a "GPU" node begun by
deploy/one_machine_cluster.py (Ray's token auth on), then `ppo-logprobs serve` joining them through RAY_ADDRESS.
Its worker goes to the node with the worker resource and answers over HTTP on loopback; no process of the cluster
or the service listens beyond loopback; a driver without the token is refused. (Joining a cluster begun outside
the service used to kill every worker process: they inherit their raylet's environment, which lacked the
service's edge; and HAProxy's admin socket went to the raylet's /tmp/haproxy-serve, open to every local user.)"""

import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import psutil

from ppo_logprobs.workers import load_model

from ..helpers import alone, free_port, stop_service, wait_logged, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def listeners_beyond_loopback(root: psutil.Process) -> list[str]:
    found = []
    for p in [root, *root.children(recursive=True)]:
        try:
            for c in p.net_connections(kind="inet"):
                address = ipaddress.ip_address(c.laddr.ip)
                address = getattr(address, "ipv4_mapped", None) or address  # (::ffff:127.0.0.1 is loopback)
                if c.status == psutil.CONN_LISTEN and not address.is_loopback:
                    found.append(f"{p.name()} {c.laddr.ip}:{c.laddr.port}")
        except psutil.Error:
            pass
    return found


def refused_at_once(code: str, env: dict) -> bool:
    """Whether a driver running `code` is told its token is wrong (read from its log as it comes: Ray's client would
    go on asking for a while before it gives up)."""
    driver = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        return any("Authentication token is missing or incorrect" in line for line in driver.stderr)
    finally:
        driver.kill()
        driver.wait()


def test_serve_joins_a_two_node_cluster_on_loopback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", PYTHONUNBUFFERED="1", HOME=str(tmp_path),  # (a machine with no token yet)
               # HAProxy's metrics and statistics on ports of their own, not Ray's fixed 9101 and 8404
               RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()), RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()))
    haproxies = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"}
    gcs, port = free_port(), free_port()
    nodes_log, log = tmp_path / "nodes.log", tmp_path / "serve.log"
    nodes = proc = None
    try:
        with open(nodes_log, "wb") as out:
            nodes = subprocess.Popen([sys.executable, str(ROOT / "deploy/one_machine_cluster.py"), "--port", str(gcs)],
                                     stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_logged("a head and a GPU node at", nodes_log, nodes, every_s=0.5)
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
        probe = "import ray; ray.init(address='auto', log_to_driver=False); print(ray.available_resources())"
        asked = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"},
                               capture_output=True, text=True, timeout=120)
        assert "'gpu_node': 0.5" in asked.stdout, asked.stdout + asked.stderr[-2000:]  # the worker holds its share
        assert listeners_beyond_loopback(psutil.Process(nodes.pid)) == []
        assert listeners_beyond_loopback(psutil.Process(proc.pid)) == []
        assert (tmp_path / ".ray/auth_token").stat().st_size > 0  # (made by the script, as ray.init makes it)
        assert refused_at_once(probe, {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}", "RAY_AUTH_TOKEN": "not-the-token"})
        assert "KeyError" not in log.read_text()
        # HAProxy's files in the service's own folder of mode 0700, removed when it stops (in the raylet's
        # /tmp/haproxy-serve, the admin socket of mode 666 was anyone's, and was left behind)
        folders = {os.path.dirname(os.path.dirname(arg)) for p in psutil.process_iter(["name", "cmdline"])
                   if p.info["name"] == "haproxy" and p.pid not in haproxies
                   for arg in p.info["cmdline"] or () if arg.endswith(".cfg")}
        assert len(folders) == 1 and os.path.basename(next(iter(folders))).startswith("ppl-"), folders
        folder = next(iter(folders))
        assert os.stat(folder).st_mode & 0o777 == 0o700
        stop_service(proc)
        proc = None
        assert not os.path.exists(folder)
    finally:
        if proc is not None:
            stop_service(proc)
        if nodes is not None:
            nodes.send_signal(signal.SIGTERM)
            nodes.wait(120)
        for p in psutil.process_iter(["name"]):  # (the service stopped and the nodes too, its HAProxy still ran)
            if p.info["name"] == "haproxy" and p.pid not in haproxies:
                p.kill()
