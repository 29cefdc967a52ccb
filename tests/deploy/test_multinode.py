"""Two Ray nodes on this machine (Ray's own multi-node test harness: one raylet process per node): the workers
go to the node that has the worker resource, the PoolKeeper stays on the head, the two ingress replicas spread over
both nodes and a Serve proxy on each node answers HTTP (the worker node's on a port of its own, as two nodes on one
machine need); losing the worker node is reported and service resumes when a worker node is back."""

import time

import httpx
import numpy as np
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from ppo_logprobs.service import Settings, build_app
from ppo_logprobs.workers import load_model

from ..helpers import alone, free_port, random_sequences


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    serve.shutdown()
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


def test_workers_on_the_gpu_node_gateway_on_the_head(cluster):
    port, node_port = free_port(), free_port()
    gpu_node = dict(num_cpus=2, resources={"logprob_gpu": 2},
                    env_vars={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(node_port)})
    worker_node = cluster.add_node(**gpu_node)
    serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": port})
    settings = Settings(models={"policy": "tiny"}, backend="torch", worker_resources={"logprob_gpu": 1},
                        gateway_resources={"head": 0.01}, request_timeout_s=10, ingress_replicas=2)
    serve.run(build_app(settings), name="multinode", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
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
