"""Two Ray nodes on this machine (Ray's own multi-node test harness: one raylet process per node): the workers
go to the node that has the worker resource, the PoolKeeper stays on the head, the two ingress replicas spread over
both nodes and a Serve proxy on each node answers HTTP (the worker node's on a port of its own, as two nodes on one
machine need); a trainer's process with no Ray settings reaches the pool with connect_pool and the cluster's address;
losing the worker node is reported and service resumes when a worker node is back."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from ppo_logprobs.service import Settings, build_app
from ppo_logprobs.service.app import shut_down_serve
from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.wire import BINARY, decode_binary

from ..helpers import alone, free_port, random_sequences


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    shut_down_serve()
    ray.shutdown()
    cluster.shutdown()


def wait_until(check, seconds=180, what="condition"):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def service(cluster):
    """The gateway under Serve on the cluster, its pools named "multinode:<model>", workers on a second node."""
    port, node_port = free_port(), free_port()
    gpu_node = dict(num_cpus=2, resources={"logprob_gpu": 2},
                    env_vars={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(node_port)})
    worker_node = cluster.add_node(**gpu_node)
    serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": port})
    settings = Settings(models={"policy": "tiny"}, backend="torch", worker_resources={"logprob_gpu": 1},
                        gateway_resources={"head": 0.01}, request_timeout_s=10, ingress_replicas=2,
                        pool_name="multinode")
    serve.run(build_app(settings), name="multinode", route_prefix="/")
    return SimpleNamespace(url=f"http://127.0.0.1:{port}", node_port=node_port, gpu_node=gpu_node,
                           worker_node=worker_node)


TRAINER = """\
import json, sys
from ray._private import services
from ppo_logprobs.client import connect_pool

def error(call):
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"

address, seqs = sys.argv[1], json.loads(sys.stdin.read())
find_node_ids, services.find_node_ids = services.find_node_ids, set  # as on a machine that has not joined
no_node = error(lambda: connect_pool("policy", service="multinode", address=address))
services.find_node_ids = find_node_ids
wrong_name = error(lambda: connect_pool("policy", service="no-such-service", address=address))
pool = connect_pool("policy", service="multinode", address=address)
results = pool.compute_log_probs(seqs)
print(json.dumps({"no_node": no_node, "wrong_name": wrong_name, "log_probs": [r.log_probs.tolist() for r in results],
                  "versions": [r.weights_version for r in results], "pool_version": pool.weights_version}))
"""


def test_a_trainer_on_another_node_connects_with_the_clusters_address(cluster, service):
    """connect_pool(address=<the GCS address>) from a plain process, none of this process's Ray settings (Ray on
    loopback) in its environment, gives what the gateway gives over HTTP, bitwise; a wrong pool name, or a machine
    without a Ray node, is an error that says what to set."""
    seqs = random_sequences(5, seed=2020)
    r = httpx.post(service.url + "/logprobs", json={"input_ids": seqs}, headers={"Accept": BINARY}, timeout=60)
    assert r.status_code == 200, r.text
    header, log_probs, _, offsets = decode_binary(r.content)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH")}  # (packages)
    done = subprocess.run([sys.executable, "-c", TRAINER, cluster.address], input=json.dumps(seqs), env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["no_node"].startswith("ConnectionError") and f"`ray start --address={cluster.address}`" in out["no_node"]
    assert out["wrong_name"].startswith("ValueError: no worker pool named 'no-such-service:policy'"), out["wrong_name"]
    assert "its pools: 'multinode:policy'" in out["wrong_name"], out["wrong_name"]
    for k, lp in enumerate(out["log_probs"]):
        assert np.array_equal(np.array(lp, dtype=np.float32), log_probs[offsets[k] : offsets[k + 1]])
    version = header["weights_version"]
    assert out["versions"] == [version] * len(seqs) and out["pool_version"] == version


def test_workers_on_the_gpu_node_gateway_on_the_head(cluster, service):
    url, node_port, gpu_node, worker_node = service.url, service.node_port, service.gpu_node, service.worker_node
    tiny = load_model("tiny", backend="torch")

    def score_ok(url=url):
        seqs = random_sequences(4, seed=int(time.monotonic()))
        r = httpx.post(url + "/logprobs", json={"input_ids": seqs}, timeout=60)
        assert r.status_code == 200, r.text
        for res, seq in zip(r.json()["results"], seqs, strict=True):
            np.testing.assert_allclose(np.array(res["log_probs"], dtype=np.float32), alone(tiny, seq)[0],
                                       rtol=0, atol=1e-5)

    score_ok()
    (worker,) = httpx.get(url + "/v1/health", timeout=60).json()["models"]["policy"]
    assert worker["node_id"] == worker_node.node_id != cluster.head_node.node_id
    wait_until(lambda: _answers(f"http://127.0.0.1:{node_port}"), what="the worker node's proxy")
    score_ok(f"http://127.0.0.1:{node_port}")  # the worker node's own proxy

    cluster.remove_node(worker_node)  # the GPU node goes away
    wait_until(lambda: httpx.get(url + "/readyz", timeout=60).status_code == 503, what="/readyz to report it")
    r = httpx.post(url + "/logprobs", json={"input_ids": [[1, 2, 3]]}, timeout=60)
    assert r.status_code == 503 and "workers" in r.json()["detail"] and r.headers["Retry-After"]

    new_node = cluster.add_node(**gpu_node)  # a GPU node comes back
    wait_until(lambda: httpx.get(url + "/readyz", timeout=60).status_code == 200, what="recovery")
    score_ok()
    (worker,) = httpx.get(url + "/v1/health", timeout=60).json()["models"]["policy"]
    assert worker["node_id"] == new_node.node_id
