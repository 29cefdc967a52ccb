"""LogProbWorker as a plain class: packing, order, alignment, token budget, OOM splitting, weights, errors."""

import numpy as np
import pytest
import torch

from ppo_logprobs.workers import LogProbWorker, load_model
from ppo_logprobs.workers.errors import IncompatibleWeights, TooLarge
from ppo_logprobs.workers.pool.log_prob_worker import bucket_length, pack_rows, pad_batches

from ...helpers import alone, random_sequences


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", backend="torch")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_results_in_order_and_aligned(model, layout):
    worker = LogProbWorker("tiny", max_tokens_per_batch=100, layout=layout, backend="torch")
    seqs = random_sequences(20, seed=0)
    starts = [1 + i % 3 for i in range(20)]
    temps = [0.5 + 0.1 * i for i in range(20)]
    results = worker.score(seqs, starts, temperature=temps)
    assert len(results) == 20
    for seq, s, t, r in zip(seqs, starts, temps, results, strict=True):
        lp, ent = alone(model, seq, s, t)
        assert r.log_probs.dtype == np.float32 and r.log_probs.shape == (len(seq) - s,)
        np.testing.assert_allclose(r.log_probs, lp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.entropy, ent, rtol=0, atol=1e-5)
        assert r.weights_version == 0
    assert worker.stats["rows"] > 1  # several packed rows were needed
    assert 0 < worker.stats["max_row_tokens"] <= 100
    assert worker.stats["calls"] == 1 and worker.stats["tokens"] == sum(map(len, seqs))  # what the calls carried


def test_rows_padded_to_bucket_lengths_give_the_same_results(model):
    """On CUDA rows are padded to a few lengths (compiled attention); the padding must change nothing."""
    worker = LogProbWorker("tiny", max_tokens_per_batch=700, layout="packed", row_buckets=True, backend="torch")
    seqs = random_sequences(15, seed=3, hi=90)
    for seq, r in zip(seqs, worker.score(seqs, 2), strict=True):
        lp, ent = alone(model, seq, 2)
        np.testing.assert_allclose(r.log_probs, lp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.entropy, ent, rtol=0, atol=1e-5)
    assert worker.stats["max_row_tokens"] in (256, 384, 512, 700)


def test_warm_up_scores_only_what_fits_and_leaves_no_counts():
    """(It runs at start-up on CUDA, and here when asked: a worker whose forwards hold fewer tokens than its
    warm-up's longest asks failed to start.)"""
    worker = LogProbWorker("tiny", max_tokens_per_batch=100, backend="torch")
    worker.warm_up()
    assert worker.stats["calls"] == worker.stats["tokens"] == 0


def test_bucket_lengths():
    assert [bucket_length(t, 16384) for t in (1, 256, 257, 385, 600, 5000, 16000)] == [
        256, 256, 384, 512, 768, 6144, 16384]
    assert bucket_length(900, 1000) == 1000  # never past the worker's budget


def test_score_from_at_the_end_gives_empty_results():
    worker = LogProbWorker("tiny", backend="torch")
    (r,) = worker.score([[5, 6, 7]], score_from=3, return_entropy=False)
    assert r.log_probs.shape == (0,) and r.entropy is None


def test_pad_batches_group_similar_lengths_within_the_budget():
    lengths = np.array([2, 3, 100, 7, 6, 2, 64, 65, 5, 96] * 20)
    batches = pad_batches(lengths, 200)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * lengths[b].max() <= 200 and lengths[b].max() <= 1.5 * lengths[b].min()
    many = pad_batches(np.full(131072, 2), 16384)  # the gateway's largest request of the shortest sequences
    assert len(many) == 16 and all(b.size == 8192 for b in many)


def test_many_short_sequences_cost_what_their_tokens_do(model):
    """A forward per ~max_tokens_per_batch tokens, whatever the number of sequences (no per-sequence forward)."""
    worker = LogProbWorker("tiny", max_tokens_per_batch=4096, backend="torch")
    seqs = [[i % 500, (7 * i) % 500] for i in range(20000)]
    results = worker.score(seqs)
    assert worker.stats["rows"] == 10
    for i in (0, 9999, 19999):
        np.testing.assert_allclose(results[i].log_probs, alone(model, seqs[i])[0], rtol=0, atol=1e-5)


def test_pack_rows_respects_the_budget():
    lengths = np.array([50, 3, 97, 20, 20, 100, 1, 64])
    rows = pack_rows(lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(lengths[row].sum() <= 100 for row in rows)
    assert len(rows) == 4  # 355 tokens: the fewest rows of 100 possible
    many = np.array([2] * 131072 + [7] * 5 + [16384])  # one placement per distinct length, not per sequence
    rows = pack_rows(many, 16384)
    assert sorted(np.concatenate(rows).tolist()) == list(range(len(many)))
    assert all(many[row].sum() <= 16384 for row in rows) and len(rows) == 18


class OutOfMemoryAbove(LogProbWorker):
    """A worker whose device runs out of memory on rows over `limit` tokens once it is set (CUDA's error, raised on
    the CPU; not in the warm-up a worker runs on a GPU)."""

    limit = None

    def _forward(self, **inputs):
        if self.limit is not None and inputs["input_ids"].numel() > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (test device)")
        return super()._forward(**inputs)


@pytest.mark.parametrize("layout, row_buckets", [("packed", False), ("packed", True), ("padded", False)])
def test_out_of_memory_halves_the_forward_and_retries(model, layout, row_buckets):
    worker = OutOfMemoryAbove("tiny", max_tokens_per_batch=160, layout=layout, row_buckets=row_buckets,
                              backend="torch")
    worker.limit = 40
    seqs = random_sequences(12, seed=1, hi=30)
    results = worker.score(seqs)
    assert worker.stats["oom_splits"] > 0 and worker.stats["max_row_tokens"] <= 40
    for seq, r in zip(seqs, results, strict=True):
        np.testing.assert_allclose(r.log_probs, alone(model, seq)[0], rtol=0, atol=1e-5)
    with pytest.raises(TooLarge, match="a sequence of 41 tokens does not fit in a worker's memory"):
        worker.score([list(range(41))])  # one sequence that does not fit cannot be split: the request's fault


def test_update_weights_changes_results_and_version():
    worker = LogProbWorker("tiny", backend="torch")
    other = load_model("tiny", backend="torch")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    seqs = random_sequences(4, seed=2)
    before = worker.score(seqs)
    assert worker.update_weights(other.state_dict(), 7) == 7
    after = worker.score(seqs)
    for seq, b, a in zip(seqs, before, after, strict=True):
        assert a.weights_version == 7 and not np.allclose(a.log_probs, b.log_probs)
        np.testing.assert_allclose(a.log_probs, alone(other, seq)[0], rtol=0, atol=1e-5)
    with pytest.raises(IncompatibleWeights, match=r"'lm_head.weight' has shape \[3, 3\] in the update and \[503, 64\]"):
        worker.update_weights({"lm_head.weight": torch.zeros(3, 3)}, 8)
    with pytest.raises(IncompatibleWeights, match=r"tensors the model does not, e.g. 'model.layers.2.mlp.w'"):
        worker.update_weights({"model.layers.2.mlp.w": torch.zeros(3)}, 8)
    refused = worker.score(seqs)  # nothing changed
    for a, r in zip(after, refused, strict=True):
        assert r.weights_version == 7 and np.array_equal(a.log_probs, r.log_probs)


def test_a_partial_update_changes_only_the_parameters_it_names(model):
    worker = LogProbWorker("tiny", backend="torch")
    head = torch.randn(503, 64) * 0.1
    assert worker.update_weights({"lm_head.weight": head}, 3) == 3
    for name, p in worker.model.named_parameters():
        assert torch.equal(p.cpu(), head if name == "lm_head.weight" else model.get_parameter(name)), name


@pytest.mark.parametrize(
    "input_ids, score_from, temperature, message",
    [
        ([[1, 2], []], 1, 1.0, r"input_ids\[1\] has 0 tokens; scoring needs at least 2"),
        ([[1, 2], [3, 503]], 1, 1.0, r"input_ids\[1\]\[1\] = 503 is outside the vocabulary \[0, 503\)"),
        ([[1, 2], [3, -1]], 1, 1.0, r"input_ids\[1\]\[1\] = -1"),
        ([[1, 2], [3, 4]], [1, 3], 1.0, r"score_from\[1\] = 3 must be in \[1, 2\]"),
        ([[1, 2], [3, 4]], 0, 1.0, r"score_from\[0\] = 0"),
        ([[1, 2], [3, 4]], [1], 1.0, r"score_from has 1 entries for 2 sequences"),
        ([[1, 2], [3, 4]], 1, [1.0, 0.0], r"temperature\[1\] = 0.0 must be a number in \[0.01, 100\]"),
        ([[1, 2]], 1, 1e-45, r"temperature\[0\] = 1e-45 must be a number in \[0.01, 100\]"),
        ([[1, 2]], 1, 1e308, r"temperature\[0\] = 1e\+308"),
        ([[1, 2]], [True], 1.0, r"score_from\[0\] = True must be an integer"),
        ([[1, 2], [3, 4]], 1, float("nan"), r"temperature\[0\] = nan"),
        ([[1, 2], [3.5, 4]], 1, 1.0, r"input_ids\[1\]\[0\] = 3.5 is not a token id"),
        ([[1, 2], [3, True]], 1, 1.0, r"input_ids\[1\]\[1\] = True is not a token id"),  # (numpy would take 1)
        ([[1, 2], [3, 4]], [1, True], 1.0, r"score_from\[1\] = True must be an integer"),
        ([[1, 2], [3, 4]], [1, 1.9], 1.0, r"score_from\[1\] = 1.9 must be an integer"),
        ([list(range(300))], 1, 1.0, r"input_ids\[0\] has 300 tokens; this model takes at most 256"),
    ],
)
def test_bad_requests_name_the_sequence(input_ids, score_from, temperature, message):
    worker = LogProbWorker("tiny", max_tokens_per_batch=256, backend="torch")
    with pytest.raises(ValueError, match=message):
        worker.score(input_ids, score_from, temperature=temperature)


def oracle(model, seq, score_from, temperature=1.0):
    """float64 log-probs [entries, V] of one sequence, from the model's own body and head."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
        logits = hidden.double() @ model.lm_head.weight.double().T / temperature
    return torch.log_softmax(logits, dim=-1)[score_from - 1 : len(seq) - 1]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_top_k_tail_and_candidates_per_sequence(model, layout):
    """Each entry's k most likely tokens (ids as a stable sort's), the tail's log-probability and the candidates'
    log-probs, against float64; per-sequence candidate lists of several lengths come back cut to each list."""
    seqs = random_sequences(7, seed=21, lo=5, hi=70)
    starts = [1 + i % 4 for i in range(7)]
    temps = [0.7 + 0.1 * i for i in range(7)]
    ids = [[i, 502 - i, 7][: 1 + i % 3] for i in range(7)]
    worker = LogProbWorker(model, max_tokens_per_batch=128, layout=layout)
    got = worker.score(seqs, starts, temperature=temps, top_k=6, token_ids=ids)
    for i, r in enumerate(got):
        log_p = oracle(model, seqs[i], starts[i], temps[i])
        order = torch.sort(log_p, dim=-1, descending=True, stable=True).indices[:, :6]
        assert np.array_equal(r.top_ids, order.numpy()), i
        np.testing.assert_allclose(r.top_log_probs, log_p.gather(-1, order).numpy(), rtol=0, atol=1e-5)
        tail = torch.logsumexp(log_p.scatter(-1, order, float("-inf")), dim=-1)
        np.testing.assert_allclose(r.tail_log_prob, tail.numpy(), rtol=0, atol=1e-5)
        assert r.candidate_log_probs.shape == (len(seqs[i]) - starts[i], len(ids[i]))
        np.testing.assert_allclose(r.candidate_log_probs, log_p[:, ids[i]].numpy(), rtol=0, atol=1e-5)
        assert r.top_ids.dtype == np.int32 and r.top_log_probs.dtype == np.float32
    plain = worker.score(seqs, starts, temperature=temps)
    assert all(p.top_ids is None and p.candidate_log_probs is None for p in plain)
    for p, r in zip(plain, got, strict=True):
        assert np.array_equal(p.log_probs, r.log_probs)  # (the same pass's log-probs, whatever else was asked)


def test_shared_prompts_share_with_one_candidate_list_and_not_with_several(model):
    """A shared position is scored once for all its sequences: with one candidate list for all they still share
    (and get what each alone gets); with lists that differ they do not."""
    g = np.random.default_rng(22)
    prompt = g.integers(0, 503, 40).tolist()
    seqs = [prompt + g.integers(0, 503, int(r)).tolist() for r in (9, 14, 3)]
    worker = LogProbWorker(model, layout="packed", min_shared_prefix=16)
    shared = worker.score(seqs, 30, top_k=3, token_ids=[5, 6])
    assert worker.stats["computed_tokens"] < sum(map(len, seqs))
    alone_worker = LogProbWorker(model, layout="packed", min_shared_prefix=None)
    for seq, r in zip(seqs, shared, strict=True):
        one = alone_worker.score([seq], 30, top_k=3, token_ids=[5, 6])[0]
        assert np.array_equal(r.top_ids, one.top_ids)
        for name in ("top_log_probs", "tail_log_prob", "candidate_log_probs"):
            np.testing.assert_allclose(getattr(r, name), getattr(one, name), rtol=0, atol=1e-6)
    before = worker.stats["computed_tokens"]
    worker.score(seqs, 30, token_ids=[[5], [6], [5]])
    assert worker.stats["computed_tokens"] - before == sum(map(len, seqs))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k=504), r"top_k = 504 must be an integer in \[0, 256\]"),
        (dict(top_k=-1), r"top_k = -1 must be an integer"),
        (dict(top_k=2.0), r"top_k = 2.0 must be an integer"),
        (dict(top_k=True), r"top_k = True must be an integer"),
        (dict(token_ids=[]), r"token_ids must be a non-empty list"),
        (dict(token_ids=[1, 503]), r"token_ids\[1\] = 503 is outside the vocabulary \[0, 503\)"),
        (dict(token_ids=[[1], [2], [3]]), r"token_ids has 3 lists for 2 sequences"),
        (dict(token_ids=[[1], [2, -4]]), r"token_ids\[1\]\[1\] = -4 is outside the vocabulary"),
        (dict(token_ids=[[1], []]), r"token_ids\[1\] = \[\] must be a non-empty list"),
        (dict(token_ids=[[1], [True]]), r"token_ids\[1\]\[0\] = True is not a token id"),
        (dict(token_ids=list(range(1025))), r"token_ids has 1025 ids; the limit is 1024"),
    ],
)
def test_bad_top_k_and_candidates_are_named(kwargs, message):
    worker = LogProbWorker("tiny", max_tokens_per_batch=256, backend="torch")
    with pytest.raises(ValueError, match=message):
        worker.score([[1, 2], [3, 4]], **kwargs)
