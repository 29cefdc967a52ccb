"""Pools whose workers have 2 ranks (tensor parallelism over gloo, CPU actors): the same results as the whole model,
the loss of either rank's actor survived, checkpoint and streamed updates on every rank, a restarted rank given
streamed weights back by a peer worker."""

import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from ppo_logprobs.workers import LogProbWorker, WorkerPool, load_model
from ppo_logprobs.workers.errors import IncompatibleWeights, TooLarge, WeightsUnavailable, get
from ppo_logprobs.workers.pool.pool_worker import PoolWorker, actor_class
from ppo_logprobs.workers.request import ScoreRequest
from ppo_logprobs.workers.sharding import held_shard
from ppo_logprobs.workers.weights.checkpoint import read_checkpoint
from ppo_logprobs.workers.weights.keep import PARTS_FILE, rank_copy

from ...helpers import alone, perturbed, random_sequences, save, scoring_now


@pytest.fixture(scope="module")
def cluster():
    # 6 CPU slots on this 2-core machine: the pools hold 2 + 4 rank actors, each reserving one
    ray.init(num_cpus=6, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    pool = WorkerPool.create("tiny", 1, tensor_parallel=2, max_tokens_per_batch=256, backend="torch",
                             local_copy=True)  # (a test restores streamed weights from the ranks' copies)
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
@pytest.mark.parametrize("during", [False, True])
def test_the_loss_of_a_rank_is_survived(pool, which, during):
    """Killed between calls, or during one (its forwards under way in both ranks): Ray restarts it, it reads its
    part again, the group is formed anew and the call completes with every sequence's right numbers."""
    seqs = random_sequences(600 if during else 12, seed=2, hi=150 if during else 80)  # (about 3 s of work)
    follower = ray.get(pool.workers[0].followers_of.remote())[0]
    victim = pool.workers[0] if which == "leader" else ray.get_actor(follower, namespace="ppo_logprobs")
    pid = ray.get(victim.info.remote())["pid"]
    call = pool.compute_log_probs_async(seqs) if during else None
    if during:
        scoring_now(victim)  # its forwards under way
    ray.kill(victim, no_restart=False)
    results = ray.get(call) if during else pool.compute_log_probs(seqs)
    assert_matches(results, seqs, load_model("tiny", backend="torch"))
    assert ray.get(victim.info.remote())["pid"] != pid


def test_checkpoint_and_streamed_updates_reach_every_rank(pool, tmp_path):
    source = perturbed(7)
    version = pool.update_weights(save(source, tmp_path / "ckpt"))
    seqs = random_sequences(10, seed=3, hi=90)
    assert_matches(pool.compute_log_probs(seqs), seqs, source, version=version)

    streamed = perturbed(8)
    with pool.weight_sender() as sender:  # whole tensors to both ranks (gloo); each keeps its parts
        version = sender.send(streamed.named_parameters())
        assert_matches(pool.compute_log_probs(seqs), seqs, streamed, version=version)
        head = {"lm_head.weight": source.lm_head.weight}  # a partial update: the vocabulary rows of both ranks
        version = sender.send(head)
    streamed.lm_head.weight.data.copy_(source.lm_head.weight)
    assert_matches(pool.compute_log_probs(seqs), seqs, streamed, version=version)
    with pytest.raises(IncompatibleWeights, match=r"mlp.up_proj.weight has shape \[64, 64\], not 128 entries"):
        pool.update_weights({"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 64)})  # a part, not the whole
    assert pool.weights_version == version  # nothing changed
    assert_matches(pool.compute_log_probs(seqs), seqs, streamed, version=version)


@pytest.mark.parametrize("which", ["follower", "leader"])
def test_a_lone_worker_gets_streamed_weights_back_from_its_ranks_local_copies(pool, which):
    """A pool of one tensor-parallel worker has no peer: each rank keeps a local copy of its parts of streamed
    weights (its own folder, marked as parts), and a restarted rank reads its own back."""
    source = perturbed(12)
    version = pool.update_weights(dict(source.named_parameters()))
    for _ in range(600):  # the copies are written in the background; the owner hears of rank 0's
        keep = ray.get(pool.owner.state.remote())["source"].get("keep", "")
        if keep.endswith(f"/rank0/v{version}") and os.path.isdir(rank_copy(keep, 1)):
            break
        time.sleep(0.1)
    assert json.loads((Path(rank_copy(keep, 1)) / PARTS_FILE).read_text()) == dict(rank=1, size=2)
    follower = ray.get_actor(ray.get(pool.workers[0].followers_of.remote())[0], namespace="ppo_logprobs")
    victim = pool.workers[0] if which == "leader" else follower
    ray.kill(victim, no_restart=False)
    seqs = random_sequences(10, seed=6, hi=90)
    assert_matches(pool.compute_log_probs(seqs), seqs, source, version=version)
    with pytest.raises(IncompatibleWeights, match=r"holds the parts of tensor-parallel rank 1 of 2; this model is a w"):
        read_checkpoint(load_model("tiny", backend="torch"), rank_copy(keep, 1))
    ray.get(pool.workers[0].stage_checkpoint.remote(keep, version + 1))  # (the owner's fallback): each its own copy
    ray.get(pool.workers[0].abort.remote(version + 1))


def test_a_restarted_rank_gets_streamed_weights_from_a_peer_worker(cluster):
    """Streamed weights exist on no disk: a restarted rank has none, so its worker reports none and the pool's
    owner streams every rank its part from the other worker (rank r to rank r), then the call completes."""
    pool = WorkerPool.create("tiny", 2, tensor_parallel=2, max_tokens_per_batch=256, backend="torch")
    placements = pool._placements  # each worker's ranks on one node: a placement group of its own
    assert [(placement_group_table(p)["strategy"], len(p.bundle_specs)) for p in placements] == [("STRICT_PACK", 2)] * 2
    try:
        source = perturbed(9)
        version = pool.update_weights(dict(source.named_parameters()))
        follower = ray.get_actor(ray.get(pool.workers[0].followers_of.remote())[0], namespace="ppo_logprobs")
        ray.kill(follower, no_restart=False)
        head = {"lm_head.weight": perturbed(10).lm_head.weight}
        with pytest.raises(WeightsUnavailable, match="restarted and has no weights, so a partial update cannot"):
            pool.update_weights(head)  # the restarted rank holds initial values: a head alone would not do
        seqs = random_sequences(16, seed=4, hi=70)
        assert_matches(pool.compute_log_probs(seqs), seqs, source, version=version)
        version = pool.update_weights(head)  # restored first by the call above: now it lands
        source.lm_head.weight.data.copy_(head["lm_head.weight"])
        assert_matches(pool.compute_log_probs(seqs), seqs, source, version=version)
        assert [h["weights_version"] for h in pool.health()] == [version, version]
        assert ray.get(follower.info.remote())["weights_version"] == version
    finally:
        pool.shutdown()
    assert all(placement_group_table(p)["state"] == "REMOVED" for p in placements)


def test_a_size_the_model_cannot_take_is_refused_before_any_actor_starts(cluster):
    with pytest.raises(ValueError, match="num_attention_heads = 4 does not divide among 3 ranks"):
        WorkerPool.create("tiny", 1, tensor_parallel=3, backend="torch")


class OutOfMemoryAbove(LogProbWorker):
    """A rank whose device runs out of memory in forwards over 40 tokens (CUDA's error, raised on the CPU). Only
    rank 1's does, so rank 0 is left waiting in the forward's collectives."""

    def _forward(self, **inputs):
        if held_shard(self.model).rank == 1 and inputs["input_ids"].numel() > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (test device)")
        return super()._forward(**inputs)


class OutOfMemoryActor(PoolWorker):
    scorer = OutOfMemoryAbove


def test_a_forward_one_rank_cannot_fit_is_split_by_every_rank(cluster):
    """Rank 1 runs out of memory inside a forward: the group is formed again (after its 5 s timeout here), and
    from then on every rank splits forwards of that size up front, in step; a sequence that fits nowhere is
    TooLarge on every rank."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (the test's actor class travels by value)
    options = dict(max_tokens_per_batch=160, size=2, backend="torch", group_timeout_s=5.0)
    name = f"oom-{uuid.uuid4().hex[:8]}:rank:1"
    actor = actor_class(OutOfMemoryActor)
    follower = actor.options(num_cpus=1, name=name, namespace="ppo_logprobs").remote("tiny", rank=1, **options)
    leader = actor.options(num_cpus=1).remote("tiny", rank=0, followers=[name], **options)
    try:
        seqs = random_sequences(12, seed=1, hi=30)
        request = ScoreRequest.build(seqs, 1, 1.0, True, vocab_size=503, max_length=160)
        results = get(leader.score_request.remote(request)).sequences()
        assert_matches(results, seqs, load_model("tiny", backend="torch"))
        for rank in (leader, follower):
            info = ray.get(rank.info.remote())
            assert info["oom_splits"] > 0 and info["max_row_tokens"] <= 40
        long = ScoreRequest.build([list(range(41))], 1, 1.0, True, vocab_size=503, max_length=160)
        with pytest.raises(TooLarge, match="a sequence of 41 tokens does not fit in a worker's memory"):
            get(leader.score_request.remote(long))
        results = get(leader.score_request.remote(request)).sequences()  # the group still works
        assert_matches(results, seqs, load_model("tiny", backend="torch"))
    finally:
        for rank in (leader, follower):
            ray.kill(rank, no_restart=True)
