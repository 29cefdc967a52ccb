"""Sequences of one call that share a prefix compute it once (workers/prefixes.py), and each gets what it gets
scored alone: within 1e-6 on the CPU (fp32, the reference attention), bitwise on CUDA in the invariant mode."""

import numpy as np
import pytest
import torch

from ppo_logprobs.workers import LogProbWorker, load_model

from ...helpers import TINY_VOCAB

TOLERANCE = 1e-6  # fp32 on the CPU: BLAS sums a row in another order for other row counts


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", backend="torch")


def grpo_batch(seed: int) -> tuple[list[list[int]], list[int], list[float]]:
    """Groups of responses to prompts of odd lengths, a system prompt shared by all but one group, a prompt shorter
    than the minimum, identical responses, score_from in the prompt and in the response, temperatures differing
    within a group."""
    g = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return g.integers(0, TINY_VOCAB, n).tolist()

    system, seqs, starts, temps = tokens(9), [], [], []
    groups = ((13, 4, True), (21, 3, True), (7, 3, True), (17, 2, False), (3, 2, False))
    for prompt_length, group, with_system in groups:
        prompt = (system if with_system else []) + tokens(prompt_length)
        answers = [tokens(int(k)) for k in g.integers(1, 12, group)]
        answers[-1] = answers[0] if group > 2 else answers[-1]  # identical sequences
        for k, answer in enumerate(answers):
            seqs.append(prompt + answer)
            starts.append(len(prompt) if k % 2 else int(g.integers(1, len(prompt))))  # the response, or in the prompt
            temps.append(1.0 if k < 2 else float(g.choice([0.5, 1.7])))
    return seqs, starts, temps


def each_alone(model, seqs, starts, temps, entropy=True):
    alone = LogProbWorker(model, layout="packed", min_shared_prefix=None)
    return [alone.score([s], [f], temperature=[t], return_entropy=entropy)[0]
            for s, f, t in zip(seqs, starts, temps, strict=True)]


def assert_close(got, expected, atol):
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.log_probs.shape == b.log_probs.shape, i
        np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=atol, err_msg=f"sequence {i}")
        if b.entropy is not None:
            np.testing.assert_allclose(a.entropy, b.entropy, rtol=0, atol=atol, err_msg=f"sequence {i}")
        else:
            assert a.entropy is None


@pytest.mark.parametrize("entropy", [True, False])
def test_a_grpo_batch_gets_what_each_sequence_gets_alone_and_computes_less(model, entropy):
    seqs, starts, temps = grpo_batch(1)
    worker = LogProbWorker(model, layout="packed", min_shared_prefix=4)
    got = worker.score(seqs, starts, temperature=temps, return_entropy=entropy)
    assert_close(got, each_alone(model, seqs, starts, temps, entropy), TOLERANCE)
    assert worker.stats["computed_tokens"] < worker.stats["tokens"] == sum(map(len, seqs))
    trainer, _ = worker.log_probs_with_grad(seqs, starts, temps)  # a trainer's forward lays them out alike
    assert all(torch.equal(t.detach(), torch.from_numpy(r.log_probs)) for t, r in zip(trainer, got, strict=True))


def test_nothing_shared_below_the_minimum(model):
    seqs, starts, temps = grpo_batch(2)
    worker = LogProbWorker(model, layout="packed", min_shared_prefix=1000)
    got = worker.score(seqs, starts, temperature=temps)
    assert worker.stats["computed_tokens"] == worker.stats["tokens"]
    assert_close(got, each_alone(model, seqs, starts, temps), TOLERANCE)


def test_a_group_larger_than_a_forward_is_split_into_forwards_that_each_share(model):
    seqs, starts, temps = grpo_batch(3)
    seqs = [seqs[0][:22] + s[22:] for s in seqs]  # one group of all, sharing 22 tokens
    worker = LogProbWorker(model, layout="packed", min_shared_prefix=4, max_tokens_per_batch=48)
    got = worker.score(seqs, starts, temperature=temps)
    assert worker.stats["rows"] > 1 and worker.stats["max_row_tokens"] <= 48
    assert worker.stats["computed_tokens"] < worker.stats["tokens"] - 21 * (worker.stats["rows"] - 1)
    assert_close(got, each_alone(model, seqs, starts, temps), TOLERANCE)


class OutOfMemoryAbove(LogProbWorker):
    """A worker whose device runs out of memory on forwards over 60 tokens (CUDA's error, raised on the CPU)."""

    def _forward(self, **inputs):
        if inputs["input_ids"].numel() > 60:
            raise torch.OutOfMemoryError("CUDA out of memory (test device)")
        return super()._forward(**inputs)


def test_out_of_memory_splits_between_groups_and_then_within_them(model):
    seqs, starts, temps = grpo_batch(4)
    worker = OutOfMemoryAbove(model, layout="packed", min_shared_prefix=4, max_tokens_per_batch=400)
    got = worker.score(seqs, starts, temperature=temps)
    assert worker.stats["oom_splits"] > 0 and worker.stats["max_row_tokens"] <= 60
    assert worker.stats["computed_tokens"] < worker.stats["tokens"]  # the groups that fit still share
    assert_close(got, each_alone(model, seqs, starts, temps), TOLERANCE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("invariant", [True, False])
def test_on_cuda_shared_prefixes_give_each_sequence_its_bits_in_the_invariant_mode(invariant):
    gpu = load_model("tiny", device="cuda", dtype=torch.bfloat16, invariant=invariant)
    seqs, starts, temps = grpo_batch(5)
    worker = LogProbWorker(gpu, min_shared_prefix=4)
    got = worker.score(seqs, starts, temperature=temps)
    assert worker.stats["computed_tokens"] < worker.stats["tokens"]
    expected = [LogProbWorker(gpu, min_shared_prefix=None).score([s], [f], temperature=[t])[0]
                for s, f, t in zip(seqs, starts, temps, strict=True)]
    assert_close(got, expected, 0.0 if invariant else 5e-2)  # (fast mode: bf16 GEMMs may split their sums)


def test_a_pool_sends_each_group_to_one_worker_balanced_by_the_tokens_computed():
    from ppo_logprobs.workers.pool.worker_pool import shares_of
    from ppo_logprobs.workers.prefixes import forest

    seqs, starts, temps = grpo_batch(6)
    worker = LogProbWorker("tiny", layout="packed", backend="torch", max_tokens_per_batch=400)
    request = worker.request(seqs, starts, temperature=temps)
    trees = forest(request, np.arange(len(seqs)), 4)
    groups = [set(members.tolist()) for members, _ in trees.roots()]
    assert max(map(len, groups)) > 2
    shares = shares_of(request, 3, 4)
    assert sorted(i for share in shares for i in share.tolist()) == list(range(len(seqs)))
    for group in groups:  # each group whole in one share
        assert sum(bool(group & set(share.tolist())) for share in shares) == 1
    computed = [forest(request, share, 4).tokens for share in shares]
    assert max(computed) - min(computed) <= max(cost for _, cost in trees.roots())
    assert [s.tolist() for s in shares_of(request, 3, None)] != [s.tolist() for s in shares]  # (by lengths alone)


def test_each_sequence_is_told_its_part_of_the_tokens_computed_through_spans_and_merges(model):
    """A piece shared by k sequences counts 1/k to each: parts of a call (the batcher's spans of joined requests,
    the pool's shares) add up to what the call computed."""
    from ppo_logprobs.workers.request import ScoreResult

    seqs, starts, temps = grpo_batch(7)
    worker = LogProbWorker(model, layout="packed", min_shared_prefix=4)
    request = worker.request(seqs, starts, temperature=temps)
    result = worker.score_request(request)
    assert result.computed_tokens(request.lengths) == worker.stats["computed_tokens"] < request.offsets[-1]
    assert (result.computed <= request.lengths).all() and (result.computed > 0).all()
    halves = [(np.arange(0, 5), result.span(0, 5)), (np.arange(5, len(seqs)), result.span(5, len(seqs)))]
    merged = ScoreResult.merge(halves[::-1], len(seqs), True)
    assert np.array_equal(merged.computed, result.computed)
    alone = LogProbWorker(model, layout="packed", min_shared_prefix=None).score_request(request)
    assert alone.computed_tokens(request.lengths) == request.offsets[-1]


def test_no_sharing_where_varlen_attention_cannot_run_the_models_attention():
    from ppo_logprobs.workers import patch_model

    from ..models.test_patch_model import tiny

    capped = patch_model(tiny("gemma2", False), backend="torch")  # attention logits capped: the model's own attention
    assert LogProbWorker(capped, layout="packed").min_shared_prefix is None
    assert LogProbWorker(patch_model(tiny("phi3", False), backend="torch"), layout="packed").min_shared_prefix == 128
