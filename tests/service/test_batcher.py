"""The Batcher alone, with a scorer in this process that answers each call with its sequences' own tokens as
"log-probs" (so every result shows which tokens it came from) and a weights version the test sets: joining,
splitting, order, turns, a full queue, a call that fails or never answers, and parts re-asked after an update."""

import asyncio

import numpy as np
import pytest

from ppo_logprobs.service.batcher import Batcher
from ppo_logprobs.service.errors import Overloaded, WorkersTimedOut
from ppo_logprobs.workers.errors import WeightsChanged
from ppo_logprobs.workers.request import ScoreRequest, ScoreResult, ragged_index


class Scorer:
    """Answers a call with the scored tokens themselves; `version` is the weights version it reports, `gate` (when
    set) holds every call until it is set, `fail` makes the next call raise."""

    def __init__(self) -> None:
        self.calls: list[ScoreRequest] = []
        self.version = 0
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.on_call = None  # called with the call's number before it answers

    async def __call__(self, request: ScoreRequest) -> ScoreResult:
        self.calls.append(request)
        if self.on_call:
            self.on_call(len(self.calls))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        tokens = request.tokens[ragged_index(request.offsets[:-1] + request.score_from, request.scored)]
        return ScoreResult(tokens.astype(np.float32), None, request.result_offsets(), self.version)


def request(seqs, starts=1) -> ScoreRequest:
    return ScoreRequest.build(seqs, starts, vocab_size=1000, max_length=4096, return_entropy=False)


def check(result: ScoreResult, seqs, starts=1) -> None:
    starts = [starts] * len(seqs) if isinstance(starts, int) else starts
    assert len(result) == len(seqs)
    for got, seq, s in zip(result.sequences(), seqs, starts, strict=True):
        assert got.log_probs.tolist() == seq[s:]


def sequences(n, length, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=length).tolist() for _ in range(n)]


def batcher(scorer, **options) -> Batcher:
    return Batcher(scorer, **{**dict(batch_tokens=1000, wait_s=0.01, max_queue=16, max_in_flight=1), **options})


def test_requests_that_fit_are_joined_into_one_call_and_each_gets_its_own_results():
    async def run():
        scorer = Scorer()
        b = batcher(scorer, wait_s=5.0, batch_tokens=3 * 4 * 20)  # waits until three requests' tokens are in
        groups = [sequences(4, 20, seed) for seed in range(3)]
        outcomes = await asyncio.gather(*(b.submit(request(g, 1 + i)) for i, g in enumerate(groups)))
        return scorer, groups, outcomes

    scorer, groups, outcomes = asyncio.run(run())
    assert len(scorer.calls) == 1 and len(scorer.calls[0]) == 12
    for i, (g, (result, waited)) in enumerate(zip(groups, outcomes, strict=True)):
        check(result, g, 1 + i)
        assert waited == 0


def test_a_large_request_is_cut_into_calls_in_order_and_a_small_one_goes_in_the_next_call():
    async def run():
        scorer = Scorer()
        b = batcher(scorer, batch_tokens=100)
        large, small = sequences(40, 25, 1), sequences(1, 10, 2)  # 1000 tokens: 10 calls of 4 sequences
        first = asyncio.ensure_future(b.submit(request(large)))
        while not scorer.calls:  # the large request's first call has started
            await asyncio.sleep(0)
        second = await b.submit(request(small))
        return scorer, large, small, await first, second

    scorer, large, small, (big, _), (little, waited) = asyncio.run(run())
    check(big, large)
    check(little, small)
    assert waited <= 1  # served in turn: it waited for at most the call that was running
    sizes = [len(c) for c in scorer.calls]
    assert all(int(c.offsets[-1]) <= 100 for c in scorer.calls) and sum(sizes) == 41
    assert any((c.lengths == 10).any() for c in scorer.calls[:3])  # in turn, not after the whole large request


def test_a_request_is_cut_between_groups_of_a_shared_prompt_not_inside_them():
    """Three groups of three sequences (a prompt of 8 shared tokens, then 2 of their own): calls of 35 tokens take
    one group each (30 tokens), not 3.5 sequences; a group larger than a call is cut where the budget falls."""
    async def run(seqs, batch_tokens):
        scorer = Scorer()
        result, _ = await batcher(scorer, batch_tokens=batch_tokens, min_shared_prefix=8).submit(request(seqs))
        return scorer, result

    g = np.random.default_rng(5)
    seqs = [prompt + g.integers(0, 50, 2).tolist() for prompt in (g.integers(0, 50, 8).tolist() for _ in range(3))
            for _ in range(3)]
    scorer, result = asyncio.run(run(seqs, 35))
    check(result, seqs)
    assert [len(c) for c in scorer.calls] == [3, 3, 3]
    scorer, result = asyncio.run(run(seqs, 25))  # a group of 30 tokens: in two calls
    check(result, seqs)
    assert [len(c) for c in scorer.calls] == [2, 1, 2, 1, 2, 1]


def test_a_full_queue_answers_overloaded():
    async def run():
        scorer = Scorer()
        scorer.gate = asyncio.Event()
        b = batcher(scorer, max_queue=1)
        running = asyncio.ensure_future(b.submit(request(sequences(1, 8, 3))))
        while not scorer.calls:
            await asyncio.sleep(0)
        queued = asyncio.ensure_future(b.submit(request(sequences(1, 8, 4))))  # one waiting: the queue is full
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await b.submit(request(sequences(1, 8, 5)))
        scorer.gate.set()
        return await running, await queued

    (a, _), (b, _) = asyncio.run(run())
    assert len(a) == len(b) == 1


def test_a_failed_call_fails_each_of_its_requests_and_leaves_none_waiting():
    async def run():
        scorer = Scorer()
        scorer.fail = RuntimeError("the workers broke")
        b = batcher(scorer, wait_s=5.0, batch_tokens=2 * 16)
        outcomes = await asyncio.gather(*(b.submit(request(sequences(2, 8, s))) for s in range(2)),
                                        return_exceptions=True)
        return b, outcomes

    b, outcomes = asyncio.run(run())
    assert [str(o) for o in outcomes] == ["the workers broke"] * 2 and not b.waiting


def test_a_call_that_never_answers_times_out():
    async def run():
        scorer = Scorer()
        scorer.gate = asyncio.Event()  # never set
        b = batcher(scorer, timeout_s=0.05)
        with pytest.raises(WorkersTimedOut, match="did not answer within"):
            await b.submit(request(sequences(1, 8, 6)))
        return b

    assert not asyncio.run(run()).waiting


def test_parts_answered_with_older_weights_are_asked_again_and_never_mixed():
    async def run(updates_every_call):
        scorer = Scorer()
        b = batcher(scorer, batch_tokens=40)  # 4 calls of 4 sequences of 10 tokens
        seqs = sequences(16, 10, 7)

        def update(call):  # an update lands between the first call and the second (or before every call)
            if call == 2 or updates_every_call:
                scorer.version += 1

        scorer.on_call = update
        try:
            result, _ = await b.submit(request(seqs))
        except WeightsChanged as e:
            return scorer, seqs, e
        return scorer, seqs, result

    scorer, seqs, result = asyncio.run(run(False))
    check(result, seqs)
    assert result.weights_version == 1 and len(scorer.calls) == 5  # the first call's part asked again
    scorer, _, error = asyncio.run(run(True))
    assert isinstance(error, WeightsChanged) and "3 times" in str(error)
