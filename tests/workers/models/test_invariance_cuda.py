"""Bitwise invariance on CUDA (skipped without): a sequence's log-probs and entropies are the same bits alone, in
any packed row at any offset, in any split, and in a trainer's forward with gradients on; and the fast mode's
results stay within bf16 noise of them."""

import numpy as np
import pytest
import torch

from ppo_logprobs.workers import LogProbWorker, patch_model
from ppo_logprobs.workers.models.patch_model import allow_split_k
from tests.helpers import small_cuda_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def worker():
    yield LogProbWorker(small_cuda_model(), max_tokens_per_batch=4096)
    allow_split_k(True)  # the process-wide setting back for the tests that follow


def sequences(n=40, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(2), np.log(1500), n)).astype(int)  # as many below 128 tokens as above
    return [rng.integers(0, 4099, k).tolist() for k in lengths]


def scores(worker, seqs, order, budget):
    worker.max_tokens_per_batch = budget
    got = worker.score([seqs[i] for i in order])
    out = [None] * len(seqs)
    for i, r in zip(order, got, strict=True):
        out[i] = np.concatenate([r.log_probs, r.entropy])
    return out


def test_a_sequence_has_the_same_bits_alone_packed_anywhere_and_in_a_trainer(worker):
    seqs = sequences()
    alone = [scores(worker, [s], [0], 4096)[0] for s in seqs]
    rng = np.random.default_rng(1)
    for budget in (4096, 1500, 3000):
        got = scores(worker, seqs, rng.permutation(len(seqs)), budget)
        differ = [i for i in range(len(seqs)) if not np.array_equal(got[i], alone[i])]
        assert not differ, (budget, differ)
    model = worker.model
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        for lo in range(0, len(seqs), 5):  # right-padded micro-batches, as a trainer sends them
            group = seqs[lo : lo + 5]
            t = max(map(len, group))
            ids = torch.zeros(len(group), t, dtype=torch.long, device="cuda")
            mask = torch.zeros_like(ids)
            for b, s in enumerate(group):
                ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
            out = model(input_ids=ids, attention_mask=mask)
            assert out.log_probs.requires_grad
            for b, s in enumerate(group):
                n = len(s) - 1
                mine = torch.cat([out.log_probs[b, :n], out.entropy[b, :n]]).detach().cpu().numpy()
                assert np.array_equal(mine, alone[lo + b]), lo + b
            out.log_probs.sum().backward()  # and it trains
            assert model.lm_head.weight.grad is not None
    finally:
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None


def test_the_fast_mode_stays_within_bf16_noise(worker):
    seqs = sequences(12, seed=3)
    exact = scores(worker, seqs, range(len(seqs)), 4096)
    patch_model(worker.model, invariant=False)
    try:
        fast = scores(worker, seqs, range(len(seqs)), 4096)
    finally:
        patch_model(worker.model)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(fast, exact, strict=True))
    assert worst < 0.05
