"""A worker's scheduler alone (threads, no Ray): a scorer in this process answers each step with its sequences'
own tokens as "log-probs", so every answer shows where it came from. Callers on many threads merged into steps and
each answered with its own tokens, in order; a huge request beside small ones; the line's limits; a commit between
steps and a request cut across it; a failure reaching only the request it belongs to; steps launched while the
one before is collected (as on CUDA), with a real worker too."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from ppo_logprobs.workers.errors import Overloaded, TooLarge
from ppo_logprobs.workers.pool.scheduler import Line, Scheduler
from ppo_logprobs.workers.request import ScoreRequest, ScoreResult, ragged_index

POISON = 999  # a token the scorer refuses (as a worker refuses a sequence too large for its memory)


class Scorer:
    """One step at a time, as the worker's forward runs: `gate` (when set) holds each step until it is set;
    `version` is the weights version it answers with; a sequence holding POISON fails its step."""

    def __init__(self) -> None:
        self.steps: list[ScoreRequest] = []
        self.version = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)  # released as each step begins

    def __call__(self, request: ScoreRequest) -> ScoreResult:
        self.steps.append(request)
        self.entered.release()
        if self.gate is not None:
            assert self.gate.wait(30)
        return own_tokens(request, self.version)


def own_tokens(request: ScoreRequest, version: int) -> ScoreResult:
    """Each scored entry's own token as its "log-prob" (minus it as its entropy); a sequence holding POISON fails."""
    if (request.tokens == POISON).any():
        raise TooLarge("a sequence does not fit")
    tokens = request.tokens[ragged_index(request.offsets[:-1] + request.score_from, request.scored)]
    entropy = -tokens.astype(np.float32) if request.return_entropy else None
    return ScoreResult(tokens.astype(np.float32), entropy, request.result_offsets(), version)


def request(seqs, starts=1) -> ScoreRequest:
    return ScoreRequest.build(seqs, starts, vocab_size=1000, max_length=4096, return_entropy=False)


def sequences(n, length, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, POISON, size=length).tolist() for _ in range(n)]


def wait_for_line(scheduler: Scheduler, n: int) -> None:
    """Returns once n requests wait in the scheduler's line (fails after 30 s)."""
    deadline = time.monotonic() + 30
    while len(scheduler.line) < n:
        assert time.monotonic() < deadline, f"{len(scheduler.line)} requests in the line, not {n}"
        threading.Event().wait(0.01)


def check(result: ScoreResult, seqs, starts=1) -> None:
    assert len(result) == len(seqs)
    for got, seq in zip(result.sequences(), seqs, strict=True):
        assert got.log_probs.tolist() == seq[starts:]


def test_many_callers_are_merged_into_steps_and_each_gets_its_own_answer_in_order():
    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=8192)
    asks = [sequences(1 + i % 5, 10 + i, seed=i) for i in range(48)]  # 5,268 tokens
    with ThreadPoolExecutor(48) as callers:
        futures = [callers.submit(scheduler.submit, request(asks[0]))]
        assert scorer.entered.acquire(timeout=30)  # the first caller's step runs, alone, held by the gate
        futures += [callers.submit(scheduler.submit, request(seqs)) for seqs in asks[1:]]  # the others wait in line
        wait_for_line(scheduler, 47)
        scorer.gate.set()
        answers = [f.result(timeout=30) for f in futures]
    for (result, waited), seqs in zip(answers, asks, strict=True):
        check(result, seqs)
        assert waited <= 1
    assert len(scorer.steps) == 2  # the first caller's step, then everyone else's in one
    assert scheduler.line.queued_tokens() == 0 and not scheduler.line.waiting


def test_callers_awaiting_on_one_event_loop_each_get_their_own_answer_and_one_that_stops_waiting_harms_none():
    """`answer` (the actor's path: every caller a coroutine on one loop): merged into steps like threads' calls; a
    caller cancelled while its request waits leaves it to be answered in turn, and the line goes on."""
    import asyncio

    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=8192)
    asks = [sequences(1 + i % 3, 10 + i, seed=80 + i) for i in range(24)]

    async def run():
        tasks = [asyncio.create_task(scheduler.answer(request(asks[0])))]
        while not scorer.entered.acquire(blocking=False):  # the first caller's step runs, held by the gate
            await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(scheduler.answer(request(seqs))) for seqs in asks[1:]]
        while len(scheduler.line) < len(asks) - 1:
            await asyncio.sleep(0.01)
        tasks[5].cancel()
        scorer.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(run())
    assert isinstance(answers[5], asyncio.CancelledError)
    for i, (answer, seqs) in enumerate(zip(answers, asks, strict=True)):
        if i != 5:
            check(answer[0], seqs)
    check(scheduler.submit(request(asks[0]))[0], asks[0])  # (the line went on)
    assert not scheduler.line.waiting


def test_a_huge_request_does_not_hold_back_a_small_one_by_more_than_a_step():
    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=1000)
    huge, small = sequences(100, 100, seed=1), sequences(2, 30, seed=2)  # 10 steps, and a part of one
    with ThreadPoolExecutor(2) as callers:
        big = callers.submit(scheduler.submit, request(huge))
        assert scorer.entered.acquire(timeout=30)  # the huge one's first step is running
        little = callers.submit(scheduler.submit, request(small))
        wait_for_line(scheduler, 2)
        scorer.gate.set()
        result, waited = little.result(timeout=30)
        assert not big.done() or big.result()[1] == 0  # (the small one's answer came within the huge one's steps)
        check(result, small)
        check(big.result(timeout=30)[0], huge)
    assert waited == 0  # no step began between its coming and its first part: the one under way, then its own
    firsts = [int(s.offsets[-1]) for s in scorer.steps]
    assert max(firsts) <= 1000 and len(scorer.steps) == 11  # the small one joined the second step's room


def test_a_request_a_step_can_hold_is_never_cut_and_a_huge_one_fills_the_room_behind_new_ones():
    """A huge request under way and requests of 400 tokens coming: each of those goes whole in one step (first, in
    its half of the room), and every step carries half a step or more of the huge one beside them until it is done:
    however many new requests come, the one under way goes on at half the rate or more."""
    line = Line(step_tokens=1000)
    huge = line.add(request(sequences(50, 100, seed=90)), Future())
    assert [(lo, hi) for _, lo, hi in line.take()] == [(0, 10)]
    smalls = [line.add(request(sequences(4, 100, seed=91 + i)), Future()) for i in range(6)]
    steps = []
    while batch := line.take():
        steps.append(batch)
    for small in smalls:
        parts = [(lo, hi) for batch in steps for item, lo, hi in batch if item is small]
        assert parts == [(0, 4)]
    for batch in steps[: len(steps) - 1]:
        assert sum(hi - lo for item, lo, hi in batch if item is huge) >= 5  # (its 500 tokens of each step's 1000)
        assert sum(hi - lo for _, lo, hi in batch) >= 8  # (and the step 800 tokens full or more)
    assert sum(hi - lo for batch in steps for item, lo, hi in batch if item is huge) == 40


def test_a_full_line_refuses_at_once_and_the_worker_goes_on():
    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=100, max_requests=3, max_tokens=500)
    with ThreadPoolExecutor(4) as callers:
        first = callers.submit(scheduler.submit, request(sequences(1, 50, seed=0)))
        assert scorer.entered.acquire(timeout=30)
        waiting = [callers.submit(scheduler.submit, request(sequences(1, 50, seed=s))) for s in (1, 2)]
        wait_for_line(scheduler, 2)
        with pytest.raises(Overloaded) as refused:  # too many tokens waiting: 100 + 450 > 500
            scheduler.submit(request(sequences(1, 450, seed=3)))
        assert refused.value.status == 429 and refused.value.retry_after > 0
        third = callers.submit(scheduler.submit, request(sequences(1, 50, seed=4)))
        wait_for_line(scheduler, 3)
        with pytest.raises(Overloaded):  # too many requests waiting
            scheduler.submit(request(sequences(1, 5, seed=5)))
        scorer.gate.set()
        for f, s in zip([first, *waiting, third], (0, 1, 2, 4), strict=True):
            check(f.result(timeout=30)[0], sequences(1, 50, seed=s))


def test_a_huge_request_under_way_keeps_no_small_one_out():
    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=100, max_tokens=500)
    huge, small = sequences(40, 50, seed=1), sequences(1, 50, seed=2)  # 2,000 tokens: more than the line holds
    with ThreadPoolExecutor(2) as callers:
        big = callers.submit(scheduler.submit, request(huge))  # (taken: nothing else waits)
        assert scorer.entered.acquire(timeout=30)
        little = callers.submit(scheduler.submit, request(small))
        while len(scheduler.line) < 2:
            assert not little.done(), little.result()
            threading.Event().wait(0.01)
        scorer.gate.set()
        check(little.result(timeout=30)[0], small)
        check(big.result(timeout=30)[0], huge)


def test_a_commit_waits_for_the_step_in_flight_never_for_the_line_and_a_cut_request_gets_one_version():
    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=1000)
    seqs = sequences(30, 100, seed=7)  # three steps
    with ThreadPoolExecutor(2) as callers:
        answer = callers.submit(scheduler.submit, request(seqs))
        assert scorer.entered.acquire(timeout=30)  # step 1 of 3 runs at version 0

        def commit():
            scorer.version = 1
            return len(scorer.steps)

        committed = callers.submit(scheduler.between, commit)
        threading.Event().wait(0.05)
        assert not committed.done()  # the step in flight ends first
        scorer.gate.set()
        assert committed.result(timeout=30) == 1  # and then the commit, before the line's next step
        result, _ = answer.result(timeout=30)
    check(result, seqs)
    assert result.weights_version == 1
    assert len(scorer.steps) == 4  # the part answered at version 0 was scored again at version 1


def test_a_failing_sequence_fails_only_its_own_request():
    scorer = Scorer()
    scorer.gate = threading.Event()
    scheduler = Scheduler(scorer, step_tokens=4096)
    good, bad = sequences(3, 20, seed=1), sequences(2, 20, seed=2)
    bad[1][5] = POISON
    with ThreadPoolExecutor(3) as callers:
        first = callers.submit(scheduler.submit, request(sequences(1, 20, seed=0)))
        assert scorer.entered.acquire(timeout=30)
        answers = [callers.submit(scheduler.submit, request(s)) for s in (good, bad)]
        wait_for_line(scheduler, 2)
        scorer.gate.set()
        first.result(timeout=30)
        check(answers[0].result(timeout=30)[0], good)
        with pytest.raises(TooLarge):
            answers[1].result(timeout=30)
    assert scheduler.line.queued_tokens() == 0 and not scheduler.line.waiting


def test_a_request_is_cut_between_the_runs_of_a_shared_prompt_not_inside_them():
    """Three runs of three sequences (a prompt of 8 shared tokens, then 2 of their own): a run computes 14 tokens
    (its prompt once), so steps of 35 take two runs, and steps of 25 one run each (not a run and a half); a run larger
    than a step is cut where the budget falls, the part begun inside it counting the prompt it computes again."""
    g = np.random.default_rng(5)
    seqs = [prompt + [50 + i, 60 + i] for prompt in (g.integers(0, 50, 8).tolist() for _ in range(3)) for i in range(3)]

    def steps(step_tokens):
        line = Line(step_tokens, min_shared_prefix=8)
        line.add(request(seqs), Future())
        taken = []
        while batch := line.take():
            taken += [hi - lo for _, lo, hi in batch]
        return taken

    assert steps(35) == [6, 3]
    assert steps(25) == [3, 3, 3]
    assert steps(12) == [2, 1, 2, 1, 2, 1]


def test_a_request_whole_in_one_step_gets_its_span_and_entropy_only_if_it_asked():
    line, scorer = Line(step_tokens=1000), Scorer()
    plain, asking = sequences(2, 10, seed=50), sequences(3, 12, seed=51)
    futures = [Future(), Future()]
    line.add(request(plain), futures[0])
    line.add(ScoreRequest.build(asking, vocab_size=1000, max_length=4096, return_entropy=True), futures[1])
    batch = line.take()
    line.answer(batch, scorer(ScoreRequest.concat([item.request.span(lo, hi) for item, lo, hi in batch])))
    (got_plain, _), (got_asking, _) = (f.result(timeout=0) for f in futures)
    check(got_plain, plain)
    check(got_asking, asking)
    assert got_plain.entropy is None  # (the step computed entropy for the other request)
    assert got_asking.entropy.tolist() == [-t for seq in asking for t in seq[1:]]


class Launcher(Scorer):
    """A scorer whose steps are launched (`start`, held by `launch_gate` while set up) and collected later (held by
    `collect_gate`), as the worker's forwards are on CUDA; `log` records each launch, collection and commit."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.launch_gate, self.collect_gate = threading.Event(), threading.Event()

    def start(self, request: ScoreRequest):
        n = len(self.steps)
        self.log.append(f"launch {n}")
        self.steps.append(request)
        self.entered.release()
        assert self.launch_gate.wait(30)

        def collect():
            assert self.collect_gate.wait(30)
            self.log.append(f"collect {n}")
            return own_tokens(request, self.version)

        return collect


def test_with_start_the_next_step_is_launched_before_the_one_in_flight_is_collected_and_a_commit_waits_for_both():
    scorer = Launcher()
    scheduler = Scheduler(scorer, start=scorer.start, step_tokens=4096)
    first, later = sequences(2, 30, seed=60), [sequences(1 + i, 20, seed=61 + i) for i in range(3)]
    with ThreadPoolExecutor(5) as callers:
        answers = [callers.submit(scheduler.submit, request(first))]
        assert scorer.entered.acquire(timeout=30)  # step 0 is being launched
        answers += [callers.submit(scheduler.submit, request(s)) for s in later]
        wait_for_line(scheduler, 3)
        scorer.launch_gate.set()
        assert scorer.entered.acquire(timeout=30)  # step 1, the three later requests, launched with step 0 in flight
        committed = callers.submit(scheduler.between, lambda: scorer.log.append("commit"))
        threading.Event().wait(0.05)
        assert not committed.done()
        scorer.collect_gate.set()
        committed.result(timeout=30)
        results = [a.result(timeout=30)[0] for a in answers]
    assert scorer.log == ["launch 0", "launch 1", "collect 0", "collect 1", "commit"]
    assert len(scorer.steps[1]) == 6  # (the three later requests' sequences)
    for result, seqs in zip(results, [first, *later], strict=True):
        check(result, seqs)


def test_a_real_worker_started_and_collected_in_turn_answers_each_caller_as_scoring_alone():
    """Bitwise on CUDA in bf16, which runs varlen attention (the tiny model's fp32 runs flex_attention, whose rows are
    padded to a few bucket lengths: not the invariant path)."""
    import torch

    from ppo_logprobs.workers import LogProbWorker

    worker = LogProbWorker("tiny", layout="packed", **({"dtype": "bfloat16"} if torch.cuda.is_available() else {}))
    scheduler = Scheduler(worker.score_request, start=worker.start, step_tokens=300,
                          min_shared_prefix=worker.min_shared_prefix)
    g = np.random.default_rng(70)
    prompt = g.integers(0, 200, 40).tolist()
    asks = [[g.integers(0, 200, int(g.integers(3, 60))).tolist() for _ in range(1 + i % 3)] for i in range(12)]
    asks += [[prompt + g.integers(0, 200, 5).tolist() for _ in range(4)]]  # a GRPO-like group sharing a prompt
    with ThreadPoolExecutor(len(asks)) as callers:
        got = list(callers.map(lambda seqs: scheduler.submit(worker.request(seqs))[0], asks))
    assert scheduler.line.steps > 1
    for result, seqs in zip(got, asks, strict=True):
        alone = worker.score_request(worker.request(seqs))
        np.testing.assert_array_equal(result.log_probs, alone.log_probs)
        np.testing.assert_array_equal(result.entropy, alone.entropy)
