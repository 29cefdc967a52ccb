"""The request/result contract (workers/request.py), alone: what ScoreRequest.build refuses and the message that
names the field, the sequence and the value; what it accepts at the edges; select, concat and merge giving every
sequence back in request order for any split; the stale-part policy and the assembler of parts by weights version
(Parts) as its callers drive it; ragged_index against a loop."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_logprobs.workers.errors import RequestError, TooLarge, WeightsChanged
from ppo_logprobs.workers.request import VERSION_ATTEMPTS, Parts, ScoreRequest, ScoreResult, ragged_index, stale_parts

VOCAB = 10


def build(input_ids, score_from=1, temperature=1.0, return_entropy=True, max_length=8, max_tokens=None):
    return ScoreRequest.build(input_ids, score_from, temperature, return_entropy, vocab_size=VOCAB,
                              max_length=max_length, max_tokens=max_tokens)


def sequences(request: ScoreRequest) -> list[list[int]]:
    return [request.tokens[a:b].tolist() for a, b in zip(request.offsets[:-1], request.offsets[1:], strict=True)]


def score(request: ScoreRequest, version: int = 0) -> ScoreResult:
    """A stand-in for a worker that shows where each entry came from: log-prob = the scored token, entropy = its
    position in its sequence."""
    at = ragged_index(request.offsets[:-1] + request.score_from, request.scored)
    position = at - np.repeat(request.offsets[:-1], request.scored)
    entropy = position.astype(np.float32) if request.return_entropy else None
    return ScoreResult(request.tokens[at].astype(np.float32), entropy, request.result_offsets(), version)


@pytest.mark.parametrize(
    "input_ids, score_from, temperature, error, message",
    [
        ([], 1, 1.0, RequestError, "input_ids must be a non-empty list of token lists"),
        ("ab", 1, 1.0, RequestError, "input_ids must be a non-empty list of token lists"),
        ([[1, 2], 5], 1, 1.0, RequestError, "input_ids[1] = 5 is not a list of token ids"),
        ([[1, 2], "ab"], 1, 1.0, RequestError, "input_ids[1] = 'ab' is not a list of token ids"),
        ([[1, 2], [3]], 1, 1.0, RequestError, "input_ids[1] has 1 token; scoring needs at least 2"),
        ([[1, 2], [1] * 9], 1, 1.0, TooLarge, "input_ids[1] has 9 tokens; this model takes at most 8"),
        ([[1, 2], [3, 4, 10]], 1, 1.0, RequestError, "input_ids[1][2] = 10 is outside the vocabulary [0, 10)"),
        ([[1, 2], [-1, 4]], 1, 1.0, RequestError, "input_ids[1][0] = -1 is outside the vocabulary [0, 10)"),
        ([np.array([1, 2]), np.array([3, -4], dtype=np.int8)], 1, 1.0, RequestError,
         "input_ids[1][1] = -4 is outside the vocabulary [0, 10)"),
        ([[1, 2], [3, True]], 1, 1.0, RequestError, "input_ids[1][1] = True is not a token id (an integer)"),
        ([np.array([True, False])], 1, 1.0, RequestError,
         "input_ids[0][0] = np.True_ is not a token id (an integer)"),
        ([[1, [2, 3]]], 1, 1.0, RequestError, "input_ids[0][1] = [2, 3] is not a token id (an integer)"),
        ([[1, None]], 1, 1.0, RequestError, "input_ids[0][1] = None is not a token id (an integer)"),
        ([[1, 2]], True, 1.0, RequestError, "score_from = True must be an integer"),
        ([[1, 2], [3, 4]], [2, False], 1.0, RequestError, "score_from[1] = False must be an integer"),
        ([[1, 2]], 2.0, 1.0, RequestError, "score_from = 2.0 must be an integer"),
        ([[1, 2]], 0, 1.0, RequestError, "score_from[0] = 0 must be in [1, 2] (len(input_ids[0]))"),
        ([[1, 2, 3], [4, 5]], [3, 3], 1.0, RequestError, "score_from[1] = 3 must be in [1, 2] (len(input_ids[1]))"),
        ([[1, 2]], 2**63, 1.0, RequestError, "score_from = 9223372036854775808 is out of range"),
        ([[1, 2], [3, 4]], [1, -(2**64)], 1.0, RequestError, "score_from[1] = -18446744073709551616 is out of range"),
        ([[1, 2], [3, 4]], [1], 1.0, RequestError, "score_from has 1 entries for 2 sequences"),
        ([[1, 2], [3, 4]], 1, [1.0, 1e-3], RequestError, "temperature[1] = 0.001 must be a number in [0.01, 100]"),
        ([[1, 2], [3, 4]], 1, [1.0, float("inf")], RequestError,
         "temperature[1] = inf must be a number in [0.01, 100]"),
        ([[1, 2]], 1, 100.5, RequestError, "temperature[0] = 100.5 must be a number in [0.01, 100]"),
        ([[1, 2], [3, 4]], 1, [1.0, True], RequestError, "temperature[1] = True must be a number"),
        ([[1, 2]], 1, None, RequestError, "temperature = None must be a number"),
        ([[1, 2], [3, 4]], 1, [1.0, 2.0, 3.0], RequestError, "temperature has 3 entries for 2 sequences"),
    ],
)
def test_each_refusal_names_the_field_the_sequence_and_the_value(input_ids, score_from, temperature, error, message):
    with pytest.raises(RequestError) as refused:
        build(input_ids, score_from, temperature)
    assert type(refused.value) is error and str(refused.value) == message


def test_the_other_refusals_name_what_is_wrong():
    with pytest.raises(TooLarge) as refused:
        build([[1, 2], [3, 4, 5]], max_tokens=4)
    assert str(refused.value) == "the request has 5 tokens; the limit is 4 per request"
    with pytest.raises(RequestError) as refused:
        build([[1, 2]], return_entropy=1)
    assert str(refused.value) == "return_entropy = 1 must be true or false"
    with pytest.raises(RequestError) as refused:
        build([[1, 2]], ["x" * 100])  # an echoed value is cut to 60 characters
    assert str(refused.value) == f"score_from[0] = '{'x' * 59}... must be an integer"
    assert (TooLarge.status, RequestError.status) == (413, 422)


@pytest.mark.parametrize("input_ids, score_from, temperature, message", [
    # (each was taken wrongly before: flattened rows, a bare OverflowError or TypeError, a string as a list, a
    # uint64 wrapped to -1)
    ([np.array([[1, 2], [3, 4]]), np.array([5, 6])], 1, 1.0, "input_ids[0] = array([[1, 2],"),
    ([[1, 2]], 1, 10**400, "temperature = 1000"),
    ([[1, 2]], 1, [10**400], "temperature[0] = 1000"),
    ([[1, 2]], 1, "1.0", "temperature = '1.0' must be a number"),
    ([[1, 2], [3, 4]], "12", 1.0, "score_from = '12' must be an integer"),
    ([np.array([2**64 - 1, 1], dtype=np.uint64)], 1, 1.0, "input_ids[0][0] = np.uint64(18446744073709551615) is "
                                                          "outside the vocabulary"),
    ([[1, 2**63]], 1, 1.0, "input_ids[0][1] = 9223372036854775808 is outside the vocabulary"),
])
def test_odd_python_and_numpy_values_are_refused_by_name(input_ids, score_from, temperature, message):
    with pytest.raises(RequestError) as refused:
        build(input_ids, score_from, temperature)
    assert str(refused.value).startswith(message)


def test_numpy_scalars_are_scalars():
    request = build([[1, 2, 3]], np.array(2), np.array(0.5))
    assert request.score_from.tolist() == [2] and request.temperature.tolist() == [0.5]


def test_the_edges_are_accepted_and_stored_flat():
    request = build([[0, 9], [1, 2, 3, 4, 5, 6, 7, 8], np.array([5, 6, 7])], score_from=[2, 1, np.int64(3)],
                    temperature=[0.01, 100, np.float32(0.5)], return_entropy=np.bool_(False), max_tokens=13)
    assert sequences(request) == [[0, 9], [1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7]]
    assert request.offsets.tolist() == [0, 2, 10, 13] and len(request) == 3
    assert request.score_from.tolist() == [2, 1, 3] and request.temperature.tolist() == [0.01, 100.0, 0.5]
    assert request.scored.tolist() == [0, 7, 0]  # score_from at the last token: nothing scored, not refused
    assert request.result_offsets().tolist() == [0, 0, 7, 7]
    assert request.return_entropy is False
    assert (request.tokens.dtype, request.offsets.dtype, request.score_from.dtype, request.temperature.dtype) == (
        np.int32, np.int64, np.int64, np.float64)
    one = build([(3, 4)], score_from=np.uint64(2), temperature=2)  # scalars apply to every sequence
    assert sequences(one) == [[3, 4]] and one.score_from.tolist() == [2] and one.temperature.tolist() == [2.0]


@st.composite
def splits(draw):
    """A request of 1-9 sequences of 2-6 tokens (score_from anywhere, the last token included) and its sequences
    cut into parts of any order and size."""
    n = draw(st.integers(1, 9))
    seqs = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=6)) for _ in range(n)]
    starts = [draw(st.integers(1, len(s))) for s in seqs]
    temps = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(n)]
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), max_size=4, unique=True))) if n > 1 else []
    parts = np.split(np.array(order, dtype=np.int64), cuts)
    return build(seqs, starts, temps, return_entropy=draw(st.booleans())), seqs, parts


@given(splits())
def test_parts_scored_apart_merge_back_in_request_order(case):
    request, seqs, parts = case
    shares = [request.select(index) for index in parts]
    for index, share in zip(parts, shares, strict=True):
        assert sequences(share) == [seqs[i] for i in index]
        assert np.array_equal(share.score_from, request.score_from[index])
        assert np.array_equal(share.temperature, request.temperature[index])
    merged = ScoreResult.merge([(index, score(s, 3)) for index, s in zip(parts, shares, strict=True)],
                               len(request), request.return_entropy)
    whole = score(request, 3)
    assert np.array_equal(merged.offsets, request.result_offsets()) and merged.weights_version == 3
    assert merged.log_probs.tobytes() == whole.log_probs.tobytes()
    if request.return_entropy:
        assert merged.entropy.tobytes() == whole.entropy.tobytes()
    else:
        assert merged.entropy is None
    for got, seq, start in zip(merged.sequences(), seqs, request.score_from.tolist(), strict=True):
        assert got.log_probs.tolist() == seq[start:] and got.weights_version == 3
        want = list(range(start, len(seq))) if request.return_entropy else None
        assert (got.entropy if want is None else got.entropy.tolist()) == want


@given(splits())
def test_spans_concatenated_are_the_whole(case):
    request, _, parts = case
    cuts = np.cumsum([0] + [len(p) for p in parts])
    spans = [(lo, hi) for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True)]
    joined = ScoreRequest.concat([request.span(lo, hi) for lo, hi in spans])
    for field in ("tokens", "offsets", "score_from", "temperature"):
        assert np.array_equal(getattr(joined, field), getattr(request, field)), field
    result = score(request)
    for lo, hi in spans:
        assert result.span(lo, hi).log_probs.tobytes() == score(request.span(lo, hi)).log_probs.tobytes()


def test_parts_of_two_weights_versions_are_not_merged():
    request = build([[1, 2, 3], [4, 5]])
    parts = [(np.array([0]), score(request.select([0]), 4)), (np.array([1]), score(request.select([1]), 5))]
    with pytest.raises(ValueError, match=r"^parts of versions \[4, 5\] cannot be merged$"):
        ScoreResult.merge(parts, 2, True)


@pytest.mark.parametrize(
    "versions, stale",
    [([7], []), ([2, 2, 2], []), ([3, 1], [1]), ([1, 3, 2, 3], [0, 2]), ([5, 4, 4, 5], [1, 2])],
)
def test_parts_older_than_the_newest_are_the_stale_ones(versions, stale):
    assert stale_parts(versions) == stale


def assemble(request: ScoreRequest, parts: list[np.ndarray], versions) -> tuple[ScoreResult, list[list[int]]]:
    """Drives Parts as its callers do: every part answered (in the order given), then those Parts gives back asked
    again, until none; `versions` yields the weights version of each answer in turn. Returns the merged result and
    the positions asked again in each round."""
    assembled, rounds = Parts(len(request)), []
    ask = parts
    while ask:
        for index in ask:
            assembled.add(index, score(request.select(index), next(versions)))
        assert assembled.complete
        ask = assembled.again()
        if ask:
            rounds.append([np.asarray(a).tolist() for a in ask])
    return assembled.merge(request.return_entropy), rounds


def assert_whole(merged: ScoreResult, request: ScoreRequest, version: int) -> None:
    whole = score(request, version)
    assert merged.weights_version == version and np.array_equal(merged.offsets, whole.offsets)
    assert merged.log_probs.tobytes() == whole.log_probs.tobytes()
    assert (merged.entropy is None) == (not request.return_entropy)
    if request.return_entropy:
        assert merged.entropy.tobytes() == whole.entropy.tobytes()


@given(splits(), st.randoms(use_true_random=False))
def test_parts_answered_in_any_order_and_any_versions_assemble_the_whole_of_the_newest(case, rng):
    request, _, parts = case
    rng.shuffle(parts)
    # each first answer of an older version than the newest, or of the newest; every later one of the newest
    first = [rng.choice([4, 5, 6]) for _ in parts]
    newest = max(first)
    merged, rounds = assemble(request, parts, iter(first + [newest] * len(parts)))
    assert_whole(merged, request, newest)
    stale = [p.tolist() for p, v in zip(parts, first, strict=True) if v != newest]
    assert rounds == ([stale] if stale else [])  # asked again once, in the order they were answered


def test_three_versions_the_older_two_are_asked_again_and_a_newer_answer_makes_the_rest_late():
    request = build([[1, 2, 3], [4, 5], [6, 7, 8], [9, 1]])
    parts = [np.array([2]), np.array([0, 3]), np.array([1])]
    merged, rounds = assemble(request, parts, iter([1, 3, 2, 3, 3]))
    assert rounds == [[[2], [1]]] and merged.weights_version == 3
    assert_whole(merged, request, 3)
    # the part asked again comes back newer still: the others are late in their turn
    merged, rounds = assemble(request, parts, iter([1, 2, 2, 3, 3, 3]))
    assert rounds == [[[2]], [[0, 3], [1]]]
    assert_whole(merged, request, 3)


@pytest.mark.parametrize("changes", [VERSION_ATTEMPTS, VERSION_ATTEMPTS + 1])
def test_parts_are_asked_again_version_attempts_times_then_weights_changed(changes):
    """An update lands under every attempt, `changes` times in all: the call ends in one version while the
    attempts last, in WeightsChanged naming the versions when they do not."""
    request = build([[1, 2, 3], [4, 5], [6, 7]])
    parts = [np.array([0]), np.array([1, 2])]
    versions = iter([*range(changes + 1), changes, changes])  # each answer of weights newer than the one before
    if changes <= VERSION_ATTEMPTS:
        merged, rounds = assemble(request, parts, versions)
        assert len(rounds) == changes and merged.weights_version == changes
        assert_whole(merged, request, changes)
        return
    with pytest.raises(WeightsChanged) as raised:
        assemble(request, parts, versions)
    assert str(raised.value) == (f"the weights changed while the parts of this call were scored (versions "
                                 f"[{changes - 1}, {changes}]), {VERSION_ATTEMPTS} times; retry")


def test_parts_of_runs_and_answers_of_any_kind():
    """The workers' lines give ranges; the HTTP clients give ranges and their answers' bodies (a dict); a part of
    a range holding the whole call merges to itself unless a copy is asked for."""
    request = build([[1, 2, 3], [4, 5], [6, 7, 8]], return_entropy=False)
    parts = Parts(3, version=lambda answer: answer["weights_version"])
    parts.add(range(2, 3), {"weights_version": 1, "name": "c"})
    assert not parts.complete and parts.again() == []
    parts.add(range(0, 2), {"weights_version": 0, "name": "ab"})
    assert parts.complete and parts.again() == [range(0, 2)] and not parts.complete
    parts.add(range(0, 2), {"weights_version": 1, "name": "ab"})
    assert parts.again() == [] and [a["name"] for a in parts.in_order()] == ["ab", "c"]
    whole = Parts(3)
    answer = score(build([[1, 2, 3], [4, 5], [6, 7, 8]]), 2)  # (entropy another request of its step asked for)
    whole.add(range(3), answer)
    alone = whole.merge(request.return_entropy, copy=False)
    assert alone.log_probs is answer.log_probs and alone.entropy is None
    copied = whole.merge(request.return_entropy)
    assert copied.log_probs is not answer.log_probs and copied.log_probs.tobytes() == answer.log_probs.tobytes()


@pytest.mark.parametrize("counts", [[], [0, 0], [1], [3, 0, 2, 1], [0, 5, 0]])
def test_ragged_index_is_the_concatenation_of_the_ranges(counts):
    counts = np.array(counts, dtype=np.int64)
    starts = np.arange(len(counts), dtype=np.int64) * 7 + 3
    want = [i for s, c in zip(starts.tolist(), counts.tolist(), strict=True) for i in range(s, s + c)]
    got = ragged_index(starts, counts)
    assert got.dtype == np.int64 and got.tolist() == want


def test_mismatch_against_a_plain_computation_per_sequence():
    """mean and max |ours - rollout|, k3 = mean(exp(d) - 1 - d) and the share of ratios outside the bounds, per
    sequence; sequences without entries (first, middle, last) give zeros."""
    from ppo_logprobs.workers.request import mismatch

    rng = np.random.default_rng(0)
    counts = [0, 5, 0, 9, 1, 0]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ours = -rng.random(offsets[-1]).astype(np.float32) * 3
    rollout = ours + rng.normal(0, 0.3, offsets[-1])
    stats = mismatch(ours, rollout, offsets, (0.8, 1.25))
    for i, n in enumerate(counts):
        d = ours[offsets[i] : offsets[i + 1]].astype(np.float64) - rollout[offsets[i] : offsets[i + 1]]
        want = dict(mean_abs=np.abs(d).mean(), max_abs=np.abs(d).max(), kl_k3=(np.exp(d) - 1 - d).mean(),
                    outside=((np.exp(d) < 0.8) | (np.exp(d) > 1.25)).mean()) if n else dict.fromkeys(stats, 0.0)
        for name, value in want.items():
            assert stats[name][i] == pytest.approx(value, rel=1e-12, abs=1e-15), (name, i)
    assert (stats["kl_k3"] >= 0).all()


@pytest.mark.parametrize(("rollout", "message"), [
    ([[-0.1]], r"rollout_log_probs has 1 lists for 2 sequences"),
    ([[-0.1], [-0.2]], r"rollout_log_probs\[0\] has 1 entries; sequence 0 has 2 scored tokens"),
    ([[-0.1, -0.2], [-0.3, 0.5]], r"rollout_log_probs\[1\]\[1\] = 0.5 must be a finite log-probability"),
    ([[-0.1, float("nan")], [-0.3, -1]], r"rollout_log_probs\[0\]\[1\] = nan"),
    ([[-0.1, -0.2], [-0.3, True]], r"rollout_log_probs\[1\]\[1\] = True must be a number"),
    ([[-0.1, -0.2], "ab"], r"rollout_log_probs\[1\] has 'ab'"),
    ("ab", r"one list of log-probs per sequence"),
    ([[-0.1, -(10**400)], [-0.3, -1]], r"rollout_log_probs\[0\]\[1\] = -1000+\.\.\. is out of range"),
    ([[-0.1, -0.2], [2**1024, -1]], r"rollout_log_probs\[1\]\[0\] = 1797\d+\.\.\. is out of range"),
])
def test_rollout_log_probs_are_checked_against_the_request(rollout, message):
    from ppo_logprobs.workers.request import rollout_values

    request = ScoreRequest.build([[1, 2, 3], [4, 5, 6]], 1, vocab_size=10, max_length=10)
    with pytest.raises(RequestError, match=message):
        rollout_values(rollout, request)
    values = rollout_values([[-0.1, -2], [0, -3.5]], request)
    assert values.dtype == np.float64 and values.tolist() == [-0.1, -2, 0, -3.5]


def test_top_k_and_candidates_travel_with_spans_selections_and_joins():
    a = ScoreRequest.build([[1, 2, 3], [4, 5]], 1, vocab_size=10, max_length=10, top_k=2, token_ids=[[1], [2, 3]])
    b = ScoreRequest.build([[6, 7]], 1, vocab_size=10, max_length=10, top_k=2, token_ids=[4, 5, 6])
    joined = ScoreRequest.concat([a, b])
    assert joined.top_k == 2 and joined.token_ids.tolist() == [[1, -1, -1], [2, 3, -1], [4, 5, 6]]
    assert joined.candidate_counts().tolist() == [1, 2, 3]
    assert joined.select(np.array([2, 0])).token_ids.tolist() == [[4, 5, 6], [1, -1, -1]]
    assert joined.span(1, 3).token_ids.tolist() == [[2, 3, -1], [4, 5, 6]]
    plain = ScoreRequest.build([[1, 2]], 1, vocab_size=10, max_length=10, top_k=2)
    assert ScoreRequest.concat([plain, b]).token_ids.tolist() == [[-1, -1, -1], [4, 5, 6]]
    with pytest.raises(ValueError, match=r"top_k \[0, 2\] cannot be joined"):
        ScoreRequest.concat([ScoreRequest.build([[1, 2]], 1, vocab_size=10, max_length=10), a])
