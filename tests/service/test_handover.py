"""The hand-over of an ingress replica, without Ray or Serve, in front of a real LogProbWorker (torch head, CPU):
small requests that reach it in one turn of the event loop go to the workers as one call, each answered with its
own part as if it had been scored alone; requests asking different top_k, and large ones, go apart; a joined call
that fails is sent again request by request, so only the request at fault gets the error."""

import asyncio

import numpy as np
import pytest

from ppo_logprobs.service import handover as handover_module
from ppo_logprobs.service.errors import Overloaded, WorkersTimedOut
from ppo_logprobs.service.handover import JOIN_TOKENS, Handover
from ppo_logprobs.workers import LogProbWorker
from ppo_logprobs.workers.request import ScoreRequest

from ..helpers import TINY_VOCAB


@pytest.fixture(scope="module")
def worker():
    return LogProbWorker("tiny", backend="torch", max_tokens_per_batch=64)


class Recorded:
    """The worker's scoring as the pool's (async), each call's sequence count recorded."""

    def __init__(self, worker) -> None:
        self.worker, self.calls = worker, []

    async def __call__(self, request: ScoreRequest):
        self.calls.append(len(request))
        await asyncio.sleep(0)
        return self.worker.score_request(request)


def requests(worker, rng, n: int, **options) -> list[ScoreRequest]:
    return [ScoreRequest.build(rng.integers(0, TINY_VOCAB, (int(rng.integers(1, 3)), int(rng.integers(3, 20))))
                               .tolist(), score_from=2, temperature=float(rng.uniform(0.5, 1.5)),
                               vocab_size=TINY_VOCAB, max_length=1 << 20, **options) for _ in range(n)]


def submit_together(handover: Handover, reqs: list[ScoreRequest]) -> list:
    async def run():
        return await asyncio.gather(*(handover.submit(r) for r in reqs), return_exceptions=True)

    return asyncio.run(run())


def assert_alone(worker, request: ScoreRequest, result) -> None:
    """`result` is what scoring `request` alone gives (the CPU's batch-variant matmul: within float32 rounding)."""
    alone = worker.score_request(request)
    np.testing.assert_array_equal(result.offsets, alone.offsets)
    np.testing.assert_allclose(result.log_probs, alone.log_probs, rtol=0, atol=1e-5)
    if request.return_entropy:
        np.testing.assert_allclose(result.entropy, alone.entropy, rtol=0, atol=1e-5)
    for name, value in alone.extras.items():
        got = getattr(result, name)
        assert got is not None and got.shape == value.shape, name
        if name == "top_ids":
            assert (got == value).mean() > 0.99
        else:
            np.testing.assert_allclose(got, value, rtol=0, atol=1e-5)
    assert set(result.extras) == set(alone.extras)


def test_small_requests_arriving_together_go_as_one_call_and_each_gets_its_own_answer(worker):
    rng = np.random.default_rng(1)
    reqs = requests(worker, rng, 12) + requests(worker, rng, 3, return_entropy=False)
    reqs += requests(worker, rng, 2, token_ids=[5, 9, 11]) + requests(worker, rng, 2, token_ids=[3])
    score = Recorded(worker)
    handover = Handover(score, max_queue=64)
    results = submit_together(handover, reqs)
    assert score.calls == [sum(len(r) for r in reqs)] and handover.calls == 1
    for request, (result, waited) in zip(reqs, results, strict=True):
        assert_alone(worker, request, result)
        assert waited == 0
    assert handover.out == 0 and handover.out_tokens == 0


def test_requests_asking_different_top_k_and_large_ones_go_apart(worker):
    rng = np.random.default_rng(2)
    plain, top = requests(worker, rng, 3), requests(worker, rng, 2, top_k=4)
    large = ScoreRequest.build([rng.integers(0, TINY_VOCAB, JOIN_TOKENS).tolist()], vocab_size=TINY_VOCAB,
                               max_length=JOIN_TOKENS, return_entropy=False)
    score = Recorded(worker)
    results = submit_together(Handover(score, max_queue=64), [plain[0], top[0], large, plain[1], top[1], plain[2]])
    assert sorted(score.calls) == sorted([1, sum(map(len, plain)), sum(map(len, top))])
    for request, (result, _) in zip([plain[0], top[0], plain[1], top[1], plain[2]],
                                    [results[i] for i in (0, 1, 3, 4, 5)], strict=True):
        assert_alone(worker, request, result)
    assert len(results[2][0].log_probs) == JOIN_TOKENS - 1


def test_a_request_arriving_later_goes_in_a_call_of_its_own(worker):
    rng = np.random.default_rng(3)
    first, second = requests(worker, rng, 2)
    score = Recorded(worker)
    handover = Handover(score, max_queue=64)

    async def run():
        a = asyncio.ensure_future(handover.submit(first))
        await asyncio.sleep(0.01)  # the first has gone by now
        return await asyncio.gather(a, handover.submit(second))

    results = asyncio.run(run())
    assert score.calls == [len(first), len(second)]
    for request, (result, _) in zip((first, second), results, strict=True):
        assert_alone(worker, request, result)


def test_an_idle_hand_over_sends_at_once_and_a_busy_one_gathers_what_comes_close_behind(worker, monkeypatch):
    monkeypatch.setattr(handover_module, "JOIN_WAIT_S", 0.2)  # (1 ms in service; wide here, for a slow machine)
    rng = np.random.default_rng(7)
    first, second, third = requests(worker, rng, 3)
    gate = asyncio.Event()
    calls = []

    async def score(request):
        calls.append(len(request))
        await gate.wait()
        return worker.score_request(request)

    async def run():
        handover = Handover(score, max_queue=64)
        answers = [asyncio.ensure_future(handover.submit(first))]
        for _ in range(10):  # idle: sent within a few turns of the loop (tasks starting), no wait
            await asyncio.sleep(0)
        assert calls == [len(first)]
        answers.append(asyncio.ensure_future(handover.submit(second)))
        await asyncio.sleep(0)
        answers.append(asyncio.ensure_future(handover.submit(third)))  # a turn later: joins the second
        gate.set()
        return await asyncio.gather(*answers)

    results = asyncio.run(run())
    assert calls == [len(first), len(second) + len(third)]
    for request, (result, _) in zip((first, second, third), results, strict=True):
        assert_alone(worker, request, result)


def test_a_joined_call_that_fails_is_sent_again_one_request_at_a_time_and_only_the_bad_one_fails(worker):
    rng = np.random.default_rng(4)
    good = requests(worker, rng, 4)
    bad = ScoreRequest.build([[3, 4, TINY_VOCAB + 5]], vocab_size=2 * TINY_VOCAB, max_length=64)
    score = Recorded(worker)  # (a token past the model's vocabulary: the worker's embedding raises IndexError)
    results = submit_together(Handover(score, max_queue=64), [good[0], good[1], bad, good[2], good[3]])
    assert isinstance(results[2], IndexError)
    for request, (result, _) in zip(good, [results[i] for i in (0, 1, 3, 4)], strict=True):
        assert_alone(worker, request, result)
    assert score.calls[0] == sum(map(len, good)) + 1 and len(score.calls) == 6  # joined, then each alone


def test_refusals_and_timeouts_of_a_joined_call_reach_each_of_its_requests_without_a_resend(worker):
    rng = np.random.default_rng(5)
    reqs = requests(worker, rng, 3)
    sent = []

    async def full(request):
        sent.append(len(request))
        raise Overloaded(retry_after=2.0)

    results = submit_together(Handover(full, max_queue=64), reqs)
    assert all(isinstance(r, Overloaded) for r in results) and len(sent) == 1

    async def silent(request):
        sent.append(len(request))
        await asyncio.sleep(10)

    sent.clear()
    results = submit_together(Handover(silent, max_queue=64, timeout_s=0.05), reqs)
    assert all(isinstance(r, WorkersTimedOut) for r in results) and len(sent) == 1


def test_the_replica_refuses_past_max_queue_at_once(worker):
    rng = np.random.default_rng(6)
    reqs = requests(worker, rng, 5)
    score = Recorded(worker)
    results = submit_together(Handover(score, max_queue=3), reqs)
    assert [type(r).__name__ for r in results[3:]] == ["Overloaded", "Overloaded"]
    for request, (result, _) in zip(reqs[:3], results[:3], strict=True):
        assert_alone(worker, request, result)
    assert score.calls == [sum(len(r) for r in reqs[:3])]
