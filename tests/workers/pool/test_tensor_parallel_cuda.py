"""A tensor-parallel worker on two GPUs (NCCL between its ranks): the same numbers as the model on one GPU, and a
streamed update (from host tensors, gloo) reaching both ranks. Needs two GPUs; skipped otherwise."""

import numpy as np
import pytest
import ray
import torch

from ppo_logprobs.workers import LogProbWorker, WorkerPool

from ...helpers import perturbed, random_sequences

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between the ranks)")]


def assert_close(results, expected):
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        error = np.abs(got.log_probs - want.log_probs)  # bf16: the two layouts round differently
        assert error.max() < 5e-2 and error.mean() < 5e-3, (i, error.max(), error.mean())


def test_a_worker_of_two_gpus_scores_as_one_gpu_and_takes_a_stream():
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = WorkerPool.create("tiny", 1, num_gpus_per_worker=2, dtype=torch.bfloat16)
        one = LogProbWorker("tiny", device="cuda", dtype=torch.bfloat16)
        seqs = random_sequences(40, seed=1, hi=400)
        assert [h["ranks"] for h in pool.health()] == [2] and len(ray.get(pool.owner.devices.remote())) == 2
        assert_close(pool.compute_log_probs(seqs), one.score(seqs))
        source = perturbed(3)
        version = pool.update_weights({n: p.detach() for n, p in source.named_parameters()})
        one.update_weights({n: p.detach().cuda() for n, p in source.named_parameters()}, version)
        results = pool.compute_log_probs(seqs)
        assert_close(results, one.score(seqs))
        assert {r.weights_version for r in results} == {version}
        pool.shutdown()
    finally:
        ray.shutdown()
