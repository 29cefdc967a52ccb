"""A pool whose worker has 2 ranks (tensor parallelism over gloo, CPU actors): the same results as the whole model,
the loss of either rank's actor survived, checkpoint updates on every rank, streams refused."""

import numpy as np
import pytest
import ray
import torch

from ppo_logprobs.workers import WorkerPool, load_model
from ppo_logprobs.workers.errors import UpdateFailed

from ...helpers import alone, perturbed, random_sequences, save


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    pool = WorkerPool.create("tiny", 1, tensor_parallel=2, max_tokens_per_batch=256, backend="torch")
    yield pool
    pool.shutdown()


def assert_matches(results, seqs, model, version=None):
    for i, (seq, r) in enumerate(zip(seqs, results, strict=True)):
        lp, ent = alone(model, seq)
        np.testing.assert_allclose(r.log_probs, lp, rtol=0, atol=1e-5, err_msg=f"sequence {i}")
        np.testing.assert_allclose(r.entropy, ent, rtol=0, atol=1e-5, err_msg=f"sequence {i}")
        if version is not None:
            assert r.weights_version == version


def test_two_ranks_score_as_the_whole_model(pool):
    seqs = random_sequences(30, seed=1, hi=100)
    assert_matches(pool.compute_log_probs(seqs), seqs, load_model("tiny", backend="torch"))
    ranks = ray.get(pool.workers[0].followers_of.remote())
    assert len(ranks) == 1 and ranks[0].endswith(":worker:0:rank:1") and len(pool.workers) == 1


@pytest.mark.parametrize("which", ["follower", "leader"])
def test_the_loss_of_a_rank_is_survived(pool, which):
    seqs = random_sequences(12, seed=2, hi=80)
    follower = ray.get(pool.workers[0].followers_of.remote())[0]
    victim = pool.workers[0] if which == "leader" else ray.get_actor(follower, namespace="ppo_logprobs")
    pid = ray.get(victim.info.remote())["pid"]
    ray.kill(victim, no_restart=False)  # Ray restarts it; it reads its part again and the group is formed anew
    results = pool.compute_log_probs(seqs)
    assert_matches(results, seqs, load_model("tiny", backend="torch"))
    assert ray.get(victim.info.remote())["pid"] != pid


def test_a_checkpoint_update_reaches_every_rank_and_streams_are_refused(pool, tmp_path):
    source = perturbed(7)
    version = pool.update_weights(save(source, tmp_path / "ckpt"))
    seqs = random_sequences(10, seed=3, hi=90)
    assert_matches(pool.compute_log_probs(seqs), seqs, source, version=version)
    with pytest.raises(UpdateFailed, match="tensor-parallel workers take weight updates from checkpoints only"):
        pool.update_weights({"lm_head.weight": torch.zeros(503, 64)})
    assert pool.weights_version == version  # nothing changed
    assert_matches(pool.compute_log_probs(seqs), seqs, source, version=version)


def test_a_size_the_model_cannot_take_is_refused_before_any_actor_starts(cluster):
    with pytest.raises(ValueError, match="num_attention_heads = 4 does not divide among 3 ranks"):
        WorkerPool.create("tiny", 1, tensor_parallel=3, backend="torch")
