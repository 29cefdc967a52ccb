"""Several ingress replicas in front of pools that the PoolKeeper owns, under Ray Serve, over real HTTP on loopback:
both replicas answer, a reload through one is seen through the other, concurrent reloads get distinct versions,
losing a replica loses no answer and touches no worker, scaling touches no worker, deleting the application shuts
its pools down."""

import asyncio
import os
import signal
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
import ray
from ray import serve

from ppo_logprobs.client import LogProbClient
from ppo_logprobs.service import Settings, build_app
from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.pool.owner import NAMESPACE

from ..helpers import alone, perturbed, random_sequences, save, serving

APP = "two"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = [save(perturbed(seed), tmp_path_factory.mktemp(f"ckpt{seed}")) for seed in (9, 11)]
    return {path: load_model(path, backend="torch") for path in paths}


@pytest.fixture(scope="module")
def settings():
    return Settings(models={"policy": "tiny"}, backend="torch", ingress_replicas=2, pool_name="gw-two")


@pytest.fixture(scope="module")
def server(settings):
    with serving(4, {APP: settings}) as url:
        yield url


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="torch")


def right(model, body: dict, seqs) -> None:
    for res, seq in zip(body["results"], seqs, strict=True):
        np.testing.assert_allclose(np.array(res["log_probs"], dtype=np.float32), alone(model, seq)[0], rtol=0,
                                   atol=1e-5)


def worker_pids(url: str) -> list[int]:
    return [w["pid"] for w in httpx.get(url + "/v1/health", timeout=60).json()["models"]["policy"]]


def ingress_processes(app: str = APP, deployment: str = "LogProbsIngress") -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(f"ServeReplica:{app}:{deployment}" in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def running_replicas(app: str = APP, deployment: str = "LogProbsIngress") -> int:
    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=16)) as client:
        return await asyncio.gather(*(client.post("/logprobs", json=b) for b in bodies))


def test_both_replicas_answer_and_every_answer_is_right(server, tiny):
    requests = [random_sequences(1 + i % 3, seed=600 + i) for i in range(48)]
    responses = asyncio.run(post_all(server, [{"input_ids": r} for r in requests]))
    assert {r.status_code for r in responses} == {200}
    assert len({r.headers["X-Replica"] for r in responses}) == 2
    for seqs, r in zip(requests, responses, strict=True):
        right(tiny, r.json(), seqs)


def test_reloads_through_either_replica(server, tiny, checkpoints):
    """A reload is seen by every later request through either replica; reloads sent at once (six at a time,
    beside 24 requests, until both replicas have taken some) get distinct versions, and each answer sent beside
    them has the results of the version it names."""
    paths = list(checkpoints)
    models = {}
    r = httpx.post(server + "/v1/models/policy/reload", json={"path": paths[0]}, timeout=120)
    assert r.status_code == 200, r.text
    models[r.json()["weights_version"]] = checkpoints[paths[0]]
    seqs = random_sequences(2, seed=610)
    seen = set()
    # (at once, so that both replicas answer: one after another, Serve's router may keep to one on a busy machine)
    for answer in asyncio.run(post_all(server, [{"input_ids": seqs}] * 32)):
        assert answer.json()["weights_version"] == r.json()["weights_version"]
        right(checkpoints[paths[0]], answer.json(), seqs)
        seen.add(answer.headers["X-Replica"])
    assert len(seen) == 2 and r.headers["X-Replica"] in seen

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            reloads = [client.post("/v1/models/policy/reload", json={"path": paths[i % 2]}) for i in range(6)]
            scoring = [client.post("/logprobs", json={"input_ids": seqs}) for _ in range(24)]
            return await asyncio.gather(*reloads), await asyncio.gather(*scoring)

    models[0] = tiny
    reloaded_by = set()
    for _ in range(4):  # (which replica takes a request is Serve's router's choice: on a busy machine it may keep
        # to one for a while)
        reloads, scoring = asyncio.run(run())
        assert {r.status_code for r in reloads} == {200}
        versions = [r.json()["weights_version"] for r in reloads]
        assert len(set(versions)) == 6 and min(versions) > max(models)
        models.update({v: checkpoints[paths[i % 2]] for i, v in enumerate(versions)})
        for answer in scoring:
            assert answer.status_code == 200, answer.text
            right(models[answer.json()["weights_version"]], answer.json(), seqs)
        reloaded_by |= {r.headers["X-Replica"] for r in reloads}
        if len(reloaded_by) == 2:
            break
    assert len(reloaded_by) == 2


def test_losing_an_ingress_replica_loses_no_answer_and_touches_no_worker(server, checkpoints):
    """SIGKILL one ingress replica's process while eight clients (ours, which retry what was lost in transit) keep
    scoring (so that requests are out from the dead replica when it dies, waiting for the workers): every request
    is answered, rightly, the workers keep their processes and weights, and Serve starts a new replica."""
    path = next(iter(checkpoints))
    reload = httpx.post(server + "/v1/models/policy/reload", json={"path": path}, timeout=120)
    version, model, pids = reload.json()["weights_version"], checkpoints[path], worker_pids(server)
    answered, errors = [], []
    requests = [random_sequences(3, seed=700 + i) for i in range(96)]

    def client_loop(part: list) -> None:
        client = LogProbClient(server, binary=False)
        for seqs in part:
            try:
                answered.append((seqs, client.score(seqs)))
            except Exception as e:  # recorded: the test fails on any
                errors.append(e)

    threads = [threading.Thread(target=client_loop, args=(requests[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    while len(answered) < 16 and not errors:
        time.sleep(0.01)
    victim = ingress_processes()[0]
    os.kill(victim.pid, signal.SIGKILL)
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(answered) == len(requests)  # (lost in transit: retried by our client, or by Serve's proxy)
    for seqs, results in answered:
        assert {r.weights_version for r in results} == {version}
        for r, seq in zip(results, seqs, strict=True):
            np.testing.assert_allclose(r.log_probs, alone(model, seq)[0], rtol=0, atol=1e-5)
    assert worker_pids(server) == pids
    assert httpx.get(server + "/v1/models").json()["data"][0]["weights_version"] == version
    deadline = time.monotonic() + 120
    while running_replicas() < 2 or victim.pid in [p.pid for p in ingress_processes()]:
        assert time.monotonic() < deadline, "Serve did not bring the replica back"
        time.sleep(0.5)


def test_scaling_the_ingress_touches_no_worker(server, settings, tiny):
    """1 -> 3 -> 1 ingress replicas, each a new deployment of the application with another setting: the keeper
    attaches to the running pools, so workers keep their processes and weights version."""
    pids = worker_pids(server)
    version = httpx.get(server + "/v1/models").json()["data"][0]["weights_version"]
    seqs = random_sequences(2, seed=800)
    for replicas in (1, 3, 1):
        serve.run(build_app(settings.model_copy(update={"ingress_replicas": replicas})), name=APP, route_prefix="/")
        assert running_replicas() == replicas
        answer = httpx.post(server + "/logprobs", json={"input_ids": seqs}, timeout=60)
        assert answer.status_code == 200 and answer.json()["weights_version"] == version
        assert worker_pids(server) == pids


def test_losing_the_keeper_touches_no_worker(server):
    """SIGKILL the PoolKeeper's process: the ingress replicas keep scoring through the pool, and the keeper that
    Serve starts attaches to the running pool instead of making another (which failed before: the name was
    taken, and the old placement groups held the CPUs)."""
    pids = worker_pids(server)
    (keeper,) = ingress_processes(deployment="PoolKeeper")
    os.kill(keeper.pid, signal.SIGKILL)
    seqs = random_sequences(2, seed=900)
    answer = httpx.post(server + "/logprobs", json={"input_ids": seqs}, timeout=60)
    assert answer.status_code == 200
    keeper_handle = serve.get_deployment_handle("PoolKeeper", APP)
    deadline = time.monotonic() + 120
    while True:  # until a new keeper process has attached and answers
        assert time.monotonic() < deadline, "Serve did not bring the keeper back"
        if [p for p in ingress_processes(deployment="PoolKeeper") if p.pid != keeper.pid]:
            try:
                if keeper_handle.pools.remote().result(timeout_s=10):
                    break
            except Exception:  # the router may still send to the replica that died
                pass
        time.sleep(0.5)
    assert worker_pids(server) == pids
    assert httpx.post(server + "/logprobs", json={"input_ids": seqs}, timeout=60).json() == answer.json()


def test_deleting_the_application_shuts_its_pools_down(server):
    """(After the test above: the keeper that Serve started in place of the one killed, which attached to the
    pool, is the one that shuts it down.)"""
    owner = ray.get_actor("gw-two:policy:owner", namespace=NAMESPACE)
    pids = worker_pids(server)
    serve.delete(APP)

    def gone(name: str) -> bool:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    deadline = time.monotonic() + 60  # (the keeper's replica may finish stopping after delete returns)
    while not (gone("gw-two:policy:owner") and gone("gw-two:policy:worker:0")):
        assert time.monotonic() < deadline, "the application's pool outlived it"
        time.sleep(0.5)
    del owner
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "the workers' processes outlived their application"
        time.sleep(0.2)


def test_each_replica_takes_an_equal_share_of_the_per_model_limits():
    from ppo_logprobs.service.app import share

    assert [share(256, n) for n in (1, 2, 3, 8, 300)] == [256, 128, 86, 32, 1]
    assert [share(2, n) for n in (1, 2, 4)] == [2, 1, 1]  # at least one request out each
