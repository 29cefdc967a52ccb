"""WorkerPool on a local Ray cluster (2 CPUs, loopback): results, order, budget, faults, weights, attach."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import torch

from ppo_logprobs.workers import WorkerPool, load_model
from ppo_logprobs.workers.errors import CheckpointNotFound
from ppo_logprobs.workers.pool import worker_pool

from ...helpers import alone, perturbed, random_sequences, scoring_now


@pytest.fixture(scope="module")
def cluster():
    # 3 logical CPUs on the 2 cores: the module's pool (2 workers) and a named pool of 1 live side by side
    ray.init(num_cpus=3, num_gpus=0, include_dashboard=False, log_to_driver=False)  # placed by CPU on any host
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    pool = WorkerPool.create("tiny", 2, name="module-pool", max_tokens_per_batch=256, backend="torch")
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", backend="torch")




def assert_matches(results, seqs, model, starts=None, temps=None, version=None):
    assert len(results) == len(seqs)
    for i, (seq, r) in enumerate(zip(seqs, results, strict=True)):
        s = starts[i] if starts else 1
        lp, ent = alone(model, seq, s, temps[i] if temps else 1.0)
        np.testing.assert_allclose(r.log_probs, lp, rtol=0, atol=1e-5, err_msg=f"sequence {i}")
        np.testing.assert_allclose(r.entropy, ent, rtol=0, atol=1e-5, err_msg=f"sequence {i}")
        if version is not None:
            assert r.weights_version == version


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_workers_placed_without_a_gpu_compute_on_the_cpu_of_a_gpu_host(pool):
    """Ray hides no GPU from an actor that asks for none, so an actor given none computes on the CPU (before: both
    took the GPU unasked; two ranks of a tensor-parallel worker there failed in NCCL, "Duplicate GPU"; ranks made as
    actors directly took it too, and test_tensor_parallel_pool's out-of-memory case ran there past 5 minutes)."""
    assert ray.get(pool.owner.devices.remote()) == ["cpu", "cpu"]


def test_pool_matches_the_model_in_order_within_budget(pool, model):
    seqs = random_sequences(40, seed=10, hi=120)
    starts = [1 + (i * 7) % len(s) for i, s in enumerate(seqs)]
    temps = [0.6 + 0.05 * i for i in range(40)]
    assert_matches(pool.compute_log_probs(seqs, starts, temperature=temps), seqs, model, starts, temps)
    health = pool.health()
    assert all(h["alive"] and h["rows"] > 0 for h in health)  # both actors got work
    assert all(h["max_row_tokens"] <= 256 for h in health)


def test_top_k_and_candidates_through_the_pool_equal_one_worker(pool, model):
    """Shares on two actors, merged: each sequence's top-k, tail and candidates (cut to its own list) as a
    LogProbWorker gives them; the async path too."""
    from ppo_logprobs.workers import LogProbWorker

    seqs = random_sequences(12, seed=13, lo=5, hi=90)
    ids = [[3, 4], [5], *[[7, 8, 9]] * 10]
    got = pool.compute_log_probs(seqs, 2, top_k=4, token_ids=ids)
    want = LogProbWorker(model, max_tokens_per_batch=256).score(seqs, 2, top_k=4, token_ids=ids)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g.top_ids, w.top_ids), i
        assert g.candidate_log_probs.shape == (len(seqs[i]) - 2, len(ids[i]))
        for name in ("top_log_probs", "tail_log_prob", "candidate_log_probs"):
            np.testing.assert_allclose(getattr(g, name), getattr(w, name), rtol=0, atol=1e-5, err_msg=f"{name} {i}")
    later = ray.get(pool.compute_log_probs_async(seqs[:2], 2, top_k=4, token_ids=ids[:2]))
    assert [r.candidate_log_probs.shape[1] for r in later] == [2, 1] and later[0].top_ids.shape[1] == 4
    rollout = [(r.log_probs - 0.5 * (i % 2)).tolist() for i, r in enumerate(got)]  # every other one off by 0.5
    checked = pool.compute_log_probs(seqs, 2, rollout_log_probs=rollout, ratio_bounds=(0.9, 1.1))
    for i, r in enumerate(checked):
        assert r.mismatch["max_abs"] == pytest.approx(0.5 * (i % 2), abs=1e-6)
        assert r.mismatch["outside"] == (1.0 if i % 2 else 0.0)  # exp(0.5) > 1.1
        assert r.mismatch["kl_k3"] == pytest.approx(np.expm1(0.5) - 0.5 if i % 2 else 0.0, abs=1e-5)
    assert got[0].mismatch is None


def test_async_returns_an_object_ref(pool, model):
    seqs = random_sequences(6, seed=11)
    ref = pool.compute_log_probs_async(seqs, return_entropy=False)
    assert isinstance(ref, ray.ObjectRef)
    results = ray.get(ref)
    assert all(r.entropy is None for r in results)
    for seq, r in zip(seqs, results, strict=True):
        np.testing.assert_allclose(r.log_probs, alone(model, seq)[0], rtol=0, atol=1e-5)


def test_small_callers_beside_a_huge_call_ride_in_its_steps_and_are_answered_first(pool, model):
    """Twelve callers on threads of their own send small requests while a call of ~100k tokens is being scored:
    each gets its own answers, all of them before the huge call ends (a request waits in a worker's line for about
    one step, not for the calls ahead of it), and the workers merge them into the steps they run anyway."""
    huge = random_sequences(600, seed=20, lo=100, hi=250)
    small = [random_sequences(2, seed=30 + i, hi=40) for i in range(12)]

    def steps_and_requests():
        health = pool.health()
        return sum(h["steps"] for h in health), sum(h["requests"] for h in health)

    steps, requests = steps_and_requests()
    alone_results = pool.compute_log_probs(huge)
    alone_steps = steps_and_requests()[0] - steps
    steps, requests = steps_and_requests()
    big = pool.compute_log_probs_async(huge)
    for worker in pool.workers:
        scoring_now(worker)
    with ThreadPoolExecutor(len(small)) as callers:
        answers = list(callers.map(pool.compute_log_probs, small))
    assert not ray.wait([big], timeout=0)[0]  # every small answer came while the huge call was under way
    for seqs, results in zip(small, answers, strict=True):
        assert_matches(results, seqs, model)
    for got, want in zip(ray.get(big, timeout=300), alone_results, strict=True):  # (CPU: within rounding)
        np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(got.entropy, want.entropy, rtol=0, atol=1e-5)
    now_steps, now_requests = steps_and_requests()
    small_requests = now_requests - requests - len(pool.workers)  # (the huge call's share at each worker)
    assert small_requests >= len(small)
    assert now_steps - steps - alone_steps <= small_requests // 3  # not a step of their own each


def test_update_weights_then_an_actor_killed_mid_call(pool):
    new = perturbed(seed=1)
    version = pool.update_weights(new.state_dict())
    assert version == pool.weights_version >= 1
    seqs = random_sequences(400, seed=12, lo=100, hi=250)
    pid = pool.health()[0]["pid"]
    ref = pool.compute_log_probs_async(seqs)
    scoring_now(pool.workers[0])
    ray.kill(pool.workers[0], no_restart=False)  # mid-call; Ray restarts it with its initial weights
    results = ray.get(ref, timeout=300)
    assert_matches(results, seqs, new, version=version)  # complete, in order, with the current weights
    after = pool.health()
    assert after[0]["pid"] != pid and after[0]["weights_version"] == version


_SECOND_DRIVER = """
import json, sys, ray
from concurrent.futures import ThreadPoolExecutor
from ppo_logprobs.workers import WorkerPool
ray.init(address=sys.argv[1], log_to_driver=False)
pool = WorkerPool.connect(sys.argv[2])
requests = json.loads(sys.stdin.readline())
print("connected", flush=True)
with ThreadPoolExecutor(4) as callers:
    answers = list(callers.map(pool.compute_log_probs, requests))
print(json.dumps([[[r.weights_version, r.log_probs.tolist()] for r in a] for a in answers]), flush=True)
"""


def test_two_drivers_and_many_callers_share_the_workers_through_an_update_and_a_kill(cluster, pool):
    """A second driver process (4 callers) and 8 callers here score small requests through the same workers while
    the weights change and a worker is killed mid-call (of a larger request): every request is answered, in order,
    each with one version, and each sequence's answer is that version's model on the sequence alone."""
    models = {pool.update_weights(perturbed(seed=40).state_dict()): perturbed(seed=40)}
    theirs = [random_sequences(3, seed=500 + i, hi=30) for i in range(24)]
    ours = [random_sequences(3, seed=600 + i, hi=30) for i in range(24)]
    second = subprocess.Popen([sys.executable, "-c", _SECOND_DRIVER, cluster, "module-pool"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second.stdin.write(json.dumps(theirs) + "\n")
    second.stdin.flush()
    assert second.stdout.readline().strip() == "connected", second.stderr.read()[-2000:]
    big = random_sequences(120, seed=700, lo=100, hi=200)
    with ThreadPoolExecutor(8) as callers:
        answers = [callers.submit(pool.compute_log_probs, seqs) for seqs in ours]
        new = perturbed(seed=41)
        models[pool.update_weights(new.state_dict())] = new
        ours.append(big)
        answers.append(callers.submit(pool.compute_log_probs, big))
        scoring_now(pool.workers[1])
        ray.kill(pool.workers[1], no_restart=False)  # restarted with its initial weights, then restored
        answers = [a.result(timeout=300) for a in answers]
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-2000:]
    remote = [[(v, np.array(lp, np.float32)) for v, lp in a] for a in json.loads(out.strip().splitlines()[-1])]
    answers = [[(r.weights_version, r.log_probs) for r in a] for a in answers] + remote
    for seqs, answer in zip(ours + theirs, answers, strict=True):
        assert len(answer) == len(seqs) and len({v for v, _ in answer}) == 1  # all of it, of one version
        for seq, (version, lp) in zip(seqs, answer, strict=True):
            np.testing.assert_allclose(lp, alone(models[version], seq)[0], rtol=0, atol=1e-5)


_UNNAMED = """
import sys, ray
from ppo_logprobs.workers import WorkerPool
ray.init(address=sys.argv[1])
pool = WorkerPool.create("tiny", 1, max_tokens_per_batch=256, backend="torch")
print(pool.compute_log_probs([[1, 2, 3]])[0].log_probs.shape, flush=True)
"""


def test_an_unnamed_pool_starts_without_an_error_line_from_ray(cluster, pool):
    """The pool as a trainer makes it (no name), in a driver of its own: its workers find their owner by name. With
    the owner's handle among their arguments, Ray logged an error for each ("constructor arguments in the object
    store and max_restarts > 0 ... the actor restart will fail"; ray#53727)."""
    done = subprocess.run([sys.executable, "-c", _UNNAMED, cluster], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "(2,)", done.stderr[-2000:]
    assert "object store" not in done.stderr and "core_worker.cc" not in done.stderr, done.stderr[-2000:]


def test_attach_by_name_from_a_second_driver(cluster, model):
    named = WorkerPool.create("tiny", 1, name="attach-test", max_tokens_per_batch=256, backend="torch")
    try:
        seqs = random_sequences(5, seed=13)
        script = (
            "import json, sys, ray\n"
            "from ppo_logprobs.workers import WorkerPool\n"
            f"ray.init(address={cluster!r}, log_to_driver=False)\n"
            "pool = WorkerPool.connect('attach-test')\n"
            "seqs = json.loads(sys.stdin.read())\n"
            "print(json.dumps([r.log_probs.tolist() for r in pool.compute_log_probs(seqs)]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], input=json.dumps(seqs), capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr[-2000:]
        remote = json.loads(done.stdout.strip().splitlines()[-1])
        for seq, lp in zip(seqs, remote, strict=True):
            np.testing.assert_allclose(np.array(lp, dtype=np.float32), alone(model, seq)[0], rtol=0, atol=1e-5)
    finally:
        named.shutdown()
    with pytest.raises(ValueError, match="no worker pool named 'attach-test'"):
        WorkerPool.connect("attach-test")


def test_a_pool_that_cannot_be_placed_says_so(pool, caplog, monkeypatch):
    """At once in the log (a trainer waited in silence until ready_timeout_s), then as the error."""
    monkeypatch.setattr(worker_pool, "PLACEMENT_SAID_S", 1.0)
    with caplog.at_level("WARNING", logger=worker_pool.__name__):
        with pytest.raises(RuntimeError, match="could not place 5 workers"):
            WorkerPool.create("tiny", 5, ready_timeout_s=3, backend="torch")
    said = [r.getMessage() for r in caplog.records if r.name == worker_pool.__name__]
    assert len(said) == 1 and said[0].startswith("waiting for room for 5 workers of 1 x {'CPU': 1}"), said
    assert "giving up after ready_timeout_s=3 s" in said[0], said


def test_a_path_with_no_checkpoint_raises_that_and_leaves_no_part_of_the_pool(pool):
    """The workers' own error, raised by create (before: Ray's ActorDiedError, the worker's traceback its message),
    and nothing of a named pool left behind: its owner and placement group are detached."""
    def live_groups():
        return sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())

    groups = live_groups()
    with pytest.raises(CheckpointNotFound, match="^no checkpoint directory at '/no/such/model'$"):
        WorkerPool.create("/no/such/model", 1, name="no-model", backend="torch")
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("no-model")]
    assert live_groups() == groups


def test_bad_requests_fail_before_dispatch(pool):
    rows_before = sum(h["rows"] for h in pool.health())
    with pytest.raises(ValueError, match=r"input_ids\[2\]\[0\] = 99999 is outside the vocabulary"):
        pool.compute_log_probs([[1, 2], [3, 4], [99999, 1]])
    with pytest.raises(ValueError, match=r"score_from\[0\] = 5"):
        pool.compute_log_probs_async([[1, 2]], score_from=5)
    assert sum(h["rows"] for h in pool.health()) == rows_before


def test_a_pool_computes_a_shared_prompt_once_and_says_so(cluster, model):
    import asyncio

    from ..pool.test_shared_prefixes import grpo_batch

    pool = WorkerPool.create("tiny", 1, backend="torch", layout="packed", min_shared_prefix=4)
    try:
        seqs, starts, temps = grpo_batch(9)
        assert pool.min_shared_prefix == 4
        assert_matches(pool.compute_log_probs(seqs, starts, temperature=temps), seqs, model, starts, temps)
        request = pool.request(seqs, starts, temperature=temps)
        result = asyncio.run(pool.score(request))
        assert result.computed_tokens(request.lengths) < int(request.lengths.sum())
    finally:
        pool.shutdown()
