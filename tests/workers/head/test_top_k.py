"""Top-k log-probs, the tail's mass and candidate sets from the fused head's one pass (both backends), against a
float64 oracle: ids equal to a stable descending sort's (ties to the lower id), values as close as the plain
log-probs are; odd V, k = 1 and k = V, ignored positions, per-token temperatures, softcap, bad arguments; the same
bits for a token whatever else is in the call."""

from types import SimpleNamespace

import pytest
import torch

from ppo_logprobs.workers import fused_log_probs
from ppo_logprobs.workers.head.fused_log_probs import MAX_TOP_K
from ppo_logprobs.workers.head.triton_log_probs_forward import interpreting

from .reference import assert_same_bits

# The Triton backend here is the interpreter's: these cases are cut to its tiling (vocabulary tiles of 32). On a GPU
# host they skip; the compiled kernels' cases are the two GPU-marked tests at the end.
INTERPRETED = interpreting()
BACKENDS = ["torch"] + (["triton"] if INTERPRETED else [])
TOL = 2e-6  # max |error| / (1 + max |logit|), as the plain log-probs


def oracle(hidden, weight, temps=1.0, softcap=None):
    """float64 log-probs [N, V], ids sorted by descending log-prob with ties to the lower id."""
    logits = hidden.double() @ weight.double().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / (temps.double()[:, None] if isinstance(temps, torch.Tensor) else temps)
    log_p = torch.log_softmax(logits, dim=-1)
    return log_p, torch.sort(log_p, dim=-1, descending=True, stable=True).indices, float(logits.abs().max())


def inputs(n, h, v, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * scale / h**0.5
    return hidden, weight, torch.randint(0, v, (n,), generator=g)


def check(out, log_p, order, k, keep, tol, near_ties=False):
    """`near_ties`: fp32 logits of 16-bit inputs may order two logits within a rounding of each other either way;
    then the ids need only be distinct and the reference's log-prob at each within `tol` of its rank's."""
    ids = order[:, :k]
    if near_ties:
        assert (out.top_ids.sort(dim=-1).values.diff(dim=-1) > 0)[keep].all()
        assert (log_p.gather(-1, out.top_ids.clamp(min=0)) - log_p.gather(-1, ids))[keep].abs().max() <= tol
    else:
        assert torch.equal(out.top_ids[keep], ids[keep])
    assert (out.top_log_probs[keep].double() - log_p.gather(-1, ids)[keep]).abs().max() <= tol
    tail = torch.logsumexp(log_p.scatter(-1, ids, float("-inf")), dim=-1)
    got = out.tail_log_prob[keep].double()
    if k == log_p.shape[-1]:
        assert torch.isneginf(got).all()
    else:
        assert (got - tail[keep]).abs().max() <= tol
    assert (out.top_log_probs[~keep] == 0).all() and (out.top_ids[~keep] == -1).all()
    assert (out.tail_log_prob[~keep] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 7])
def test_top_k_and_tail_match_the_oracle_with_temperatures_and_ignored_positions(backend, k):
    hidden, weight, labels = inputs(19, 24, 503)
    labels[::5] = -100
    temps = torch.rand(19, generator=torch.Generator().manual_seed(1)) + 0.5
    out = fused_log_probs(hidden, weight, labels, temps, top_k=k, backend=backend)
    log_p, order, biggest = oracle(hidden, weight, temps)
    keep = labels != -100
    check(out, log_p, order, k, keep, TOL * (1 + biggest))
    plain_lp, plain_ent = fused_log_probs(hidden, weight, labels, temps, backend=backend)
    assert torch.equal(out.log_probs, plain_lp) and torch.equal(out.entropy, plain_ent)  # the same pass's bits
    assert out.top_log_probs.shape == (19, k) and out.top_ids.dtype == torch.int64
    assert out.candidate_log_probs is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_token_ranked_when_k_is_the_vocabulary(backend):
    v = 61 if backend == "triton" else 503  # (the kernels' lists are powers of two up to MAX_TOP_K)
    hidden, weight, labels = inputs(9, 16, v, seed=2)
    out = fused_log_probs(hidden, weight, labels, top_k=v, backend=backend, softcap=2.5)
    log_p, order, biggest = oracle(hidden, weight, softcap=2.5)
    check(out, log_p, order, v, torch.ones(9, dtype=torch.bool), TOL * (1 + biggest))
    assert torch.equal(out.top_ids.sort(dim=-1).values, torch.arange(v).expand(9, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [2, 8])
def test_ties_go_to_the_lower_id(backend, k):
    """Integer-valued inputs make exact logits; rows 5, 17, 40 and 77 of the weight are one row, so their tokens
    tie everywhere, and so do other exact coincidences (with Triton, whole tiles' maxima tie: k = 2 chooses 2 of
    the 4 tiles, k = 8 all of them)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randint(-2, 3, (11, 8), generator=g).float()
    weight = torch.randint(-2, 3, (97, 8), generator=g).float()
    weight[[17, 40, 77]] = weight[5].clone()
    hidden[3] = 0.0  # every logit 0: the top k are ids 0..k-1
    out = fused_log_probs(hidden, weight, torch.zeros(11, dtype=torch.long), top_k=k, backend=backend)
    log_p, order, _ = oracle(hidden, weight)
    assert torch.equal(out.top_ids, order[:, :k])
    assert torch.equal(out.top_ids[3], torch.arange(k))
    for row in range(11):
        picked = out.top_ids[row].tolist()
        if 17 in picked:
            assert 5 in picked and picked.index(5) < picked.index(17)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_top_k_held_by_one_vocabulary_tile(backend):
    """Every row's 16 largest logits in ids 64..95 (one tile of the interpreter's Triton tiling): the tile that
    holds the top must give all 16, and the other chosen tiles only their mass."""
    hidden, weight, labels = inputs(13, 24, 503, seed=9)
    hidden = hidden.abs()
    weight[64:96] = weight[64:96].abs() + 1.0
    out = fused_log_probs(hidden, weight, labels, top_k=16, backend=backend)
    log_p, order, biggest = oracle(hidden, weight)
    assert ((order[:, :16] >= 64) & (order[:, :16] < 96)).all()  # (what the test is about)
    check(out, log_p, order, 16, torch.ones(13, dtype=torch.bool), TOL * (1 + biggest))


def chosen_list_lengths(hidden, weight, k, tile=32, width=16):
    """float64 statement of the second pass's lists: per row and chosen tile (the k of largest maxima), how many of
    its logits are at or above the k-th tile maximum, at most `width` (the interpreter's tiles are 32 wide)."""
    logits = hidden.double() @ weight.double().T
    tiles = torch.nn.functional.pad(logits, (0, -logits.shape[1] % tile), value=float("-inf")).unflatten(1, (-1, tile))
    maxima = tiles.max(-1).values
    chosen = torch.zeros_like(maxima, dtype=torch.bool).scatter(
        1, torch.sort(maxima, dim=-1, descending=True, stable=True).indices[:, :k], True)  # (ties to the lower tile)
    floor = maxima.sort(-1, descending=True).values[:, k - 1]
    return (tiles >= floor[:, None, None]).sum(-1).clamp(max=width) * chosen


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_whose_top_k_crowds_one_tile_beside_rows_whose_does_not(backend):
    """The Triton second pass computes a chosen tile again only where its second largest logit reaches the k-th
    tile maximum, and the combine puts that tile's other entries into the row's list one by one. Rows of three
    kinds: plain (most chosen tiles give their largest alone), one tile crowded with the top (a list of 16), all
    logits tied (every chosen tile again, every list full): all in one block of the combine, and the plain rows by
    themselves; each against the oracle, and a row's bits the same either way."""
    hidden, weight, labels = inputs(6, 24, 1000, seed=16)
    kind = torch.tensor([1, 0, 2, 0, 1, 0])
    weight[64:96] = weight[64:96].abs() + 1.0
    hidden = torch.where((kind == 1)[:, None], hidden.abs(), torch.where((kind == 2)[:, None], 0.0, -hidden.abs()))
    lengths = chosen_list_lengths(hidden, weight, 12)
    assert (lengths[kind > 0].max(1).values == 16).all() and (lengths[kind == 0] <= 8).all()  # (what it is about)
    assert ((lengths[kind == 0] == 1).sum(1) >= 6).all()  # (the plain rows' tiles mostly give their largest alone)
    log_p, order, biggest = oracle(hidden, weight)
    plain = kind == 0
    block = fused_log_probs(hidden, weight, labels, top_k=12, backend=backend)
    alone = fused_log_probs(hidden[plain], weight, labels[plain], top_k=12, backend=backend)
    for out, rows in ((block, slice(None)), (alone, plain)):
        check(out, log_p[rows], order[rows], 12, torch.ones(len(out.top_ids), dtype=torch.bool), TOL * (1 + biggest))
    for name in ("top_ids", "top_log_probs", "tail_log_prob"):
        assert_same_bits(getattr(alone, name), getattr(block, name)[plain], backend == "triton")


@pytest.mark.skipif(not INTERPRETED, reason="cut to the interpreter's tiling")
def test_a_long_top_k_call_runs_in_row_chunks_with_the_same_answers(monkeypatch):
    from ppo_logprobs.workers.head import triton_log_probs_forward as forward
    hidden, weight, labels = inputs(37, 24, 503, seed=10)
    whole = fused_log_probs(hidden, weight, labels, top_k=5, token_ids=torch.tensor([7]), backend="triton")
    kernel, grids = forward._triton_top_tiles_kernel, []

    class Launches:  # the second pass's launches, one a chunk
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    # a row of 16 tiles (V = 503 in 32-wide tiles) and 5 chosen tiles' lists of 8 takes 16 * 24 + 5 * 88 bytes
    monkeypatch.setattr(forward, "TOP_K_WORKSPACE", 20 * (16 * 24 + 5 * 88))  # (16 rows a chunk)
    monkeypatch.setattr(forward, "_triton_top_tiles_kernel", Launches())
    chunked = fused_log_probs(hidden, weight, labels, top_k=5, token_ids=torch.tensor([7]), backend="triton")
    assert len(grids) == 3  # 16 + 16 + 5 rows
    assert torch.equal(chunked.top_ids, whole.top_ids)
    for name in ("log_probs", "entropy", "top_log_probs", "tail_log_prob", "candidate_log_probs"):
        assert_same_bits(getattr(chunked, name), getattr(whole, name), interpreted=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidate_sets_shared_and_per_position(backend):
    hidden, weight, labels = inputs(13, 24, 503, seed=4)
    labels[6] = -100
    log_p, _, biggest = oracle(hidden, weight)
    keep = labels != -100
    shared = torch.tensor([3, 502, 3, 0])  # (a repeated id is answered twice)
    out = fused_log_probs(hidden, weight, labels, token_ids=shared, backend=backend)
    assert out.top_log_probs is None and out.candidate_log_probs.shape == (13, 4)
    assert (out.candidate_log_probs[keep].double() - log_p[:, shared][keep]).abs().max() <= TOL * (1 + biggest)
    assert torch.equal(out.candidate_log_probs[:, 0], out.candidate_log_probs[:, 2])
    assert (out.candidate_log_probs[6] == 0).all()
    per = torch.randint(0, 503, (13, 5), generator=torch.Generator().manual_seed(5))
    per[:, 0] = labels.clamp(min=0)
    both = fused_log_probs(hidden, weight, labels, token_ids=per, top_k=3, backend=backend)
    assert (both.candidate_log_probs[keep].double() - log_p.gather(-1, per)[keep]).abs().max() <= TOL * (1 + biggest)
    torch.testing.assert_close(both.candidate_log_probs[keep, 0], both.log_probs[keep], rtol=0, atol=1e-6)
    check(both, log_p, oracle(hidden, weight)[1], 3, keep, TOL * (1 + biggest))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tokens_top_k_does_not_depend_on_the_rest_of_the_call(backend):
    hidden, weight, labels = inputs(20, 24, 503, seed=6)
    whole = fused_log_probs(hidden, weight, labels, top_k=7, token_ids=torch.tensor([1, 2]), backend=backend)
    idx = torch.tensor([17, 2, 11])
    part = fused_log_probs(hidden[idx], weight, labels[idx], top_k=7, token_ids=torch.tensor([1, 2]),
                           backend=backend)
    assert torch.equal(part.top_ids, whole.top_ids[idx])
    interpreted = backend == "triton"
    for name in ("top_log_probs", "tail_log_prob", "candidate_log_probs"):
        assert_same_bits(getattr(part, name), getattr(whole, name)[idx], interpreted)


def test_shapes_follow_the_labels_and_no_tokens_give_empty_answers():
    hidden, weight, _ = inputs(12, 24, 503, seed=7)
    labels = torch.randint(0, 503, (3, 4))
    out = fused_log_probs(hidden.view(3, 4, 24), weight, labels, top_k=5, token_ids=torch.tensor([9, 8]))
    assert out.top_ids.shape == (3, 4, 5) and out.tail_log_prob.shape == (3, 4)
    assert out.candidate_log_probs.shape == (3, 4, 2)
    flat = fused_log_probs(hidden, weight, labels.reshape(12), top_k=5, token_ids=torch.tensor([9, 8]))
    assert torch.equal(out.top_ids.reshape(12, 5), flat.top_ids)
    empty = fused_log_probs(hidden[:0], weight, labels.reshape(12)[:0], top_k=5, token_ids=torch.tensor([9]))
    assert empty.top_ids.shape == (0, 5) and empty.candidate_log_probs.shape == (0, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(top_k=-1), r"top_k must be an integer in \[0, 503\].*got -1"),
    (dict(top_k=504), r"top_k must be an integer in \[0, 503\].*got 504"),
    (dict(top_k=True), r"top_k must be an integer.*got True"),
    (dict(top_k=MAX_TOP_K + 1, backend="triton"), rf"top_k must be an integer in \[0, {MAX_TOP_K}\] \(MAX_TOP_K"),
    (dict(token_ids=torch.tensor([4, 503])), r"token_ids\[1\] = 503 is outside the vocabulary \[0, 503\)"),
    (dict(token_ids=torch.tensor([[4, -1]] * 6)), r"token_ids\[0, 1\] = -1 is outside the vocabulary"),
    (dict(token_ids=torch.tensor([[4, 1]] * 5)), r"token_ids must be \[C\] or \[6, C\].*got shape \(5, 2\)"),
    (dict(token_ids=torch.tensor([1.0])), r"token_ids must be an integer tensor"),
    (dict(token_ids=torch.tensor([], dtype=torch.long)), r"at least one candidate"),
])
def test_bad_arguments_are_named(kwargs, message):
    hidden, weight, labels = inputs(6, 24, 503, seed=8)
    if kwargs.get("backend") == "triton" and not INTERPRETED:  # (the compiled kernels take CUDA tensors)
        hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    with pytest.raises(ValueError, match=message):
        fused_log_probs(hidden, weight, labels, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("k", "v"), [(20, 20011), (64, 20011), (128, 40009), (256, 20011), (256, 80021)])
def test_compiled_top_k_is_exact_invariant_and_recomputes_the_first_pass_bits(k, v):
    """bf16 on the GPU's own tiling (vocabulary tiles of 256: 79 of them at V = 20011, where k = 256 chooses every
    tile; 157 and 313 at the larger V): ids as float64's up to near-ties (two logits within an fp32 rounding),
    values and the tail within the plain log-probs' error; a token's bits whatever else is in the call; and the
    second pass's logits the first pass's to the bit (the top-1 log-prob of a token whose label is its most likely
    id is its log-prob)."""
    hidden, weight, labels = inputs(300, 256, v, seed=11)
    hidden, weight = hidden.cuda().bfloat16(), weight.cuda().bfloat16()
    log_p, order, biggest = oracle(hidden, weight)
    labels = torch.where(torch.arange(300) % 2 == 0, order[:, 0].cpu(), labels).cuda()
    labels[::7] = -100
    keep = (labels != -100).cpu()
    out = fused_log_probs(hidden, weight, labels, top_k=k, backend="triton")
    check(SimpleNamespace(**{n: getattr(out, n).cpu() for n in ("top_ids", "top_log_probs", "tail_log_prob")}),
          log_p.cpu(), order.cpu(), k, keep, TOL * (1 + biggest), near_ties=True)
    plain = fused_log_probs(hidden, weight, labels, backend="triton")
    assert torch.equal(out.log_probs, plain[0]) and torch.equal(out.entropy, plain[1])
    own = keep.cuda() & (out.top_ids[:, 0] == labels)
    assert own.sum() >= 100 and torch.equal(out.top_log_probs[own, 0], out.log_probs[own])
    idx = torch.tensor([299, 3, 150, 151]).cuda()
    part = fused_log_probs(hidden[idx], weight, labels[idx], top_k=k, backend="triton")
    for name in ("top_ids", "top_log_probs", "tail_log_prob"):
        assert torch.equal(getattr(part, name), getattr(out, name)[idx])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [2, 64, 256])
def test_compiled_top_k_on_exact_ties_with_candidates_and_in_row_chunks(k, monkeypatch):
    """The interpreter's cases above on the GPU's own tiling (bf16, vocabulary tiles of 256, rows of 128). Integer
    inputs make exact logits, so the ids must be float64's stable sort's exactly: ties go to the lower id within a
    tile and across tiles (weight rows 5, 300, 301 and 777 are one row, in three tiles), and a zero hidden row ties
    every logit (its top k is 0 .. k - 1). A candidate set per position rides along. A call cut into row
    chunks (a workspace for one row block) has the whole call's bits. And k = V at V = 256 ranks every token."""
    from ppo_logprobs.workers.head import triton_log_probs_forward as forward
    g = torch.Generator().manual_seed(12)
    hidden = torch.randint(-2, 3, (300, 64), generator=g).float()
    weight = torch.randint(-2, 3, (1000, 64), generator=g).float()
    weight[[300, 301, 777]] = weight[5].clone()
    hidden[3] = 0.0
    labels = torch.randint(0, 1000, (300,), generator=g)
    labels[::7] = -100
    per = torch.randint(0, 1000, (300, 5), generator=g)
    keep = labels != -100
    log_p, order, biggest = oracle(hidden, weight)
    tol = TOL * (1 + biggest)
    on_gpu = (hidden.cuda().bfloat16(), weight.cuda().bfloat16(), labels.cuda())
    names = ("top_ids", "top_log_probs", "tail_log_prob", "candidate_log_probs", "log_probs", "entropy")
    whole = fused_log_probs(*on_gpu, top_k=k, token_ids=per.cuda(), backend="triton")
    got = SimpleNamespace(**{name: getattr(whole, name).cpu() for name in names})
    assert (log_p.gather(-1, order[:, :k]).diff(dim=-1) == 0).any(), "the case has no ties among the top k"
    check(got, log_p, order, k, keep, tol)  # (the ids exactly)
    assert torch.equal(got.top_ids[3], torch.arange(k))
    assert (got.candidate_log_probs[keep].double() - log_p.gather(-1, per)[keep]).abs().max() <= tol
    assert (got.candidate_log_probs[~keep] == 0).all()
    monkeypatch.setattr(forward, "TOP_K_WORKSPACE", 1)  # (one row block a chunk: 128 + 128 + 44 rows)
    chunked = fused_log_probs(*on_gpu, top_k=k, token_ids=per.cuda(), backend="triton")
    for name in names:
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    if k == MAX_TOP_K:
        every = fused_log_probs(on_gpu[0], on_gpu[1][:k], on_gpu[2].remainder(k), top_k=k, backend="triton")
        log_p, order, biggest = oracle(hidden, weight[:k])
        check(SimpleNamespace(**{name: getattr(every, name).cpu() for name in names[:3]}), log_p, order, k,
              torch.ones(300, dtype=torch.bool), TOL * (1 + biggest))
        assert torch.isneginf(every.tail_log_prob).all()
