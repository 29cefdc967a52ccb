"""A worker's scheduler: every caller's requests (each ingress replica's, each trainer's through its WorkerPool)
wait in one line at the worker, and each forward step is formed from what is waiting when the last one ends: up
to `step_tokens` tokens computed (one forward's; a prompt its neighbours share counted once) from the waiting
requests in turn. A request larger than a step is cut and its parts interleave with the others (one that still has
sequences left goes to the back of the line), so a request waits about one step before its first part runs, however
large the requests ahead of it. Results do not depend on what shares a forward (the model's forward is
batch-invariant), so merging any waiting requests costs nothing.

Weights change between steps (`between`), never during one: each step's answer is of one version, and a request
whose parts came back with different versions has its older parts scored again (VERSION_ATTEMPTS times at most).
A full line refuses more (Overloaded: a 429 over HTTP) and is the queue a caller's backpressure sees.

`Line` is the line itself (no threads): the Scheduler drives it from its own thread in the worker actor.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..errors import Overloaded, WeightsChanged
from ..prefixes import computed_offsets, neighbour_groups
from ..request import Parts, ScoreRequest, ScoreResult


@dataclass(eq=False)
class _Waiting:
    request: ScoreRequest
    future: Future
    queued_at: int  # steps started when it was queued
    groups: np.ndarray  # where each sequence's run of neighbours sharing a prompt begins
    computed: np.ndarray  # cumulative tokens its sequences compute (prefixes.computed_offsets)
    todo: deque = field(default_factory=deque)  # (lo, hi) ranges of its sequences not yet sent
    parts: Parts[ScoreResult] = field(init=False)  # its parts received, each a range of its sequences
    steps_waited: int | None = None  # steps started after it was queued and before its first

    def __post_init__(self) -> None:
        self.parts = Parts(len(self.request))


class Line:
    """Waiting requests, served in turn in steps of up to `step_tokens` tokens. `min_shared_prefix`: the worker's
    (a cut falls between the sequences of a shared prompt, not inside their run)."""

    def __init__(self, step_tokens: int, min_shared_prefix: int | None = None) -> None:
        self.step_tokens = step_tokens
        self.min_shared_prefix = min_shared_prefix
        self.waiting: deque[_Waiting] = deque()
        self.steps = 0  # started so far
        self.added = 0  # requests so far
        self.fresh_tokens = 0  # of the requests waiting that no step has begun yet

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: ScoreRequest, future) -> _Waiting:
        groups = neighbour_groups(request, self.min_shared_prefix)
        item = _Waiting(request, future, self.steps, groups, computed_offsets(request, groups))
        item.todo.append((0, len(request)))
        self.waiting.append(item)
        self.added += 1
        self.fresh_tokens += int(request.offsets[-1])
        return item

    def queued_tokens(self) -> int:
        return sum(int(w.request.offsets[hi] - w.request.offsets[lo]) for w in self.waiting for lo, hi in w.todo)

    def take(self) -> list[tuple[_Waiting, int, int]]:
        """The next step: up to step_tokens tokens computed from the waiting requests in turn, all asking for one
        top_k (a tail's mass depends on its k). While requests are under way (begun: those larger than a step), the
        requests not yet begun come first in up to half the room, the begun ones have the other half, and what is
        left goes to whatever fits: a request that comes while a huge one is under way runs in the next step, and
        the huge one goes on at half a step or more however many new ones come. A step holds at least one sequence,
        and the whole run of sequences sharing a prompt that begins it (the worker splits a run too large for one
        forward itself, sharing in each part)."""
        batch: list[tuple[_Waiting, int, int]] = []
        begun = any(w.steps_waited is not None for w in self.waiting)
        room = self._pass(batch, self.step_tokens // 2 if begun else self.step_tokens, begun=False)
        if begun:
            room = self._pass(batch, room + self.step_tokens - self.step_tokens // 2, begun=True)
        self._pass(batch, room, begun=None)
        if batch:
            self.steps += 1
        return batch

    def _pass(self, batch: list, room: int, begun: bool | None) -> int:
        """One turn through the line (only the requests begun, or only those not yet, unless `begun` is None),
        adding parts to `batch` up to `room` tokens; returns the room left. A request with sequences left goes to
        the back of the line. A request not yet begun that a step could hold whole is not cut: it waits for the next
        step where the room left cannot hold it (so the requests begun are those larger than a step)."""
        kept = []  # the requests passed over keep their places, ahead of those served
        for _ in range(len(self.waiting)):
            item = self.waiting.popleft()
            whole = int(item.computed[-1])
            if room <= 0 or (begun is not None and begun != (item.steps_waited is not None)) or (
                    batch and item.request.top_k != batch[0][0].request.top_k) or (
                    batch and item.steps_waited is None and room < whole <= self.step_tokens):
                kept.append(item)
                continue
            offsets, groups, lengths = item.computed, item.groups, item.request.lengths
            while item.todo and room > 0:
                lo, hi = item.todo[0]
                again = int(lengths[lo] - (offsets[lo + 1] - offsets[lo]))  # (a part begun inside a run computes
                # the prompt it shares again)
                end = min(hi, int(np.searchsorted(offsets, offsets[lo] + room - again, side="right")) - 1)
                inside = end < hi and groups[end] < end  # the cut would split a run sharing a prompt
                if inside:
                    head = int(groups[end])
                    if head > lo:
                        end = head  # (the run goes whole in a later step)
                    elif head == lo and self._run_tokens(item, lo) <= self.step_tokens:
                        end = lo  # (the run begun here goes whole in the next step)
                    else:
                        inside = False  # (a run larger than a step: cut where the budget falls)
                if end <= lo:
                    if batch:
                        break
                    end = lo + 1  # nothing fits: the run beginning here, whole
                    while end < hi and groups[end] == lo:
                        end += 1
                batch.append((item, lo, end))
                if item.steps_waited is None:
                    item.steps_waited = self.steps - item.queued_at
                    self.fresh_tokens -= int(item.request.offsets[-1])
                room -= int(offsets[end] - offsets[lo]) + again
                item.todo[0] = (end, hi)
                if end == hi:
                    item.todo.popleft()
                if inside:
                    break
            if item.todo:
                self.waiting.append(item)  # to the back of the line
        self.waiting.extendleft(reversed(kept))
        return room

    @staticmethod
    def _run_tokens(item: _Waiting, head: int) -> int:
        """Tokens computed by the run of sequences sharing a prompt that begins at `head`."""
        stop = head + 1
        while stop < len(item.groups) and item.groups[stop] == head:
            stop += 1
        return int(item.computed[stop] - item.computed[head])

    def answer(self, batch: list[tuple[_Waiting, int, int]], result: ScoreResult) -> None:
        """Hands each request its part of a step's result (parts answered with older weights are queued again)."""
        start = 0
        for item, lo, hi in batch:
            item.parts.add(range(lo, hi), result.span(start, start + hi - lo).fit(item.request))
            start += hi - lo
            self._finish(item)

    def fail(self, batch: list[tuple[_Waiting, int, int]], error: BaseException) -> None:
        """Every request of a failed step gets the failure; none is left waiting."""
        for item, _, _ in batch:
            if not item.future.done():
                item.future.set_exception(error)
            if item in self.waiting:
                self.waiting.remove(item)

    def _finish(self, item: _Waiting) -> None:
        """Completes a request whose parts are all in, all of one version; parts answered with older weights than
        its newest part are queued again (request.Parts)."""
        if item.future.done() or not item.parts.complete:
            return
        try:
            late = item.parts.again()
        except WeightsChanged as e:
            item.future.set_exception(e)
            return
        if late:
            item.todo.extend((positions.start, positions.stop) for positions in late)
            if item not in self.waiting:
                self.waiting.append(item)
            return
        # (whole in one step, as most small requests are: its span of the step's result, not a copy)
        item.future.set_result((item.parts.merge(item.request.return_entropy, copy=False), item.steps_waited or 0))


class _Answer:
    """A caller's future on its event loop that the scheduler's thread completes (lighter than a
    concurrent.futures.Future wrapped for the loop: no lock and no condition made a call)."""

    __slots__ = ("loop", "future", "_done")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.future, self._done = loop, loop.create_future(), False

    def done(self) -> bool:
        return self._done

    def set_result(self, value) -> None:
        self._settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, value, error: BaseException | None) -> None:
        self._done = True
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, value, error)
        except RuntimeError:  # (its loop is closed: the actor is going, and nobody waits)
            pass


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    if not future.done():  # (cancelled meanwhile: nobody waits)
        future.set_exception(error) if error is not None else future.set_result(value)


class Scheduler:
    """A worker's one line and the thread that runs its steps: `submit(request)` (from any number of caller
    threads) blocks until the request is answered and returns (its ScoreResult, steps waited), and `answer(request)`
    is the same awaited from an event loop (the actor's: see PoolWorker.score_request); `between(fn)` runs
    `fn` after the steps in flight and before the next (a weight commit). `score` runs one step's joined request
    on the worker; or `start`, where given, launches it and returns what collects its result: the next step is then
    formed and launched before this one is collected, so that the device goes on while the host answers one step
    and prepares the next. The line holds at most `max_requests` requests, and `max_tokens` tokens of the requests
    it has not begun (one larger is taken when none waits; a huge request under way keeps no other out); more are
    refused at once (Overloaded) and the worker goes on with what it has."""

    def __init__(self, score: Callable[[ScoreRequest], ScoreResult], *, step_tokens: int,
                 start: Callable[[ScoreRequest], Callable[[], ScoreResult]] | None = None,
                 min_shared_prefix: int | None = None, max_requests: int = 4096, max_tokens: int | None = None,
                 name: str = "scheduler") -> None:
        self.score, self.start = score, start
        self.line = Line(step_tokens, min_shared_prefix)
        self.max_requests = max_requests
        self.max_tokens = max_tokens if max_tokens is not None else 64 * step_tokens
        self._ops: deque[tuple[Callable[[], object], Future]] = deque()
        self._changed = threading.Condition()
        self.idle_s = 0.0  # the time it has waited with nothing to do
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def queued_tokens(self) -> int:
        with self._changed:
            return self.line.queued_tokens()

    def submit(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        return self._queue(request, Future()).result()

    async def answer(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        # (its own future, which the line completes: a caller that stops waiting leaves its request to be answered
        # in turn, never a future the line finds cancelled)
        answer = _Answer(asyncio.get_running_loop())
        return await asyncio.shield(self._queue(request, answer).future)

    def _queue(self, request: ScoreRequest, future: Future | _Answer) -> Future | _Answer:
        """The request in the line (or Overloaded at once), answered through `future`, which it returns."""
        tokens = int(request.offsets[-1])
        with self._changed:
            fresh = self.line.fresh_tokens
            if len(self.line) >= self.max_requests or (fresh and fresh + tokens > self.max_tokens):
                raise Overloaded(retry_after=1.0)
            self.line.add(request, future)
            self._changed.notify()
        return future

    def between(self, fn: Callable[[], object]):
        """fn() in the scheduler's thread between two steps (the steps in flight end first; the line waits)."""
        future: Future = Future()
        with self._changed:
            self._ops.append((fn, future))
            self._changed.notify()
        return future.result()

    def _run(self) -> None:
        flight = None  # the step launched and not yet collected: (its parts, what collects it)
        while True:
            with self._changed:
                if not self.line.waiting and not self._ops and flight is None:
                    idle = time.perf_counter()
                    while not self.line.waiting and not self._ops:
                        self._changed.wait()
                    self.idle_s += time.perf_counter() - idle
                ops = []
                if self._ops and flight is None:  # (an op waits for the step in flight)
                    ops = list(self._ops)
                    self._ops.clear()
                batch = [] if self._ops or ops else self.line.take()
            for fn, future in ops:
                try:
                    future.set_result(fn())
                except BaseException as e:  # (the caller gets it; the line goes on)
                    future.set_exception(e)
            step = (batch, self._launch(batch)) if batch else None
            if self.start is not None:  # this one runs while the one before is collected
                step, flight = flight, step
            if step:
                self._step(*step)

    def _launch(self, batch: list[tuple[_Waiting, int, int]]) -> Callable[[], ScoreResult]:
        """The step started (scored at once without `start`); a failure to start is raised when it is collected."""
        joined = ScoreRequest.concat([item.request.span(lo, hi) for item, lo, hi in batch])
        try:
            if self.start is None:
                result = self.score(joined)
                return lambda: result
            return self.start(joined)
        except Exception as e:
            error = e

            def failed():
                raise error

            return failed

    def _step(self, batch: list[tuple[_Waiting, int, int]], collect: Callable[[], ScoreResult]) -> None:
        """Collects a step; when it failed and holds several requests, each request's part is scored again alone, so
        that a failure (a sequence too large for memory, say) reaches only the request it belongs to."""
        parts = [(batch, collect)]
        while parts:
            part, collect = parts.pop()
            try:
                result = collect()
            except Exception as e:
                items = list({id(item): item for item, _, _ in part}.values())  # (in order, each once)
                if len(items) > 1:
                    for item in items:
                        mine = [p for p in part if p[0] is item]
                        parts.append((mine, self._launch(mine)))
                    continue
                with self._changed:
                    self.line.fail(part, e)
                continue
            with self._changed:
                self.line.answer(part, result)
